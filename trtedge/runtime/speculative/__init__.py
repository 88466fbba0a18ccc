"""Speculative decoding: proposers (n-gram lookup, a draft model, an EAGLE-3 head) draft tokens and
the target verifies them in one forward (see ``decoder``)."""

from __future__ import annotations

from trtedge.runtime.speculative.config import (
    METHODS,
    SpeculativeConfig,
    SpeculativeConfigError,
)
from trtedge.runtime.speculative.decoder import SpecStats, SpeculativeDecoder
from trtedge.runtime.speculative.ngram import NgramProposer
from trtedge.runtime.speculative.tree import Draft


class UnsupportedSpeculativeMethod(SpeculativeConfigError):
    pass


def check_supported(config: SpeculativeConfig, model_type: str) -> None:
    """Refuse methods the target family cannot run yet (before anything is loaded)."""
    if config.method == "mtp":
        raise UnsupportedSpeculativeMethod(
            f"--speculative-config method mtp is not supported for this family yet ({model_type} "
            f"checkpoints have no multi-token-prediction layers trtedge can run); use ngram, "
            f"draft_model or eagle3"
        )


def build_decoder(
    config: SpeculativeConfig, draft, runner, blocks, max_num_batched_tokens: int, max_kv_cache_capacity: int
) -> SpeculativeDecoder:
    """The engine's speculative step for ``config``; ``draft`` is the loaded draft model or head."""
    check_supported(config, runner.model.cfg.model_type)
    if config.method == "ngram":
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    elif config.method == "draft_model":
        from trtedge.runtime.speculative.draft_model import DraftModelProposer

        proposer = DraftModelProposer(draft, runner.model, blocks.num_blocks, blocks.block_size)
    else:
        from trtedge.runtime.speculative.eagle3 import Eagle3Proposer

        proposer = Eagle3Proposer(draft, runner.model, config, blocks.num_blocks, blocks.block_size)
    return SpeculativeDecoder(config, proposer, runner, blocks, max_num_batched_tokens, max_kv_cache_capacity)


__all__ = [
    "METHODS",
    "Draft",
    "SpecStats",
    "SpeculativeConfig",
    "SpeculativeConfigError",
    "SpeculativeDecoder",
    "UnsupportedSpeculativeMethod",
    "build_decoder",
    "check_supported",
]
