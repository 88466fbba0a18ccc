"""Subcommands registered now and filled in by later releases: they say so and exit 2."""

from __future__ import annotations

import typer

COMMANDS = {
    "bench": "Benchmark a model offline or a running server. (Not available yet in this version.)",
}


def make(name: str):
    def command(ctx: typer.Context) -> None:
        typer.echo(f"trtedge {name}: not available yet in this version of trtedge", err=True)
        raise typer.Exit(2)

    command.__name__ = name
    return command
