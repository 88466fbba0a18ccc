"""Nemotron-H on CUDA: the Mamba-2 scan on the device against the CPU reference, and greedy output
against HF transformers on the GPU (attention through the Triton kernels). Skips without CUDA."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.tiny import make_tiny_nemotron_h_checkpoint
from trtedge.runtime.ops import ssd
from trtedge.runtime.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("t", [1, 37, 128, 300])
def test_chunked_scan_on_the_device_matches_the_cpu(t):
    g = torch.Generator().manual_seed(t)
    h, p, n = 8, 64, 128
    x, b, c = (torch.randn(t, h, d, generator=g) for d in (p, n, n))
    dt, a = torch.rand(t, h, generator=g) * 0.1, -torch.rand(h, generator=g) - 0.1
    state = torch.randn(h, p, n, generator=g) * 0.1
    ref_out, ref_state = ssd.chunk_scan(x, dt, a, b, c, state, chunk=128)
    out, final = ssd.chunk_scan(*(v.cuda() for v in (x, dt, a, b, c, state)), chunk=128)
    assert torch.allclose(out.cpu(), ref_out, atol=2e-3, rtol=2e-3)
    assert torch.allclose(final.cpu(), ref_state, atol=2e-3, rtol=2e-3)


LAYER_TYPES = ["linear_attention", "moe", "full_attention", "mlp"]
# Logits this close are float32 rounding apart, not a different model: the 150-token prompt's first
# step has tokens 55 and 1 4.4e-4 apart (HF in float64 picks 55).
TIE = 1e-3
SCORE = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)


def test_greedy_matches_transformers_on_the_gpu(tmp_path, device="cuda"):
    """float32: 64 greedy tokens = HF's on the same device (each HF's argmax after our prefix, or
    within TIE of it), alone and batched (prompts of 24 and 150 tokens: 2 and 10 scan chunks). A
    mismatch fails with the story (``_diagnose``)."""
    transformers = pytest.importorskip("transformers")
    from trtedge import LLM

    path = make_tiny_nemotron_h_checkpoint(tmp_path / "m")
    hf = _hf_float32(transformers, path, device)
    assert [b.block_type for b in hf.model.layers] == LAYER_TYPES, transformers.__version__
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    prompts = [list(range(5, 29)), [(i * 37) % 500 + 3 for i in range(150)]]
    kw = dict(dtype="float32", device=device, max_kv_cache_capacity=512, max_input_len=256)
    with LLM(str(path), **kw) as llm:
        got = [llm.generate(ids, params).token_ids for ids in prompts]
        batched = [o.token_ids for o in llm.generate(prompts, params)]
        scored = llm.generate(prompts[1], SCORE).prompt_logprobs[1:]
        assert llm.stats()["state_slots_free"] == llm.stats()["state_slots_total"]
    with _no_tf32(), torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompts[1]], device=device)).logits[0].double(), -1).cpu()
    err = torch.tensor([lp.logprob for lp in scored]) - ref[torch.arange(149), torch.tensor(prompts[1][1:])]
    checks = [_hf_choices(hf, ids, out, device) for ids, out in zip(prompts, got)]
    # this tiny model's logits are flat: greedy alone barely sees a wrong layer, the prompt's
    # logprobs do (an expert weighting swapped: 1.8e-3 off; the attention kernels reading q densely
    # from the qkv view: 9.7e-4, picking 1 at that near tie; 2e-6 when right, on the CPU)
    if any(gap > TIE for _, gaps in checks for gap in gaps) or err.abs().max() > 2e-4:
        want = [picks for picks, _ in checks]
        story = _diagnose(hf, path, prompts, got, want, kw, transformers.__version__)
        pytest.fail(
            f"{story}\nprompt 1's logprobs in the first run: max err {err.abs().max():.3g}", pytrace=False
        )
    ties = sum(p != o for (picks, _), out in zip(checks, got) for p, o in zip(picks, out))
    assert ties <= 2, checks  # a near tie is rare: mostly HF's own argmax
    assert batched == got


def _hf_float32(transformers, path, device):
    """HF in plain float32: the per-expert loop (not grouped_mm), and convolutions without TF32 while
    it runs (``_hf_choices``)."""
    return (
        transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, experts_implementation="eager"
        )
        .to(device)
        .eval()
    )


@contextlib.contextmanager
def _no_tf32():
    """cuDNN convolutions in float32 (PyTorch lets them use TF32 by default) while the reference runs."""
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


def _hf_choices(hf, ids: list[int], out: list[int], device) -> tuple[list[int], list[float]]:
    """HF's greedy pick after the prompt and after each of our tokens, and how far below that pick's
    logit ours is (``out`` is HF's greedy generation exactly when every gap is 0)."""
    with _no_tf32(), torch.no_grad():
        logits = hf(torch.tensor([ids + out], device=device)).logits[0, len(ids) - 1 : -1].double()
    gaps = logits.max(-1).values - logits[torch.arange(len(out)), torch.tensor(out)]
    return logits.argmax(-1).tolist(), gaps.tolist()


class _Recorder:
    """Stands in for a layer's mixer and keeps its outputs of ``seen["rows"]`` rows (one prompt's
    prefill) on the host."""

    def __init__(self, mixer, seen: dict):
        self._mixer, self._seen = mixer, seen

    def __getattr__(self, name):
        return getattr(self._mixer, name)

    def __call__(self, *args):
        out = self._mixer(*args)
        if out.shape[0] == self._seen["rows"]:
            self._seen["outputs"].append(out.detach().float().cpu())
        return out


def _diagnose(hf, path, prompts, got, want, kw, hf_version) -> str:
    """Where trtedge and HF part, in one message: the first differing step per prompt, the first
    logits' gap (trtedge's top-20 logprobs against HF's log-softmax), the prompt's logprobs, each
    layer's prefill output against HF's (trtedge's engine core in this process, HF's forward hooks),
    and HF on the CPU against HF on the device (is the reference itself the odd one out?)."""
    from trtedge import LLM

    device = kw["device"]
    lines = [f"greedy differs from HF (transformers {hf_version}) on {device}:"]
    probe = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=20, prompt_logprobs=0)
    hf_cpu = type(hf).from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()
    seen: dict = {"rows": 0, "outputs": []}
    hf_seen: list = []

    def keep(module, args, out):
        hf_seen.append((out[0] if isinstance(out, tuple) else out)[0].float().cpu())

    with LLM(str(path), engine_process=False, max_num_batched_tokens=512, **kw) as llm:
        for layer in llm.model.layers:
            layer.mixer = _Recorder(layer.mixer, seen)
        for n, (ids, ours, theirs) in enumerate(zip(prompts, got, want)):
            step = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
            lines.append(
                f"prompt {n} ({len(ids)} tokens): first differing step {step}: trtedge {ours[:8]}..."
            )
            lines.append(f"  HF picks {theirs[:8]}...")
            seen["rows"], seen["outputs"] = len(ids), []
            out = llm.generate(ids, probe)
            hf_seen.clear()
            hooks = [layer.mixer.register_forward_hook(keep) for layer in hf.model.layers]
            try:
                with _no_tf32(), torch.no_grad():
                    logits = hf(torch.tensor([ids], device=device)).logits[0].float().cpu()
                    logits_cpu = hf_cpu(torch.tensor([ids])).logits[0]
            finally:
                for h in hooks:
                    h.remove()
            ref = torch.log_softmax(logits, -1)
            first = out.logprobs[0]
            top_gap = max(abs(lp - ref[-1, t].item()) for t, lp in first.top)
            lines.append(
                f"  first logits: trtedge top-5 {[(t, round(lp, 4)) for t, lp in first.top[:5]]}, "
                f"HF top-5 {[(i, round(v, 4)) for v, i in zip(*map(torch.Tensor.tolist, ref[-1].topk(5)))]}, "
                f"max |logprob diff| over trtedge's top 20: {top_gap:.3g}"
            )
            prompt_lp = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
            err = (prompt_lp - ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]).abs()
            bad = (err > 1e-3).nonzero().flatten().tolist()
            lines.append(
                f"  prompt logprobs: max err {err.max().item():.3g}, first position over 1e-3: "
                f"{bad[0] + 1 if bad else None} (scan chunk {hf.config.chunk_size})"
            )
            for i, (kind, a, b) in enumerate(zip(LAYER_TYPES, seen["outputs"], hf_seen)):
                rel = ((a - b).norm() / b.norm()).item() if a.shape == b.shape else float("nan")
                lines.append(
                    f"  layer {i} {kind}: prefill output rel. diff {rel:.3g} (shapes {list(a.shape)} / {list(b.shape)})"
                )
            if len(seen["outputs"]) != len(hf_seen):
                lines.append(f"  recorded {len(seen['outputs'])} trtedge / {len(hf_seen)} HF layer outputs")
            lines.append(
                f"  HF on the CPU: first pick {int(logits_cpu[-1].argmax())}, "
                f"max |logits cpu - {device}| {(logits_cpu - logits).abs().max().item():.3g}"
            )
    return "\n".join(lines)


def test_bfloat16_runs_and_frees_its_state_slots(tmp_path):
    """bf16 (the CUDA default): conv and norm weights in bf16, the scan and its state in float32."""
    from trtedge import LLM

    path = make_tiny_nemotron_h_checkpoint(tmp_path / "m")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(str(path), dtype="bfloat16", device="cuda", max_kv_cache_capacity=256, max_input_len=128) as llm:
        outs = [o.token_ids for o in llm.generate([list(range(5, 45)), list(range(7, 30))], params)]
        assert llm.stats()["state_slots_free"] == llm.stats()["state_slots_total"]
    assert [len(o) for o in outs] == [8, 8]


def _gaps(logits: torch.Tensor, chosen: list[int]) -> list[float]:
    """For each row, how far the chosen token's logit is below the row's best, as a share of the row's
    spread: 0 where the choice is the float32 argmax, small where bf16 broke a near tie."""
    rows = logits.float()
    best, worst = rows.max(-1).values, rows.min(-1).values
    picked = rows[torch.arange(len(chosen)), torch.tensor(chosen)]
    return ((best - picked) / (best - worst)).tolist()


def test_bfloat16_tracks_the_float32_reference(tmp_path, device="cuda"):
    """bf16 on the device against HF in float32: the prompt's log-probabilities through three scan
    chunks, and 32 greedy tokens that are the float32 argmax or within 2% of the logit spread of it."""
    transformers = pytest.importorskip("transformers")
    from trtedge import LLM

    path = make_tiny_nemotron_h_checkpoint(tmp_path / "m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    ids = [(i * 37) % 500 + 3 for i in range(48)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, prompt_logprobs=0)
    with LLM(str(path), dtype="bfloat16", device=device, max_kv_cache_capacity=256, max_input_len=128) as llm:
        out = llm.generate(ids, params)
        assert llm.stats()["state_slots_free"] == llm.stats()["state_slots_total"]
    with torch.no_grad():
        logits = hf(torch.tensor([ids + out.token_ids], device=device)).logits[0].float().cpu()
    ref = torch.log_softmax(logits, -1)
    got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    err = (got - want).abs()
    assert err.max() < 0.15 and err.mean() < 0.03, (err.max(), err.mean())
    gaps = _gaps(logits[len(ids) - 1 : -1], out.token_ids)
    assert max(gaps) <= 0.02, gaps
    assert sum(g == 0 for g in gaps) >= 24, gaps  # most steps pick the float32 argmax itself


@pytest.mark.parametrize("fmt", ["modelopt-fp8", "modelopt-nvfp4"])
def test_prequantized_checkpoints_run_their_projections_in_fp8_with_graphs(tmp_path, fmt):
    """A ModelOpt FP8 / NVFP4 Nemotron-H in bf16: the Mamba, attention and MLP projections run the fp8
    kernels (NVFP4 read as fp8 with a scale per 16 inputs), the experts dequantized into the float
    grouped kernel; graphs = eager, and the prompt's logprobs track the dequantized float model's."""
    from tests.runtime.prequantized_tiny import write_dequantized, write_prequantized
    from tests.runtime.test_nemotron_h import NEMOTRON_LINEARS
    from trtedge import LLM
    from trtedge.runtime.artifacts.checkpoint import resolve_checkpoint
    from trtedge.runtime.models import load_model
    from trtedge.runtime.ops.quant_linear import Fp8Linear

    if not torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("E4M3 needs compute capability 8.9")
    src = make_tiny_nemotron_h_checkpoint(tmp_path / "m")
    path, reference = write_prequantized(src, tmp_path / "q", fmt, NEMOTRON_LINEARS)
    model = load_model(
        resolve_checkpoint(str(path)), dtype="bfloat16", device="cuda", weights="auto", max_positions=256
    )
    mamba, moe, attention, mlp = (layer.mixer for layer in model.layers)
    assert all(isinstance(m, Fp8Linear) for m in (mamba.in_proj, mamba.out_proj, attention.qkv, mlp.up))
    assert isinstance(moe.shared.down, Fp8Linear) and moe.w_up.dtype == torch.bfloat16
    del model
    float_path = write_dequantized(src, tmp_path / "float", reference)
    ids = [(i * 37) % 500 + 3 for i in range(48)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=0)
    kw = dict(dtype="bfloat16", device="cuda", max_kv_cache_capacity=256, max_input_len=128)
    runs = {}
    for name, model_path, eager in (
        ("graphs", path, False),
        ("eager", path, True),
        ("float", float_path, False),
    ):
        with LLM(str(model_path), enforce_eager=eager, cache_dir=str(tmp_path / "cache"), **kw) as llm:
            runs[name] = llm.generate(ids, params)
            assert llm.stats()["state_slots_free"] == llm.stats()["state_slots_total"]
    assert runs["graphs"].token_ids == runs["eager"].token_ids
    got, want = (
        torch.tensor([lp.logprob for lp in runs[n].prompt_logprobs[1:]]) for n in ("graphs", "float")
    )
    err = (got - want).abs()
    assert err.max() < 0.15 and err.mean() < 0.03, (err.max(), err.mean())
