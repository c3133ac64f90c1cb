"""The ``backends`` command line."""

from __future__ import annotations

import typer

from backends.bundle.cli import bundle_app
from backends.cli.report import report_command
from backends.cli.run import run_command
from backends.cli.tasks_check import tasks_app
from backends.fdlimit import raise_open_file_limit
from backends.relay.cli import relay_command, scripted_policy_command
from backends.runtimes.cli import runtime_app
from backends.sandbox.cli import sandbox_app
from backends.server.cli import serve_command

app = typer.Typer(
    name="backends",
    help="Sandboxed rollouts for agent RL: run datasets, serve trainers, relay the policy.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _group() -> None:
    """Sandboxed rollouts for agent RL: run datasets, serve trainers, relay the policy."""


app.command("run")(run_command)
app.command("report")(report_command)
app.command("serve")(serve_command)
app.command("relay")(relay_command)
app.command("scripted-policy")(scripted_policy_command)
app.add_typer(bundle_app, name="bundle")
app.add_typer(tasks_app, name="tasks")
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(runtime_app, name="runtime")


def main() -> None:
    raise_open_file_limit()
    app()
