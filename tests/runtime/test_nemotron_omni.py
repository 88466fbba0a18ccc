"""Nemotron Omni video (``nemotron_h_omni``) against HF transformers on a tiny random checkpoint, on the
CPU in float32: the tubelet embeddings, the prompt spelled per tubelet as transformers' processor
spells it, and greedy output with a synthetic video; the aspect-preserving grid, the tubelet
capacity and the refusal of images."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trtedge.runtime.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")
tiny = pytest.importorskip("tests.tiny_nemotron_omni")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny.make_tiny_nemotron_omni(tmp_path_factory.mktemp("nemotron-omni"))


@pytest.fixture(scope="module")
def hf(checkpoint):
    return transformers.NemotronH_Omni_Reasoning_V3.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tmp_path_factory, checkpoint):
    from trtedge import LLM

    cache = tmp_path_factory.getbasetemp() / "trtedge-cache"
    kw = dict(
        cache_dir=str(cache), dtype="float32", device="cpu", max_kv_cache_capacity=512, max_input_len=400
    )
    with LLM(str(checkpoint), **kw) as llm:
        yield llm


def chat(frames, fps: float = 2.0, text: str = "w5 w6 w7") -> list[dict]:
    video = {"type": "video", "video": [Image.fromarray(f) for f in frames], "fps": fps}
    return [{"role": "user", "content": [video, {"type": "text", "text": text}]}]


def hf_greedy(hf, ids: list[int], pixels: torch.Tensor, n: int) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(input_ids=torch.tensor([ids + out]), pixel_values_videos=pixels).logits[0, -1]
            out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize(("num_frames", "size"), [(5, (30, 50)), (4, (40, 24))])
def test_tubelet_embeddings_equal_transformers(llm, hf, num_frames, size):
    frames = tiny.frames(num_frames, *size)
    item = llm.vision.video([Image.fromarray(f) for f in frames], 2.0)
    rows, cols = llm.vision.grid(size[1], size[0])
    assert (
        item.grid == (-(-num_frames // 2), rows, cols) and item.num_tokens == item.grid[0] * rows * cols // 4
    )
    with torch.no_grad():
        ref = hf.get_video_features(
            pixel_values_videos=tiny.reference_pixels(frames, rows, cols)
        ).pooler_output[0]
    got = llm.engine.runner.model.vision(item.pixels, [item.grid])
    assert torch.allclose(got, ref, atol=1e-4)


def test_the_prompt_spells_each_tubelet_as_transformers_does(llm):
    from transformers.models.nemotron_h_omni.processing_nemotron_h_omni import (
        NemotronH_Omni_Reasoning_V3Processor as Processor,
    )

    frames = tiny.frames(5)
    prompt = llm.encode_prompt(chat(frames))
    first, last = prompt.items[0].offset, prompt.items[-1].end
    rows, cols = llm.vision.grid(50, 30)
    fake = SimpleNamespace(
        video_processor=SimpleNamespace(patch_size=4, downsample_ratio=0.5),
        image_start_token="<img>",
        image_end_token="</img>",
        image_token="<image>",
        video_temporal_patch_dim=2,
    )
    inputs = {
        "num_frames": [5],
        "video_metadata": [SimpleNamespace(fps=2.0, frames_indices=list(range(5)))],
        "pixel_values_videos": torch.zeros(1, 3, 6, rows * 4, cols * 4),
    }
    text = Processor.replace_video_token(fake, inputs, 0)
    want = llm.tokenizer.encode(text, add_special_tokens=False)
    start = prompt.ids.index(tiny.TOKEN_IDS["<img>"])
    label = "Frame 1 sampled at 0.00 seconds and frame 2 sampled at 0.50 seconds: "
    label = len(llm.tokenizer.encode(label, add_special_tokens=False))
    assert prompt.ids[start - label : last + 1] == want
    assert [it.offset for it in prompt.items] == [
        i for i in range(first, last) if prompt.ids[i - 1] == want[label]
    ]


def test_greedy_with_a_video_equals_transformers(llm, hf):
    frames = tiny.frames(5)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    out = llm.chat(chat(frames), params)
    prompt = llm.encode_prompt(chat(frames))
    rows, cols = llm.vision.grid(50, 30)
    assert out.token_ids == hf_greedy(hf, prompt.ids, tiny.reference_pixels(frames, rows, cols), 24)
    again = llm.chat(chat(frames), params)  # the same video again: the same tokens
    assert again.token_ids == out.token_ids
    assert llm.stats()["state_slots_free"] == llm.stats()["state_slots_total"]


def test_the_grid_keeps_the_aspect_ratio():
    from trtedge.runtime.multimodal.nemotron_video import NemotronVideoProcessor

    p = NemotronVideoProcessor()  # 1024 target patches
    assert p.grid(1920, 1080) == (24, 42) and p.grid(1080, 1920) == (42, 24)
    assert p.grid(640, 640) == (32, 32)
    assert p.video_size(8, 1920, 1080) == (24 * 16, 42 * 16)
    assert NemotronVideoProcessor(maintain_aspect_ratio=False).grid(1920, 1080) == (32, 32)


def test_over_the_tubelet_capacity_and_images_are_refused(llm):
    cap = llm.vision.max_tubelets
    assert llm.vision.video_tokens(2 * cap, 50, 30) == cap * 8
    with pytest.raises(ValueError, match=f"more than the {cap} one video may take"):
        llm.vision.video_tokens(2 * cap + 1, 50, 30)
    frames = tiny.frames(1) * (2 * cap + 1)
    with pytest.raises(ValueError, match="tubelets"):
        llm.encode_prompt(chat(frames))
    image = [{"role": "user", "content": [{"type": "image", "image": Image.fromarray(tiny.frames(1)[0])}]}]
    with pytest.raises(ValueError, match="image input is not supported"):
        llm.encode_prompt(image)
    assert llm.stats()["active_requests"] == 0


def test_a_processor_that_does_not_match_the_tower_is_refused_at_load(tmp_path):
    import json

    from trtedge.runtime.multimodal.nemotron_video import NemotronVideoProcessor

    vision = {"vision_config": dict(tiny.VISION), "video_temporal_patch_size": 2}
    (tmp_path / "video_preprocessor_config.json").write_text(
        json.dumps({**tiny.VIDEO_PROCESSOR, "patch_size": 8})
    )
    with pytest.raises(
        ValueError, match=r"patch_size \(8\) must equal the model's vision_config.patch_size \(4\)"
    ):
        NemotronVideoProcessor.from_dir(tmp_path, vision)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(tiny.VIDEO_PROCESSOR))
    assert NemotronVideoProcessor.from_dir(tmp_path, vision).patch_size == 4
    with pytest.raises(ValueError, match="video_temporal_patch_size"):
        NemotronVideoProcessor.from_dir(tmp_path, {**vision, "video_temporal_patch_size": 4})


def test_video_requests_survive_preemption_and_reuse_their_prefix(llm, tmp_path_factory, checkpoint):
    """Three video requests in a pool too small for them: preempted, recomputed (the video encoded
    again), the same tokens as alone and every slot and block free after; a prompt that extends one
    with the same video reuses its prefix snapshot with unchanged output."""
    from trtedge import LLM, ContextCacheConfig
    from trtedge.runtime.engine import Engine, EngineConfig

    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    prompts = [llm.encode_prompt(chat(tiny.frames(5, seed=s), text=f"w{5 + s}")) for s in range(3)]
    expected = [llm.generate(p, params).token_ids for p in prompts]
    config = EngineConfig(
        max_batch_size=3, max_kv_cache_capacity=128, enable_in_flight_batching=True, num_blocks=10
    )
    engine = Engine(llm.engine.runner.model, llm.tokenizer, config)
    try:
        outs = [[t for d in s for t in d.token_ids] for s in [engine.submit(p, params) for p in prompts]]
        assert engine.stats.preemptions > 0 and outs == expected
        assert engine.blocks.state.num_free_slots == 3 and engine.blocks.num_free_blocks == 10
    finally:
        engine.shutdown()
    cache = tmp_path_factory.getbasetemp() / "trtedge-cache"
    kw = dict(
        cache_dir=str(cache), dtype="float32", device="cpu", max_kv_cache_capacity=512, max_input_len=400
    )
    with LLM(str(checkpoint), context_cache_config=ContextCacheConfig(enabled=True), **kw) as warm:
        first = warm.chat(chat(tiny.frames(9)), params)  # 5 tubelets: a 113-token prompt
        again = warm.chat(chat(tiny.frames(9), text="w5 w6 w7 w9 w8"), params)
        assert warm.stats()["state_slots_free"] == warm.stats()["state_slots_total"]
    # the snapshot at the first prompt's last full block (112 tokens, the video and "w5 w6 w7")
    assert first.metrics.reused_tokens == 0 and again.metrics.reused_tokens == 112
    assert again.token_ids == llm.chat(chat(tiny.frames(9), text="w5 w6 w7 w9 w8"), params).token_ids
