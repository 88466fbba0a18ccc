"""Nemotron Omni video on CUDA: float32 tubelet embeddings and greedy tokens with a synthetic video
equal HF's, and bf16 (the CUDA default) runs the video through and frees its state slots. Skips
without CUDA."""

from __future__ import annotations

import pytest
import torch

from trtedge.runtime.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")
if not hasattr(transformers, "NemotronH_Omni_Reasoning_V3_Config"):  # the reference (transformers >= 5.24)
    pytest.skip(
        f"transformers {transformers.__version__} has no Nemotron Omni reference", allow_module_level=True
    )
tiny = pytest.importorskip("tests.tiny_nemotron_omni")


def test_video_greedy_on_the_gpu_equals_transformers_and_bf16_runs(tmp_path, device="cuda"):
    from trtedge import LLM

    path = tiny.make_tiny_nemotron_omni(tmp_path / "m")
    frames = tiny.frames(6)
    video = {"type": "video", "video": [Image.fromarray(f) for f in frames], "fps": 2.0}
    messages = [{"role": "user", "content": [video, {"type": "text", "text": "w5 w6 w7"}]}]
    hf = transformers.NemotronH_Omni_Reasoning_V3.from_pretrained(path, dtype=torch.float32).eval()
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    kw = dict(cache_dir=str(tmp_path / "cache"), device=device, max_kv_cache_capacity=512, max_input_len=400)
    with LLM(str(path), dtype="float32", **kw) as llm:
        prompt = llm.encode_prompt(messages)
        out = llm.chat(messages, params)
        rows, cols = llm.vision.grid(50, 30)
        item = llm.vision.video(video["video"], 2.0)
        got = llm.engine.runner.model.vision(item.pixels, [item.grid]).cpu()
    pixels = tiny.reference_pixels(frames, rows, cols)
    ids: list[int] = []
    top2: list[list[tuple[int, float]]] = []  # HF's two best (token, logit) at each step
    with torch.no_grad():
        ref = hf.get_video_features(pixel_values_videos=pixels).pooler_output[0]
        for _ in range(24):
            logits = hf(input_ids=torch.tensor([prompt.ids + ids]), pixel_values_videos=pixels).logits[0, -1]
            ids.append(int(logits.argmax()))
            v, i = logits.topk(2)
            top2.append(list(zip(i.tolist(), v.tolist())))
    assert torch.allclose(got, ref, atol=1e-3), (got - ref).abs().max()
    if out.token_ids != ids:
        step = next(k for k, (a, b) in enumerate(zip(out.token_ids, ids)) if a != b)
        (t1, v1), (t2, v2) = top2[step]
        pytest.fail(
            f"greedy differs from HF at step {step}: trtedge {out.token_ids[step]}, HF's two best "
            f"{t1} ({v1:.6f}) and {t2} ({v2:.6f}), {v1 - v2:.2e} apart; embeddings max diff "
            f"{(got - ref).abs().max():.2e}; trtedge {out.token_ids}, HF {ids}",
            pytrace=False,
        )
    with LLM(str(path), dtype="bfloat16", **kw) as llm:
        out16 = llm.chat(messages, params)
        assert llm.stats()["state_slots_free"] == llm.stats()["state_slots_total"]
    assert len(out16.token_ids) == 24
