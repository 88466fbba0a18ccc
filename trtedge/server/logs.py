"""What a request brings (field names, model ids, paths, error text) reaches the log escaped: a value with
a newline or another control character cannot forge or garble a log line. ``EscapeArgs`` escapes the
arguments of every record on the server's and the engine's loggers; the message templates are ours."""

from __future__ import annotations

import logging
import numbers
from collections.abc import Mapping

MAX_FIELD_CHARS = 100  # a logged name longer than this is cut
MAX_FIELDS = 20  # a list of names longer than this is cut


def escape(value: object) -> str:
    """``value`` as text with every unprintable character (newlines, escapes, NUL, U+2028) written as its
    Python escape: one printable line."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def name_list(names) -> str:
    """A bounded, comma-separated list of request-supplied names for a log line."""
    names = sorted(names)
    shown = [n if len(n) <= MAX_FIELD_CHARS else n[:MAX_FIELD_CHARS] + "..." for n in names[:MAX_FIELDS]]
    more = f" (+{len(names) - MAX_FIELDS} more)" if len(names) > MAX_FIELDS else ""
    return ", ".join(shown) + more


class EscapeArgs(logging.Filter):
    """Escapes the %-arguments of each record (numbers pass as they are, for %d and %g)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple):
            record.args = tuple(_safe(a) for a in args)
        elif isinstance(args, Mapping):
            record.args = {k: _safe(v) for k, v in args.items()}
        return True


def _safe(value: object) -> object:
    if value is None or isinstance(value, numbers.Number):
        return value
    return escape(value)


def install() -> None:
    """Escape the arguments of records on the server's and the engine's loggers (idempotent)."""
    for name in ("trtedge.server", "trtedge"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, EscapeArgs) for f in logger.filters):
            logger.addFilter(EscapeArgs())
