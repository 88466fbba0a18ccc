"""GPT-2's byte-level alphabet: every byte drawn as a printable character (the spelling of byte-level
BPE vocabularies, which GGUF files and tokenizer.json share)."""

from __future__ import annotations


def _byte_chars() -> dict[int, str]:
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return table


BYTE_CHARS: dict[int, str] = _byte_chars()  # byte -> its character
CHAR_BYTES: dict[str, int] = {c: b for b, c in BYTE_CHARS.items()}  # character -> its byte


def piece_bytes(piece: str) -> bytes | None:
    """The bytes a byte-level BPE piece spells, or None when ``piece`` is not in the alphabet."""
    if not piece or not all(c in CHAR_BYTES for c in piece):
        return None
    return bytes(CHAR_BYTES[c] for c in piece)
