"""Transcription prompts and answers of ASR models (Qwen3-ASR's format).

The prompt is a chat: an optional system turn with the caller's context (hot words, spelling), a
user turn with the audio, and the assistant's turn. The model answers ``language <Name><asr_text>``
and the transcript; a caller who names the language has ``language <Name><asr_text>`` written into
the assistant's turn already, so that the model only transcribes. ``TranscriptReader`` turns the
answer's text deltas into the transcript's: everything up to ``<asr_text>`` is the language header.
"""

from __future__ import annotations

from dataclasses import dataclass

MARKER = "<asr_text>"

# ISO-639-1 (and Cantonese's ISO-639-3) codes of the languages Qwen3-ASR names, as it names them.
LANGUAGES = {
    "ar": "Arabic",
    "yue": "Cantonese",
    "zh": "Chinese",
    "cs": "Czech",
    "da": "Danish",
    "nl": "Dutch",
    "en": "English",
    "fil": "Filipino",
    "fi": "Finnish",
    "fr": "French",
    "de": "German",
    "el": "Greek",
    "hi": "Hindi",
    "hu": "Hungarian",
    "id": "Indonesian",
    "it": "Italian",
    "ja": "Japanese",
    "ko": "Korean",
    "mk": "Macedonian",
    "ms": "Malay",
    "fa": "Persian",
    "pl": "Polish",
    "pt": "Portuguese",
    "ro": "Romanian",
    "ru": "Russian",
    "es": "Spanish",
    "sv": "Swedish",
    "th": "Thai",
    "tr": "Turkish",
    "vi": "Vietnamese",
}


def language_name(language: str) -> str:
    """The model's name of ``language`` (an ISO code such as "en", or the name itself); ValueError
    naming the known codes otherwise."""
    code = language.strip().lower()
    if code in LANGUAGES:
        return LANGUAGES[code]
    for name in LANGUAGES.values():
        if name.lower() == code:
            return name
    raise ValueError(
        f"language {language!r} is not one the model transcribes; send one of {', '.join(LANGUAGES)}"
    )


@dataclass(frozen=True)
class TranscriptionPrompt:
    messages: list[dict]  # the chat, its audio part as {"type": "audio", "audio": samples}
    prefill: str  # text the assistant's turn starts with (after the generation prompt)
    header: bool  # whether the answer starts with the language header (ends at <asr_text>)


def transcription_prompt(
    samples, prompt: str | None = None, language: str | None = None, style: str = "qwen3_asr"
) -> TranscriptionPrompt:
    """The chat that asks for a transcript: Qwen3-ASR's (``style`` "qwen3_asr": the audio alone, the
    language forced in the answer's header), or an instruction after the audio for a chat model that
    hears ("instruct", Qwen2.5-Omni)."""
    messages: list[dict] = []
    if prompt:
        messages.append({"role": "system", "content": [{"type": "text", "text": prompt}]})
    if style == "instruct":
        what = f"the {language_name(language)} audio" if language else "the audio"
        ask = {"type": "text", "text": f"Transcribe {what} into text."}
        messages.append({"role": "user", "content": [{"type": "audio", "audio": samples}, ask]})
        return TranscriptionPrompt(messages, "", header=False)
    messages.append({"role": "user", "content": [{"type": "audio", "audio": samples}]})
    prefill = f"language {language_name(language)}{MARKER}" if language else ""
    return TranscriptionPrompt(messages, prefill, header=not language)


class TranscriptReader:
    """Feeds the answer's text deltas; returns the transcript's deltas (the language header held back
    until ``<asr_text>`` ends it). ``finish()`` returns what is left once the answer ends."""

    def __init__(self, header_done: bool = False):
        self.header_done = header_done
        self.pending = ""
        self.language: str | None = None
        self.text = ""

    def feed(self, delta: str) -> str:
        if self.header_done:
            return self._emit(delta if self.text else delta.lstrip())
        self.pending += delta
        head, marker, rest = self.pending.partition(MARKER)
        if not marker:
            return ""
        self.header_done = True
        self.pending = ""
        words = head.strip().split()
        if len(words) >= 2 and words[0].lower() == "language" and words[1].lower() != "none":
            self.language = words[1]
        return self._emit(rest.lstrip())

    def finish(self) -> str:
        """The rest: an answer that never wrote ``<asr_text>`` is all transcript."""
        if self.header_done:
            return ""
        self.header_done = True
        rest, self.pending = self.pending.strip(), ""
        return self._emit(rest)

    def _emit(self, text: str) -> str:
        self.text += text
        return text
