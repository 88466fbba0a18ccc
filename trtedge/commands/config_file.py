"""A TOML file of a command's flags (`trtedge serve --config serve.toml`, or `$TRTEDGE_CONFIG`).

Keys are the flag names without the dashes, with ``-`` or ``_`` (``max-batch-size = 4``), any of a
flag's spellings (``draft-step`` for ``max-spec-draft-tokens``); the positional MODEL is ``model``. Precedence: a flag on the command line > its environment variable
> the file > the default. An unknown key or a value of the wrong type is an error naming the key
and the file's line.
"""

from __future__ import annotations

import difflib
import inspect
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import typer

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_TYPES = {"str": str, "int": int, "float": float, "bool": bool}
_KEY_LINE = re.compile(r"""^\s*(?:"([^"]+)"|'([^']+)'|([A-Za-z0-9_-]+))\s*=""")


class ConfigFileError(ValueError):
    """The config file cannot be read or holds an unknown key or a mistyped value."""


@dataclass(frozen=True)
class Setting:
    """One resolved setting: its value and where it came from (flag, env NAME, file PATH, default)."""

    value: object
    source: str


def settable(command) -> dict[str, type]:
    """The settings of a Typer command function: parameter name -> Python type."""
    out = {}
    for name, param in inspect.signature(command).parameters.items():
        annotation = param.annotation if isinstance(param.annotation, str) else param.annotation.__name__
        if annotation in _TYPES:
            out[name] = _TYPES[annotation]
    return out


def aliases(command) -> dict[str, str]:
    """The other long spellings of a Typer command's flags: ``draft_step`` -> ``max_spec_draft_tokens``."""
    out = {}
    for name, param in inspect.signature(command).parameters.items():
        for decl in getattr(param.default, "param_decls", None) or ():
            key = decl.removeprefix("--").replace("-", "_")
            if decl.startswith("--") and "/" not in decl and key != name:
                out[key] = name
    return out


def load(
    path: str | Path,
    types: dict[str, type],
    json_keys: tuple[str, ...] = (),
    aliases: dict[str, str] | None = None,
) -> dict[str, object]:
    """Read ``path``: {parameter name: value}. ``json_keys`` may also be TOML tables (sent on as JSON);
    ``aliases`` maps other spellings of a key to its parameter name."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigFileError(f"config file {path}: {e.strerror or e}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigFileError(f"config file {path}: not valid TOML ({e})") from None
    lines = _key_lines(text)
    out: dict[str, object] = {}
    spelt: dict[str, str] = {}
    for key, value in data.items():
        where = f"{path}:{lines.get(key, '?')}"
        name = key.replace("-", "_")
        name = (aliases or {}).get(name, name)
        if name not in types:
            known = sorted(n.replace("_", "-") for n in types)
            near = difflib.get_close_matches(key.replace("_", "-"), known, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ConfigFileError(f"{where}: unknown key {key!r}{hint}")
        if name in out:
            raise ConfigFileError(f"{where}: {key!r} is set twice (as {spelt[name]!r} and {key!r})")
        spelt[name] = key
        if name in json_keys and isinstance(value, dict):
            value = json.dumps(value)
        want = types[name]
        ok = isinstance(value, want) and not (want is not bool and isinstance(value, bool))
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise ConfigFileError(f"{where}: {key} must be {want.__name__}, got {value!r}")
        out[name] = value
    return out


def resolve(
    ctx: typer.Context, values: dict[str, object], path: str | Path | None, types: dict[str, type], **load_kw
) -> dict[str, Setting]:
    """Merge the command line, environment, file and defaults: flag > env > file > default."""
    from_file = load(path, types, **load_kw) if path else {}
    out = {}
    for name in types:
        source = ctx.get_parameter_source(name)
        kind = getattr(source, "name", "DEFAULT")
        if kind == "COMMANDLINE":
            out[name] = Setting(values[name], "flag")
        elif kind == "ENVIRONMENT":
            out[name] = Setting(values[name], "env")
        elif name in from_file:
            out[name] = Setting(from_file[name], f"file {path}")
        else:
            out[name] = Setting(values[name], "default")
    return out


def to_toml(settings: dict[str, Setting], secret: tuple[str, ...] = ()) -> str:
    """The effective settings as TOML a user can save as a config file, each with its source."""
    lines = []
    for name, s in settings.items():
        key = name.replace("_", "-")
        if s.value is None:
            lines.append(f"# {key} = (unset)  # {s.source}")
            continue
        value = "***" if name in secret else s.value
        lines.append(f"{key} = {_toml_value(value)}  # {s.source}")
    return "\n".join(lines)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


def _key_lines(text: str) -> dict[str, int]:
    lines: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        header = re.match(r"^\s*\[\s*([A-Za-z0-9_-]+)\s*\]", line)
        if header:
            lines.setdefault(header.group(1), number)
            break  # the keys inside a table are not top-level settings
        m = _KEY_LINE.match(line)
        if m:
            lines.setdefault(next(g for g in m.groups() if g), number)
    return lines
