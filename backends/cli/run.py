"""``backends run``: run a rollout over a dataset and print each reward.

Each run gets a directory of its own, ``$BACKENDS_HOME/runs/<run id>/`` (or ``-o DIR``):
``results.jsonl`` and ``rollouts/<rollout id>/`` (artifacts, ``trajectory.json``); rollout ids
start with the run id, so two runs, at once or one after the other, never share or delete each
other's files. The dataset is streamed. SIGINT and SIGTERM cancel the rollouts in flight,
record them as cancelled, print what finished and exit 130 / 143.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, closing
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import anyio
import typer
from rich.console import Console
from rich.table import Table

from backends.cli.results import ResultsFile, ResultsFileError
from backends.graders.text import message_text
from backends.relay import Relay
from backends.relay.scripted import ScriptedPolicy
from backends.relayed import RelayedBackend
from backends.rollout.artifacts import ENV_HOME, default_rollout_root
from backends.rollout.backend import ExecutionBackend
from backends.rollout.batch import run_batch
from backends.rollout.dataset import DEFAULT_MAX_ROW_BYTES, DatasetError, count_rows, iter_requests
from backends.rollout.errors import ErrorCategory, Phase, RolloutFailure
from backends.rollout.loading import EntrypointError, load_object
from backends.rollout.request import RolloutRequest, RolloutResult, RolloutStatus
from backends.trajectory import Redactor, redact_text, save_trajectory

REPO_TASKS = Path(__file__).resolve().parents[2] / "tasks"
DEFAULT_ENTRYPOINT = str(REPO_TASKS / "rollouts" / "arithmetic" / "main.py") + ":backend"
DEFAULT_DATASET = REPO_TASKS / "data" / "arithmetic.jsonl"
RESULTS_FILE = "results.jsonl"
TABLE_ROWS = 200  # the table shows this many; the results file has every one
CANCEL_GRACE_SEC = 5.0  # after a signal, how long rollouts get to honour their cancellation

console = Console()


def run_command(
    entrypoint: Annotated[
        str, typer.Argument(help="The backend to run: 'path/main.py:backend' or 'module:backend'.")
    ] = DEFAULT_ENTRYPOINT,
    dataset: Annotated[
        Path, typer.Option("--dataset", "-d", help="JSONL rows: user_prompt, ground_truth, ...")
    ] = DEFAULT_DATASET,
    policy_url: Annotated[
        str | None,
        typer.Option(
            help="OpenAI-compatible base URL of the policy; default: the scripted policy."
        ),
    ] = None,
    policy_key: Annotated[
        str | None, typer.Option(envvar="BACKENDS_POLICY_API_KEY", help="Key for --policy-url.")
    ] = None,
    samples: Annotated[int, typer.Option("--samples", "-n", min=1, help="Rollouts per row.")] = 1,
    max_in_flight: Annotated[int, typer.Option(min=1)] = 8,
    agent_timeout: Annotated[float | None, typer.Option(min=0)] = 300.0,
    grader_timeout: Annotated[float | None, typer.Option(min=0)] = 60.0,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="Write one JSON result per line to this file; a directory (existing and "
            "empty, or ending in '/') becomes the run's directory. Default: "
            "$BACKENDS_HOME/runs/<run id>/results.jsonl.",
        ),
    ] = None,
    max_row_bytes: Annotated[
        int, typer.Option(min=1, help="Refuse a dataset row larger than this.")
    ] = DEFAULT_MAX_ROW_BYTES,
    token_ids: Annotated[
        bool | None,
        typer.Option(
            "--token-ids/--no-token-ids",
            help="Ask the policy for sampled token ids and logprobs (vLLM/SGLang style); "
            "default: on for the scripted policy only.",
        ),
    ] = None,
) -> None:
    """Run ENTRYPOINT's backend over a dataset and print each rollout's reward."""
    try:
        backend = load_object(entrypoint)
    except (EntrypointError, TypeError) as exc:
        raise typer.BadParameter(str(exc), param_hint="ENTRYPOINT") from None
    if not isinstance(backend, ExecutionBackend):
        raise typer.BadParameter(
            f"{entrypoint} is a {type(backend).__name__}, not a backend", param_hint="ENTRYPOINT"
        )
    # Bad input is reported (exit 2) before any rollout starts.
    for hint, timeout in (("--agent-timeout", agent_timeout), ("--grader-timeout", grader_timeout)):
        if timeout is not None and not math.isfinite(timeout):
            raise typer.BadParameter(
                f"{timeout} is not a finite number of seconds", param_hint=hint
            )
    try:
        # Every row is checked now, none kept: the run itself streams the file again.
        rows = count_rows(dataset, max_row_bytes=max_row_bytes)
    except DatasetError as exc:
        raise typer.BadParameter(str(exc), param_hint="--dataset") from None
    if not rows:
        raise typer.BadParameter(f"{dataset} has no rows", param_hint="--dataset")
    options = _Options(
        dataset=dataset,
        policy_url=policy_url,
        policy_key=policy_key,
        max_in_flight=max_in_flight,
        token_ids=token_ids if token_ids is not None else policy_url is None,
    )
    redactor = Redactor(options.secrets())
    run_dir, results_path = _run_paths(output)
    try:
        sink = ResultsFile(results_path, redactor)
    except ResultsFileError as exc:
        raise typer.BadParameter(str(exc), param_hint="--output") from None
    run_id = run_dir.name
    with closing(sink):
        _place_artifacts(backend, run_dir / "rollouts")
        requests = partial(
            iter_requests,
            dataset,
            id_prefix=f"{run_id}.row",
            n_samples=samples,
            agent_timeout_sec=agent_timeout,
            grader_timeout_sec=grader_timeout,
            max_row_bytes=max_row_bytes,
        )
        run = _Run(
            run_id=run_id, total=rows * samples, run_dir=run_dir, sink=sink, redactor=redactor
        )
        anyio.run(_run, backend, options, requests, run)
    raise typer.Exit(_finish(run, run_dir))


@dataclass(frozen=True)
class _Options:
    dataset: Path
    policy_url: str | None
    policy_key: str | None
    max_in_flight: int
    token_ids: bool

    def secrets(self) -> list[str | None]:
        """The policy key and any credentials in the policy URL: replaced wherever they appear."""
        parts = urlsplit(self.policy_url) if self.policy_url else None
        return [self.policy_key, parts and parts.username, parts and parts.password]


def _run_paths(output: Path | None) -> tuple[Path, Path]:
    """The run's own directory (created here, never reused) and its results file."""
    if output is not None and (output.is_dir() or str(output).endswith("/")):
        if output.is_dir() and any(output.iterdir()):
            raise typer.BadParameter(
                f"{output} is not empty: a run directory holds one run only (its files would "
                "mix with another run's)",
                param_hint="--output",
            )
        try:
            output.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise typer.BadParameter(
                f"cannot create {output}: {exc.strerror or exc}", param_hint="--output"
            ) from None
        return output, output / RESULTS_FILE
    if output is not None and not output.parent.is_dir():
        raise typer.BadParameter(f"cannot write {output}: no such directory", param_hint="--output")
    home = os.environ.get(ENV_HOME)
    runs = (Path(home) if home else Path.home() / ".backends") / "runs"
    while True:
        # Time first, so runs sort; random after, so two started in the same second differ;
        # mkdir without exist_ok, so no two runs ever get the same one.
        run_id = time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)
        try:
            runs.mkdir(parents=True, exist_ok=True)
            (runs / run_id).mkdir()
        except FileExistsError:
            continue
        except OSError as exc:
            raise typer.BadParameter(
                f"cannot create a run directory under {runs}: {exc.strerror or exc}",
                param_hint="--output",
            ) from None
        return runs / run_id, output or runs / run_id / RESULTS_FILE


def _place_artifacts(backend: Any, root: Path) -> None:
    # A backend left on the default shared root keeps this run's files in the run directory;
    # one given a root of its own keeps it (ids start with the run id, so nothing collides).
    if getattr(backend, "artifacts_root", None) == default_rollout_root():
        backend.artifacts_root = root


@dataclass(frozen=True)
class _Row:
    """What the table needs of a result: the full result (policy traces, token ids and
    logprobs) goes to the results file as it arrives and is not kept."""

    order: int
    rollout_id: str
    status: str
    reward: float | None
    policy_calls: int
    answer: str
    failure: str


@dataclass
class _Run:
    """A run's progress: counts for the summary, a bounded table, the rollouts in flight."""

    run_id: str
    total: int
    run_dir: Path
    sink: ResultsFile
    redactor: Redactor
    started: int = 0
    in_flight: dict[str, int] = field(default_factory=dict)  # rollout id -> request order
    table: list[_Row] = field(default_factory=list)
    results: int = 0
    graded: int = 0
    reward_sum: float = 0.0
    failures: Counter[str] = field(default_factory=Counter)
    cancelled: int = 0
    policy_calls: int = 0
    stray: list[str] = field(default_factory=list)  # results for ids never asked for
    stop_reason: str | None = None
    signal: int | None = None
    output_error: str | None = None

    def feed(self, requests: Iterator[RolloutRequest]) -> Iterator[RolloutRequest]:
        """The requests, each noted as in flight as it starts; nothing more once stopped."""
        for request in requests:
            if self.stop_reason is not None:
                return
            self.in_flight[request.rollout_id] = self.started
            self.started += 1
            yield request

    def record(self, result: RolloutResult) -> None:
        order = self.in_flight.pop(result.rollout_id, None)
        if order is None:
            self.stray.append(result.rollout_id)
            order = self.started + len(self.stray)
        self.results += 1
        calls = len(result.policy_trace.calls) if result.policy_trace else 0
        self.policy_calls += calls
        failure = result.failure
        if failure is not None:
            self.failures[str(failure.category)] += 1
        if result.status is RolloutStatus.CANCELLED:
            self.cancelled += 1
        if result.reward is not None:
            self.graded += 1
            self.reward_sum += result.reward
        if len(self.table) >= TABLE_ROWS:
            return
        answer = ""
        if result.sample and result.sample.messages:
            answer = self.redactor.text(message_text(result.sample.messages[-1]))[:40]
        self.table.append(
            _Row(
                order=order,
                rollout_id=result.rollout_id,
                status=str(result.status),
                reward=result.reward,
                policy_calls=calls,
                answer=answer,
                failure=f"{failure.category}: {self.redactor.text(failure.message)[:60]}"
                if failure
                else "",
            )
        )

    def stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason


async def _run(
    backend: ExecutionBackend,
    options: _Options,
    requests: Any,
    run: _Run,
) -> None:
    """Run the batch, writing each result as it arrives; stop early on a signal or a write
    error, recording the rollouts it cancels."""
    trajectories = getattr(backend, "artifacts_root", None) or run.run_dir / "rollouts"
    secrets = options.secrets()
    # Every policy call goes through the relay, which holds the endpoint's key and records
    # each call (token ids and logprobs included) against its rollout.
    async with (
        _policy(options.policy_url) as (base_url, scripted),
        Relay(
            upstream_url=base_url,
            upstream_api_key=options.policy_key,
            request_token_ids=options.token_ids,
        ) as relay,
    ):
        label = "scripted policy (no model)" if scripted else redact_text(base_url, secrets)
        console.print(
            f"run [bold]{run.run_id}[/]: [bold]{run.total}[/] rollouts from {options.dataset} "
            f"against {label}"
        )
        relayed = RelayedBackend(backend, relay)
        batch = anyio.CancelScope()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_on_signals, run, relayed, batch)
                with batch:
                    async with run_batch(
                        relayed, run.feed(requests()), max_in_flight=options.max_in_flight
                    ) as stream:
                        async for result in stream:
                            await _keep(result, run, trajectories, secrets, relayed)
                # Rollouts a stop cut short without a result are recorded as cancelled.
                for rid in list(run.in_flight) if run.stop_reason else []:
                    cancelled = _cancelled(rid, run.stop_reason or "the run stopped")
                    _write(cancelled, run)
                    run.record(cancelled)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await backend.aclose()
    console.print(f"trajectories and artifacts: {trajectories}/<rollout id>/")
    _report(run, scripted)


async def _keep(
    result: RolloutResult,
    run: _Run,
    trajectories: Path,
    secrets: list[str | None],
    backend: ExecutionBackend,
) -> None:
    run.record(result)
    # ATIF trajectory.json beside the artifacts, with the policy's token ids.
    await anyio.to_thread.run_sync(partial(save_trajectory, trajectories, result, secrets=secrets))
    if not _write(result, run):
        _stop(run, backend, "the results file cannot be written")


def _write(result: RolloutResult, run: _Run) -> bool:
    """Append to the results file; ``False`` (and the error noted) once it cannot be written."""
    if run.output_error is not None:
        return False
    try:
        run.sink.write(result)
    except ResultsFileError as exc:
        run.output_error = str(exc)
        return False
    return True


def _stop(run: _Run, backend: ExecutionBackend, reason: str) -> None:
    """Start nothing more and cancel what runs; their cancelled results still arrive."""
    if run.stop_reason is not None:
        return
    run.stop(reason)
    backend.cancel(all=True)


async def _on_signals(run: _Run, backend: ExecutionBackend, batch: anyio.CancelScope) -> None:
    """SIGINT or SIGTERM: stop as ``_stop`` does; rollouts that ignore their cancellation for
    ``CANCEL_GRACE_SEC`` (or a second signal) are cut off and recorded as cancelled."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            if run.signal is not None:
                batch.cancel()
                continue
            run.signal = signum
            name = signal.Signals(signum).name
            print(
                f"\n{name}: cancelling {len(run.in_flight)} rollout(s) in flight", file=sys.stderr
            )
            _stop(run, backend, f"the run was interrupted ({name})")
            break
    with anyio.move_on_after(CANCEL_GRACE_SEC):
        while run.in_flight:
            # Again while they wind down: one started just before the signal may have missed it.
            backend.cancel(all=True)
            await anyio.sleep(0.2)
    batch.cancel()


def _cancelled(rollout_id: str, reason: str) -> RolloutResult:
    failure = RolloutFailure(
        category=ErrorCategory.CANCELLED, phase=Phase.AGENT, message=f"rollout cancelled: {reason}"
    )
    return RolloutResult.failed(rollout_id, failure)


def _finish(run: _Run, run_dir: Path) -> int:
    """Say what went wrong, if anything, and pick the exit code."""
    code = 0 if not run.failures and not run.in_flight else 1
    print(f"run directory: {run_dir}", file=sys.stderr)
    if run.output_error is not None:
        print(
            f"error: {run.output_error}; the run stopped, {run.sink.written} result(s) were "
            "written before it, each a whole JSON line",
            file=sys.stderr,
        )
        code = 1
    if run.in_flight:
        # A rollout without a result is a failure too, never a silent gap in the table.
        missing = list(run.in_flight)
        print(
            f"error: {len(missing)} of {run.total} rollouts returned no result: "
            + ", ".join(missing[:10])
            + (" ..." if len(missing) > 10 else ""),
            file=sys.stderr,
        )
        code = 1
    if run.stray:
        print(
            f"error: results arrived for unknown ids: {', '.join(run.stray[:10])}", file=sys.stderr
        )
        code = 1
    if run.signal is not None:
        done = run.results - run.cancelled
        print(
            f"interrupted by {signal.Signals(run.signal).name}: {done} of {run.total} rollouts "
            f"finished, {run.cancelled} cancelled, {run.total - run.results} not started; "
            f"results in {run.sink.path}",
            file=sys.stderr,
        )
        code = 128 + run.signal
    return code


@asynccontextmanager
async def _policy(url: str | None) -> AsyncIterator[tuple[str, bool]]:
    """The policy endpoint: the given URL, or the embedded scripted policy for the run."""
    if url:
        yield url, False
        return
    async with ScriptedPolicy() as policy:
        yield policy.base_url, True


def _report(run: _Run, scripted: bool) -> None:
    title = f"rollouts of run {run.run_id}" + (" (policy answers are scripted)" if scripted else "")
    table = Table(title=title)
    for column in ("rollout", "status", "reward", "policy calls", "answer", "failure"):
        table.add_column(column)
    for row in sorted(run.table, key=lambda r: r.order):
        reward = "-" if row.reward is None else f"{row.reward:g}"
        table.add_row(
            row.rollout_id.removeprefix(f"{run.run_id}."),  # the title names the run
            row.status,
            reward,
            str(row.policy_calls),
            row.answer,
            row.failure,
        )
    if run.results > len(run.table):
        table.caption = (
            f"the first {len(run.table)} of {run.results}; every one in the results file"
        )
    console.print(table)
    # One machine-readable summary line, never wrapped.
    print(
        json.dumps(
            {
                "run_id": run.run_id,
                "rollouts": run.results,
                "graded": run.graded,
                "mean_reward": round(run.reward_sum / run.graded, 4) if run.graded else None,
                "failures": dict(run.failures),
                "policy_calls": run.policy_calls,
                "results": str(run.sink.path),
            }
        )
    )
