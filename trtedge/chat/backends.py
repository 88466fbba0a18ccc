"""Where `trtedge chat` gets its answers: a local LLM, or an OpenAI-compatible server over HTTP.

Both backends have one interface: ``stream(messages, params)`` returns a ``ChatStream`` that iterates
``Chunk``s (text deltas; reasoning flagged), can be cancelled from any thread (a signal handler
included), and holds the turn's ``TurnMetrics`` once the iteration ends.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from trtedge.runtime.sampling_params import SamplingParams


class BackendError(Exception):
    """A request could not be made or failed (the message is meant for the user)."""


@dataclass(frozen=True)
class Chunk:
    text: str
    reasoning: bool = False  # reasoning_content from a server (local <think> tags arrive as text)


@dataclass
class TurnMetrics:
    """What the status line shows after one answer; times in seconds."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    time_to_first_token: float = 0.0
    decode_tokens_per_second: float = 0.0
    latency: float = 0.0  # request sent -> last token
    finish_reason: str | None = None
    reused_tokens: int = 0


class ChatStream(Iterator[Chunk]):
    """The chunks of one answer, fed by a producer thread through a queue so that ``cancel()`` can end
    the iteration at once from anywhere (a SIGINT handler, another thread)."""

    def __init__(self) -> None:
        self.metrics: TurnMetrics | None = None
        self.finish_reason: str | None = None
        self.cancelled = False
        self._queue: queue.Queue = queue.Queue()
        self._done = False
        self._ended = threading.Event()

    def __iter__(self) -> ChatStream:
        return self

    def __next__(self) -> Chunk:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if isinstance(item, Chunk):
            return item
        self._done = True
        if isinstance(item, BaseException):
            raise item
        raise StopIteration

    def cancel(self) -> None:
        if not self.cancelled and not self._done:
            self.cancelled = True
            self._stop_producer()

    def _stop_producer(self) -> None:
        raise NotImplementedError

    def wait_metrics(self, timeout: float) -> TurnMetrics | None:
        """The turn's metrics, waiting up to ``timeout`` s for the producer to finish (after a cancel)."""
        self._ended.wait(timeout)
        return self.metrics

    def _end(self, metrics: TurnMetrics | None = None, error: BaseException | None = None) -> None:
        self.metrics = metrics
        self._ended.set()
        self._queue.put(error if error is not None else _END)


_END = object()


# ---- local ----------------------------------------------------------------------------------------
class LocalBackend:
    """An ``LLM`` in this process. ``max_tokens`` is trimmed to the room left in the context, so that a
    long conversation gets a shorter answer rather than an error."""

    def __init__(self, llm):
        self.llm = llm
        self.model_name = llm.model_name
        self.max_context = llm.config.max_kv_cache_capacity

    @property
    def chat_template_origin(self) -> str | None:
        """``LLM.chat_template_origin``: "model", "default" (a file without one: a base model?) or None."""
        return self.llm.chat_template_origin

    def speak(self, text: str, voice: str | None = None):
        """``text`` spoken by the model (float32 mono, 24 kHz); BackendError without speech output."""
        if self.llm.speech_output is None:
            raise BackendError(f"{self.model_name} has no speech output (a Qwen3-Omni model speaks)")
        return self.llm.speech(text, voice=voice).audio

    def stream(self, messages: list[dict] | str, params: SamplingParams) -> ChatStream:
        """Messages go through the chat template; a string is sent as raw text."""
        llm = self.llm
        if isinstance(messages, str):
            ids = llm.encode_prompt(messages, apply_chat_template=False)
        else:
            ids = llm.encode_prompt(_decoded(messages, llm))
        room = self.max_context - len(ids)
        if room < 1 or len(ids) > llm.config.max_input_len:
            llm.check_lengths(len(ids), 1)  # raises with the limits named
        if params.max_tokens > room:
            params = dataclasses.replace(params, max_tokens=room)
        return _LocalStream(llm, ids, params)

    def describe(self) -> list[tuple[str, str]]:
        cfg = self.llm.config
        loaded = self.llm.describe()
        device, dtype = loaded.device, loaded.dtype
        rows = [("model", self.model_name)]
        if loaded.bundle_key is not None:
            rows.append(("bundle", f"{loaded.bundle_key} ({loaded.loaded_from})"))
        rows += [
            ("device", f"{device}, {dtype}" if dtype else device),
            ("context", f"{cfg.max_kv_cache_capacity} tokens (max input {cfg.max_input_len})"),
        ]
        return rows

    def close(self) -> None:
        self.llm.close()


def _decoded(messages: list[dict], llm) -> list[dict]:
    """Messages with each OpenAI input_audio part (from /audio) decoded into the samples ``LLM`` takes."""
    import base64

    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list) and any(p.get("type") == "input_audio" for p in content):
            from trtedge.runtime.multimodal.audio_file import SAMPLE_RATE, decode_audio_file

            rate = llm.audio.sampling_rate if llm.audio is not None else SAMPLE_RATE
            content = [
                {
                    "type": "audio",
                    "audio": decode_audio_file(base64.b64decode(p["input_audio"]["data"]), 600.0, rate),
                }
                if p.get("type") == "input_audio"
                else p
                for p in content
            ]
            m = {**m, "content": content}
        out.append(m)
    return out


class _LocalStream(ChatStream):
    def __init__(self, llm, ids: list[int], params: SamplingParams):
        super().__init__()
        self._metrics_ready = threading.Event()
        self._engine_metrics = None
        self._start = time.monotonic()
        self._inner = llm.generate_stream(ids, params, on_metrics=self._on_metrics)
        self._num_prompt = len(ids)
        threading.Thread(target=self._pump, name="chat-local-stream", daemon=True).start()

    def _on_metrics(self, m) -> None:
        self._engine_metrics = m
        self._metrics_ready.set()

    def _pump(self) -> None:
        first = None
        num_tokens = 0
        try:
            for delta in self._inner:
                num_tokens += len(delta.token_ids)
                if delta.text:
                    first = first or time.monotonic()
                    self._queue.put(Chunk(delta.text))
                if delta.finish_reason:
                    self.finish_reason = delta.finish_reason
        except Exception as e:
            self._end(error=BackendError(f"generation failed: {e}"))
            return
        end = time.monotonic()
        self._metrics_ready.wait(5.0)  # the engine reports metrics just after the last delta
        m = self._engine_metrics
        if m is None:
            m = TurnMetrics(self._num_prompt, num_tokens, (first or end) - self._start, 0.0)
        else:
            m = TurnMetrics(
                prompt_tokens=m.prompt_tokens,
                generated_tokens=m.generated_tokens,
                time_to_first_token=m.time_to_first_token,
                decode_tokens_per_second=m.decode_tokens_per_second,
                reused_tokens=m.reused_tokens,
            )
        m.latency = end - self._start
        m.finish_reason = self.finish_reason or ("cancelled" if self.cancelled else None)
        self._end(m)

    def _stop_producer(self) -> None:
        # The engine ends the request with a final "cancelled" delta; the pump passes it on.
        self._inner.cancel()


# ---- HTTP -----------------------------------------------------------------------------------------
class HttpBackend:
    """Any OpenAI-compatible server: POST /v1/chat/completions with stream=true and usage included."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        model: str | None = None,
        *,
        timeout: float = 10.0,
        transport=None,
    ):
        import httpx

        root = url.rstrip("/")
        root = root[: -len("/v1")] if root.endswith("/v1") else root
        self.url = root
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            base_url=root, headers=headers, timeout=httpx.Timeout(timeout, read=None), transport=transport
        )
        self.model_name = model or self._first_model()
        self.max_context = self._max_context()

    def _first_model(self) -> str:
        body = self._get_json("/v1/models")
        data = body.get("data") if isinstance(body, dict) else None
        if not data:
            raise BackendError(f"{self.url}/v1/models lists no model; pass MODEL to name one")
        return data[0]["id"]

    def _max_context(self) -> int | None:
        try:  # trtedge serve reports its limits on /health; other servers may not
            body = self._client.get("/health").json()
            return int(body["capabilities"]["max_model_len"])
        except Exception:
            return None

    def _get_json(self, path: str):
        import httpx

        try:
            r = self._client.get(path)
        except httpx.HTTPError as e:
            raise BackendError(f"cannot reach {self.url}: {e}") from None
        if r.status_code != 200:
            raise BackendError(f"{self.url}{path}: HTTP {r.status_code}: {_error_message(r.text)}")
        return r.json()

    def stream(self, messages: list[dict] | str, params: SamplingParams) -> ChatStream:
        import httpx

        if isinstance(messages, str):
            raise BackendError("--no-chat-template needs a local model, not --url")
        body = {
            "model": self.model_name,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            **_openai_params(params),
        }
        start = time.monotonic()
        request = self._client.build_request("POST", "/v1/chat/completions", json=body)
        try:
            response = self._client.send(request, stream=True)
        except httpx.HTTPError as e:
            raise BackendError(f"cannot reach {self.url}: {e}") from None
        if response.status_code != 200:
            text = response.read().decode(errors="replace")
            response.close()
            raise BackendError(f"HTTP {response.status_code}: {_error_message(text)}")
        return _HttpStream(response, start)

    def speak(self, text: str, voice: str | None = None):
        """``text`` spoken by the server (POST /v1/audio/speech as 24 kHz PCM) as float32 samples."""
        import httpx
        import numpy as np

        body = {"model": self.model_name, "input": text, "response_format": "pcm"}
        if voice:
            body["voice"] = voice
        try:
            r = self._client.post("/v1/audio/speech", json=body)
        except httpx.HTTPError as e:
            raise BackendError(f"cannot reach {self.url}: {e}") from None
        if r.status_code != 200:
            raise BackendError(f"speech: HTTP {r.status_code}: {_error_message(r.text)}")
        return np.frombuffer(r.content[: len(r.content) // 2 * 2], "<i2").astype(np.float32) / 32768.0

    def describe(self) -> list[tuple[str, str]]:
        context = f"{self.max_context} tokens" if self.max_context else "not reported by the server"
        return [("model", self.model_name), ("server", self.url), ("context", context)]

    def close(self) -> None:
        self._client.close()


class _HttpStream(ChatStream):
    def __init__(self, response, start: float):
        super().__init__()
        self._response = response
        self._start = start
        threading.Thread(target=self._pump, name="chat-http-stream", daemon=True).start()

    def _pump(self) -> None:
        first = last = None
        usage = None
        num_chunks = 0
        event = None
        try:
            for line in self._response.iter_lines():
                if self.cancelled:
                    break
                if line.startswith("event:"):
                    event = line[6:].strip()
                    continue
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                if event == "error" or "error" in payload:
                    raise BackendError(_error_message(data))
                usage = payload.get("usage") or usage
                for choice in payload.get("choices") or []:
                    delta = choice.get("delta") or {}
                    reasoning = delta.get("reasoning_content") or delta.get("reasoning")
                    for text, is_reasoning in ((reasoning, True), (delta.get("content"), False)):
                        if text:
                            now = time.monotonic()
                            first = first or now
                            last = now
                            num_chunks += 1
                            self._queue.put(Chunk(text, is_reasoning))
                    if choice.get("finish_reason"):
                        self.finish_reason = choice["finish_reason"]
        except Exception as e:
            if not self.cancelled:
                self._end(error=e if isinstance(e, BackendError) else BackendError(f"stream broke: {e}"))
                return
        finally:
            self._response.close()
        end = time.monotonic()
        generated = usage.get("completion_tokens", num_chunks) if usage else num_chunks
        decode_time = (last - first) if first is not None and last is not None else 0.0
        m = TurnMetrics(
            prompt_tokens=usage.get("prompt_tokens", 0) if usage else 0,
            generated_tokens=generated,
            time_to_first_token=(first or end) - self._start,
            decode_tokens_per_second=(generated - 1) / decode_time
            if decode_time > 0 and generated > 1
            else 0.0,
            latency=(last or end) - self._start,
            finish_reason="cancelled" if self.cancelled else self.finish_reason,
        )
        self._end(m)

    def _stop_producer(self) -> None:
        # End the iteration now; the pump notices at its next line, closes the connection (the server
        # then cancels the request) and reports what it counted.
        self._queue.put(_END)
        threading.Thread(target=self._close_quietly, daemon=True).start()

    def _close_quietly(self) -> None:
        try:
            self._response.close()
        except Exception:
            pass


def _openai_params(p: SamplingParams) -> dict:
    body: dict = {"max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p}
    if p.seed is not None:
        body["seed"] = p.seed
    if p.stop:
        body["stop"] = list(p.stop)
    for key in ("frequency_penalty", "presence_penalty"):
        if getattr(p, key):
            body[key] = getattr(p, key)
    # vLLM-style extensions: send only when set, since the OpenAI API itself refuses unknown fields
    defaults = SamplingParams()
    for key in ("top_k", "min_p", "repetition_penalty"):
        if getattr(p, key) != getattr(defaults, key):
            body[key] = getattr(p, key)
    return body


def _error_message(text: str) -> str:
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip()[:300] or "(empty response)"
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)
