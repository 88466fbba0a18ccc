"""`trtedge cache ls|prune|clear|path`: look after the bundle cache; quiet and cron-friendly."""

from __future__ import annotations

import json
import logging
import sys
import time

import typer

from trtedge.commands.exit_codes import FAILED, USAGE

HELP = "List, prune or clear the runtime-bundle cache (downloaded checkpoints are kept)."

app = typer.Typer(help=HELP, no_args_is_help=True)

_CACHE_DIR = typer.Option(
    None, "--cache-dir", help="Cache directory (default $TRTEDGE_CACHE_DIR or ~/.cache/trtedge)."
)
_VERBOSE = typer.Option(False, "--verbose", "-v", help="Say what was done (quiet by default, for cron).")


@app.command("ls", help="List bundles: model, profile, size, last used, whether a process has it loaded.")
def ls(
    cache_dir: str = _CACHE_DIR,
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    cache = _cache(cache_dir)
    entries = sorted(cache.entries(), key=lambda e: e.last_used, reverse=True)
    in_use = {e.key: cache.in_use(e.key) for e in entries}
    if as_json:
        typer.echo(json.dumps([{**e.to_dict(), "in_use": in_use[e.key]} for e in entries], indent=2))
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(f"{cache.bundles} ({len(entries)} bundles, {_size(_disk_bytes(entries))})"))
    for column in ("key", "model", "profile", "size", "last used", "in use"):
        table.add_column(column, justify="right" if column == "size" else "left")
    for e in entries:
        used = "yes" if in_use[e.key] else ""
        summary = _summary(e.profile)
        if e.outdated:
            summary = f"old layout {e.layout_version}: unused, `prune` removes it"
        cells = (e.key, e.model, summary, _size(e.size_bytes), _when(e.last_used), used)
        table.add_row(*(escape(str(c)) for c in cells))  # a model path may hold [brackets]
    Console(width=None if sys.stdout.isatty() else 160).print(table)


@app.command(
    "prune",
    help="Remove bundles of an older trtedge layout, then evict least-recently-used bundles until the "
    "cache fits the cap.",
)
def prune(
    max_size_gb: float = typer.Option(50.0, "--max-size-gb", help="Cap in GiB (positive)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what would be evicted; remove nothing."),
    cache_dir: str = _CACHE_DIR,
    verbose: bool = _VERBOSE,
) -> None:
    from trtedge.runtime.artifacts.cache import BundleError, check_max_size_gb

    _logging(verbose)
    try:
        cap = check_max_size_gb(max_size_gb, "--max-size-gb")
    except BundleError as e:
        _fail(str(e), USAGE)
    removed = _run(lambda: _cache(cache_dir).prune(cap * 2**30, dry_run=dry_run))
    if verbose or dry_run:
        verb = "would evict" if dry_run else "evicted"
        for e in removed:
            typer.echo(f"{verb} {e.key} {e.model} ({_size(e.size_bytes)}, last used {_when(e.last_used)})")
        if verbose:
            typer.echo(f"{verb} {len(removed)} bundle(s), {_size(sum(e.size_bytes for e in removed))}")


@app.command("clear", help="Remove every bundle (checkpoints too with --checkpoints).")
def clear(
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    checkpoints: bool = typer.Option(False, "--checkpoints", help="Also remove downloaded checkpoints."),
    cache_dir: str = _CACHE_DIR,
    verbose: bool = _VERBOSE,
) -> None:
    _logging(verbose)
    cache = _cache(cache_dir)
    if not yes:
        if not sys.stdin.isatty():
            _fail("refusing to clear without --yes (no terminal to ask on)", USAGE)
        what = "all bundles" + (" and downloaded checkpoints" if checkpoints else "")
        if not typer.confirm(f"Remove {what} in {cache.root}?"):
            raise typer.Exit(FAILED)
    removed = _run(lambda: cache.clear(checkpoints=checkpoints))
    if verbose:
        typer.echo(f"removed {len(removed)} bundle(s), {_size(sum(e.size_bytes for e in removed))}")


@app.command("path", help="Print the cache directory.")
def path(cache_dir: str = _CACHE_DIR) -> None:
    from trtedge.runtime.artifacts.cache import Cache

    typer.echo(str(Cache(cache_dir).root))  # it may not exist yet: nothing has been built


def _cache(cache_dir):
    """The cache at --cache-dir, which must be a directory: a typo in a cron job's path fails loudly.
    The default cache may not exist yet (nothing built): that is an empty cache."""
    from pathlib import Path

    from trtedge.runtime.artifacts.cache import Cache

    if cache_dir is not None:
        where = Path(cache_dir).expanduser()
        if not where.exists():
            _fail(f"--cache-dir {cache_dir}: no such directory", USAGE)
        if not where.is_dir():
            _fail(f"--cache-dir {cache_dir}: not a directory", USAGE)
    return Cache(cache_dir)


def _run(action):
    try:
        return action()
    except OSError as e:
        _fail(f"{e.filename or ''}: {e.strerror or e}".lstrip(": "), FAILED)


def _logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.ERROR, format="%(message)s", stream=sys.stderr
    )


def _summary(profile: dict) -> str:
    from trtedge.runtime.artifacts.bundle import BuildProfile

    try:
        fields = {k: v for k, v in profile.items() if k != "components"}
        return BuildProfile(**fields, components=tuple(profile.get("components", ("llm",)))).summary()
    except (TypeError, ValueError):
        return json.dumps(profile)


def _disk_bytes(entries) -> int:
    return sum({inode: size for e in entries for inode, size in e.inodes.items()}.values())


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _fail(message: str, code: int) -> None:
    typer.echo(f"trtedge cache: {message}", err=True)
    raise typer.Exit(code)
