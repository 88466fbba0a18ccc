"""The `trtedge` command line: wires the subcommands, nothing else."""

from __future__ import annotations

import typer

from trtedge.commands import bench, build, cache, chat, help_format, serve

help_format.install()

app = typer.Typer(
    name="trtedge",
    help="Build, cache, serve and measure LLMs on your own machine.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from trtedge.commands.version import version_text

        typer.echo(version_text())
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False,
        "--version",
        callback=_version,
        is_eager=True,
        help="Print versions (trtedge, torch, device) and exit.",
    ),
) -> None:
    pass


app.command("chat", help=chat.HELP)(chat.chat)
app.command("serve", help=serve.HELP)(serve.serve)
app.command("build", help=build.HELP)(build.build)
app.add_typer(cache.app, name="cache", help=cache.HELP)
app.add_typer(bench.app, name="bench", help=bench.HELP)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
