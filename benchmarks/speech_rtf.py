"""Speech output speed: time to the first audio and the real-time factor of the Talker + code
predictor + Code2Wav at Qwen3-Omni-30B-A3B's shapes (transformers' default Qwen3OmniMoeConfig),
random weights, greedy-free sampling (the reference's defaults) for a fixed number of frames.

    python benchmarks/speech_rtf.py [cuda|cpu] [bfloat16|float32] [frames] [chunk_frames] [--sequences=1,4]
    python benchmarks/speech_rtf.py cpu float32 20 5 --tiny      # the test suite's tiny shapes

Prints the weights' size, the time to the first Code2Wav chunk, and audio seconds per wall second
(above 1: faster than real time): first for the pipeline called directly (one speech, its frames
in a loop), then, in the same run, for the engine's speech sequences (``SpeechScheduler`` and
``SpeechRunner`` stepped as ``Engine._speak`` steps them: one frame per running sequence a step) with
each count of ``--sequences`` speaking at once (the figure is their audio together)."""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trtedge.runtime.speech.config import SpeechConfig  # noqa: E402
from trtedge.runtime.speech.pipeline import load_speech  # noqa: E402
from trtedge.runtime.speech.talker import TalkerSampling  # noqa: E402

args = [a for a in sys.argv[1:] if not a.startswith("--")]
device = torch.device(args[0] if args else "cuda")
dtype = getattr(torch, args[1] if len(args) > 1 else "bfloat16")
num_frames = int(args[2]) if len(args) > 2 else 125  # 10 s
chunk = int(args[3]) if len(args) > 3 else 25
counts = [1, 4]
for a in sys.argv[1:]:
    if a.startswith("--sequences="):
        counts = [int(n) for n in a.removeprefix("--sequences=").split(",")]


def config() -> dict:
    import transformers

    if "--tiny" in sys.argv:
        from tests.tiny_omni import CODE2WAV, TALKER

        return transformers.Qwen3OmniMoeConfig(talker_config=TALKER, code2wav_config=CODE2WAV).to_dict()
    hf = transformers.Qwen3OmniMoeConfig().to_dict()
    talker = hf["talker_config"]
    # what the defaults leave out or place past the codec vocabulary (3072 = 2048 codes + 1024 specials);
    # assumed, not the checkpoint's
    talker["text_config"]["shared_expert_intermediate_size"] = 768
    talker.update(speaker_id={"chelsie": 2301, "ethan": 2302, "aiden": 2303}, codec_eos_token_id=2150)
    talker.update(codec_pad_id=2148, codec_bos_id=2149, codec_nothink_id=2155)
    talker.update(codec_think_bos_id=2156, codec_think_eos_id=2157)
    return hf


def shapes(hf_config: dict) -> dict[str, tuple]:
    """Parameter names and shapes of the HF Talker and Code2Wav, built on the meta device."""
    import transformers

    cfg = transformers.Qwen3OmniMoeConfig(**hf_config)
    cfg.talker_config.spatial_merge_size = 2
    with torch.device("meta"):
        talker = transformers.Qwen3OmniMoeTalkerForConditionalGeneration(cfg.talker_config)
        code2wav = transformers.Qwen3OmniMoeCode2Wav(cfg.code2wav_config)
    out = {f"talker.{n}": tuple(p.shape) for n, p in talker.named_parameters()}
    out.update({f"code2wav.{n}": tuple(p.shape) for n, p in code2wav.named_parameters()})
    return out


hf = config()
cfg = SpeechConfig.from_hf(hf)
gen = torch.Generator(device=device).manual_seed(0)
tensors = []
for name, shape in shapes(hf).items():
    t = torch.randn(shape, generator=gen, device=device, dtype=dtype) * (0.02 if len(shape) > 1 else 0.1)
    if name.endswith(("norm.weight", "layernorm.weight")):
        t += 1
    tensors.append((name, t))
rows = max(cfg.text_ids.values()) + 1
thinker = hf["talker_config"]["thinker_hidden_size"]
tensors.append(("thinker.model.embed_tokens.weight", torch.randn(rows, thinker, device=device, dtype=dtype)))
size = sum(t.numel() * t.element_size() for _, t in tensors)
speech = load_speech(cfg, tensors, dtype, device)
del tensors
t = cfg.text_ids
# a user turn of 30 text tokens, an answer of 100: the Talker speaks every frame asked for (no end code)
prompt = [t["im_start"], t["user"], *range(10, 40), t["im_start"], t["assistant"], *range(40, 140)]
eos = torch.tensor([cfg.codec_ids["eos"]], device=device)
speech.talker.suppressed = torch.cat([speech.talker.suppressed, eos])
for run in ("warm-up", "timed"):
    frames = num_frames if run == "timed" else min(num_frames, 2 * chunk)
    sampling = TalkerSampling(max_frames=frames, seed=0)
    start = time.perf_counter()
    first = None
    samples = 0
    talker_prompt = speech.prompt(prompt, speech.default_voice)
    for piece in speech.waveform(speech.frames(talker_prompt, sampling), chunk):
        if device.type == "cuda":
            torch.cuda.synchronize()
        first = first or time.perf_counter() - start
        samples += piece.shape[0]
    wall = time.perf_counter() - start
    audio = samples / speech.sample_rate
print(
    f"{device.type} {str(dtype).removeprefix('torch.')}: weights {size / 2**30:.2f} GiB; {num_frames} frames "
    f"({audio:.1f} s of audio) in {wall:.2f} s: first chunk ({chunk} frames) after {first * 1000:.0f} ms, "
    f"real-time factor {audio / wall:.2f}x (pipeline, direct)"
)


def speak_as_sequences(num_seqs: int, frames: int) -> tuple[float, float, float]:
    """(audio seconds in all, wall seconds, seconds to the first chunk) of ``num_seqs`` speeches."""
    from trtedge.runtime.core.speech import SpeechScheduler, SpeechSequence
    from trtedge.runtime.speech.runner import SpeechRunner

    voice = speech.default_voice
    rows = len(prompt) - speech.check(prompt, voice) - 4 + 1  # the answer's text rows and tts_eos
    runner, sched = SpeechRunner(speech), SpeechScheduler(num_seqs)
    running = []
    for i in range(num_seqs):
        seq = SpeechSequence(prompt, voice, TalkerSampling(max_frames=frames, seed=i), chunk, rows, True)
        sched.add(seq)
        running.append(seq)
    start = time.perf_counter()
    first, samples = None, 0
    while running:
        for seq in sched.schedule():
            ended, piece = runner.step(seq)  # a piece is on the host: the device has finished it
            if piece is not None:
                first = first or time.perf_counter() - start
                samples += piece.shape[0]
            if ended:
                sched.finish(seq, "stop")
                runner.release(seq)
                running.remove(seq)
    return samples / speech.sample_rate, time.perf_counter() - start, first


for n in counts:
    speak_as_sequences(n, min(num_frames, 2 * chunk))  # warm-up
    audio, wall, first = speak_as_sequences(n, num_frames)
    print(
        f"  engine speech sequences x{n}: {n * num_frames} frames ({audio:.1f} s of audio) in {wall:.2f} s: "
        f"first chunk after {first * 1000:.0f} ms, real-time factor {audio / wall:.2f}x in all, "
        f"{audio / wall / n:.2f}x each"
    )
