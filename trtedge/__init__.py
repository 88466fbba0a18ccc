"""trtedge: build, cache, serve and measure LLMs on your own machine."""

from __future__ import annotations

import importlib

from trtedge._version import __version__

# Public names resolve lazily so that `trtedge --help` does not pay for importing torch.
_EXPORTS = {
    "LLM": "trtedge.llm",
    "PromptTooLongError": "trtedge.llm",
    "ParamError": "trtedge.runtime.sampling_params",
    "ConfigError": "trtedge.config",
    "ContextCacheConfig": "trtedge.config",
    "PleRuntimeConfig": "trtedge.config",
    "ContextCacheMetrics": "trtedge.llm_metrics",
    "EngineStats": "trtedge.llm_views",
    "ModelInfo": "trtedge.llm_views",
    "RenderedChat": "trtedge.llm_views",
    "TokenizerInfo": "trtedge.llm_views",
    "ProfilingMetrics": "trtedge.runtime.profiling",
    "CheckpointError": "trtedge.runtime.artifacts.checkpoint",
    "clear_engine_cache": "trtedge.runtime.artifacts.bundle",
    "prune_engine_cache": "trtedge.runtime.artifacts.bundle",
    "SamplingParams": "trtedge.runtime.sampling_params",
    "GuidedDecodingParams": "trtedge.runtime.sampling_params",
    "GuidedUnavailableError": "trtedge.runtime.structured",
    "CancellableIterator": "trtedge.runtime.output",
    "CompletionOutput": "trtedge.runtime.output",
    "GenerationMetrics": "trtedge.runtime.output",
    "RequestOutput": "trtedge.runtime.output",
    "StreamDelta": "trtedge.runtime.output",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trtedge' has no attribute {name!r}")
