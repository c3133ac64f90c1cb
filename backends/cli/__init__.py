"""The ``backends`` command line."""

from __future__ import annotations

import typer

from backends.cli.run import run_command

app = typer.Typer(
    name="backends",
    help="Sandboxed rollouts for agent RL: run datasets, serve trainers, relay the policy.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("run")(run_command)


def main() -> None:
    app()
