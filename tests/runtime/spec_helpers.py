"""Shared setup for the speculative decoding tests: a tiny target, engines, and prompts."""

from __future__ import annotations

import random

from trtedge.runtime.artifacts.checkpoint import resolve_checkpoint
from trtedge.runtime.engine import Engine, EngineConfig
from trtedge.runtime.models import load_model
from trtedge.runtime.sampling_params import SamplingParams
from trtedge.runtime.speculative.tree import DeviceChains

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def host_drafts(drafts):
    """A proposer's drafts as host ``Draft``s (or None per sequence), whether it returned them so or as
    ``DeviceChains`` (read back here: a recording test's copy; the engine gets the original)."""
    return drafts.to_host() if isinstance(drafts, DeviceChains) else drafts


def load(path, max_positions: int = 512):
    checkpoint = resolve_checkpoint(str(path))
    model = load_model(checkpoint, dtype="float32", device="cpu", weights="auto", max_positions=max_positions)
    return model, checkpoint.load_tokenizer()


def generate(
    model, tokenizer, prompts, params=GREEDY, speculative=None, draft=None, batch=8, rounds=1, **engine
):
    """Token ids per prompt, all submitted at once (``rounds`` times, one round after the other); and
    the engine (shut down) for its stats."""
    config = EngineConfig(
        max_batch_size=batch,
        max_kv_cache_capacity=256,
        enable_in_flight_batching=batch > 1,
        speculative=speculative,
        **engine,
    )
    eng = Engine(model, tokenizer, config, draft=draft)
    try:
        params = params if isinstance(params, list) else [params] * len(prompts)
        outs = []
        for _ in range(rounds):
            streams = [eng.submit(p, sp) for p, sp in zip(prompts, params)]
            outs += [[t for delta in s for t in delta.token_ids] for s in streams]
    finally:
        eng.shutdown()
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks  # nothing leaked, rollbacks included
    return outs, eng


def collect(engine, prompts, params=GREEDY, one_by_one: bool = False) -> list[list[int]]:
    """Token ids per prompt from ``engine``, the prompts submitted all at once (or each after the last
    one finished); the engine is shut down afterwards."""
    try:
        if one_by_one:
            return [[t for delta in engine.submit(p, params) for t in delta.token_ids] for p in prompts]
        streams = [engine.submit(p, params) for p in prompts]
        return [[t for delta in s for t in delta.token_ids] for s in streams]
    finally:
        engine.shutdown()


def repetitive_prompts(count: int = 8, vocab: int = 512, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase, so n-gram lookup finds drafts."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        phrase = [rng.randrange(3, vocab) for _ in range(5 + i % 3)]
        prompts.append(phrase * 3 + phrase[:2])
    return prompts


def head_checkpoint(root, family: str):
    """A tiny target and its draft head, written under ``root``: (target directory, draft directory
    or None where the head ships inside the target's checkpoint). ``family``: qwen3_5 / nemotron_h
    (their ``mtp.*`` layers), eagle3 (a Qwen3 target), dflash (a Qwen3 target, a block of 4)."""
    from tests.tiny import make_tiny_checkpoint, make_tiny_hybrid_checkpoint, make_tiny_nemotron_h_checkpoint

    if family in ("qwen3_5", "nemotron_h"):
        from tests.runtime.mtp_tiny import add_mtp_layers, add_nemotron_mtp_layers

        if family == "nemotron_h":
            path = make_tiny_nemotron_h_checkpoint(root / "m")
            add_nemotron_mtp_layers(path)
        else:
            path = make_tiny_hybrid_checkpoint(root / "m", vision=False)
            add_mtp_layers(path)
        return path, None
    target = make_tiny_checkpoint(root / "t", "qwen3")
    if family == "eagle3":
        import json

        from tests.runtime.eagle3_tiny import make_eagle3_head

        config = json.loads((target / "config.json").read_text())
        return target, make_eagle3_head(root / "e", config["hidden_size"], config["vocab_size"])
    from tests.runtime.dflash_tiny import write_dflash

    write_dflash(root / "d")
    return target, root / "d"
