"""Structured output with xgrammar: compiled-grammar cache, per-sequence matchers, token bitmasks.

xgrammar is imported on the first guided request. Its tokenizer module imports ``transformers`` at
module level for one constructor we never call, so the import runs with a placeholder module in its
place; the runtime never imports transformers.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import threading
import types
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from trtedge.runtime.core.request import Sequence
from trtedge.runtime.sampling_params import GuidedDecodingParams

INSTALL_HINT = "pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2"
MAX_CACHED_GRAMMARS = 64
MAX_JUMP_TOKENS = 16

# JSON Schema keywords that xgrammar 0.2.9 accepts but does not enforce while generating (each probed
# with a violating instance that its matcher accepted), and the string formats it does enforce.
UNENFORCED_KEYWORDS = (
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "unevaluatedProperties",
    "unevaluatedItems",
    "contentEncoding",
    "contentMediaType",
)
ENFORCED_FORMATS = frozenset(
    "date time date-time duration email hostname ipv4 ipv6 uri uri-reference uri-template json-pointer "
    "relative-json-pointer uuid".split()
)
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "propertyNames", "contains", "not", "if", "then", "else")


class GuideError(ValueError):
    """A guide that cannot be compiled or enforced; the message names the problem."""


class GuidedUnavailableError(RuntimeError):
    """xgrammar is not installed."""


_xgr = None
_import_lock = threading.Lock()


def import_xgrammar():
    """The xgrammar module, imported once without importing transformers."""
    global _xgr
    with _import_lock:
        if _xgr is None:
            had = sys.modules.get("transformers")
            if had is None:
                sys.modules["transformers"] = _placeholder_transformers()
            try:
                import xgrammar
            except ImportError as e:
                raise GuidedUnavailableError(
                    f"structured output needs xgrammar, which is not installed ({e}); install it with "
                    f"`{INSTALL_HINT}`"
                ) from None
            finally:
                if had is None:
                    del sys.modules["transformers"]
            _xgr = xgrammar
    return _xgr


def available() -> bool:
    """Whether xgrammar is installed (without importing it)."""
    return importlib.util.find_spec("xgrammar") is not None


def _placeholder_transformers() -> types.ModuleType:
    module = types.ModuleType("transformers")
    for name in ("PreTrainedTokenizerBase", "PreTrainedTokenizerFast", "LogitsProcessor"):
        setattr(module, name, type(name, (), {}))
    return module


def check_schema(schema, path: str = "$") -> None:
    """Raise GuideError naming the first keyword of ``schema`` that xgrammar would not enforce."""
    if not isinstance(schema, dict):
        return
    for key in UNENFORCED_KEYWORDS:
        if key in schema:
            raise GuideError(
                f"JSON schema keyword {key!r} at {path} is not enforced by the structured-output backend; "
                "remove it or check the value yourself"
            )
    if isinstance(schema.get("format"), str) and schema["format"] not in ENFORCED_FORMATS:
        raise GuideError(
            f"JSON schema keyword 'format' at {path}: format {schema['format']!r} is not enforced by the "
            f"structured-output backend (enforced: {', '.join(sorted(ENFORCED_FORMATS))})"
        )
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                check_schema(sub, f"{path}.{key}.{name}")
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                check_schema(sub, f"{path}.{key}[{i}]")
    for key in _SCHEMA_VALUES:
        check_schema(schema.get(key), f"{path}.{key}")


def _check_tag_schemas(node) -> None:
    """check_schema for every JSON schema inside a structural tag."""
    if isinstance(node, dict):
        if node.get("type") in ("json_schema", "qwen_xml_parameter") and isinstance(
            node.get("json_schema"), dict
        ):
            check_schema(node["json_schema"])
        for value in node.values():
            _check_tag_schemas(value)
    elif isinstance(node, list):
        for value in node:
            _check_tag_schemas(value)


def _choice_grammar(choices: tuple[str, ...]) -> str:
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GuidedDecoding:
    """One engine's structured-output state: the tokenizer description, the compiler and its cache."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler = None
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.num_compiled = 0
        self.num_cache_hits = 0
        self.max_jump_tokens = MAX_JUMP_TOKENS  # hybrid models: fewer (each draft token keeps a state)
        self.overlap = True  # fill masks on a worker thread during the forward (False: inline, to measure)

    # ---- any thread ---------------------------------------------------------------------------
    def compile(self, guide: GuidedDecodingParams):
        """The compiled grammar of ``guide``, cached by (kind, text). Raises GuideError with the
        compiler's message for an invalid schema, regex or grammar."""
        kind, text = guide.key
        if kind in ("json", "json_strict"):
            check_schema(json.loads(text))
        elif kind == "structural_tag":
            _check_tag_schemas(json.loads(text))
        with self._lock:
            if (kind, text) in self._cache:
                self._cache.move_to_end((kind, text))
                self.num_cache_hits += 1
                return self._cache[(kind, text)]
            compiler = self._get_compiler()
        try:
            compiled = self._compile(compiler, kind, text)
        except (RuntimeError, ValueError) as e:
            message = _LOG_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else repr(e))
            raise GuideError(f"invalid {guide.kind} guide: {message}") from None
        with self._lock:
            self._cache[(kind, text)] = compiled
            self.num_compiled += 1
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, compiled):
        return import_xgrammar().GrammarMatcher(compiled)

    def _compile(self, compiler, kind: str, text: str):
        if kind in ("json", "json_strict"):
            return compiler.compile_json_schema(text, any_whitespace=False, strict_mode=kind == "json_strict")
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "choice":
            return compiler.compile_grammar(_choice_grammar(tuple(json.loads(text))))
        if kind == "ebnf":
            return compiler.compile_grammar(text)
        if kind == "structural_tag":
            return compiler.compile_structural_tag(text)
        raise GuideError(f"unknown guide kind {kind!r}")

    def _get_compiler(self):
        if self._compiler is None:
            xgr = import_xgrammar()
            tok = self._tokenizer
            vocab = tok.get_vocab()
            encoded = [""] * self.vocab_size
            for token, i in vocab.items():
                if i < self.vocab_size:
                    encoded[i] = token
            meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_json())
            info = xgr.TokenizerInfo(
                encoded,
                meta["vocab_type"],
                vocab_size=self.vocab_size,
                stop_token_ids=sorted(tok.eos_token_ids) or None,
                add_prefix_space=meta["add_prefix_space"],
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        return self._compiler

    # ---- the engine thread --------------------------------------------------------------------
    def start_masks(self, seqs: list[Sequence]) -> GuideMasks | None:
        """Begin filling the next-token bitmasks of the guided rows of ``seqs`` on a worker thread, so that
        the fill overlaps the model forward; None when no row is guided."""
        rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if not rows:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="trtedge-guided")
        bitmask = torch.full((len(seqs), -(-self.vocab_size // 32)), -1, dtype=torch.int32)
        if self.overlap:
            future = self._pool.submit(_fill, seqs, bitmask, rows)
        else:
            future = Future()
            _fill(seqs, bitmask, rows)
            future.set_result(None)
        return GuideMasks(future, bitmask, rows, self.vocab_size)

    def propose(self, seq: Sequence) -> None:
        """Jump-forward: append the tokens the guide forces next as a draft, to be computed in one pass and
        verified against what the model samples at each of their positions."""
        limit = min(self.max_jump_tokens, seq.params.max_tokens - seq.num_output_tokens - 1)
        if limit <= 0 or seq.matcher.is_terminated():
            return
        draft = seq.matcher.find_jump_forward_tokens()[:limit]
        seq.token_ids.extend(draft)
        seq.num_draft_tokens = len(draft)


def _fill(seqs: list[Sequence], bitmask: torch.Tensor, rows: list[int]) -> None:
    # The n rows of one sequence are consecutive: row j is its mask after j of its n - 1 draft tokens.
    i = 0
    while i < len(rows):
        seq = seqs[rows[i]]
        n = 1
        while i + n < len(rows) and seqs[rows[i + n]] is seq:
            n += 1
        draft = seq.token_ids[len(seq.token_ids) - (n - 1) :]
        taken = 0
        for j in range(n):
            seq.matcher.fill_next_token_bitmask(bitmask, rows[i + j])
            if j == n - 1 or not seq.matcher.accept_token(draft[j]):
                break  # the sample at row j cannot match a draft token the guide refuses: later rows unused
            taken += 1
        if taken:
            seq.matcher.rollback(taken)
        i += n


class DraftRow:
    """A sequence as it stands ``num_tokens`` tokens in: what the sampler reads for one draft position."""

    def __init__(self, seq: Sequence, num_tokens: int):
        self.params = seq.params
        self.seed = seq.seed
        self.token_ids = seq.token_ids[:num_tokens]
        self.num_prompt_tokens = seq.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def draft_rows(seqs: list[Sequence]) -> list:
    """The sampler's rows: a sequence that repeats k + 1 times (a draft of k tokens computed this step)
    becomes its state before each draft token and after all of them."""
    if len(seqs) == len({id(s) for s in seqs}):
        return seqs
    rows, i = [], 0
    while i < len(seqs):
        seq = seqs[i]
        k = 0
        while i + k + 1 < len(seqs) and seqs[i + k + 1] is seq:
            k += 1
        base = seq.num_tokens - k
        rows.extend(DraftRow(seq, base + j) for j in range(k + 1))
        i += k + 1
    return rows


class GuideMasks:
    """Bitmasks being filled for one batch; ``apply`` waits for them and masks the logits in place."""

    def __init__(self, future: Future, bitmask: torch.Tensor, rows: list[int], vocab_size: int):
        self._future = future
        self.bitmask = bitmask
        self.rows = rows
        self.vocab_size = vocab_size

    def apply(self, logits: torch.Tensor) -> None:
        self._future.result()
        apply_bitmask(logits, self.bitmask, self.rows)


# bit j of byte v, for every byte value: unpacks a bitmask with one gather (int32 shifts are slow on CPU)
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set ``logits[row, t]`` to -inf where bit t of ``bitmask[row]`` is 0, for each row in ``rows``."""
    vocab = logits.shape[-1]
    index = torch.tensor(rows, dtype=torch.long)
    # little-endian words: bit t of the row is bit t % 8 of byte t // 8
    packed = bitmask.index_select(0, index).contiguous().view(torch.uint8)
    allowed = _BYTE_BITS[packed.long()].reshape(len(rows), -1)[:, :vocab]
    allowed = allowed.to(logits.device, non_blocking=True)
    index = index.to(logits.device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill(~allowed, float("-inf")))
