"""``backends run``: run a rollout (or Harbor tasks) over a dataset, into a run directory.

What runs comes from ``backends.cli.targets`` (a workflow in sandboxes or in process, a ready
backend, Harbor tasks); where its files go and what is left to do from
``backends.cli.resume`` (a new run directory, or the rest of the run already in it); the files
themselves are ``backends.cli.runfiles``. Every policy call goes through the relay, to the
scripted policy unless ``--policy-url`` names an endpoint. Rollout ids start with the run id,
so two runs never share or delete each other's files. The dataset is streamed. SIGINT and
SIGTERM cancel the rollouts in flight, record them as cancelled (a rerun on the directory
redoes them), print what finished and exit 130 / 143.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import anyio
import typer
from rich.console import Console
from rich.table import Table

from backends.cli.metrics import compute_metrics
from backends.cli.progress import ProgressDisplay, Tally
from backends.cli.relay_socket import socket_dir
from backends.cli.results import ResultsFile, ResultsFileError, Try, record_of, save_result
from backends.cli.resume import OpenRun, RunDirError, open_run, redacted_argv, retry_selectors
from backends.cli.runfiles import (
    METRICS_FILE,
    REPORT_FILE,
    RESULTS_FILE,
    ROLLOUTS_DIR,
    ResultRecord,
    RunMetrics,
    write_json_atomic,
)
from backends.cli.targets import BACKENDS, Choice, Target, TargetError, resolve
from backends.relay import Relay
from backends.relay.scripted import Script, ScriptedPolicy
from backends.relayed import RelayedBackend
from backends.rollout.artifacts import default_rollout_root
from backends.rollout.backend import ExecutionBackend, start_backend
from backends.rollout.batch import run_batch
from backends.rollout.dataset import DEFAULT_MAX_ROW_BYTES
from backends.rollout.errors import ErrorCategory, Phase, RolloutFailure
from backends.rollout.request import RolloutRequest, RolloutResult, RolloutStatus
from backends.trajectory import Redactor, save_trajectory

TABLE_ROWS = 200  # the table shows this many; the results file has every one
CANCEL_GRACE_SEC = 5.0  # after a signal, how long rollouts get to honour their cancellation
METRICS_EVERY_SEC = 5.0  # metrics.json is rewritten at most this often while the run goes
DEFAULT_KEY_ENV = "BACKENDS_POLICY_API_KEY"

console = Console()


def run_command(
    entrypoint: Annotated[
        str | None,
        typer.Argument(
            help="What to run: an AgentWorkflow class or a backend ('path/main.py:name' or "
            "'module:name'). Default: the example arithmetic rollout. Leave it out with -p to "
            "run Harbor tasks.",
            show_default=False,
        ),
    ] = None,
    dataset: Annotated[
        Path | None,
        typer.Option(
            "--dataset",
            "-d",
            help="Rows (system_prompt, user_prompt, ground_truth, metadata) as JSONL, CSV or "
            "Parquet. Default: tasks/data/arithmetic.jsonl (none with -p DIR: one row per task).",
            show_default=False,
        ),
    ] = None,
    path: Annotated[
        Path | None,
        typer.Option(
            "--path",
            "-p",
            help="Harbor tasks: a directory of tasks (one rollout per task), or one task (run "
            "as it is, or the template for the rows of -d). With ENTRYPOINT: the template task "
            "the workflow runs in (default tasks/templates/workflow).",
            show_default=False,
        ),
    ] = None,
    backend: Annotated[
        str | None,
        typer.Option(
            "--backend",
            help=f"Where a workflow runs: {' or '.join(BACKENDS)} (harbor: in a sandbox, from "
            "a rollout bundle; local: in this process). Default harbor. A ready backend runs "
            "as it is built.",
            show_default=False,
        ),
    ] = None,
    environment: Annotated[
        str | None,
        typer.Option(
            "--env",
            "-e",
            help="The sandbox of Harbor trials: local (default), skypilot, a Harbor "
            "environment type, or 'module:Class'.",
            show_default=False,
        ),
    ] = None,
    agent: Annotated[
        str | None,
        typer.Option(
            "--agent",
            "-a",
            help="The Harbor agent for -p tasks: oracle (default), nop, terminus-2, ... or "
            "'module:Class'.",
            show_default=False,
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option("--model", "-m", help="Model name the agent asks the policy for."),
    ] = None,
    grader: Annotated[
        str | None,
        typer.Option(
            help="A Grader class ('main.py:Grader') for a workflow class, or a template "
            "without tests."
        ),
    ] = None,
    policy_url: Annotated[
        str | None,
        typer.Option(
            "--policy-url",
            "--base-url",
            help="OpenAI-compatible base URL of the policy; default: the embedded scripted policy.",
        ),
    ] = None,
    api_key_env: Annotated[
        str,
        typer.Option(
            "--api-key-env",
            "--api-key-name",
            help="Name of the environment variable holding the key for --policy-url (it stays "
            "on the host: agents get a rollout-scoped token).",
        ),
    ] = DEFAULT_KEY_ENV,
    policy_script: Annotated[
        Path | None,
        typer.Option(help="A script for the embedded scripted policy (JSON; see README)."),
    ] = None,
    n_concurrent: Annotated[
        int,
        typer.Option("--n-concurrent", "-n", "--max-in-flight", min=1, help="Rollouts at once."),
    ] = 8,
    n_attempts: Annotated[
        int,
        typer.Option(
            "--n-attempts",
            "-k",
            min=1,
            help="Attempts per row: each row's attempts are its group (GRPO's samples per "
            "prompt); pass@k and per-group statistics are computed over them.",
        ),
    ] = 1,
    success_threshold: Annotated[
        float, typer.Option(help="A reward at or above this passes (pass@k).")
    ] = 1.0,
    agent_timeout: Annotated[
        float | None, typer.Option(min=0, help="Seconds for the agent phase.")
    ] = 300.0,
    grader_timeout: Annotated[
        float | None,
        typer.Option("--grader-timeout", "--verifier-timeout", min=0, help="Seconds to grade."),
    ] = 60.0,
    run_dir: Annotated[
        Path | None,
        typer.Option(
            "--run-dir",
            "-o",
            help="The run's directory. A new one is created (it must be empty); one holding "
            "a run is resumed: only unfinished rollouts run. Default: a new "
            "$BACKENDS_HOME/runs/<run id>/.",
            show_default=False,
        ),
    ] = None,
    retry_failed: Annotated[
        str | None,
        typer.Option(
            help="On resume, also rerun failures of these phases (setup, agent, grading) or "
            "categories (infra_error, timeout, ...), comma-separated, or 'all'.",
            show_default=False,
        ),
    ] = None,
    progress_every: Annotated[
        float, typer.Option(min=0.1, help="Seconds between progress lines off a terminal.")
    ] = 10.0,
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
    relay_host: Annotated[
        str,
        typer.Option(
            help="Address the relay listens on (TCP). Sandboxes off this host (SkyPilot pods) "
            "need one they can reach, with --relay-url."
        ),
    ] = "127.0.0.1",
    relay_port: Annotated[
        int, typer.Option(min=0, max=65535, help="The relay's TCP port (0: a free one).")
    ] = 0,
    relay_url: Annotated[
        str | None,
        typer.Option(
            help="The relay's URL as agents in remote sandboxes reach it, e.g. "
            "http://10.0.0.5:8321 (needs --relay-port). Local sandboxes use a socket instead.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Run a rollout over a dataset (or Harbor tasks) and print each rollout's reward."""
    # Bad input is reported (exit 2) before anything runs or any directory is made.
    for hint, timeout in (("--agent-timeout", agent_timeout), ("--grader-timeout", grader_timeout)):
        if timeout is not None and not math.isfinite(timeout):
            raise typer.BadParameter(
                f"{timeout} is not a finite number of seconds", param_hint=hint
            )
    if not math.isfinite(success_threshold):
        raise typer.BadParameter("must be a finite number", param_hint="--success-threshold")
    if policy_url and policy_script:
        raise typer.BadParameter(
            "a script is for the embedded scripted policy: drop it, or --policy-url",
            param_hint="--policy-script",
        )
    relay_at = _RelayAt(relay_host, relay_port, relay_url)
    relay_at.check()
    try:
        retry = retry_selectors(retry_failed)
        script = Script.load(policy_script) if policy_script else None
    except RunDirError as exc:
        raise typer.BadParameter(str(exc), param_hint="--retry-failed") from None
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(f"{policy_script}: {exc}", param_hint="--policy-script") from None
    choice = Choice(
        entrypoint=entrypoint,
        path=path,
        dataset=dataset,
        backend=backend,
        environment=environment,
        agent=agent,
        model=model,
        grader=grader,
        max_concurrent=n_concurrent,
        max_row_bytes=max_row_bytes,
    )
    try:
        target = resolve(choice)
    except TargetError as exc:
        raise typer.BadParameter(str(exc), param_hint=exc.option) from None
    policy = _Policy(
        url=policy_url,
        key=os.environ.get(api_key_env) if policy_url else None,
        script=script,
        token_ids=token_ids if token_ids is not None else policy_url is None,
    )
    redactor = Redactor(policy.secrets())
    target.inputs.update(
        attempts=n_attempts,
        agent_timeout_sec=agent_timeout,
        grader_timeout_sec=grader_timeout,
        success_threshold=success_threshold,
        policy="upstream" if policy_url else "scripted",
        policy_script_sha256=_script_hash(policy_script),
    )
    target.display["policy"] = policy.label(redactor)
    try:
        opened = open_run(
            run_dir,
            inputs=target.inputs,
            display=target.display,
            rows=target.row_count,
            attempts=n_attempts,
            success_threshold=success_threshold,
            retry=retry,
            argv=redacted_argv(sys.argv, policy.secrets()),
        )
    except RunDirError as exc:
        raise typer.BadParameter(str(exc), param_hint="--run-dir") from None
    try:
        sink = ResultsFile(opened.run_dir / RESULTS_FILE)
    except ResultsFileError as exc:
        opened.close()
        raise typer.BadParameter(str(exc), param_hint="--run-dir") from None
    try:
        _place_artifacts(target.backend, opened.run_dir / ROLLOUTS_DIR)
        run = _Run(
            opened=opened,
            target=target,
            sink=sink,
            redactor=redactor,
            attempts=n_attempts,
            timeouts=(agent_timeout, grader_timeout),
        )
        run.tally.total = run.count_to_run()
        display = ProgressDisplay(run.tally, interval=progress_every)
        anyio.run(_run, run, policy, relay_at, n_concurrent, display)
        code = _finish(run)
    finally:
        sink.close()
        opened.close()
    raise typer.Exit(code)


@dataclass(frozen=True)
class _Policy:
    url: str | None
    key: str | None
    script: Script | None
    token_ids: bool

    def secrets(self) -> list[str | None]:
        """The policy key and any credentials in the policy URL: replaced wherever they appear."""
        parts = urlsplit(self.url) if self.url else None
        return [self.key, parts and parts.username, parts and parts.password]

    def label(self, redactor: Redactor) -> str:
        if self.url:
            return redactor.text(self.url)
        name = self.script.name if self.script else "default"
        return f"scripted policy '{name}' (no model)"


@dataclass(frozen=True)
class _RelayAt:
    """Where the relay listens, and the URL agents in remote sandboxes are told."""

    host: str
    port: int
    url: str | None

    def check(self) -> None:
        if self.url is None:
            return
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise typer.BadParameter(
                f"{self.url!r} is not an http(s) URL with a host", param_hint="--relay-url"
            )
        if self.port == 0:
            raise typer.BadParameter(
                "an advertised URL needs a fixed port: give --relay-port (and the URL's port "
                "where the relay is reached)",
                param_hint="--relay-url",
            )


def _script_hash(path: Path | None) -> str | None:
    if path is None:
        return None
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _place_artifacts(backend: Any, root: Path) -> None:
    # A backend left on the default shared root keeps this run's files in the run directory;
    # one given a root of its own keeps it (ids start with the run id, so nothing collides).
    if getattr(backend, "artifacts_root", None) == default_rollout_root():
        backend.artifacts_root = root


@dataclass
class _Run:
    """A session's state: the slots to run, what is in flight, the results as they come."""

    opened: OpenRun
    target: Target
    sink: ResultsFile
    redactor: Redactor
    attempts: int
    timeouts: tuple[float | None, float | None]
    tally: Tally = field(default_factory=lambda: Tally(total=0))
    in_flight: dict[str, Try] = field(default_factory=dict)
    session_records: int = 0
    stray: list[str] = field(default_factory=list)  # results for ids never asked for
    stop_reason: str | None = None
    signal: int | None = None
    output_error: str | None = None
    metrics: RunMetrics | None = None
    _metrics_at: float = 0.0

    @property
    def run_dir(self) -> Path:
        return self.opened.run_dir

    @property
    def total(self) -> int:
        return self.target.row_count * self.attempts

    def count_to_run(self) -> int:
        return sum(
            1
            for row in range(self.target.row_count)
            for attempt in range(self.attempts)
            if self.opened.runs((row, attempt))
        )

    def requests(self) -> Iterator[RolloutRequest]:
        """The slots this session runs, as requests, streamed from the dataset; each is noted
        as in flight as it starts, and nothing more starts once the run is stopped."""
        agent_timeout, grader_timeout = self.timeouts
        for row_index, row in enumerate(self.target.rows()):
            for attempt in range(self.attempts):
                if not self.opened.runs((row_index, attempt)):
                    continue
                if self.stop_reason is not None:
                    return
                request = RolloutRequest(
                    rollout_id=self.opened.rollout_id((row_index, attempt)),
                    prompt=row.prompt(),
                    label=row.ground_truth_text(),
                    metadata=row.metadata,
                    agent_timeout_sec=agent_timeout,
                    grader_timeout_sec=grader_timeout,
                    extra_fields={"row_index": row_index, "run_index": attempt},
                )
                task = (row.metadata or {}).get("harbor_task_id")
                self.in_flight[request.rollout_id] = Try(
                    rollout_id=request.rollout_id,
                    row=row_index,
                    attempt=attempt,
                    session=self.opened.session,
                    task=task if isinstance(task, str) else None,
                    prompt=row.user_prompt or "",
                    started_at=time.time(),
                )
                self.tally.running += 1
                yield request

    def stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason

    def refresh_metrics(self, *, force: bool = False) -> None:
        """Rewrite metrics.json (throttled while the run goes; a failure costs only a warning)."""
        now = time.monotonic()
        if not force and now - self._metrics_at < METRICS_EVERY_SEC:
            return
        self._metrics_at = now
        self.metrics = compute_metrics(self.opened.manifest, self.opened.records)
        try:
            write_json_atomic(self.run_dir / METRICS_FILE, self.metrics)
            self.opened.save_manifest()  # this session's count so far, should it be killed
        except OSError as exc:
            print(f"warning: cannot write the run's {METRICS_FILE}: {exc}", file=sys.stderr)


async def _run(
    run: _Run, policy: _Policy, relay_at: _RelayAt, n_concurrent: int, display: ProgressDisplay
) -> None:
    """Run the batch, writing each result as it arrives; stop early on a signal or a write
    error, recording the rollouts it cancels."""
    backend = run.target.backend
    trajectories = getattr(backend, "artifacts_root", None) or run.run_dir / ROLLOUTS_DIR
    secrets = policy.secrets()
    kept = len(run.opened.records) - len(run.opened.redo)
    verb = "resuming" if run.opened.resumed else "run"
    console.print(
        f"{verb} [bold]{run.opened.run_id}[/]: [bold]{run.tally.total}[/] of {run.total} "
        f"rollouts to run ({kept} kept), {_what(run.target)}, against "
        f"{policy.label(run.redactor)}",
        highlight=False,
        soft_wrap=True,
    )
    async with (
        _policy(policy) as base_url,
        socket_dir() as sockets,
        Relay(
            upstream_url=base_url,
            upstream_api_key=policy.key,
            request_token_ids=policy.token_ids,
            # Local sandboxes reach the relay through this socket, bound into each one.
            unix_socket_path=sockets / "relay.sock",
            host=relay_at.host,
            port=relay_at.port,
            advertised_url=relay_at.url,
        ) as relay,
    ):
        # Every policy call goes through the relay, which holds the endpoint's key and records
        # each call (token ids and logprobs included) against its rollout.
        relayed = RelayedBackend(backend, relay)
        batch = anyio.CancelScope()
        try:
            with display:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_on_signals, run, relayed, batch)
                    tg.start_soon(_tick, display)
                    with batch:
                        if run.tally.total:
                            # Building and installing a rollout bundle can take minutes.
                            run.tally.note = "starting the backend"
                            await start_backend(relayed)
                            run.tally.begin()
                        async with run_batch(
                            relayed, run.requests(), max_in_flight=n_concurrent
                        ) as stream:
                            async for result in stream:
                                await _keep(result, run, trajectories, secrets, relayed)
                                display.update()
                    # Rollouts a stop cut short without a result are recorded as cancelled.
                    for rid in list(run.in_flight) if run.stop_reason else []:
                        cancelled = _cancelled(rid, run.stop_reason or "the run stopped")
                        await _keep(cancelled, run, trajectories, secrets, relayed)
                    tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await backend.aclose()


def _what(target: Target) -> str:
    shown = target.display
    if "tasks" in shown:
        return f"Harbor tasks {shown['tasks']} with agent {shown['agent']}"
    where = {"harbor": "in sandboxes (HarborBackend)", "local": "in this process"}
    return f"{shown.get('entrypoint')} {where.get(shown['backend'], 'on ' + shown['backend'])}"


async def _tick(display: ProgressDisplay) -> None:
    while True:  # plain lines keep coming while nothing finishes (a bundle building, say)
        await anyio.sleep(1.0)
        display.update()


async def _keep(
    result: RolloutResult,
    run: _Run,
    trajectories: Path,
    secrets: list[str | None],
    backend: ExecutionBackend,
) -> None:
    attempt = run.in_flight.pop(result.rollout_id, None)
    if attempt is None:
        run.stray.append(result.rollout_id)
        return
    run.tally.running -= 1
    folder = run.run_dir / ROLLOUTS_DIR / result.rollout_id

    def save() -> tuple[Path | None, Path | None]:
        # ATIF trajectory.json beside the artifacts, with the policy's token ids; the full
        # result beside it. Neither may cost the result line.
        trajectory = save_trajectory(trajectories, result, secrets=secrets)
        try:
            full = save_result(folder, result, run.redactor)
        except OSError as exc:
            print(f"warning: cannot save {folder}/result.json: {exc}", file=sys.stderr)
            full = None
        return trajectory, full

    trajectory, full = await anyio.to_thread.run_sync(save)
    record = record_of(
        result,
        attempt,
        run_dir=run.run_dir,
        folder=trajectories / result.rollout_id,
        result_path=full,
        trajectory=trajectory,
        redactor=run.redactor,
        success_threshold=run.opened.manifest.success_threshold,
        finished_at=time.time(),
    )
    _count(run, record)
    if run.output_error is None:
        try:
            run.sink.write(record)
        except ResultsFileError as exc:
            run.output_error = str(exc)
            _stop(run, backend, "the results file cannot be written")
            return
        run.opened.records[record.slot] = record
        run.opened.manifest.sessions[-1].finished += 1
        run.session_records += 1
        run.refresh_metrics()


def _count(run: _Run, record: ResultRecord) -> None:
    tally = run.tally
    tally.done += 1
    if record.status == RolloutStatus.CANCELLED:
        tally.cancelled += 1
    elif record.failed_phase:
        tally.failed[record.failed_phase] += 1
    if record.reward is not None:
        tally.graded += 1
        tally.reward_sum += record.reward


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


@asynccontextmanager
async def _policy(policy: _Policy) -> AsyncIterator[str]:
    """The policy endpoint: the given URL, or the embedded scripted policy for the run."""
    if policy.url:
        yield policy.url
        return
    async with ScriptedPolicy(policy.script) as scripted:
        yield scripted.base_url


def _finish(run: _Run) -> int:
    """Close the session's record, print the table and summary, pick the exit code."""
    session = run.opened.manifest.sessions[-1]
    session.ended_at = time.time()
    run.refresh_metrics(force=True)
    metrics = run.metrics
    assert metrics is not None
    code = 0 if not metrics.counts["failure"] and not metrics.counts["cancelled"] else 1
    if run.in_flight or run.output_error or run.stray:
        code = 1
    if run.signal is not None:
        code = 128 + run.signal
    session.exit_code = code
    try:
        run.opened.save_manifest()
        write_json_atomic(run.run_dir / METRICS_FILE, metrics)
    except OSError as exc:
        print(f"warning: cannot update the run's files: {exc}", file=sys.stderr)
    _table(run)
    _summary(run, metrics, _write_report(run.run_dir))
    _problems(run)
    return code


def _write_report(run_dir: Path) -> bool:
    """The HTML report, when ``backends.report`` is installed; a failure costs a warning."""
    try:
        from backends.report import write_report
    except ImportError:
        return False
    try:
        write_report(run_dir)
    except Exception as exc:  # the run's results stand without their page
        print(f"warning: the report could not be written: {exc}", file=sys.stderr)
        return False
    return True


def _table(run: _Run) -> None:
    records = sorted(run.opened.records.values(), key=lambda r: r.slot)
    scripted = run.target.inputs.get("policy") == "scripted"
    title = f"rollouts of run {run.opened.run_id}" + (
        " (policy answers are scripted)" if scripted else ""
    )
    table = Table(title=title)
    for column in ("rollout", "status", "reward", "policy calls", "answer", "failure"):
        table.add_column(column)
    for record in records[:TABLE_ROWS]:
        failure = record.failure
        table.add_row(
            record.rollout_id.removeprefix(f"{run.opened.run_id}."),  # the title names the run
            record.status,
            "-" if record.reward is None else f"{record.reward:g}",
            str(record.policy_calls),
            record.answer[:40],
            f"{failure.phase}/{failure.category}: {failure.message[:60]}" if failure else "",
        )
    if len(records) > TABLE_ROWS:
        table.caption = f"the first {TABLE_ROWS} of {len(records)}; every one in {RESULTS_FILE}"
    console.print(table)


def _summary(run: _Run, metrics: RunMetrics, reported: bool) -> None:
    counts = metrics.counts
    mean = "-" if metrics.mean_reward is None else f"{metrics.mean_reward:.4g}"
    pass_k = ", ".join(f"pass@{k} {v:.3f}" for k, v in metrics.pass_at_k.items()) or "-"
    failures = "; ".join(
        f"{phase}: " + ", ".join(f"{cat} {n}" for cat, n in cats.items())
        for phase, cats in metrics.failures_by_phase.items()
    )
    groups = metrics.group_summary
    lines = [
        f"rollouts: {counts['success']} succeeded, {counts['failure']} failed, "
        f"{counts['cancelled']} cancelled, {counts['not_run']} not run, of {metrics.planned}",
        f"mean reward: {mean} over {metrics.graded} graded; {pass_k}",
    ]
    if run.attempts > 1:
        lines.append(
            f"groups: {groups.groups} of {run.attempts} attempts, {groups.zero_variance} with "
            f"no reward variance, {groups.all_passed} all passed, {groups.none_passed} none passed"
        )
    if failures:
        lines.append(f"failures by phase: {failures}")
    wall = f"{metrics.wall_sec:.1f}s"
    rate = f", {metrics.rollouts_per_sec:.2f} rollouts/s" if metrics.rollouts_per_sec else ""
    lines.append(
        f"tokens: {metrics.tokens.prompt} prompt, {metrics.tokens.completion} completion; "
        f"{metrics.policy_calls} policy calls; wall {wall}{rate}"
    )
    for line in lines:
        console.print(line, highlight=False, soft_wrap=True)
    report = run.run_dir / REPORT_FILE
    console.print(f"run directory: {run.run_dir}", highlight=False, soft_wrap=True)
    how = "" if reported else f" (write it with: backends report {run.run_dir})"
    console.print(f"report: {report}{how}", highlight=False, soft_wrap=True)
    # One machine-readable summary line, last on stdout, never wrapped.
    print(
        json.dumps(
            {
                "run_id": run.opened.run_id,
                "rollouts": metrics.planned - counts["not_run"],
                "planned": metrics.planned,
                "ran": run.session_records,
                "graded": metrics.graded,
                "mean_reward": round(metrics.mean_reward, 4)
                if metrics.mean_reward is not None
                else None,
                "pass_at_k": {k: round(v, 4) for k, v in metrics.pass_at_k.items()},
                "failures": metrics.failures_by_category,
                "policy_calls": metrics.policy_calls,
                "run_dir": str(run.run_dir),
                "results": str(run.sink.path),
                "metrics": str(run.run_dir / METRICS_FILE),
                "report": str(report),
            }
        )
    )


def _problems(run: _Run) -> None:
    """Say what went wrong, on stderr."""
    if run.output_error is not None:
        print(
            f"error: {run.output_error}; the run stopped, {run.sink.written} result(s) were "
            "written before it, each a whole JSON line",
            file=sys.stderr,
        )
    if run.in_flight:
        # A rollout without a result is a failure too, never a silent gap in the table.
        missing = list(run.in_flight)
        print(
            f"error: {len(missing)} of {run.tally.total} rollouts returned no result: "
            + ", ".join(missing[:10])
            + (" ..." if len(missing) > 10 else ""),
            file=sys.stderr,
        )
    if run.stray:
        print(
            f"error: results arrived for unknown ids: {', '.join(run.stray[:10])}", file=sys.stderr
        )
    if run.signal is not None:
        tally = run.tally
        print(
            f"interrupted by {signal.Signals(run.signal).name}: {tally.done - tally.cancelled} "
            f"of {tally.total} rollouts finished, {tally.cancelled} cancelled, "
            f"{tally.total - tally.done} not started; results in {run.sink.path}; rerun the "
            f"same command with -o {run.run_dir} to finish the run",
            file=sys.stderr,
        )
