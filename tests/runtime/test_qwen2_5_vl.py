"""Qwen2.5-VL against HF transformers on a tiny random checkpoint: processor, vision encoder, and
greedy generation with images and a video through ``LLM``."""

from __future__ import annotations

import pytest
import torch

from tests.eager_graphs import EagerGraphs
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


def hf_greedy(hf, prompt: MultimodalPrompt, video_seconds: bool = True) -> list[int]:
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
        if video_seconds:
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
    images = [
        random_image(40, 56, 0),
        random_image(64, 64, 1),
        random_image(100, 30, 2),
        random_image(300, 200, 3),
    ]
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


def image_prompt(image, text: str = "w8 w9") -> list[dict]:
    return user("w5 w6 w7", image, text)


def test_image_cut_by_prefill_chunks_matches_hf(checkpoint, hf):
    from trtedge import LLM, SamplingParams

    with LLM(
        str(checkpoint), max_kv_cache_capacity=512, max_input_len=400, max_num_batched_tokens=16
    ) as small:
        messages = image_prompt(random_image(40, 56, 0))
        prompt = small.encode_prompt(messages)
        item = prompt.items[0]
        assert item.offset % 16 and item.num_tokens > 16  # the image spans three chunks
        out = small.chat(messages, SamplingParams(**GREEDY))
        assert out.token_ids == hf_greedy(hf, prompt)


def test_context_reuse_keys_on_the_image(checkpoint, hf):
    from trtedge import LLM, SamplingParams

    with LLM(
        str(checkpoint),
        max_kv_cache_capacity=512,
        max_input_len=400,
        context_cache_config={"enabled": True},
    ) as llm:
        a, b = random_image(40, 56, 0), random_image(40, 56, 7)
        text = " ".join(f"w{i}" for i in range(30, 70))  # same long text after the image
        pa, pb = llm.encode_prompt(image_prompt(a, text)), llm.encode_prompt(image_prompt(b, text))
        assert pa.ids == pb.ids and pa.items[0].hash != pb.items[0].hash
        first = llm.chat(image_prompt(a, text), SamplingParams(**GREEDY))
        other = llm.chat(image_prompt(b, text), SamplingParams(**GREEDY))
        again = llm.chat(image_prompt(a, text), SamplingParams(**GREEDY))
        # same text, other image: nothing from the image's first block on is reused
        assert other.metrics.reused_tokens <= pb.items[0].offset
        assert other.token_ids == hf_greedy(hf, pb)
        # the same image again: the blocks holding the image (and the text after it) are reused
        assert again.metrics.reused_tokens >= pa.items[0].end
        assert again.token_ids == first.token_ids == hf_greedy(hf, pa)
        cache = llm.get_mm_embedding_cache_metrics()
        assert cache["misses"] == 2 and cache["encoded_items"] == 2


def test_embedding_cache_is_lru_and_bounded():
    from trtedge.runtime.multimodal.cache import EmbeddingCache

    cache = EmbeddingCache(max_bytes=3 * 4 * 8)  # three float32 tensors of 8 values
    for key in b"abc":
        cache.put(bytes([key]), torch.zeros(8))
    assert cache.get(b"a") is not None  # a is now the most recent
    cache.put(b"d", torch.zeros(8))
    assert cache.get(b"b") is None and cache.get(b"a") is not None and len(cache) == 3
    assert cache.bytes <= cache.max_bytes and cache.stats.evictions == 1
    cache.put(b"big", torch.zeros(100))  # larger than the whole cache: not kept
    assert cache.get(b"big") is None and cache.bytes <= cache.max_bytes
    assert (cache.stats.hits, cache.stats.misses) == (2, 2)


def test_embedding_cache_holds_only_the_bytes_it_counts():
    """Items encoded in one batch are slices of one output: a cached slice must not keep the whole
    batch's storage alive past the byte bound."""
    from trtedge.runtime.multimodal import MediaItem
    from trtedge.runtime.multimodal.inputs import MediaInputs

    def encoder(pixels, grids):
        return torch.randn(len(grids) * 4, 8)

    items = [MediaItem("image", torch.zeros(16, 3), (1, 4, 4), bytes([i]), 0, 4) for i in range(3)]
    media = MediaInputs(encoder, cache_bytes=10 * 4 * 8 * 4)
    media.encode(items)
    cache = media.cache
    held = sum(cache.get(it.hash).untyped_storage().nbytes() for it in items)
    assert len(cache) == 3 and held == cache.bytes == 3 * 4 * 8 * 4


def test_repeated_image_hits_the_embedding_cache_within_its_byte_bound(checkpoint):
    from trtedge import LLM, SamplingParams

    one_image = 35 * 64 * 4  # 35 tokens x 64 wide x float32
    with LLM(str(checkpoint), max_kv_cache_capacity=512, mm_embedding_cache_bytes=one_image) as llm:
        params = SamplingParams(max_tokens=2)
        a, b = random_image(40, 56, 0), random_image(40, 56, 1)
        for image in (a, a, b, b, a):
            llm.chat(image_prompt(image), params)
        m = llm.get_mm_embedding_cache_metrics()
        assert (m["hits"], m["misses"], m["evictions"]) == (2, 3, 2)
        assert m["entries"] == 1 and m["bytes"] <= one_image
        assert llm.stats()["mm_embedding_cache"]["hits"] == 2


def test_preempted_requests_recompute_their_images(llm, hf):
    from trtedge import SamplingParams
    from trtedge.runtime.engine import Engine, EngineConfig

    calls = []
    encoder = llm.model.vision

    def counting(pixels, grids):
        calls.append(len(grids))
        return encoder(pixels, grids)

    # 9 blocks of 16 tokens cannot hold both requests (47 + 32 tokens each): one is preempted
    config = EngineConfig(
        max_batch_size=2, max_kv_cache_capacity=128, num_blocks=9, enable_in_flight_batching=True
    )
    engine = Engine(llm.model, llm.tokenizer, config)
    engine.runner.media.encoder = counting
    try:
        prompts = [llm.encode_prompt(image_prompt(random_image(40, 56, s))) for s in (0, 3)]
        streams = [engine.submit(p, SamplingParams(**GREEDY)) for p in prompts]
        outputs = [[t for d in s for t in d.token_ids] for s in streams]
        assert engine.stats.preemptions > 0
        assert calls[0] == 2  # both requests' images went through the encoder in one batch
        assert outputs == [hf_greedy(hf, p) for p in prompts]
    finally:
        engine.shutdown()


def test_text_only_bundle_refuses_media(checkpoint, tmp_path):
    from trtedge import LLM, SamplingParams
    from trtedge.runtime.artifacts.bundle import BuildProfile, prepare_bundle

    full = prepare_bundle(str(checkpoint), BuildProfile.create(components="all"), cache_dir=tmp_path)
    text = prepare_bundle(str(checkpoint), BuildProfile.create(components="llm"), cache_dir=tmp_path)
    assert set(full.manifest["components"]) == {"llm", "vision"} and full.key != text.key
    assert set(text.manifest["components"]) == {"llm"}
    full.release()
    text.release()
    with LLM(str(checkpoint), cache_dir=str(tmp_path), components="llm", max_kv_cache_capacity=256) as llm:
        assert llm.vision is None and llm.model.vision is None
        assert set(llm.bundle.manifest["components"]) == {"llm"}
        with pytest.raises(ValueError, match="no vision component"):
            llm.encode_prompt(image_prompt(random_image()))
        assert llm.chat(user("w5 w6"), SamplingParams(max_tokens=3)).completion_tokens == 3


def test_unprocessable_image_names_the_content_part(llm):
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\]: cannot process the image"):
        llm.encode_prompt(user("w5", object()))
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[2\].*aspect ratio"):
        llm.encode_prompt(user("w5", random_image(), random_image(600, 2)))


def test_server_metrics_show_the_embedding_cache(llm):
    from trtedge.server.metrics import ServerMetrics

    text = ServerMetrics(llm.stats, lambda: 0).render().decode()
    m = llm.get_mm_embedding_cache_metrics()
    assert f"trtedge_mm_embedding_cache_hits {float(m['hits'])}" in text
    assert f"trtedge_mm_embedding_cache_misses {float(m['misses'])}" in text


def test_one_token_prompt_step_of_a_media_request_skips_the_decode_graphs(llm):
    """A repeated image request reuses every full block and computes its last prompt token alone: a
    decode-shaped step whose positions are M-RoPE rows, which the decode graphs cannot take."""
    from trtedge import SamplingParams
    from trtedge.runtime.engine import Engine, EngineConfig

    config = EngineConfig(max_kv_cache_capacity=256, enable_context_reuse=True)
    engine = Engine(llm.model, llm.tokenizer, config)
    engine.runner.graphs = graphs = EagerGraphs(engine.runner)
    try:
        prompt = llm.encode_prompt(image_prompt(random_image(40, 56, 0), "w8 w9 w10 w11"))
        assert len(prompt) % config.block_size == 1  # all but the last prompt token sit in full blocks
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        outputs = []
        for _ in range(2):
            stream = engine.submit(prompt, params)
            outputs.append([t for d in stream for t in d.token_ids])
        assert outputs[0] == outputs[1] and len(outputs[0]) == 4
        assert graphs.calls > 0  # the decode steps after the prompt still use the graphs
    finally:
        engine.shutdown()


def test_media_with_speculative_decoding_is_refused_before_it_takes_any_blocks(checkpoint):
    """Decode after media needs the rope delta, which the speculative paths do not carry yet: such a
    request is refused at submit with the reason, and the engine keeps serving text."""
    from trtedge import LLM, SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with LLM(str(checkpoint), max_kv_cache_capacity=256, speculative_config=spec) as llm:
        free = llm.engine.blocks.num_free_blocks
        with pytest.raises(ValueError, match="speculative decoding"):
            llm.chat(image_prompt(random_image()), SamplingParams(max_tokens=3))
        assert llm.engine.num_active == 0 and llm.engine.blocks.num_free_blocks == free
        assert llm.chat(user("w5 w6"), SamplingParams(max_tokens=3)).completion_tokens == 3


def test_media_that_fail_to_encode_fail_their_request_alone(llm, hf):
    """The encoder refusing one request's image fails that request (its blocks freed); the request
    batched with it is served, and the engine does not restart."""
    from trtedge import SamplingParams
    from trtedge.runtime.engine import Engine, EngineConfig, EngineError

    encoder = llm.model.vision
    bad_grid = (1, 12, 12)  # the 48 x 48 image

    def picky(pixels, grids):
        if bad_grid in [tuple(g) for g in grids]:
            raise RuntimeError("encoder out of memory")
        return encoder(pixels, grids)

    config = EngineConfig(max_batch_size=2, max_kv_cache_capacity=256, enable_in_flight_batching=True)
    engine = Engine(llm.model, llm.tokenizer, config)
    engine.runner.media.encoder = picky
    try:
        good = llm.encode_prompt(image_prompt(random_image(40, 56, 0)))
        bad = llm.encode_prompt(image_prompt(random_image(48, 48, 1)))
        assert bad.items[0].grid == bad_grid and good.items[0].grid != bad_grid
        streams = [engine.submit(p, SamplingParams(**GREEDY)) for p in (good, bad)]
        assert [t for d in streams[0] for t in d.token_ids] == hf_greedy(hf, good)
        with pytest.raises(EngineError, match="could not be encoded.*out of memory"):
            list(streams[1])
        assert engine.stats.restarts == 0 and engine.num_active == 0
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    finally:
        engine.shutdown()
