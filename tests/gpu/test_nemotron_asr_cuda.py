"""Nemotron-3.5-ASR (an RNN-T transcriber) on CUDA: float32 greedy tokens equal HF's, and bf16 (the
CUDA default: the encoder in bf16, the prediction network and joint in float32) transcribes with
encoder frames close to float32's. Skips without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trtedge.runtime.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
transformers = pytest.importorskip("transformers")
tiny = pytest.importorskip("tests.tiny_nemotron_asr")


def test_float32_on_the_gpu_equals_transformers_and_bf16_tracks_it(tmp_path):
    from trtedge import LLM

    path = tiny.make_tiny_nemotron_asr(tmp_path / "m")
    samples = np.concatenate([tiny.clip(1), tiny.clip(2)])
    hf = transformers.Nemotron3_5AsrForRNNT.from_pretrained(path, dtype=torch.float32).eval()
    try:
        inputs = transformers.AutoProcessor.from_pretrained(path)(samples, sampling_rate=16000, language="de")
    except ImportError as e:  # some transformers releases' feature extractor needs librosa for the reference
        pytest.skip(f"the transformers {transformers.__version__} reference cannot run here: {e}")
    with torch.no_grad():
        ref = [
            t for t in hf.generate(**inputs, max_new_tokens=2000).sequences[0, 1:].tolist() if t != tiny.BLANK
        ]
    params = SamplingParams(max_tokens=2000)
    cache = str(tmp_path / "cache")
    with LLM(str(path), cache_dir=cache, dtype="float32", device="cuda") as llm:
        out = llm.generate(llm.audio.prompt(samples, "de"), params)
        frames32 = llm.engine.model.encode(llm.audio.features(samples), 1, 2)
    if out.token_ids != ref:
        step = next(
            (k for k, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b),
            min(len(ref), len(out.token_ids)),
        )
        pytest.fail(
            f"transcript tokens differ from HF from token {step} (trtedge {len(out.token_ids)}, HF {len(ref)} "
            f"tokens): trtedge {out.token_ids[step : step + 8]}, HF {ref[step : step + 8]}",
            pytrace=False,
        )
    with LLM(str(path), cache_dir=cache, dtype="bfloat16", device="cuda") as llm:
        assert llm.describe()["dtype"] == "bfloat16"
        frames16 = llm.engine.model.encode(llm.audio.features(samples), 1, 2)
        out16 = llm.generate(llm.audio.prompt(samples, "de"), params)
        assert llm.stats()["active_requests"] == 0
    rel = ((frames16 - frames32).norm() / frames32.norm()).item()
    assert rel < 3e-2, rel
    assert out16.token_ids and out16.finish_reason == "stop"
