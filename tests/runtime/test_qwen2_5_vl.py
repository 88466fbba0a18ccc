"""Qwen2.5-VL against HF transformers on a tiny random checkpoint: processor, vision encoder, and
greedy generation with images and a video through ``LLM``."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_vl import PREPROCESSOR, TOKEN_IDS, make_tiny_qwen2_5_vl, random_image
from trtedge.runtime.multimodal import MultimodalPrompt

transformers = pytest.importorskip("transformers")

IMAGE, VIDEO = TOKEN_IDS["<|image_pad|>"], TOKEN_IDS["<|video_pad|>"]
GREEDY = dict(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def hf(checkpoint):
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def llm(checkpoint):
    from trtedge import LLM

    with LLM(str(checkpoint), max_kv_cache_capacity=512, max_input_len=400, dtype="float32") as llm:
        yield llm


def hf_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    keys = ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size")
    return Qwen2VLImageProcessorPil(**{k: PREPROCESSOR[k] for k in keys})


def hf_greedy(hf, prompt: MultimodalPrompt) -> list[int]:
    """HF's greedy continuation of a prompt, fed our pixels (the processors are compared separately)."""
    ids = torch.tensor([prompt.ids])
    kinds = torch.zeros_like(ids)
    kinds[ids == IMAGE], kinds[ids == VIDEO] = 1, 2
    kw = {}
    images = [it for it in prompt.items if it.kind == "image"]
    videos = [it for it in prompt.items if it.kind == "video"]
    if images:
        kw["pixel_values"] = torch.cat([it.pixels for it in images])
        kw["image_grid_thw"] = torch.tensor([it.grid for it in images])
    if videos:
        kw["pixel_values_videos"] = torch.cat([it.pixels for it in videos])
        kw["video_grid_thw"] = torch.tensor([it.grid for it in videos])
        kw["second_per_grid_ts"] = torch.tensor([it.second_per_grid for it in videos])
    out = hf.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=kinds,
        max_new_tokens=32,
        min_new_tokens=32,
        do_sample=False,
        **kw,
    )
    return out[0, ids.shape[1] :].tolist()


def user(*parts) -> list[dict]:
    content = []
    for p in parts:
        if isinstance(p, str):
            content.append({"type": "text", "text": p})
        elif isinstance(p, list):
            content.append({"type": "video", "video": p, "fps": 2.0})
        else:
            content.append({"type": "image", "image": p})
    return [{"role": "user", "content": content}]


def test_processor_matches_hf(llm):
    images = [random_image(40, 56, 0), random_image(64, 64, 1), random_image(100, 30, 2), random_image(300, 200, 3)]
    ref = hf_processor()(images, return_tensors="pt")
    items = [llm.vision.image(im) for im in images]
    assert [list(it.grid) for it in items] == ref["image_grid_thw"].tolist()
    torch.testing.assert_close(torch.cat([it.pixels for it in items]), ref["pixel_values"], atol=1e-5, rtol=0)
    for im, it in zip(images, items):
        assert llm.vision.image_tokens(im.width, im.height) == it.num_tokens


def test_vision_encoder_matches_hf(llm, hf):
    items = [llm.vision.image(random_image(40, 56, 0)), llm.vision.image(random_image(100, 30, 2))]
    items.append(llm.vision.video([random_image(48, 40, s) for s in range(4)], fps=2.0))
    grids = [it.grid for it in items]
    pixels = torch.cat([it.pixels for it in items])
    with torch.no_grad():
        ref = hf.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
    got = llm.model.vision(pixels, grids)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "parts",
    [
        ("w5 w6 w7", "IMG0", "w8 w9"),
        ("w3", "IMG0", "w4 w4", "IMG1", "w10 w11 w12"),
        ("w20 w21", "VIDEO", "w22"),
    ],
    ids=["one-image", "two-images", "video-4-frames"],
)
def test_greedy_matches_hf(llm, hf, parts):
    from trtedge import SamplingParams

    media = {
        "IMG0": random_image(40, 56, 0),
        "IMG1": random_image(64, 48, 1),
        "VIDEO": [random_image(48, 40, s) for s in range(4)],
    }
    messages = user(*(media.get(p, p) for p in parts))
    prompt = llm.encode_prompt(messages)
    assert isinstance(prompt, MultimodalPrompt)
    out = llm.chat(messages, SamplingParams(**GREEDY))
    assert out.prompt_tokens == len(prompt.ids)
    assert out.token_ids == hf_greedy(hf, prompt)
