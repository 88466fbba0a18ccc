"""Tensor parallelism on the CPU with gloo: TP=2 against TP=1 on the same tiny checkpoints, the weight
split itself, and a worker that dies. One TP=2 LLM per family for the module (spawning is slow)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import replace

import pytest
import torch

from tests.server.asgi import call
from tests.tiny import make_tiny_checkpoint, make_tiny_hybrid_checkpoint
from trtedge import LLM, SamplingParams
from trtedge.config import ConfigError, LaunchConfig
from trtedge.runtime.artifacts.bundle import BuildProfile, cache_key
from trtedge.runtime.executor import tp_plan
from trtedge.runtime.executor.distributed import (
    check_quantized_split,
    check_tensor_parallel,
    shard_config,
    shard_tensor,
)
from trtedge.runtime.models.config import ModelConfig

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
# the second prompt spans two KV blocks and, with 16 tokens per step, prefills in chunks beside a decode
PROMPTS = [[1, 5, 9, 33, 200], [1, *range(40, 70)]]


def launch(path, cache, tp: int, weights: str = "auto", **extra) -> LLM:
    return LLM(
        str(path),
        cache_dir=str(cache),
        tensor_parallel_size=tp,
        weights=weights,
        **extra,
        max_kv_cache_capacity=128,
        max_batch_size=2,
        max_num_batched_tokens=16,
        enable_in_flight_batching=True,
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {f: make_tiny_checkpoint(root / f, f) for f in ("llama", "qwen3")}, root / "cache"


def _make(path, family: str):
    if family == "qwen3_next":  # fused projections grouped by key head; MoE with a dense layer
        return make_tiny_hybrid_checkpoint(path, family="qwen3_next")
    if family.startswith("qwen3_5"):  # the Gated DeltaNet hybrids
        return make_tiny_hybrid_checkpoint(path, vision=False, moe=family == "qwen3_5_moe")
    return make_tiny_checkpoint(path, family)


@pytest.fixture(scope="module")
def pair(checkpoints):
    """family -> (TP=1 LLM, TP=2 LLM). A process holds one torch.distributed group, so one TP=2 LLM
    at a time: asking for another family closes the previous pair."""
    paths, cache = checkpoints
    current: dict[tuple[str, str, int], tuple[LLM, LLM]] = {}
    root = cache.parent

    def close() -> None:
        for llms in current.values():
            for llm in llms:
                llm.close()
        current.clear()

    def get(family: str, weights: str = "auto", size: int = 2) -> tuple[LLM, LLM]:
        key = (family, weights, size)
        if key not in current:
            close()
            if family not in paths:
                paths[family] = _make(root / family, family)
            path = paths[family]
            # hybrids: context reuse on, so that prompts resume from recurrent-state snapshots
            hybrid = family.startswith(("qwen3_5", "qwen3_next"))
            extra = {"context_cache_config": {"enabled": True}} if hybrid else {}
            current[key] = (
                launch(path, cache, 1, weights, **extra),
                launch(path, cache, size, weights, **extra),
            )
        return current[key]

    yield get
    close()


def test_greedy_output_matches_one_rank_llama(pair):
    check_greedy(*pair("llama"))


def check_greedy(one: LLM, two: LLM) -> None:
    assert two.tp is not None and two.tp.size > 1
    expected = [o.token_ids for o in one.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in two.generate(PROMPTS, GREEDY)] == expected
    assert all(len(ids) == GREEDY.max_tokens for ids in expected)


def test_steps_send_no_python_objects(pair, monkeypatch):
    """After the start every step is one int64 tensor broadcast: no pickled plan per step."""
    from trtedge.runtime.executor import tp as tp_module

    one, two = pair("llama")

    def refuse(*args, **kwargs):
        raise AssertionError("a step pickled Python objects")

    sent = []
    broadcast = tp_module.dist.broadcast
    monkeypatch.setattr(tp_module.dist, "broadcast_object_list", refuse)
    monkeypatch.setattr(
        tp_module.dist, "broadcast", lambda t, **kw: (sent.append(t.numel()), broadcast(t, **kw))[1]
    )
    expected = [o.token_ids for o in one.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in two.generate(PROMPTS, GREEDY)] == expected
    assert sent and all(n == tp_plan.CAPACITY for n in sent)  # every step fitted one broadcast


def test_a_step_plan_survives_its_tensor_form():
    plan = tp_plan.StepPlan(
        ids=[5, 6, 7, 9],
        positions=[0, 1, 2, 40],
        slots=[16, 17, 18, 3],
        query_lens=[3, 1],
        context_lens=[3, 41],
        tables=[[1], [0, 4, 2]],
        last_rows=[2, 3],
        score=([0, 1], [6, 7], 3),
    )
    assert tp_plan.decode(tp_plan.encode(plan)) == plan
    bare = replace(plan, score=None, last_rows=[])
    assert tp_plan.decode(tp_plan.encode(bare)) == bare
    hybrid = replace(
        plan,
        states=([3, 0], [None, (2, 9)], [0, 2]),
        ops=(
            (tp_plan.StateOp.ZERO, [3]),
            (tp_plan.StateOp.COPY, [8, 9, 0, 1]),
            (tp_plan.StateOp.RESTORE, [0, 4]),
        ),
    )
    assert tp_plan.decode(tp_plan.encode(hybrid)) == hybrid
    graph = replace(hybrid, query_lens=[1, 1], seq_ids=[12, 7])  # a CUDA-graph decode step
    assert tp_plan.decode(tp_plan.encode(graph)) == graph
    # a prefill chunk larger than one broadcast: the tensor grows, the plan comes back whole
    big = tp_plan.StepPlan(
        list(range(3000)), list(range(3000)), list(range(3000)), [3000], [3000], [list(range(188))], [2999]
    )
    buf = tp_plan.encode(big)
    assert buf.numel() > tp_plan.CAPACITY and tp_plan.decode(buf) == big


def test_gathered_logits_match_one_rank(pair):
    one, two = pair("llama")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=5)
    a, b = one.generate(PROMPTS[0], params), two.generate(PROMPTS[0], params)
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs):
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=1e-4)


def test_prompt_logprobs_match_one_rank(pair):
    one, two = pair("llama")
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3)
    a, b = one.generate(PROMPTS[0], params), two.generate(PROMPTS[0], params)
    assert len(b.prompt_logprobs) == len(PROMPTS[0]) and b.prompt_logprobs[0] is None
    for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
        assert (x.token_id, x.rank) == (y.token_id, y.rank) and x.logprob == pytest.approx(
            y.logprob, abs=1e-4
        )
        assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_each_rank_holds_half_the_kv_cache_and_weights(pair):
    one, two = pair("llama")
    assert two.stats()["kv_cache_bytes"] * 2 == one.stats()["kv_cache_bytes"]
    assert two.model.cfg.num_kv_heads * 2 == one.model.cfg.num_kv_heads
    assert two.model.weight_bytes < one.model.weight_bytes
    # the fused native decode kernels run on the sliced heads, as on one rank
    assert (two.model.decode_kernels is None) == (one.model.decode_kernels is None)


def test_second_group_in_one_process_is_refused(pair, checkpoints):
    paths, cache = checkpoints
    pair("llama")
    with pytest.raises(ConfigError, match="one tensor-parallel LLM per process"):
        launch(paths["llama"], cache, 2)


def test_dead_worker_fails_the_request_in_flight(pair):
    _, two = pair("llama")
    stream = two.generate_stream([1, 2, 3], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    with pytest.raises(RuntimeError, match="rank 1 exited|tensor-parallel"):
        for i, _ in enumerate(stream):
            if i == 2:
                os.kill(two.tp.processes[0].pid, signal.SIGKILL)
    assert "rank 1 exited" in two.stats()["engine_error"]


def test_greedy_output_matches_one_rank_qwen3(pair):
    check_greedy(*pair("qwen3"))


@pytest.mark.parametrize("family", ["gemma3", "qwen2_moe", "qwen3_moe", "mixtral"])
def test_greedy_output_matches_one_rank_newly_split_layouts(pair, family):
    """Gemma 3 (scaled embedding, sandwich norms, sliding layers); MoE with each expert's products
    split (Qwen2-MoE's gated shared expert, Qwen3-MoE's dense layer, Mixtral's w1/w2/w3 names)."""
    check_greedy(*pair(family))


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe", "qwen3_next"])
def test_greedy_output_matches_one_rank_hybrid(pair, family):
    """Gated DeltaNet heads and their conv / recurrent state split across ranks; the second run
    resumes the prompts from the prefix cache (rank 0's snapshot copies replayed on the worker)."""
    one, two = pair(family)
    assert two.model.cfg.linear.num_value_heads * 2 == one.model.cfg.linear.num_value_heads
    check_greedy(one, two)
    expected = [o.token_ids for o in one.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in two.generate(PROMPTS, GREEDY)] == expected
    assert two.get_context_cache_metrics().hits >= 1


@pytest.mark.parametrize(("family", "weights"), [("llama", "int8"), ("qwen3", "int4"), ("gemma3", "int8")])
def test_greedy_output_matches_one_rank_quantized(pair, family, weights):
    """Quantized layers split with their scales: int8 (a scale per row) and int4 (groups of 32)."""
    one, two = pair(family, weights)
    assert type(two.model.layers[0].qkv) is type(one.model.layers[0].qkv)
    assert type(one.model.layers[0].qkv).__name__ == f"Int{weights[3]}Linear"
    check_greedy(one, two)


@pytest.mark.slow  # four processes on the CPU: the split itself is test_kv_heads_are_replicated_...
def test_four_ranks_share_two_kv_heads(pair):
    """More ranks than KV heads: each rank keeps the one KV head its query heads read (replicated)."""
    one, four = pair("qwen2", size=4)  # 4 query heads, 2 KV heads, qkv biases, tied embeddings
    assert four.tp.size == 4 and four.model.cfg.num_kv_heads == 1 and four.model.cfg.num_heads == 1
    check_greedy(one, four)


def test_dead_worker_makes_the_server_answer_503(pair):
    from trtedge.server.app import build_app

    _, two = pair("qwen3")
    app = build_app(two)
    assert asyncio.run(call(app, "/health", method="GET")).status == 200
    worker = two.tp.processes[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(timeout=10)
    body = {"model": two.model_name, "prompt": [1, 2, 3], "max_tokens": 4}
    reply = asyncio.run(call(app, "/v1/completions", body))
    assert reply.status == 503
    assert reply.json()["error"]["code"] == "engine_unavailable"
    assert "rank 1 exited" in reply.json()["error"]["message"]
    health = asyncio.run(call(app, "/health", method="GET"))
    assert health.status == 503 and "rank 1 exited" in health.json()["reason"]
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exited"):
        two.generate([1, 2, 3], GREEDY)
    assert time.monotonic() - start < 5


# ---- the split, without processes -----------------------------------------------------------------
def _config(**kw) -> ModelConfig:
    base = dict(
        model_type="llama",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=12,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=2,
    )
    return ModelConfig.from_hf({**base, **kw})


def test_split_of_each_weight():
    cfg = _config()
    w = torch.arange(8 * 8).view(8, 8)  # q: 4 heads x 2 dims
    assert shard_tensor("model.layers.0.self_attn.q_proj.weight", w, cfg, 1, 2).tolist() == w[4:].tolist()
    assert shard_tensor("model.layers.0.self_attn.o_proj.weight", w, cfg, 1, 2).tolist() == w[:, 4:].tolist()
    assert shard_tensor("model.layers.0.self_attn.o_proj.bias", w[0], cfg, 1, 2).tolist() == [0] * 8
    qkv = torch.arange(16)  # fused q (8 rows), k (4), v (4): each split on its own, then fused again
    got = shard_tensor("model.layers.0.self_attn.qkv_proj.bias", qkv, cfg, 1, 2).tolist()
    assert got == [4, 5, 6, 7, 10, 11, 14, 15]
    gate_up = torch.arange(24)
    got = shard_tensor("model.layers.0.mlp.gate_up_proj.bias", gate_up, cfg, 0, 2).tolist()
    assert got == [0, 1, 2, 3, 4, 5, 12, 13, 14, 15, 16, 17]
    norm = torch.ones(8)
    assert shard_tensor("model.layers.0.input_layernorm.weight", norm, cfg, 1, 2).shape == (8,)
    embed = torch.arange(10).view(10, 1).float()  # 10 rows over 4 ranks: 3 each, the last padded
    last = shard_tensor("model.embed_tokens.weight", embed, cfg, 3, 4)
    assert last.flatten().tolist() == [9, 0, 0]
    assert shard_config(cfg, 2).num_kv_heads == 1 and shard_config(cfg, 2).intermediate_size == 6


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_weights_split_with_their_scales(fmt):
    from trtedge.runtime.artifacts.quantize import quantize

    cfg = _config(hidden_size=128, intermediate_size=128)
    w = torch.randn(128, 128)
    q = quantize(w, fmt)
    full = q.dequantize()
    for rank in (0, 1):  # each rank's columns (row-parallel) and rows (column-parallel): the same values
        cols = shard_tensor("model.layers.0.mlp.down_proj.weight", q, cfg, rank, 2)
        assert torch.equal(cols.dequantize(), full[:, rank * 64 : (rank + 1) * 64])
        rows = shard_tensor("model.layers.0.mlp.up_proj.weight", q, cfg, rank, 2)
        assert torch.equal(rows.dequantize(), full[rank * 64 : (rank + 1) * 64])
    head = shard_tensor("lm_head.weight", quantize(torch.randn(10, 128), fmt), cfg, 3, 4)
    assert head.shape == (3, 128) and torch.equal(head.dequantize()[1:], torch.zeros(2, 128))
    check_quantized_split(cfg, 2, fmt)  # 64 inputs a rank: whole groups
    with pytest.raises(ValueError, match=r"--tensor-parallel-size\) 8 with --weights int4.*groups of 32"):
        check_quantized_split(cfg, 8, "int4")  # 16 a rank
    check_quantized_split(cfg, 8, "int8")  # a scale per row: any split
    if fmt == "int4":  # 48 columns a rank would cut a group of 32
        with pytest.raises(ValueError, match="--tensor-parallel-size.*groups of 32"):
            shard_tensor("model.layers.0.mlp.down_proj.weight", quantize(torch.randn(8, 96), fmt), cfg, 0, 2)


def test_kv_heads_are_replicated_when_ranks_outnumber_them():
    cfg = _config()  # 4 heads (q: 8 rows), 2 KV heads of 2 dims (k, v: 4 rows each)
    k = torch.arange(4 * 3).view(4, 3)
    for rank, head in ((0, 0), (1, 0), (2, 1), (3, 1)):
        got = shard_tensor("model.layers.0.self_attn.k_proj.weight", k, cfg, rank, 4)
        assert got.tolist() == k[2 * head : 2 * head + 2].tolist()
    qkv = torch.arange(16)  # fused: q 0..7, k 8..11, v 12..15
    assert shard_tensor("model.layers.0.self_attn.qkv_proj.bias", qkv, cfg, 3, 4).tolist() == [
        6,
        7,
        10,
        11,
        14,
        15,
    ]
    assert shard_config(cfg, 4).num_kv_heads == 1


def test_split_of_each_expert():
    cfg = _config()
    w = torch.arange(6 * 4).view(6, 4)
    for name in ("mlp.experts.3.up_proj", "block_sparse_moe.experts.0.w1", "mlp.shared_expert.gate_proj"):
        got = shard_tensor(f"model.layers.0.{name}.weight", w, cfg, 1, 2)
        assert got.tolist() == w[3:].tolist(), name
    for name in ("mlp.experts.3.down_proj", "block_sparse_moe.experts.0.w2", "mlp.shared_expert.down_proj"):
        got = shard_tensor(f"model.layers.0.{name}.weight", w, cfg, 1, 2)
        assert got.tolist() == w[:, 2:].tolist(), name
    for name in ("mlp.gate.weight", "mlp.shared_expert_gate.weight"):  # routers: every rank
        assert shard_tensor(f"model.layers.0.{name}", w, cfg, 1, 2).tolist() == w.tolist()
    stacked = torch.arange(2 * 8 * 3).view(2, 8, 3)  # [E, 2I, H]: gate rows 0..3, up rows 4..7
    got = shard_tensor("model.layers.0.mlp.experts.gate_up_proj", stacked, cfg, 1, 2)
    assert got.tolist() == torch.cat([stacked[:, 2:4], stacked[:, 6:8]], dim=1).tolist()
    down = torch.arange(2 * 3 * 4).view(2, 3, 4)  # [E, H, I]
    got = shard_tensor("model.layers.0.mlp.experts.down_proj.weight", down, cfg, 0, 2)
    assert got.tolist() == down[:, :, :2].tolist()


def test_sizes_that_do_not_divide_the_heads_are_refused():
    with pytest.raises(
        ValueError, match=r"--tensor-parallel-size\) 2 neither divides the model's 3 KV heads"
    ):
        check_tensor_parallel(_config(num_attention_heads=6, num_key_value_heads=3), 2)
    check_tensor_parallel(_config(), 4)  # 2 KV heads over 4 ranks: each replicated on 2
    with pytest.raises(ValueError, match="--tensor-parallel-size.*3 attention heads"):
        check_tensor_parallel(_config(num_attention_heads=3, num_key_value_heads=3, head_dim=2), 2)
    with pytest.raises(ValueError, match="the gemma4_text family does not support tensor parallelism"):
        check_tensor_parallel(replace(_config(), model_type="gemma4_text"), 2)
    with pytest.raises(ValueError, match="divide the model's 3 moe_intermediate_size"):
        check_tensor_parallel(replace(_config(), model_type="qwen3_moe", moe_intermediate_size=3), 2)
    check_tensor_parallel(_config(), 2)


def test_llm_refuses_an_uneven_split_before_starting_workers(checkpoints):
    paths, cache = checkpoints
    with pytest.raises(ConfigError, match="--tensor-parallel-size"):
        launch(paths["llama"], cache, 3)  # 4 attention heads


def test_launch_settings_are_validated():
    with pytest.raises(ConfigError, match=r"tensor_parallel_size \(--tensor-parallel-size\)"):
        LaunchConfig(tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="--distributed-init-method"):
        LaunchConfig(distributed_init_method="localhost:29500")
    LaunchConfig(tensor_parallel_size=2, distributed_init_method="env://")


def test_tensor_parallel_size_changes_the_bundle_key():
    one, two = BuildProfile(), BuildProfile(tensor_parallel_size=2)
    assert cache_key("fp", None, one) != cache_key("fp", None, two)
    assert "tensor_parallel_size" not in one.key_fields()  # single-device keys did not move
    assert "tp=2" in two.summary()


def test_cli_flags_reach_the_bundle_profile_and_validation(checkpoints):
    import json

    from typer.testing import CliRunner

    from trtedge.cli import app

    paths, cache = checkpoints
    runner = CliRunner()
    args = ["build", str(paths["llama"]), "--cache-dir", str(cache), "--json"]
    one = json.loads(runner.invoke(app, args).stdout)
    two = json.loads(runner.invoke(app, [*args, "--tensor-parallel-size", "2"]).stdout)
    assert two["profile"]["tensor_parallel_size"] == 2 and one["key"] != two["key"]
    result = runner.invoke(
        app, ["serve", str(paths["llama"]), "--tensor-parallel-size", "0", "--print-config"]
    )
    assert result.exit_code != 0 and "--tensor-parallel-size" in result.output


def test_layouts_not_split_yet_are_refused_with_the_flag(checkpoints):
    paths, cache = checkpoints
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size\) > 1 splits float weights and"):
        LLM(str(paths["llama"]), cache_dir=str(cache), tensor_parallel_size=2, weights="fp8", device="cpu")


_STDIN_SCRIPT = """
import sys
from trtedge import LLM, SamplingParams
llm = LLM(sys.argv[1], cache_dir=sys.argv[2], tensor_parallel_size=2, max_kv_cache_capacity=128)
print(llm.generate([1, 5, 9, 33, 200], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)).token_ids)
llm.close()
"""


def test_a_script_fed_on_stdin_starts_tensor_parallel_workers(pair, checkpoints):
    # multiprocessing's spawn re-ran the parent's main file in each worker: FileNotFoundError '<stdin>'
    import subprocess
    import sys

    paths, cache = checkpoints
    one, _ = pair("llama")
    expected = one.generate(
        PROMPTS[0], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ).token_ids
    proc = subprocess.run(
        [sys.executable, "-", str(paths["llama"]), str(cache)],
        input=_STDIN_SCRIPT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == str(expected)
