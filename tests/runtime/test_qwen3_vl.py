"""Qwen3-VL against HF transformers on a tiny random checkpoint: the vision encoder (with DeepStack
features) and greedy generation with images and a video (per-frame segments after timestamps)."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.test_qwen2_5_vl import GREEDY, hf_greedy, user
from tests.tiny_vl import TOKEN_IDS, make_tiny_qwen3_vl, random_image
from trtedge.runtime.multimodal import MultimodalPrompt

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"))


@pytest.fixture(scope="module")
def hf(checkpoint):
    return transformers.Qwen3VLForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def llm(checkpoint):
    from trtedge import LLM

    with LLM(str(checkpoint), max_kv_cache_capacity=512, max_input_len=400, max_num_batched_tokens=48) as llm:
        yield llm


def test_video_frame_pairs_are_timed_like_hf(llm):
    from trtedge.runtime.multimodal.prompt import frame_times

    # HF: frame i at i / fps, the last repeated to fill a pair, each pair at the mean of its two
    video = llm.vision.video([random_image(48, 40, s) for s in range(5)], fps=2.0)
    assert frame_times(video) == [0.25, 1.25, 2.0]


def test_vision_encoder_and_deepstack_match_hf(llm, hf):
    items = [llm.vision.image(random_image(40, 56, 0)), llm.vision.image(random_image(100, 30, 2))]
    items.append(llm.vision.video([random_image(48, 40, s) for s in range(4)], fps=2.0))
    grids = [it.grid for it in items]
    pixels = torch.cat([it.pixels for it in items])
    with torch.no_grad():
        out = hf.model.visual(pixels, grid_thw=torch.tensor(grids))
    ref = torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)
    torch.testing.assert_close(llm.model.vision(pixels, grids), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "parts",
    [("w5 w6 w7", "IMG0", "w8 w9", "IMG1"), ("w20 w21", "VIDEO", "w22")],
    ids=["two-images", "video-5-frames"],
)
def test_greedy_matches_hf(llm, hf, parts):
    from trtedge import SamplingParams

    media = {
        "IMG0": random_image(40, 56, 0),
        "IMG1": random_image(64, 48, 1),
        "VIDEO": [random_image(48, 40, s) for s in range(5)],  # the last frame is repeated to a pair
    }
    messages = user(*(media.get(p, p) for p in parts))
    prompt = llm.encode_prompt(messages)
    assert isinstance(prompt, MultimodalPrompt)
    if "VIDEO" in parts:  # three frame pairs, each "<t seconds>" <|vision_start|> pads <|vision_end|>
        assert len(prompt.items) == 3 and prompt.ids.count(TOKEN_IDS["<|vision_start|>"]) == 4
    out = llm.chat(messages, SamplingParams(**GREEDY))
    assert out.token_ids == hf_greedy(hf, prompt, video_seconds=False)


def test_video_resize_follows_the_whole_clip_budget_like_hf():
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    from trtedge.runtime.multimodal.processor import VisionProcessor

    limits = dict(patch_size=4, merge_size=2, temporal_patch_size=2)
    ref = Qwen3VLVideoProcessor(
        size={"shortest_edge": 256, "longest_edge": 16384},
        cap_pixels_per_frame=True,
        max_video_tokens=20,
        **limits,
    )
    ours = VisionProcessor(
        video_min_pixels=256,
        video_max_pixels=16384,
        video_clip_budget=True,
        max_video_frame_tokens=20,
        **limits,
    )
    for n, w, h in [(4, 48, 40), (6, 300, 200), (16, 1280, 720), (2, 30, 500), (8, 64, 64)]:
        assert ours.video_tokens(n, w, h) == ref.get_num_of_video_patches(n, h, w) // 4


def test_a_one_frame_video_is_sized_like_the_two_frames_it_is_padded_to():
    from trtedge.runtime.multimodal.processor import VisionProcessor

    ours = VisionProcessor(
        patch_size=4,
        merge_size=2,
        video_min_pixels=256,
        video_max_pixels=16384,
        video_clip_budget=True,
        max_video_frame_tokens=20,
    )
    assert ours.video_size(1, 300, 200) == ours.video_size(2, 300, 200) == (24, 40)
    assert ours.video_tokens(1, 300, 200) == ours.video_tokens(2, 300, 200) == 15
