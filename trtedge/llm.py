"""LLM: the public Python API over the engine."""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

from trtedge.config import ConfigError, ContextCacheConfig, LaunchConfig, PleRuntimeConfig
from trtedge.llm_metrics import ContextCacheMetrics
from trtedge.llm_views import EngineStats, ModelInfo, RenderedChat, TokenizerInfo
from trtedge.runtime.artifacts.bundle import BuildProfile, prepare_bundle
from trtedge.runtime.artifacts.checkpoint import config_only_checkpoint, resolve_checkpoint
from trtedge.runtime.engine import Engine, EngineConfig, EngineError, EngineUnavailableError
from trtedge.runtime.models import load_model
from trtedge.runtime.models.config import TRANSDUCER_MODEL_TYPES
from trtedge.runtime.multimodal import MultimodalPrompt, media_kinds
from trtedge.runtime.multimodal.audio import AudioProcessor, audio_processor
from trtedge.runtime.multimodal.processor import VisionProcessor
from trtedge.runtime.multimodal.prompt import expand_placeholders, placeholder_tokens, process_media
from trtedge.runtime.multimodal.transducer_audio import TransducerAudioProcessor, transducer_audio_processor
from trtedge.runtime.output import (
    CancellableIterator,
    CompletionOutput,
    GenerationMetrics,
    LoopChannel,
    RequestHandle,
    RequestOutput,
)
from trtedge.runtime.profiling import ProfilingMetrics
from trtedge.runtime.sampling_params import GuidedDecodingParams, ParamError, SamplingParams, check_logit_bias
from trtedge.runtime.speculative import SpeculativeConfig, check_draft
from trtedge.runtime.speech.api import NO_SPEECH, SpeechOptions, SpeechOutput, load_speech_output
from trtedge.runtime.speech.pipeline import SpeechInputError
from trtedge.runtime.structured import GuidedUnavailableError
from trtedge.runtime.structured import available as structured_output_available
from trtedge.runtime.text.tokenizer import TemplateError

log = logging.getLogger("trtedge")

Messages = list[dict]
ENGINE_PROCESS_ENV = "TRTEDGE_ENGINE_PROCESS"  # 1: the engine core in its own process, 0: here, auto


class PromptTooLongError(ValueError):
    """The prompt (or prompt + max_tokens) does not fit the configured limits."""


class LLM:
    """A model loaded and ready to generate.

    ``LLM()`` with no model uses the embedded SmolLM2-135M-Instruct. Calls are thread-safe; with
    ``enable_in_flight_batching=True`` concurrent calls share the running batch.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        cache_dir: str | None = None,
        max_input_len: int | None = None,
        max_kv_cache_capacity: int = 8192,
        max_batch_size: int = 1,
        max_num_batched_tokens: int = 2048,
        enable_in_flight_batching: bool = False,
        dtype: str = "auto",
        device: str = "auto",
        weights: str = "auto",
        kv_cache_dtype: str = "auto",
        min_request_priority: int | None = None,
        context_cache_config: ContextCacheConfig | dict | None = None,
        engine_cache_max_size_gb: float = 50.0,
        clear_engine_cache: bool = False,
        load_format: str = "auto",
        enforce_eager: bool = False,
        async_scheduling: bool | None = None,
        engine_process: bool | None = None,
        tensor_parallel_size: int = 1,
        distributed_init_method: str | None = None,
        speculative_config: SpeculativeConfig | dict | str | None = None,
        mm_embedding_cache_bytes: int = 512 * 2**20,
        components: str = "all",
        ple_config: PleRuntimeConfig | dict | None = None,
        build_progress: Callable[[str, int, int | None], None] | None = None,
    ):
        self.config = LaunchConfig(
            model=model,
            cache_dir=cache_dir,
            max_input_len=max_input_len,
            max_kv_cache_capacity=max_kv_cache_capacity,
            max_batch_size=max_batch_size,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_in_flight_batching=enable_in_flight_batching,
            dtype=dtype,
            device=device,
            weights=weights,
            kv_cache_dtype=kv_cache_dtype,
            min_request_priority=min_request_priority,
            context_cache=ContextCacheConfig.coerce(context_cache_config),
            engine_cache_max_size_gb=engine_cache_max_size_gb,
            clear_engine_cache=clear_engine_cache,
            load_format=load_format,
            tensor_parallel_size=tensor_parallel_size,
            distributed_init_method=distributed_init_method,
            speculative=speculative_config,
            mm_embedding_cache_bytes=mm_embedding_cache_bytes,
            components=components,
            ple=ple_config,
        )
        spec = self.config.speculative
        if kv_cache_dtype == "fp8":
            _check_fp8_kv(device)
        elif kv_cache_dtype in ("fp16", "int8"):
            _check_cpu_kv(kv_cache_dtype, device)
        # the runtime bundle (key, path, manifest) stands in for the checkpoint: a hit converts nothing
        if load_format == "dummy":
            self.bundle, self.checkpoint = None, config_only_checkpoint(model or "")
        else:
            self.bundle = self.checkpoint = prepare_bundle(
                model,
                BuildProfile.from_launch(self.config),
                cache_dir=cache_dir,
                max_size_gb=engine_cache_max_size_gb,
                clear=clear_engine_cache,
                progress=build_progress,
            )
        self._check_draft(spec, load_format)
        self.tokenizer = self.checkpoint.load_tokenizer()
        self.speech_output = None
        cfg = self.config
        load = dict(dtype=dtype, device=device, weights=weights, max_positions=cfg.max_kv_cache_capacity)
        engine_config = EngineConfig(
            max_batch_size=cfg.max_batch_size,
            max_kv_cache_capacity=cfg.max_kv_cache_capacity,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            enable_in_flight_batching=cfg.enable_in_flight_batching,
            enable_context_reuse=cfg.context_cache.enabled,
            context_cache_max_records=cfg.context_cache.max_records,
            recurrent_snapshot_pool_bytes=cfg.context_cache.recurrent_snapshot_pool_bytes,
            partial_kv_snapshot_pool_bytes=cfg.context_cache.partial_kv_snapshot_pool_bytes,
            cuda_graphs=not enforce_eager,
            async_scheduling=async_scheduling,
            speculative=spec,
            mm_embedding_cache_bytes=cfg.mm_embedding_cache_bytes,
            kv_cache_dtype=cfg.kv_cache_dtype,
        )
        self.tp = None  # tensor parallel: the worker ranks, watched; rank 0's model is this process's
        self.model = self.draft = None  # in this process only when the engine core is (engine_process off)
        # the image / video processor when the model has a vision encoder loaded (see runtime.multimodal)
        self.vision: VisionProcessor | None = None
        self.audio: AudioProcessor | None = None
        try:
            self.engine_process = self._wants_engine_process(engine_process, device)
            # speech output (Qwen3-Omni's Talker, code predictor and Code2Wav) when the bundle holds them
            if self.bundle is not None:
                self.speech_output = load_speech_output(self.bundle, dtype, device)
            if self.engine_process:
                self.engine = self._start_core_process(spec, load, load_format, engine_config)
            else:
                self.engine = self._start_in_process(spec, load, load_format, engine_config)
            self._describe = self.engine.describe()
            self._last: dict[str, tuple[float, object]] = {}  # engine process: the last answer per view
            if self.engine_process:
                # an LLM dropped without close() still stops its engine core process (and its folder)
                weakref.finalize(self, self.engine.shutdown)
            if self.engine_process:  # a dead core still has figures to report
                for name in ("snapshot", "context_cache_metrics", "get_profiling_metrics"):
                    self._last[name] = (time.monotonic(), self.engine.call(name))
        except BaseException:
            engine = getattr(self, "engine", None)
            if engine is not None:
                engine.shutdown()
            if self.bundle is not None:
                self.bundle.release()
            raise
        self._closed = False
        self._close_lock = threading.Lock()

    def _wants_engine_process(self, wanted: bool | None, device: str) -> bool:
        """The engine core in its own process: on CUDA by default (measured faster there), never with
        tensor parallelism (rank 0 lives here), a vision / audio component (its processor is here) or
        speech output (the speech sequences' deltas do not cross processes yet)."""
        cfg = self.config
        model_cfg = self.checkpoint.model_config
        media = model_cfg.vision is not None or getattr(model_cfg, "audio", None) is not None
        media = media and getattr(self.checkpoint, "has_vision", True)  # the bundle's encoder component
        transducer = model_cfg.model_type in TRANSDUCER_MODEL_TYPES  # runtime.transducer: in this process
        speech = self.bundle is not None and self.bundle.has_speech
        possible = cfg.tensor_parallel_size == 1 and not media and not transducer and not speech
        if wanted is None and os.environ.get(ENGINE_PROCESS_ENV, "auto") != "auto":
            value = os.environ[ENGINE_PROCESS_ENV]
            if value not in ("0", "1"):
                raise ConfigError(f"{ENGINE_PROCESS_ENV} must be 0, 1 or auto, not {value!r}")
            wanted = value == "1"
        if wanted is None:
            from trtedge.runtime.models import resolve_device

            return possible and resolve_device(device).type == "cuda"
        if wanted and not possible:
            raise ConfigError(
                "engine_process is not supported with tensor parallelism, a vision or audio "
                "component or speech output yet; leave it unset"
            )
        return wanted

    def _start_core_process(self, spec, load: dict, load_format: str, engine_config):
        from trtedge.runtime.client import CoreLaunch, CoreProcess, picklable_checkpoint

        draft = None
        if spec is not None and spec.method == "draft_model":
            draft = ("draft_model", picklable_checkpoint(self._draft_source(load_format)))
        elif spec is not None and spec.method in ("eagle3", "dflash"):  # a head's directory
            draft = (spec.method, self._eagle3_path(spec))
        elif spec is not None and spec.method == "mtp" and spec.model is not None:  # Gemma 4's assistant
            draft = ("mtp_assistant", self._eagle3_path(spec))
        elif spec is not None and spec.method == "mtp":  # the target checkpoint's own mtp.* tensors
            draft = ("mtp", picklable_checkpoint(self.checkpoint))
        launch = CoreLaunch(
            picklable_checkpoint(self.checkpoint),
            {**load, "load_format": load_format, "ple": self.config.ple},
            engine_config,
            draft,
            logging.getLogger("trtedge").getEffectiveLevel(),
        )
        try:
            return CoreProcess(launch, tokenizer=self.tokenizer)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def _start_in_process(self, spec, load: dict, load_format: str, engine_config) -> Engine:
        cfg = self.config
        if cfg.tensor_parallel_size > 1:
            from trtedge.runtime.executor.tp import start_tensor_parallel

            try:
                self.tp, self.model = start_tensor_parallel(
                    self.checkpoint,
                    **load,
                    load_format=load_format,
                    size=cfg.tensor_parallel_size,
                    init_method=cfg.distributed_init_method,
                )
            except ValueError as e:
                raise ConfigError(str(e)) from None
        else:
            self.model = load_model(self.checkpoint, **load, load_format=load_format, ple=cfg.ple)
        self.draft = (
            self._load_draft(spec, load["dtype"], load["device"], load["weights"], load_format)
            if spec
            else None
        )
        if self.model.cfg.model_type in TRANSDUCER_MODEL_TYPES:  # an RNN-T transcriber: its own engine
            from trtedge.runtime.transducer import TransducerEngine

            self.audio = transducer_audio_processor(Path(self.checkpoint.path), self.model.cfg)
            return TransducerEngine(self.model, self.tokenizer, engine_config)
        if (
            getattr(self.model, "vision", None) is not None
            and self.model.cfg.vision.get("family") == "nemotron_h_omni"
        ):
            from trtedge.runtime.multimodal.nemotron_video import NemotronVideoProcessor

            self.vision = NemotronVideoProcessor.from_dir(Path(self.checkpoint.path), self.model.cfg.vision)
        elif getattr(self.model, "vision", None) is not None:
            self.vision = VisionProcessor.from_dir(
                Path(self.checkpoint.path),
                self.model.cfg.vision["vision_config"],
                video_clip_budget=self.model.cfg.model_type == "qwen3_vl",
            )
        # the audio front end when the model has an audio encoder loaded (Qwen3-ASR)
        if getattr(self.model, "audio", None) is not None:
            self.audio = audio_processor(
                self.model.cfg.model_type, Path(self.checkpoint.path), self.model.cfg.audio["audio_config"]
            )
        try:
            return Engine(
                self.model, self.tokenizer, engine_config, draft=self.draft, speech=self.speech_output
            )
        except BaseException:
            if self.tp is not None:
                self.tp.shutdown()
            raise

    def _eagle3_path(self, spec) -> Path:
        path = Path(spec.model).expanduser()
        if not path.is_dir():  # a Hugging Face id: downloaded into the cache like any checkpoint
            path = resolve_checkpoint(spec.model, self.config.cache_dir).path
        return path

    def _draft_source(self, load_format: str):
        return (
            config_only_checkpoint(self.config.speculative.model)
            if load_format == "dummy"
            else self.bundle.draft
        )

    def _check_draft(self, spec, load_format: str) -> None:
        """Refuse a draft model the engine cannot run from its config, before any weights load (for
        mtp: a checkpoint without MTP layers)."""
        if spec is None or spec.method not in ("draft_model", "mtp"):
            return
        try:
            if spec.method == "mtp" and spec.model is not None:
                from trtedge.runtime.speculative.gemma4_assistant import check_assistant, read_config

                check_assistant(self.checkpoint.model_config, read_config(self._eagle3_path(spec)))
            elif spec.method == "mtp":
                from trtedge.runtime.speculative.mtp import check_mtp

                check_mtp(self.checkpoint.model_config)
            else:
                check_draft(self._draft_source(load_format).model_config)
        except ValueError as e:
            if self.bundle is not None:
                self.bundle.release()
            raise ConfigError(str(e)) from None

    def _load_draft(self, spec, dtype: str, device: str, weights: str, load_format: str):
        """The draft model (from the paired bundle), the EAGLE-3 head or DFlash draft (from its
        directory) or the MTP head (the checkpoint's own mtp.* tensors)."""
        if spec.method == "draft_model":
            return load_model(
                self._draft_source(load_format),
                dtype=dtype,
                device=device,
                weights=weights,
                max_positions=self.config.max_kv_cache_capacity,
                load_format=load_format,
            )
        if spec.method == "eagle3":
            from trtedge.runtime.speculative.eagle3 import load_eagle3

            try:
                return load_eagle3(self._eagle3_path(spec), self.model, self.config.max_kv_cache_capacity)
            except ValueError as e:
                raise ConfigError(f"--speculative-config model: {e}") from None
        if spec.method == "dflash":
            from trtedge.runtime.speculative import SpeculativeConfigError
            from trtedge.runtime.speculative.dflash import load_dflash

            capacity = self.config.max_kv_cache_capacity
            try:
                return load_dflash(self._eagle3_path(spec), self.model, capacity, spec.num_speculative_tokens)
            except SpeculativeConfigError as e:  # names its key
                raise ConfigError(str(e)) from None
            except ValueError as e:
                raise ConfigError(f"--speculative-config model: {e}") from None
        if spec.method == "mtp" and spec.model is not None:
            from trtedge.runtime.speculative.gemma4_assistant import load_assistant

            try:
                return load_assistant(self._eagle3_path(spec), self.model, self.config.max_kv_cache_capacity)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if spec.method == "mtp":
            from trtedge.runtime.speculative.mtp import load_mtp

            try:
                return load_mtp(self.checkpoint, self.model, load_format)
            except ValueError as e:
                raise ConfigError(f"--speculative-config method mtp: {e}") from None
        return None

    @property
    def model_name(self) -> str:
        return self.checkpoint.name

    @property
    def chat_template_origin(self) -> str | None:
        """Where the chat template comes from: ``"model"`` (the checkpoint's own), ``"default"`` (the
        file has none, so trtedge uses its family's turn format: often a base model, which continues
        text rather than answering), or None (no template: send raw text, ``apply_chat_template=False``)."""
        from trtedge.runtime.artifacts.gguf import is_default_chat_template

        template = self.tokenizer.chat_template
        if template is None:
            return None
        return "default" if is_default_chat_template(template) else "model"

    # ---- prompts ------------------------------------------------------------------------------
    def encode_prompt(
        self,
        prompt: str | list[int] | Messages,
        *,
        apply_chat_template: bool | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        enable_thinking: bool | None = None,
        reasoning_effort: str | None = None,
    ) -> list[int] | MultimodalPrompt:
        """Token ids for a chat (messages), a text prompt or token ids (passed through); a
        ``MultimodalPrompt`` for messages with image / video parts (see ``trtedge.runtime.multimodal``)."""
        if isinstance(prompt, MultimodalPrompt):
            return prompt
        if isinstance(self.audio, TransducerAudioProcessor):  # an RNN-T transcriber: one clip, no template
            return self.audio.from_messages(prompt)
        if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
            return list(prompt)
        if isinstance(prompt, str):
            if apply_chat_template:
                prompt = [{"role": "user", "content": prompt}]
            else:
                return self.tokenizer.encode(prompt, add_special_tokens=True)
        if apply_chat_template is False:
            raise ValueError(
                "messages need the chat template; pass a string prompt with apply_chat_template=False"
            )
        items = None
        kinds = media_kinds(prompt)
        if kinds:
            if kinds & {"image", "video"} and self.vision is None:
                raise ValueError(
                    f"this model has no vision component ({self.model_name}): image and video input is not "
                    "supported (a vision-language model built with --components llm is text-only)"
                )
            if "audio" in kinds and self.audio is None:
                raise ValueError(
                    f"this model has no audio component ({self.model_name}): audio input is not supported "
                    "(an audio model built with --components llm is text-only)"
                )
            prompt, items = process_media(prompt, self.vision, self.audio)
        ids = self.tokenizer.encode_chat(
            prompt,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            enable_thinking=enable_thinking,
            reasoning_effort=reasoning_effort,
            chat_template_kwargs=chat_template_kwargs,
        )
        if items is None:
            return ids
        return expand_placeholders(ids, items, placeholder_tokens(self.model.cfg, self.tokenizer))

    # ---- text: the tokenizer and chat template, for the front doors ----------------------------
    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size: token ids (and logit_bias keys) are below it."""
        return self._describe["vocab_size"]

    def tokenizer_info(self) -> TokenizerInfo:
        t = self.tokenizer
        return TokenizerInfo(
            t.bos_token_id,
            t.eos_token_ids,
            dict(t.special_tokens),
            t.add_bos_token,
            t.vocab_size,
            t.chat_template,
            dict(t.chat_templates),
        )

    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` prepends BOS when the model wants it."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def detokenize(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_piece(self, token_id: int) -> str | None:
        """The vocabulary's spelling of a token (byte-level pieces as they are), None outside it."""
        return self.tokenizer.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (logprobs report them: a token may be part of a character)."""
        return self.tokenizer.token_bytes(token_id)

    def apply_chat_template(self, messages: Messages, **options) -> str:
        """The text of a text-only conversation through the chat template (``encode_prompt``'s options)."""
        return self.tokenizer.apply_chat_template(messages, **options)

    def render_chat(self, messages: Messages, **options) -> RenderedChat:
        """A conversation through the chat template: its text, token ids and the prompt to generate
        from; media parts (decoded images, videos, audio) are processed into a ``MultimodalPrompt``.
        Raises ``TemplateError`` when the template refuses the messages, ``ValueError`` for media
        the model cannot take."""
        if media_kinds(messages):
            prompt = self.encode_prompt(messages, **options)
            ids = list(prompt.ids)
            return RenderedChat(self.detokenize(ids, skip_special_tokens=False), ids, prompt)
        text = self.apply_chat_template(messages, **options)
        ids = self.tokenize(text, add_special_tokens=False)
        return RenderedChat(text, ids, ids)

    def check_lengths(self, num_prompt_tokens: int, max_tokens: int) -> None:
        cfg = self.config
        if num_prompt_tokens == 0:
            raise PromptTooLongError("the prompt is empty")
        if num_prompt_tokens > cfg.max_input_len:
            raise PromptTooLongError(
                f"prompt has {num_prompt_tokens} tokens, more than max_input_len {cfg.max_input_len}"
            )
        if num_prompt_tokens + max_tokens > cfg.max_kv_cache_capacity:
            raise PromptTooLongError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                f"{num_prompt_tokens + max_tokens} exceeds max_kv_cache_capacity {cfg.max_kv_cache_capacity}"
            )

    def _check_positions(self, prompt: MultimodalPrompt, max_tokens: int) -> None:
        # a video's temporal positions may run ahead of its token count; the rotary tables cover 4x
        last = len(prompt.ids) + prompt.rope_delta + max_tokens
        if last > 4 * self.config.max_kv_cache_capacity:
            raise PromptTooLongError(
                f"the media's rotary positions reach {last}, past 4 x max_kv_cache_capacity "
                f"({self.config.max_kv_cache_capacity}); sample the video at a higher fps or raise the capacity"
            )

    def check_token_ids(self, ids: list[int]) -> None:
        vocab = self._describe["vocab_size"]
        bad = next(
            (t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None
        )
        if bad is not None:
            raise ParamError("prompt", f"prompt token id {bad!r} is not in the vocabulary [0, {vocab})")

    def compile_guide(self, guide: GuidedDecodingParams | dict) -> None:
        """Compile a structured-output guide now (it is cached for the requests that use it). Raises
        ``ValueError`` with the compiler's message for a bad guide, ``GuidedUnavailableError`` without
        xgrammar."""
        self.engine.compile_guide(GuidedDecodingParams.coerce(guide))

    # ---- generation ---------------------------------------------------------------------------
    def generate_stream(
        self,
        prompt: str | list[int] | Messages,
        params: SamplingParams | None = None,
        *,
        on_metrics: Callable[[GenerationMetrics], None] | None = None,
        priority: int = 0,
        request_id: str | None = None,
        channel: LoopChannel | None = None,
        **prompt_options,
    ) -> CancellableIterator | RequestHandle:
        """Stream ``StreamDelta``s. Messages (a list of dicts) go through the chat template; a string is
        used as is; a list of ints is taken as token ids. ``channel``: deliver the deltas on an asyncio
        event loop instead (``trtedge.runtime.output.LoopChannel``, batched per engine step); the
        returned handle then only cancels."""
        self._check_open()
        params = params or SamplingParams()
        min_priority = self.config.min_request_priority
        if min_priority is not None and priority < min_priority:
            raise ParamError("priority", f"priority {priority} is below min_request_priority {min_priority}")
        prompt = self.encode_prompt(prompt, **prompt_options)
        ids = prompt.ids if isinstance(prompt, MultimodalPrompt) else prompt
        self.check_lengths(len(ids), params.max_tokens)
        if isinstance(prompt, MultimodalPrompt):
            self._check_positions(prompt, params.max_tokens)
        self.check_token_ids(ids)
        check_logit_bias(params, self._describe["vocab_size"])  # here: the engine may be another process
        return self.engine.submit(prompt, params, priority, on_metrics, request_id, channel)

    def generate(
        self,
        prompt: str | list[int] | Sequence[str] | Sequence[list[int]],
        params: SamplingParams | None = None,
        **options,
    ) -> RequestOutput | list[RequestOutput]:
        """Generate for a prompt (text or token ids), or a list of them (submitted together)."""
        if isinstance(prompt, (list, tuple)) and prompt and not isinstance(prompt[0], int):
            rid = options.get("request_id")  # prompt i: request_id.i (an id is one request's)
            streams = [
                self._collect_start(
                    p, params, options if rid is None else {**options, "request_id": f"{rid}.{i}"}
                )
                for i, p in enumerate(prompt)
            ]
            return [self._collect(*s) for s in streams]
        return self._collect(*self._collect_start(prompt, params, options))

    def chat(self, messages: Messages, params: SamplingParams | None = None, **options) -> RequestOutput:
        """Answer a conversation ([{"role": ..., "content": ...}, ...]) through the chat template."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        return self._collect(*self._collect_start(messages, params, options))

    def _collect_start(self, prompt, params, options):
        box: dict = {}
        options = dict(options)
        user_cb = options.pop("on_metrics", None)

        def on_metrics(m: GenerationMetrics) -> None:
            box["metrics"] = m
            if user_cb is not None:
                user_cb(m)

        ids = self.encode_prompt(prompt, **_prompt_options(options))
        stream = self.generate_stream(ids, params, on_metrics=on_metrics, **_engine_options(options))
        return stream, ids, box

    @staticmethod
    def _collect(stream: CancellableIterator, ids, box: dict) -> RequestOutput:
        if isinstance(ids, MultimodalPrompt):
            ids = ids.ids
        choices: dict[int, CompletionOutput] = {}
        prompt_logprobs = None
        with stream:
            for delta in stream:
                if delta.prompt_logprobs is not None:
                    prompt_logprobs = delta.prompt_logprobs
                choice = choices.get(delta.index)
                if choice is None:
                    choice = choices[delta.index] = CompletionOutput(delta.index, "", [], None)
                choice.text += delta.text
                choice.token_ids.extend(delta.token_ids)
                if delta.logprobs:
                    choice.logprobs = (choice.logprobs or []) + delta.logprobs
                choice.finish_reason = delta.finish_reason
        outputs = [choices[i] for i in sorted(choices)]
        first = outputs[0] if outputs else CompletionOutput(0, "", [], None)
        return RequestOutput(
            text=first.text,
            token_ids=first.token_ids,
            finish_reason=first.finish_reason,
            prompt_tokens=len(ids),
            completion_tokens=sum(len(o.token_ids) for o in outputs),
            logprobs=first.logprobs,
            metrics=box.get("metrics"),
            prompt_token_ids=ids,
            outputs=outputs,
            prompt_logprobs=prompt_logprobs,
        )

    # ---- speech output ------------------------------------------------------------------------
    @property
    def voices(self) -> list[str]:
        """The voices of a model with speech output (Qwen3-Omni's speakers); [] without."""
        return [] if self.speech_output is None else self.speech_output.voices

    def speech_stream(
        self,
        input: str | None = None,
        *,
        voice: str | None = None,
        instructions: str | None = None,
        token_ids: list[int] | None = None,
        **options,
    ):
        """Speak ``input`` (or a conversation's ``token_ids`` ending in the assistant's answer): float32
        mono pieces at ``speech_output.sample_rate`` (24 kHz) as Code2Wav makes them. ``options``:
        ``SpeechOptions`` fields (talker_temperature, talker_top_k, ...). Raises ``ValueError``
        (``SpeechInputError`` naming the field) for a bad request, before any audio is made."""
        from trtedge.runtime.speech.api import speak, tts_ids

        self._check_open()
        if self.speech_output is None:
            raise ValueError(f"{NO_SPEECH} ({self.model_name})")
        params = SpeechOptions.coerce({**options, "voice": voice} if voice is not None else options)
        if params.voice is not None:
            self.speech_output.voice_id(params.voice)
        ids = token_ids if token_ids is not None else tts_ids(self.tokenizer, input, instructions)
        if token_ids is None and len(ids) > self.config.max_input_len:
            raise SpeechInputError(
                f"input takes {len(ids)} tokens, more than max_input_len {self.config.max_input_len}", "input"
            )
        return speak(self.engine, self.speech_output, ids, params)  # refuses here

    def speech_live(self, prompt_ids: list[int], **options):
        """The speech of an answer to ``prompt_ids`` (a conversation ending in ``<|im_start|>assistant``)
        that is still being generated: a ``LiveSpeech`` to ``push`` the answer's token ids into as they
        come and ``finish``; ``pieces()`` yields the audio meanwhile. Refuses (SpeechInputError) now."""
        from trtedge.runtime.speech.api import LiveSpeech

        if self.speech_output is None:
            raise ValueError(f"{NO_SPEECH} ({self.model_name})")
        params = SpeechOptions.coerce(options)
        return LiveSpeech(self.engine, self.speech_output, prompt_ids, params, self.tokenizer.eos_token_ids)

    def speech_input_tokens(self, input: str, instructions: str | None = None) -> int:
        """Tokens of the conversation the Talker reads to speak ``input``."""
        from trtedge.runtime.speech.api import tts_ids

        return len(tts_ids(self.tokenizer, input, instructions))

    def speech(self, input: str, *, voice: str | None = None, **options) -> SpeechOutput:
        """Speak ``input`` whole (see ``speech_stream``)."""
        import numpy as np

        pieces = list(self.speech_stream(input, voice=voice, **options))
        audio = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
        return SpeechOutput(audio, self.speech_output.sample_rate)

    # ---- introspection -------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot for health endpoints and dashboards (safe to call from any thread)."""
        engine = self._snapshot()
        error = engine.pop("engine_error", None) or (None if self.tp is None else self.tp.error)
        stats = {"model": self.model_name, **engine, "engine_error": error}
        if self.vision or self.audio:
            stats["mm_embedding_cache"] = self.get_mm_embedding_cache_metrics()
        return EngineStats.from_dict(stats)

    def _snapshot(self) -> dict:
        snapshot = dict(self._view("snapshot", max_age=0.05))
        if self.engine_process and self.engine.error is not None:
            snapshot["engine_error"] = str(self.engine.error)
        return snapshot

    def _view(self, name: str, max_age: float = 0.0):
        """One of the engine's plain-data views. From another process: reused for ``max_age`` seconds
        (a metrics scrape reads the counters a dozen times), waited for 5 s at most (a health check
        runs on the server's event loop), and the last answer kept once that process is gone."""
        if not self.engine_process:
            return getattr(self.engine, name)()
        now = time.monotonic()
        last = self._last.get(name)
        if self.engine.error is None and (last is None or now - last[0] > max_age):
            from trtedge.runtime.client import CallbackCallError

            try:
                last = self._last[name] = (now, self.engine.call(name, timeout=5.0))
            except (EngineUnavailableError, CallbackCallError):  # the last answer will do
                if last is None:
                    raise
        if last is None:
            raise EngineUnavailableError(f"engine failed: {self.engine.error}")
        return last[1]

    def describe(self) -> ModelInfo:
        """What is loaded, as plain data: ``device``, ``dtype``, ``weight_bytes``, ``kv_bytes_per_token``,
        ``vocab_size``, ``model_type``, ``async_scheduling``, and ``engine_process`` (whether the engine
        core runs in its own process)."""
        bundle = self.bundle
        return ModelInfo.from_dict(
            self._describe,
            engine_process=self.engine_process,
            bundle_key=None if bundle is None else bundle.key,
            loaded_from=str(self.checkpoint.path),
            bundle_built=bundle is not None and bundle.built,
        )

    def get_mm_embedding_cache_metrics(self) -> dict | None:
        """The vision encoder's embedding cache (None without a vision component): hits, misses,
        evictions, entries and bytes held now, max_bytes, and encoded_items (items run through the
        encoder, cache misses batched per step)."""
        return self.engine.mm_embedding_cache_metrics()

    def speculative_metrics(self) -> dict | None:
        """The speculative configuration and its totals so far (None without speculative decoding)."""
        return self.engine.speculative_metrics()

    def get_context_cache_metrics(self) -> ContextCacheMetrics:
        """Context reuse counters (a frozen ``ContextCacheMetrics``; ``.to_dict()`` for a dict):
        lookups, hits, reused_tokens, records (held now), evictions; for hybrid models also
        recurrent_snapshots (held now), recurrent_snapshot_capacity, recurrent_snapshot_evictions
        and recurrent_snapshot_pool_bytes; with a partial-block pool also partial_kv_snapshots (held
        now), partial_kv_snapshot_capacity, partial_kv_snapshot_evictions,
        partial_kv_snapshot_pool_bytes and partial_kv_reused_tokens (of reused_tokens)."""
        return ContextCacheMetrics(**self._view("context_cache_metrics"))

    # ---- profiling ----------------------------------------------------------------------------
    def set_profiling_enabled(self, enabled: bool) -> None:
        """Start (True) or stop (False) aggregating profiling figures over runs: prefill and
        generation counters and per-stage times (CUDA events on a GPU, the wall clock on the CPU),
        read back with ``get_profiling_metrics()``. Off by default; it costs a little time per step
        while on. Independent of the per-request ``on_metrics`` figures."""
        if not isinstance(enabled, bool):
            raise TypeError(f"set_profiling_enabled takes true or false, got {enabled!r}")
        self.engine.set_profiling_enabled(enabled)

    def get_profiling_enabled(self) -> bool:
        return self.engine.get_profiling_enabled()

    def get_profiling_metrics(self) -> ProfilingMetrics:
        """The totals since profiling was first enabled (or last reset), a frozen ``ProfilingMetrics``:
        ``prefill`` (total_runs, computed_tokens, reused_tokens, total_time), ``generation``
        (total_runs, generated_tokens: output tokens summed over sequences and runs, total_time) and
        ``stages`` (name -> runs, total_time, mean_time); ``.to_dict()`` for a dict."""
        return self._view("get_profiling_metrics")

    def reset_profiling_metrics(self) -> None:
        """Set every profiling total back to zero (profiling stays on or off as it was)."""
        self.engine.reset_profiling_metrics()

    # ---- lifecycle ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise EngineUnavailableError("this LLM is closed")
        if self.tp is not None and self.tp.error is not None:
            raise EngineUnavailableError(f"engine failed: {self.tp.error}")

    def close(self) -> None:
        with self._close_lock:
            if not self._closed:
                self._closed = True
                self.engine.shutdown()
                if self.tp is not None:
                    self.tp.shutdown()
                if self.bundle is not None:
                    self.bundle.release()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_PROMPT_KEYS = {
    "apply_chat_template",
    "add_generation_prompt",
    "tools",
    "chat_template_kwargs",
    "enable_thinking",
    "reasoning_effort",
}


def _check_fp8_kv(device: str) -> None:
    """--kv-cache-dtype fp8 runs where the attention kernels read E4M3: CUDA GPUs from 8.9 on."""
    from trtedge.runtime.models import resolve_device
    from trtedge.runtime.ops import kv_fp8

    why = kv_fp8.unsupported(resolve_device(device))
    if why is not None:
        raise ConfigError(f"kv_cache_dtype (--kv-cache-dtype) fp8 {why}")


def _check_cpu_kv(kv_cache_dtype: str, device: str) -> None:
    """--kv-cache-dtype fp16 and int8 are the CPU's: its kernels convert the rows as they read them."""
    from trtedge.runtime.models import resolve_device

    where = device if device != "auto" else resolve_device(device).type  # named: refused without resolving it
    if where != "cpu":
        raise ConfigError(
            f"kv_cache_dtype (--kv-cache-dtype) {kv_cache_dtype} needs the CPU; on {where} the KV cache is in "
            "the model's dtype (or fp8)"
        )


def _prompt_options(options: dict) -> dict:
    return {k: v for k, v in options.items() if k in _PROMPT_KEYS}


def _engine_options(options: dict) -> dict:
    extra = set(options) - _PROMPT_KEYS - {"priority", "request_id"}
    if extra:
        raise TypeError(f"unexpected argument(s): {', '.join(sorted(extra))}")
    return {k: v for k, v in options.items() if k in ("priority", "request_id")}


__all__ = [
    "LLM",
    "ConfigError",
    "ContextCacheMetrics",
    "EngineStats",
    "ModelInfo",
    "ProfilingMetrics",
    "RenderedChat",
    "TokenizerInfo",
    "EngineError",
    "EngineUnavailableError",
    "GuidedUnavailableError",
    "ParamError",
    "PromptTooLongError",
    "TemplateError",
    "structured_output_available",
]
