"""The engine core behind one interface, in this process (``Engine`` itself) or in its own process
(``CoreProcess``), so that a front door's Python work (HTTP, JSON, SSE) and the engine's step never
share one GIL.

The separate process owns the model, the KV cache and the engine thread; this side keeps the tokenizer
and talks to it over two ZeroMQ sockets on a private IPC directory:

- inbound (PUSH here, PULL there): submissions, cancellations and calls, pickled (a handful per
  request; a submission may carry tensors);
- outbound (PULL here, PUSH there): one message per engine step holding every request's deltas of that
  step, encoded with msgspec (the hot path), plus the replies to calls.

A thread here receives the step messages and hands each request its deltas: to the iterator's queue, or
to a ``LoopChannel`` whose event loop gets all of a step's deltas in one wake-up, as in-process."""

from __future__ import annotations

import copy
import gc
import logging
import os
import pickle
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
import zmq

from trtedge.runtime.executor.sampler import TokenLogprobs
from trtedge.runtime.faults import FaultInjector
from trtedge.runtime.output import (
    CancellableIterator,
    GenerationMetrics,
    LoopBatcher,
    LoopChannel,
    RequestHandle,
    StreamDelta,
    TextStream,
)
from trtedge.runtime.profiling import GcPauses
from trtedge.runtime.sampling_params import ParamError, SamplingParams

log = logging.getLogger("trtedge")

START_TIMEOUT_S = 1800.0  # loading and warming up a large model takes minutes
CALL_TIMEOUT_S = 120.0
_STEP, _REPLY, _READY, _DEAD = b"s", b"r", b"k", b"x"


# ---- what crosses the process boundary ---------------------------------------------------------
class _Delta(msgspec.Struct, array_like=True):
    rid: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[tuple[int, float, list[tuple[int, float]], int | None]] | None
    prompt_tokens: int
    completion_tokens: int
    index: int
    cached_tokens: int
    prompt_logprobs: list[tuple[int, float, list[tuple[int, float]], int | None] | None] | None
    stop_token: bool


class _Failure(msgspec.Struct, array_like=True):
    rid: int
    kind: str  # "EngineError" | "EngineUnavailableError" | "ValueError" | ...
    message: str


class _Metrics(msgspec.Struct, array_like=True):
    rid: int
    fields: dict[str, Any]


class _Step(msgspec.Struct, array_like=True):
    deltas: list[_Delta]
    failures: list[_Failure]
    metrics: list[_Metrics]


def _pack_logprobs(items):
    if items is None:
        return None
    return [None if t is None else (t.token_id, t.logprob, t.top, t.rank) for t in items]


def _stream_delta(d: _Delta, text: str, finish_reason: str | None) -> StreamDelta:
    return StreamDelta(
        text,
        d.token_ids,
        finish_reason,
        _unpack_logprobs(d.logprobs),
        d.prompt_tokens,
        d.completion_tokens,
        d.index,
        d.cached_tokens,
        _unpack_logprobs(d.prompt_logprobs),
        d.stop_token,
    )


def _unpack_logprobs(items):
    if items is None:
        return None
    return [None if t is None else TokenLogprobs(t[0], t[1], [tuple(x) for x in t[2]], t[3]) for t in items]


@dataclass
class CoreLaunch:
    """What the engine core process needs to load the model and start the engine (picklable)."""

    checkpoint: Any  # a Bundle (its lock stays on this side) or a config-only checkpoint
    load: dict  # load_model's keyword arguments
    engine_config: Any  # EngineConfig
    # ("draft_model", checkpoint), ("eagle3" / "dflash", head directory) or ("mtp", the target's checkpoint)
    draft: tuple[str, Any] | None = None
    log_level: int = logging.INFO


# ---- this side ----------------------------------------------------------------------------------
@dataclass(eq=False)
class _Open:
    channel: queue.Queue | LoopChannel
    num_open: int  # choices the core has not finished
    on_metrics: Callable[[GenerationMetrics], None] | None
    batcher: LoopBatcher | None = None
    texts: list[TextStream] = field(default_factory=list)  # per choice: its text, made on this side
    # choices a stop string ended here: their final delta, handed out when the core's own final comes
    stopped: dict[int, StreamDelta] = field(default_factory=dict)


class CoreProcess:
    """An ``Engine`` in a child process, with the part of ``Engine``'s interface that ``LLM`` uses."""

    def __init__(self, launch: CoreLaunch, tokenizer=None):
        """``tokenizer``: make the deltas' text on this side (the output thread detokenizes and applies
        stop strings; the core only sends token ids) instead of in the core."""
        self._tokenizer = tokenizer
        if tokenizer is not None:
            launch = replace(launch, engine_config=replace(launch.engine_config, detokenize=False))
        self._dir = tempfile.mkdtemp(prefix="trtedge-core-")  # 0700: only this user reaches the sockets
        self._zmq = zmq.Context()
        self._in = self._out = self._proc = None
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards _open, _calls, _next, error
        self._open: dict[int, _Open] = {}
        self._calls: dict[int, list] = {}
        self._next = 0
        self.error: BaseException | None = None
        self._stopped = False
        try:
            self._in = self._zmq.socket(zmq.PUSH)
            self._in.setsockopt(zmq.LINGER, 0)
            self._in.setsockopt(zmq.SNDTIMEO, 10_000)  # a PUSH with no live peer would block for good
            self._in.bind(f"ipc://{self._dir}/in")
            self._out = self._zmq.socket(zmq.PULL)
            self._out.setsockopt(zmq.LINGER, 0)
            self._out.bind(f"ipc://{self._dir}/out")
            # A fresh interpreter (not multiprocessing's spawn, which re-imports the caller's __main__: a
            # script without a main guard would start a second LLM); the launch goes through a private file.
            with open(os.path.join(self._dir, "launch"), "wb") as f:
                pickle.dump(launch, f, protocol=pickle.HIGHEST_PROTOCOL)
            command = [sys.executable, "-m", "trtedge.runtime.client", self._dir, str(os.getpid())]
            # the child finds trtedge (and what it imports) where this process does
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            self._proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=env)
            self.info = self._wait_ready()
        except BaseException:
            self._kill()
            raise
        self._decoder = msgspec.msgpack.Decoder(_Step)
        self._thread = threading.Thread(target=self._receive, name="trtedge-core-output", daemon=True)
        self._thread.start()

    def describe(self) -> dict:
        return dict(self.info["describe"])

    def _wait_ready(self) -> dict:
        waited = 0.0
        while waited < START_TIMEOUT_S:
            if self._out.poll(500):
                kind, payload = self._out.recv_multipart()
                body = pickle.loads(payload)
                if kind == _READY:
                    return body
                if kind == _DEAD:  # the model did not load: raise its error here
                    raise body
            waited += 0.5
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"the engine core process exited (code {self._proc.returncode}) while starting"
                )
        raise RuntimeError(f"the engine core process did not start within {START_TIMEOUT_S:.0f} s")

    # ---- submission -------------------------------------------------------------------------
    def submit(
        self,
        prompt_ids,
        params: SamplingParams,
        priority: int = 0,
        on_metrics: Callable[[GenerationMetrics], None] | None = None,
        request_id: str | None = None,
        channel: LoopChannel | None = None,
    ) -> CancellableIterator | RequestHandle:
        if params.guided_decoding is not None:  # a bad guide is refused here, as in-process (cached there)
            self.call("compile_guide", params.guided_decoding)
        box = _Open(channel or queue.Queue(), params.n, on_metrics, channel.batcher if channel else None)
        if self._tokenizer is not None:
            ids = getattr(prompt_ids, "ids", prompt_ids)  # a MultimodalPrompt's ids, placeholders included
            box.texts = [
                TextStream(self._tokenizer, ids, params.skip_special_tokens, params.stop)
                for _ in range(params.n)
            ]
        with self._lock:
            self._raise_if_down()  # under the lock: _died cannot empty _open between check and entry
            rid = self._next = self._next + 1
            self._open[rid] = box
        try:
            self._send(("add", rid, prompt_ids, params, priority, request_id, on_metrics is not None))
        except BaseException:
            with self._lock:
                self._open.pop(rid, None)
            raise
        if channel is not None:
            return RequestHandle(lambda: self._cancel(rid))
        return CancellableIterator(box.channel, lambda: self._cancel(rid), params.n)

    def _cancel(self, rid: int) -> None:
        # no lock: this may run from a garbage-collected iterator on the output thread, mid-delivery
        if rid not in self._open:
            return
        try:
            self._send(("cancel", rid))
        except Exception:  # shut down meanwhile: the request is failed already
            pass

    def _send(self, message) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            if self._stopped:
                raise _unavailable("the engine is shut down")
            if self._proc.poll() is not None:
                reason = f"the engine core process exited (code {self._proc.returncode})"
                self._died(reason)
                raise _unavailable(f"engine failed: {reason}")
            try:
                self._in.send(data)
            except zmq.Again:
                raise _unavailable("engine failed: the engine core process does not take requests") from None

    def _raise_if_down(self) -> None:
        if self.error is not None:
            raise _unavailable(f"engine failed: {self.error}")
        if self._stopped:
            raise _unavailable("the engine is shut down")

    # ---- calls (anything but the hot path) ---------------------------------------------------
    def call(self, name: str, *args, timeout: float = CALL_TIMEOUT_S):
        if threading.current_thread() is getattr(self, "_thread", None):
            # a metrics callback or channel calling back on the output thread: the reply would come in
            # through this very thread
            raise CallbackCallError(f"{name} cannot be asked of the engine core from its output thread")
        done = threading.Event()
        slot = [done, None, None]
        with self._lock:
            self._raise_if_down()
            cid = self._next = self._next + 1
            self._calls[cid] = slot
        try:
            self._send(("call", cid, name, args))
        except BaseException:
            with self._lock:
                self._calls.pop(cid, None)
            raise
        if not done.wait(timeout):
            with self._lock:
                self._calls.pop(cid, None)
            raise _unavailable(f"engine busy: the engine core did not answer {name} within {timeout:.0f} s")
        if slot[2] is not None:
            raise slot[2]
        return slot[1]

    def __getattr__(self, name: str):
        if name in _CALLS:
            return lambda *args: self.call(name, *args)
        raise AttributeError(name)

    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._open)

    # ---- the output thread ------------------------------------------------------------------
    def _receive(self) -> None:
        while True:
            try:
                if not self._out.poll(1000):
                    if self._proc.poll() is not None:
                        self._died(f"the engine core process exited (code {self._proc.returncode})")
                        return
                    continue
                kind, payload = self._out.recv_multipart()
            except zmq.ZMQError:  # closed at shutdown
                return
            try:
                if kind == _STEP:
                    self._deliver(self._decoder.decode(payload))
                elif kind == _REPLY:
                    cid, value, error = pickle.loads(payload)
                    with self._lock:
                        slot = self._calls.pop(cid, None)
                    if slot is not None:
                        slot[1], slot[2] = value, error
                        slot[0].set()
                elif kind == _DEAD:
                    self._died(str(pickle.loads(payload)).removeprefix("engine failed: "))
                    return
            except Exception as e:  # a message this side cannot read: fail loudly, never hang the streams
                log.exception("engine core: unreadable output message")
                self._died(f"unreadable output from the engine core ({type(e).__name__}: {e})")
                return

    def _deliver(self, step: _Step) -> None:
        """Hand out one step's outputs. Nothing is called out under the lock: a metrics callback or a
        channel may call back into this client."""
        metrics, items = [], []
        with self._lock:
            boxes = self._open
            for m in step.metrics:  # before the final deltas: a reader that sees the end has them
                box = boxes.get(m.rid)
                if box is not None and box.on_metrics is not None:
                    metrics.append((box.on_metrics, m.fields))
            for d in step.deltas:
                box = boxes.get(d.rid)
                if box is None:
                    continue
                items.append((box, d))
                if d.finish_reason is not None:
                    box.num_open -= 1
                    if box.num_open == 0:
                        del boxes[d.rid]
            failed = [(box, f) for f in step.failures if (box := boxes.pop(f.rid, None)) is not None]
        for callback, fields in metrics:
            try:
                callback(GenerationMetrics(**fields))
            except Exception:
                log.exception("on_metrics callback raised")
        batchers: set[LoopBatcher] = set()
        for box, d in items:
            delta = self._with_text(box, d) if box.texts else _stream_delta(d, d.text, d.finish_reason)
            if delta is None:
                continue
            box.channel.put(delta)
            if box.batcher is not None:
                batchers.add(box.batcher)
        for box, f in failed:
            box.channel.put(_error(f.kind, f.message))
            if box.batcher is not None:
                batchers.add(box.batcher)
        for batcher in batchers:
            batcher.flush()

    def _with_text(self, box: _Open, d: _Delta) -> StreamDelta | None:
        """The delta with its text made here; None for one not handed out. At a stop string the choice
        ends here: the core is told to stop it there, its later deltas are dropped, and this final
        delta waits for the core's own (which brings the request's metrics first)."""
        index, final = d.index, d.finish_reason is not None
        if index in box.stopped:
            return box.stopped.pop(index) if final else None
        text = box.texts[index]
        if not d.token_ids:  # a final without a token (cancelled, failed): what was held back
            held, text.pending = text.pending, ""
            return _stream_delta(d, held, d.finish_reason)
        made, hit = text.step(d.token_ids[-1], not d.stop_token, final)
        if hit and not final:
            box.stopped[index] = _stream_delta(d, made, "stop")
            try:
                self._send(("stop", d.rid, index, d.completion_tokens))
            except Exception:  # shut down meanwhile: the request is failed already
                pass
            return None
        return _stream_delta(d, made, "stop" if hit else d.finish_reason)

    def _died(self, reason: str) -> None:
        """The core is gone: every open request and call fails, new ones are refused."""
        with self._lock:
            if self.error is None and not self._stopped:
                log.error("engine core: %s", reason)
                self.error = RuntimeError(reason)
            boxes, self._open = self._open, {}
            calls, self._calls = self._calls, {}
        batchers = set()
        for box in boxes.values():
            if box.on_metrics is not None:  # called once per request, by an error too (as in-process)
                try:
                    box.on_metrics(GenerationMetrics(finish_reason="error"))
                except Exception:
                    log.exception("on_metrics callback raised")
            box.channel.put(_unavailable(f"engine failed: {reason}"))
            if box.batcher is not None:
                batchers.add(box.batcher)
        for batcher in batchers:
            batcher.flush()
        for slot in calls.values():
            slot[2] = _unavailable(f"engine failed: {reason}")
            slot[0].set()

    # ---- lifecycle --------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._stopped:
            return
        try:
            with self._send_lock:
                if self._proc.poll() is None:
                    self._in.send(pickle.dumps(("shutdown",)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        with self._send_lock:
            self._stopped = True
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        self._thread.join(timeout=5)
        self._kill()
        self._died("the engine is shut down")

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10)
        for socket in (self._in, self._out):
            if socket is not None:
                socket.close()
        self._zmq.term()
        shutil.rmtree(self._dir, ignore_errors=True)


_CALLS = {
    "snapshot",
    "context_cache_metrics",
    "mm_embedding_cache_metrics",
    "speculative_metrics",
    "compile_guide",
    "set_profiling_enabled",
    "get_profiling_enabled",
    "get_profiling_metrics",
    "reset_profiling_metrics",
}


class CallbackCallError(RuntimeError):
    """A call to the engine core from the thread that delivers its outputs (it would wait on itself)."""


def _unavailable(message: str) -> BaseException:
    from trtedge.runtime.engine import EngineUnavailableError

    return EngineUnavailableError(message)


def _kind(error: BaseException) -> str:
    """The class a failure is raised as on the caller's side (its meaning, not its exact type)."""
    from trtedge.runtime import engine
    from trtedge.runtime.structured import GuidedUnavailableError

    if isinstance(error, ParamError):
        return f"ParamError:{error.param}"  # the field it is about crosses too
    for cls in (engine.EngineUnavailableError, engine.EngineError, GuidedUnavailableError, ValueError):
        if isinstance(error, cls):
            return cls.__name__
    return "EngineError"


def _error(kind: str, message: str) -> BaseException:
    from trtedge.runtime import engine
    from trtedge.runtime.structured import GuidedUnavailableError

    if kind.startswith("ParamError:"):
        return ParamError(kind.removeprefix("ParamError:"), message)
    cls = {
        "EngineError": engine.EngineError,
        "EngineUnavailableError": engine.EngineUnavailableError,
        "GuidedUnavailableError": GuidedUnavailableError,
        "ValueError": ValueError,
    }.get(kind, engine.EngineError)
    return cls(message)


def picklable_checkpoint(checkpoint):
    """A copy of a bundle without its lock (the lock stays with the parent, which releases it)."""
    if getattr(checkpoint, "_lock", None) is None:
        return checkpoint
    clone = copy.copy(checkpoint)
    clone._lock = None
    return clone


# ---- the engine core process --------------------------------------------------------------------
class _StepSink:
    """The child's stand-in for a ``LoopBatcher``: the engine ``put``s a step's outputs, ``flush``
    sends them as one message."""

    def __init__(self, socket, lock: threading.Lock):
        self._socket, self._send_lock = socket, lock
        self._lock = threading.Lock()
        self._step = _Step([], [], [])
        self._encoder = msgspec.msgpack.Encoder()

    def put(self, rid: int, item) -> None:
        with self._lock:
            if isinstance(item, BaseException):
                self._step.failures.append(_Failure(rid, _kind(item), str(item)))
            else:
                self._step.deltas.append(
                    _Delta(
                        rid,
                        item.text,
                        item.token_ids,
                        item.finish_reason,
                        _pack_logprobs(item.logprobs),
                        item.prompt_tokens,
                        item.completion_tokens,
                        item.index,
                        item.cached_tokens,
                        _pack_logprobs(item.prompt_logprobs),
                        item.stop_token,
                    )
                )

    def metrics(self, rid: int, metrics: GenerationMetrics) -> None:
        with self._lock:
            self._step.metrics.append(_Metrics(rid, dict(vars(metrics))))

    def flush(self) -> None:
        with self._lock:
            step, self._step = self._step, _Step([], [], [])
        if step.deltas or step.failures or step.metrics:
            data = self._encoder.encode(step)
            with self._send_lock:
                self._socket.send_multipart([_STEP, data], copy=False)


@dataclass(eq=False)
class _ChildChannel:
    """A request's output channel in the child: its outputs go to the step message."""

    rid: int
    batcher: _StepSink
    num_open: int
    handle: Any = field(default=None)

    def put(self, item) -> None:
        self.batcher.put(self.rid, item)
        if isinstance(item, BaseException):
            self.num_open = 0
        elif item.finish_reason is not None:
            self.num_open -= 1


def _core_main(directory: str, parent_pid: int) -> None:  # pragma: no cover - runs in the child
    with open(os.path.join(directory, "launch"), "rb") as f:
        launch: CoreLaunch = pickle.load(f)
    os.unlink(os.path.join(directory, "launch"))
    logging.basicConfig(level=launch.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    inbound = ctx.socket(zmq.PULL)
    inbound.connect(f"ipc://{directory}/in")
    outbound = ctx.socket(zmq.PUSH)
    outbound.setsockopt(zmq.LINGER, 5000)
    outbound.connect(f"ipc://{directory}/out")
    send_lock = threading.Lock()

    def send(kind: bytes, body) -> None:
        with send_lock:
            outbound.send_multipart([kind, pickle.dumps(body, protocol=pickle.HIGHEST_PROTOCOL)])

    try:
        engine = _start_engine(launch)
    except BaseException as e:
        send(_DEAD, _portable(e))
        outbound.close()
        ctx.term()
        return
    # The model, the compiled kernels and the captured graphs live as long as the process: moved out
    # of the collector's reach, a full collection no longer walks them while a step waits.
    gc.collect()
    gc.freeze()
    engine.gc_pauses = GcPauses(frozen=gc.get_freeze_count())
    sink = _StepSink(outbound, send_lock)
    send(_READY, {"describe": engine.describe(), "pid": os.getpid()})
    handles: dict[int, _ChildChannel] = {}
    # Calls are answered on threads of their own: a slow one (a guide's compile) must not hold up the
    # submissions and cancellations behind it. The engine's views and compile_guide take any thread.
    calls = ThreadPoolExecutor(max_workers=4, thread_name_prefix="trtedge-core-call")
    delay = FaultInjector.from_env().slow_call

    def answer(cid: int, name: str, args) -> None:
        if delay:
            time.sleep(delay)
        try:
            send(_REPLY, (cid, getattr(engine, name)(*args), None))
        except Exception as e:
            send(_REPLY, (cid, None, _portable(e)))

    try:
        while True:
            if not inbound.poll(1000):
                if os.getppid() != parent_pid:  # the parent died: nobody reads our outputs
                    break
                if engine.error is not None and not engine._thread.is_alive():
                    send(_DEAD, str(engine.error))
                    break
                continue
            message = pickle.loads(inbound.recv())
            kind = message[0]
            if kind == "add":
                _, rid, prompt, params, priority, request_id, wants_metrics = message
                channel = _ChildChannel(rid, sink, params.n)
                on_metrics = (lambda m, rid=rid: sink.metrics(rid, m)) if wants_metrics else None
                try:
                    channel.handle = engine.submit(prompt, params, priority, on_metrics, request_id, channel)
                    handles[rid] = channel
                except Exception as e:  # its own message: the step being built belongs to the engine thread
                    failure = _Step([], [_Failure(rid, _kind(e), str(e))], [])
                    with send_lock:
                        outbound.send_multipart([_STEP, msgspec.msgpack.encode(failure)])
            elif kind == "cancel":
                channel = handles.pop(message[1], None)
                if channel is not None and channel.handle is not None:
                    channel.handle.cancel()
            elif kind == "stop":  # a stop string ended a choice's text on the parent's side
                _, rid, index, count = message
                channel = handles.get(rid)
                if channel is not None and channel.handle is not None:
                    channel.handle.stop_choice(index, count)
            elif kind == "call":
                _, cid, name, args = message
                calls.submit(answer, cid, name, args)
            elif kind == "shutdown":
                break
            if len(handles) > 1024:  # forget the requests that have finished
                handles = {rid: c for rid, c in handles.items() if c.num_open > 0}
    finally:
        calls.shutdown(wait=False, cancel_futures=True)
        engine.shutdown()
        sink.flush()
        inbound.close()
        outbound.close()
        ctx.term()
        shutil.rmtree(directory, ignore_errors=True)  # the parent may be gone: leave nothing behind


def _portable(error: BaseException) -> BaseException:
    """The error itself if it survives pickling, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=5)}")


def _start_engine(launch: CoreLaunch):
    from trtedge.runtime.engine import Engine
    from trtedge.runtime.models import load_model

    model = load_model(launch.checkpoint, **launch.load)
    draft = None
    if launch.draft is not None:
        method, source = launch.draft
        if method == "draft_model":
            draft = load_model(source, **{k: v for k, v in launch.load.items() if k != "ple"})
        elif method == "mtp_assistant":  # a Gemma 4 assistant's directory
            from trtedge.runtime.speculative.gemma4_assistant import load_assistant

            draft = load_assistant(source, model, launch.load["max_positions"])
        elif method == "mtp":  # the target checkpoint's own MTP layers
            from trtedge.runtime.speculative.mtp import load_mtp

            draft = load_mtp(source, model, launch.load.get("load_format", "auto"))
        elif method == "dflash":
            from trtedge.runtime.speculative.dflash import load_dflash

            spec = launch.engine_config.speculative
            draft = load_dflash(source, model, launch.load["max_positions"], spec.num_speculative_tokens)
        else:  # an EAGLE-3 head's directory
            from trtedge.runtime.speculative.eagle3 import load_eagle3

            draft = load_eagle3(source, model, launch.load["max_positions"])
    return Engine(model, launch.checkpoint.load_tokenizer(), launch.engine_config, draft=draft)


if __name__ == "__main__":
    _core_main(sys.argv[1], int(sys.argv[2]))
