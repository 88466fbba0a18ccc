"""Where a benchmark sends its requests: the engine in-process (``LLM``) or an OpenAI-compatible server.

A backend's ``send(request)`` blocks until the request ends and is safe to call from many threads; it
never raises: a failure comes back as a ``RequestResult`` with ``ok=False`` and the error.
"""

from __future__ import annotations

import json
import time

import httpx

from trtedge.bench.metrics import RequestResult
from trtedge.bench.workloads import AudioPrompt, BenchRequest


class OfflineBackend:
    """Streams from an ``LLM`` in this process (string prompts are used as is, no chat template)."""

    def __init__(self, llm, sampling: dict):
        from trtedge.runtime.sampling_params import SamplingParams

        self.llm = llm
        self._params = lambda max_tokens: SamplingParams(max_tokens=max_tokens, **sampling)
        self._clips: dict[bytes, object] = {}  # audio file -> decoded samples

    def _transcription(self, audio: AudioPrompt):
        """The transcription prompt of ``audio``, with a dither of its own (1e-4, inaudible): each
        request's clip is new to the encoder and its cache, as distinct recordings would be."""
        import numpy as np

        from trtedge.runtime.multimodal.audio_file import decode_audio_file
        from trtedge.runtime.multimodal.transcription import transcription_prompt

        samples = self._clips.get(audio.data)
        if samples is None:
            samples = self._clips[audio.data] = decode_audio_file(audio.data, 3600.0)
        noise = np.random.default_rng(audio.index).standard_normal(samples.size).astype(np.float32)
        tp = transcription_prompt(samples + 1e-4 * noise, style=self.llm.audio.transcription)
        return self.llm.encode_prompt(tp.messages)

    def send(self, req: BenchRequest) -> RequestResult:
        result = RequestResult(prompt_tokens=req.prompt_len)
        start = time.perf_counter()
        try:
            prompt = self._transcription(req.prompt) if isinstance(req.prompt, AudioPrompt) else req.prompt
            stream = self.llm.generate_stream(prompt, self._params(req.max_tokens))
            with stream:
                for delta in stream:
                    result.prompt_tokens = delta.prompt_tokens or result.prompt_tokens
                    if delta.token_ids:
                        result.chunk_times.append(time.perf_counter() - start)
                        result.output_tokens += len(delta.token_ids)
                    if delta.finish_reason in ("cancelled", "error"):
                        raise RuntimeError(f"request ended with finish_reason={delta.finish_reason}")
            result.ok = True
        except Exception as e:  # counted as failed, never hidden
            result.error = f"{type(e).__name__}: {e}"
        result.e2e = time.perf_counter() - start
        return result


class HttpBackend:
    """Streams ``/v1/completions`` from any OpenAI-compatible server (trtedge, vLLM, SGLang, llama.cpp).

    Token-id prompts are sent as lists of ids, which trtedge, vLLM and SGLang accept. Output tokens come
    from the final ``usage`` chunk (``stream_options.include_usage``); without one, each streamed piece
    counts as one token.
    """

    def __init__(
        self, url: str, model: str | None, sampling: dict, api_key: str | None = None, timeout=600.0
    ):
        self.base = normalize_url(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.client = httpx.Client(headers=headers, timeout=timeout, limits=limits)
        self.model = model or self.first_model()
        self.sampling = sampling

    def first_model(self) -> str:
        resp = self.client.get(f"{self.base}/v1/models")
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]

    def server_info(self) -> dict | None:
        """The server's ``/health`` JSON (trtedge reports its model, limits and batching there), if any."""
        try:
            resp = self.client.get(f"{self.base}/health", timeout=10)
            return resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def send(self, req: BenchRequest) -> RequestResult:
        if isinstance(req.prompt, AudioPrompt):
            return self._transcribe(req.prompt)
        result = RequestResult(prompt_tokens=req.prompt_len)
        body = {
            "model": self.model,
            "prompt": req.prompt,
            "max_tokens": req.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.sampling,
        }
        start = time.perf_counter()
        usage = None
        num_chunks = 0
        try:
            with self.client.stream("POST", f"{self.base}/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    raise RuntimeError(f"HTTP {resp.status_code}: {error_message(resp.read())}")
                for line in resp.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise RuntimeError(f"stream error: {error_message(chunk)}")
                    usage = chunk.get("usage") or usage
                    if any(c.get("text") for c in chunk.get("choices") or []):
                        result.chunk_times.append(time.perf_counter() - start)
                        num_chunks += 1
            if usage:
                result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
                result.output_tokens = usage.get("completion_tokens", num_chunks)
            else:
                result.output_tokens = num_chunks
            result.ok = True
        except Exception as e:  # counted as failed, never hidden
            result.error = f"{type(e).__name__}: {e}"
        result.e2e = time.perf_counter() - start
        return result

    def _transcribe(self, audio: AudioPrompt) -> RequestResult:
        """A streamed ``/v1/audio/transcriptions`` upload; each text delta is a chunk, the usage comes
        with ``transcript.text.done``."""
        result = RequestResult(prompt_tokens=0)
        form = {"model": self.model, "stream": "true"}
        if "temperature" in self.sampling:
            form["temperature"] = str(min(max(self.sampling["temperature"], 0.0), 1.0))
        start = time.perf_counter()
        try:
            files = {"file": (audio.name, audio.data)}
            with self.client.stream(
                "POST", f"{self.base}/v1/audio/transcriptions", data=form, files=files
            ) as resp:
                if resp.status_code != 200:
                    raise RuntimeError(f"HTTP {resp.status_code}: {error_message(resp.read())}")
                usage = None
                for line in resp.iter_lines():
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    event = json.loads(line[5:])
                    if "error" in event:
                        raise RuntimeError(f"stream error: {error_message(event)}")
                    if event.get("type") == "transcript.text.delta" and event.get("delta"):
                        result.chunk_times.append(time.perf_counter() - start)
                    elif event.get("type") == "transcript.text.done":
                        usage = event.get("usage")
            result.prompt_tokens = (usage or {}).get("input_tokens", 0)
            result.output_tokens = (usage or {}).get("output_tokens", len(result.chunk_times))
            result.ok = True
        except Exception as e:  # counted as failed, never hidden
            result.error = f"{type(e).__name__}: {e}"
        result.e2e = time.perf_counter() - start
        return result

    def close(self) -> None:
        self.client.close()


def error_message(body: bytes | dict) -> str:
    """The message of an OpenAI- or Anthropic-style error body (``{"error": {"message": ...}}``), else
    the body itself, shortened."""
    try:
        data = json.loads(body) if isinstance(body, bytes) else body
        error = data.get("error", data) if isinstance(data, dict) else data
        message = error.get("message") if isinstance(error, dict) else error
        if isinstance(message, str) and message:
            return message
    except ValueError:
        pass
    text = body.decode(errors="replace") if isinstance(body, bytes) else json.dumps(body)
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:299] + "…"


def normalize_url(url: str) -> str:
    """``http://host:8000``, ``http://host:8000/`` and ``http://host:8000/v1`` all mean the server root."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url
