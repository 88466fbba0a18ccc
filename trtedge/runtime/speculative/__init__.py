"""Speculative decoding: proposers (n-gram lookup, a draft model, an EAGLE-3 head, the checkpoint's own
MTP layers, a DFlash block drafter) draft tokens and the target verifies them in one forward (see
``decoder``)."""

from __future__ import annotations

from trtedge.runtime.speculative.config import (
    AVAILABLE_METHODS,
    METHODS,
    UNAVAILABLE_METHODS,
    SpeculativeConfig,
    SpeculativeConfigError,
)


class UnsupportedSpeculativeMethod(SpeculativeConfigError):
    pass


def check_supported(config: SpeculativeConfig, model_type: str | None = None, hybrid: bool = False) -> None:
    """Refuse methods a hybrid model (recurrent layers: it verifies linear chains only, see
    ``runner.rollback``) cannot run. Whether a checkpoint has MTP layers is ``mtp.check_mtp``'s."""
    if config.method in UNAVAILABLE_METHODS:
        raise UnsupportedSpeculativeMethod(
            f"--speculative-config method {config.method} is not available in trtedge yet; available: "
            f"{', '.join(AVAILABLE_METHODS)}"
        )
    if hybrid and config.method in ("eagle3", "dflash"):
        raise UnsupportedSpeculativeMethod(
            f"--speculative-config method {config.method} is not supported with hybrid models ({model_type}: "
            "its recurrent layers verify linear draft chains only, and it has no hidden-state taps for "
            "a draft head); use ngram, draft_model or mtp"
        )


def check_draft(cfg) -> None:
    """Refuse a draft model with recurrent layers from its config, before its weights load: its own
    state would need the rollback the target's gets (drafts are rejected token by token)."""
    if getattr(cfg, "linear", None) is not None or getattr(cfg, "model_type", None) == "nemotron_h":
        raise UnsupportedSpeculativeMethod(
            f"speculative_config.model (--speculative-config model): a hybrid draft model ({cfg.model_type}, "
            "recurrent layers) is not supported; use a transformer draft (llama, qwen2, qwen3, ...) or method ngram"
        )


def build_decoder(
    config: SpeculativeConfig, draft, runner, blocks, max_num_batched_tokens: int, max_kv_cache_capacity: int
):
    """The engine's SpeculativeDecoder for ``config``; ``draft`` is the loaded draft model or head (the
    MTP head for ``mtp``: ``mtp.load_mtp``, or with a model ``gemma4_assistant.load_assistant``;
    ``dflash.load_dflash`` for ``dflash``)."""
    from trtedge.runtime.speculative.decoder import SpeculativeDecoder
    from trtedge.runtime.speculative.ngram import NgramProposer

    check_supported(config, runner.model.cfg.model_type, hybrid=runner.states is not None)
    if config.method == "ngram":
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    elif config.method == "draft_model":
        from trtedge.runtime.speculative.draft_model import DraftModelProposer

        graphs = runner.graphs  # the target captures decode graphs: the draft gets its own
        if not getattr(draft, "graph_safe", True):
            graphs = None
        proposer = DraftModelProposer(
            draft,
            runner.model,
            blocks.num_blocks,
            blocks.block_size,
            graph_rows=graphs.sizes[-1] if graphs is not None else 0,
            max_blocks=-(-max_kv_cache_capacity // blocks.block_size),
            chain_depth=config.num_speculative_tokens - 1,
        )
    elif config.method == "mtp" and config.model is not None:  # Gemma 4's assistant
        from trtedge.runtime.speculative.gemma4_assistant import AssistantProposer

        proposer = AssistantProposer(draft, runner, config)
    elif config.method == "mtp":
        from trtedge.runtime.speculative.mtp import MtpProposer, check_mtp

        check_mtp(runner.model.cfg)
        graphs = _head_graphs(runner, config.num_speculative_tokens, max_kv_cache_capacity, blocks.block_size)
        proposer = MtpProposer(draft, runner.model, blocks.num_blocks, blocks.block_size, graphs)
    elif config.method == "dflash":
        from trtedge.runtime.speculative.dflash import DFlashProposer

        # a proposal writes its whole block past the anchor
        graphs = None
        if draft is not None:
            graphs = _head_graphs(runner, draft.block_size, max_kv_cache_capacity, blocks.block_size)
        proposer = DFlashProposer(draft, runner.model, config, blocks.num_blocks, blocks.block_size, graphs)
    else:
        from trtedge.runtime.speculative.eagle3 import Eagle3Proposer

        depth = min(config.num_speculative_tokens, config.verify_tokens)
        graphs = _head_graphs(runner, depth, max_kv_cache_capacity, blocks.block_size)
        proposer = Eagle3Proposer(draft, runner.model, config, blocks.num_blocks, blocks.block_size, graphs)
    if runner.graphs is not None and runner.graphs.aux_layers != runner.model.aux_layers:
        runner.graphs.recapture()  # the proposer taps hidden states (eagle3, dflash): the graphs keep them
    return SpeculativeDecoder(config, proposer, runner, blocks, max_num_batched_tokens, max_kv_cache_capacity)


def _head_graphs(runner, depth: int, max_kv_cache_capacity: int, block_size: int):
    """The CUDA graphs' geometry of a draft head's chains (``head_graphs``) where the target captures
    its decode graphs: as many rows as they take. None (eager drafting) without them, and under tensor
    parallelism, whose head runs on the first rank alone."""
    from trtedge.runtime.speculative.head_graphs import HeadGraphSpec

    graphs = runner.graphs
    if graphs is None or runner.tp is not None:
        return None
    # a chain's rows reach depth - 1 past the sequence's last token
    max_blocks = -(-(max_kv_cache_capacity + depth) // block_size)
    return HeadGraphSpec(depth=depth, max_rows=graphs.sizes[-1], max_blocks=max_blocks)


__all__ = [
    "AVAILABLE_METHODS",
    "METHODS",
    "UNAVAILABLE_METHODS",
    "SpeculativeConfig",
    "SpeculativeConfigError",
    "UnsupportedSpeculativeMethod",
    "build_decoder",
    "check_draft",
    "check_supported",
]
