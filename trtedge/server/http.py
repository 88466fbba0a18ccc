"""uvicorn's h11 protocol with a deadline for request headers, against slow clients (slowloris).

uvicorn closes idle keep-alive connections but lets a client take forever over a request's headers,
one byte at a time. Here a connection that has not sent complete headers ``HEADER_TIMEOUT`` seconds
after it opened (or after its previous response) is closed. Headers larger than uvicorn's 16 KiB
limit get a 400; the body has its own deadline in the app (``read_body``).
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

from trtedge.server.config import HEADER_TIMEOUT

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
