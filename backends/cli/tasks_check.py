"""``backends tasks check DIR``: are these Harbor tasks sound, and can they run here?

For someone porting tasks: each task is parsed with Harbor's own loader, then run twice in the
chosen environment through HarborBackend's dataset mode, with Harbor's ``oracle`` agent (its
``solution/`` must score 1) and ``nop`` (an untouched environment must score 0). A task the
environment refuses (an image with no local substitute, GPUs, compose, Windows) or whose
verifier failed here while needing the network is listed as skipped, with the reason, not as
broken. The exit code is 1 when any task fails, 2 when there is nothing to check.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import anyio
import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from backends.cli.tasks_verdict import Verdict, judge, parse_task
from backends.harbor import HarborBackend, dataset_requests, discover_tasks
from backends.harbor.backend import build_environment_config
from backends.harbor.tasks import TASK_ID_KEY, is_task_dir
from backends.rollout.artifacts import default_rollout_root
from backends.rollout.batch import collect
from backends.rollout.request import RolloutResult

tasks_app = typer.Typer(
    help="Harbor tasks: check that ported tasks are sound.", no_args_is_help=True
)
console = Console()
AGENTS = ("oracle", "nop")


@tasks_app.command("check")
def check_command(
    directory: Annotated[
        Path, typer.Argument(help="A directory of Harbor tasks, or one task.", show_default=False)
    ],
    environment: Annotated[
        str,
        typer.Option(
            "--env",
            "-e",
            help="Where the trials run: 'local' (sandboxes on this machine), 'skypilot', a "
            "Harbor environment type or 'module:Class'.",
        ),
    ] = "local",
    concurrency: Annotated[
        int, typer.Option("--n-concurrent", "-n", min=1, help="Trials at once.")
    ] = 4,
) -> None:
    """Parse each task, run Harbor's oracle (must score 1) and nop (must score 0), and print a
    table; exit 1 if any task fails."""
    try:
        build_environment_config(environment, None)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--env") from None
    root, task_ids = _tasks(directory)
    trials = _trials_dir()
    verdicts = anyio.run(check_tasks, root, task_ids, trials, environment, concurrency)
    _print(verdicts, directory)
    failed = [v for v in verdicts if v.status == "fail"]
    skipped = [v for v in verdicts if v.status == "skip"]
    passed = len(verdicts) - len(failed) - len(skipped)
    console.print(
        f"{passed} passed, {len(failed)} failed, {len(skipped)} skipped "
        f"(cannot run here) of {len(verdicts)} task(s) in {directory}",
        markup=False,
    )
    if failed or skipped:
        # Each trial's logs (the tests' output in verifier/test-stdout.txt) tell why.
        console.print(f"trials of every run (oracle/, nop/): {trials}", markup=False)
    else:
        shutil.rmtree(trials, ignore_errors=True)
    raise typer.Exit(1 if failed else 0)


def _trials_dir() -> Path:
    """A fresh directory for this check's trials, kept when some task did not pass."""
    runs = default_rollout_root().parent / "tasks-check"
    runs.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return Path(tempfile.mkdtemp(prefix=f"{stamp}-", dir=runs))


def _tasks(directory: Path) -> tuple[Path, list[str]]:
    """The tasks directory and the ids to check: every task under it, or the one it is."""
    if not directory.is_dir():
        raise typer.BadParameter(f"{directory} is not a directory", param_hint="DIRECTORY")
    if is_task_dir(directory):
        return directory.resolve().parent, [directory.resolve().name]
    task_ids = discover_tasks(directory)
    if not task_ids:
        raise typer.BadParameter(
            f"{directory} holds no Harbor task (no task.toml in it or below it)",
            param_hint="DIRECTORY",
        )
    return directory.resolve(), task_ids


async def check_tasks(
    root: Path, task_ids: Sequence[str], trials: Path, environment: str, concurrency: int = 4
) -> list[Verdict]:
    """One verdict per task: parse each, run oracle and nop on those that parse; every
    trial's directory is kept under ``trials/<agent>/``."""
    parsed = {task_id: parse_task(root / task_id) for task_id in task_ids}
    runnable = [task_id for task_id, task in parsed.items() if task.problem is None]
    results: dict[str, dict[str, RolloutResult]] = {agent: {} for agent in AGENTS}

    async def run(agent: str) -> None:
        backend = HarborBackend(
            tasks_dir=root,
            task_mode="dataset",
            agent=agent,
            environment=environment,
            max_concurrent=concurrency,
            trials_dir=trials / agent,
            cleanup_successful_trials=False,  # a 0 where 1 was due is a "successful" trial
            keep_failed_trials=len(runnable),
            artifacts=trials / agent / "_artifacts",
        )
        try:
            requests = dataset_requests(root, task_ids=runnable)
            task_of = {r.rollout_id: str((r.metadata or {})[TASK_ID_KEY]) for r in requests}
            for result in await collect(backend, requests, max_in_flight=concurrency):
                results[agent][task_of[result.rollout_id]] = result
        finally:
            with anyio.CancelScope(shield=True):
                await backend.aclose()

    if runnable:
        async with anyio.create_task_group() as group:
            for agent in AGENTS:
                group.start_soon(run, agent)
    return [
        judge(
            task_id,
            root / task_id,
            parsed[task_id],
            oracle=results["oracle"].get(task_id),
            nop=results["nop"].get(task_id),
        )
        for task_id in task_ids
    ]


_STYLE = {"pass": "green", "fail": "bold red", "skip": "yellow"}


def _print(verdicts: Sequence[Verdict], directory: Path) -> None:
    table = Table(title=f"Harbor tasks in {directory}")
    for column in ("task", "oracle", "nop", "result", "why"):
        table.add_column(column, overflow="fold")
    for v in verdicts:
        # Task names and messages come from the tasks: plain text, never rich markup.
        table.add_row(
            Text(v.task_id), v.oracle, v.nop, Text(v.status, style=_STYLE[v.status]), Text(v.reason)
        )
    console.print(table)
