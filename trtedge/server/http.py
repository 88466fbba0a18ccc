"""uvicorn, the trtedge way: the listening sockets, the h11 protocol and the shutdown.

``bind`` takes the address before the model loads, so that a taken port or a bad ``--host`` fails at
once. ``DrainingServer`` keeps listening while it drains: a request that arrives after the first
Ctrl-C (or SIGTERM) gets the app's 503 ``shutting_down`` instead of a refused connection; a second
Ctrl-C ends every request in flight with an error (streams: an error event, then ``[DONE]``).

uvicorn closes idle keep-alive connections but lets a client take forever over a request's headers,
one byte at a time. Here a connection that has not sent complete headers ``HEADER_TIMEOUT`` seconds
after it opened (or after its previous response) is closed. Headers larger than uvicorn's 16 KiB
limit get a 400; the body has its own deadline in the app (``read_body``).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
from collections.abc import Callable

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from trtedge.server.config import HEADER_TIMEOUT, ServerConfigError

FORCED_EXIT_GRACE = 5.0  # seconds the requests cut by a second Ctrl-C have to send their last event

log = logging.getLogger("trtedge.server")


class GuardedH11Protocol(H11Protocol):
    header_timeout = HEADER_TIMEOUT

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._start_header_timer()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers arrived
            self._stop_header_timer()
            if isinstance(self.server_state, DrainState) and self.server_state.draining:
                self.cycle.keep_alive = False  # answered (503 shutting_down), then closed

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._start_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def _start_header_timer(self) -> None:
        self._stop_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being answered
        if not self.transport.is_closing():
            log.debug(
                "closing a connection that sent no complete request headers in %gs", self.header_timeout
            )
            self.transport.close()


def bind(host: str, port: int) -> list[socket.socket]:
    """Bound (not yet listening) sockets for every address ``host`` names, as uvicorn would bind them;
    ``ServerConfigError`` naming --host or --port when the address cannot be had."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        why = e.strerror if isinstance(e, socket.gaierror) else str(e)
        raise ServerConfigError(f"--host {host!r} cannot be resolved ({why})") from None
    addresses = dict.fromkeys((family, address) for family, _, _, _, address in infos)
    sockets: list[socket.socket] = []
    try:
        for family, address in addresses:
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((address[0], port, *address[2:]))
            port = sock.getsockname()[1]  # with port 0, every address gets the port the first was given
    except OSError as e:
        for sock in sockets:
            sock.close()
        raise _address_error(host, port, e) from None
    return sockets


def listen(sockets: list[socket.socket], host: str, port: int) -> None:
    """Start listening (connections made while the model loaded were refused); a second server that
    bound the same port meanwhile fails here."""
    try:
        for sock in sockets:
            sock.listen(2048)
    except OSError as e:
        raise _address_error(host, port, e) from None


def _address_error(host: str, port: int, error: OSError) -> ServerConfigError:
    if error.errno == errno.EADDRINUSE:
        return ServerConfigError(
            f"--port {port}: the address {host}:{port} is already in use (another server?)"
        )
    if error.errno == errno.EACCES:
        return ServerConfigError(f"--port {port}: permission denied (ports below 1024 need privileges)")
    return ServerConfigError(f"--host {host!r}: cannot listen on {host}:{port} ({error.strerror})")


class DrainState(ServerState):
    draining = False


class DrainingServer(uvicorn.Server):
    """uvicorn's server with trtedge's shutdown. On the first signal ``on_drain`` runs (the app refuses
    new requests with 503 from then on) and the server keeps listening until the requests in flight
    are answered. A second Ctrl-C during the drain runs ``on_force`` (which ends the requests in flight
    with an error) and stops as soon as they have sent it; ``forced`` is then True."""

    def __init__(self, config: uvicorn.Config, on_drain: Callable[[], None], on_force: Callable[[], None]):
        super().__init__(config)
        self.server_state = DrainState()
        self.on_drain = on_drain
        self.on_force = on_force
        self.forced = False

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        state = self.server_state
        state.draining = True
        self.on_drain()
        for connection in list(state.connections):
            connection.shutdown()  # idle keep-alive connections close; busy ones after their answer
        while state.tasks and not self.force_exit:
            await asyncio.sleep(0.05)
        if self.force_exit:
            self.forced = True
            self.on_force()
            deadline = time.monotonic() + FORCED_EXIT_GRACE
            while state.tasks and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            for task in list(state.tasks):
                task.cancel()
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(state.connections):
            connection.shutdown()  # those that connected during the drain
        for server in self.servers:
            await server.wait_closed()
