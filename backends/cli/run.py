"""``backends run``: run a rollout over a dataset and print each reward."""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Annotated
from urllib.parse import urlsplit

import anyio
import typer
from rich.console import Console
from rich.table import Table

from backends.graders.text import message_text
from backends.relay import Relay
from backends.relay.scripted import ScriptedPolicy
from backends.relayed import RelayedBackend
from backends.rollout.artifacts import default_rollout_root
from backends.rollout.backend import ExecutionBackend
from backends.rollout.batch import run_batch
from backends.rollout.dataset import DatasetError, requests_from_dataset
from backends.rollout.loading import EntrypointError, load_object
from backends.rollout.request import RolloutRequest, RolloutResult
from backends.rollout.sample import utf8_json_text
from backends.trajectory import Redactor, redact_text, save_trajectory

REPO_TASKS = Path(__file__).resolve().parents[2] / "tasks"
DEFAULT_ENTRYPOINT = str(REPO_TASKS / "rollouts" / "arithmetic" / "main.py") + ":backend"
DEFAULT_DATASET = REPO_TASKS / "data" / "arithmetic.jsonl"

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
        Path | None, typer.Option("--output", "-o", help="Write one JSON result per line here.")
    ] = None,
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
        requests = requests_from_dataset(
            dataset,
            n_samples=samples,
            agent_timeout_sec=agent_timeout,
            grader_timeout_sec=grader_timeout,
        )
    except DatasetError as exc:
        raise typer.BadParameter(str(exc), param_hint="--dataset") from None
    if not requests:
        raise typer.BadParameter(f"{dataset} has no rows", param_hint="--dataset")
    options = _Options(
        dataset=dataset,
        policy_url=policy_url,
        policy_key=policy_key,
        max_in_flight=max_in_flight,
        token_ids=token_ids if token_ids is not None else policy_url is None,
    )
    try:
        # Binary: rows are written as UTF-8 bytes that never fail to encode.
        sink = output.open("wb") if output else None
    except OSError as exc:
        raise typer.BadParameter(
            f"cannot write {output}: {exc.strerror or exc}", param_hint="--output"
        ) from None
    try:
        rows = anyio.run(_run, backend, options, requests, sink)
    finally:
        if sink:
            sink.close()
    missing = [r.rollout_id for r in requests if r.rollout_id not in rows]
    if missing:
        # A rollout without a result is a failure too, never a silent gap in the table.
        print(
            f"error: {len(missing)} of {len(requests)} rollouts returned no result: "
            + ", ".join(missing[:10])
            + (" ..." if len(missing) > 10 else ""),
            file=sys.stderr,
        )
    ok = not missing and all(row.failure_category is None for row in rows.values())
    raise typer.Exit(0 if ok else 1)


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


@dataclass(frozen=True)
class _Row:
    """What the table and summary need of a result: the full result (policy traces, token ids
    and logprobs) goes to the output file as it arrives and is not kept."""

    rollout_id: str
    status: str
    reward: float | None
    policy_calls: int
    answer: str
    failure_category: str | None
    failure: str


def _row(result: RolloutResult, redactor: Redactor) -> _Row:
    answer = ""
    if result.sample and result.sample.messages:
        answer = redactor.text(message_text(result.sample.messages[-1]))[:40]
    failure = result.failure
    return _Row(
        rollout_id=result.rollout_id,
        status=str(result.status),
        reward=result.reward,
        policy_calls=len(result.policy_trace.calls) if result.policy_trace else 0,
        answer=answer,
        failure_category=str(failure.category) if failure else None,
        failure=f"{failure.category}: {redactor.text(failure.message)[:60]}" if failure else "",
    )


async def _run(
    backend: ExecutionBackend,
    options: _Options,
    requests: list[RolloutRequest],
    sink: IO[bytes] | None,
) -> dict[str, _Row]:
    """Run the batch; return a compact row per result that arrived, by rollout id."""
    trajectories = getattr(backend, "artifacts_root", None) or default_rollout_root()
    secrets = options.secrets()
    redactor = Redactor(secrets)
    rows: dict[str, _Row] = {}
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
        console.print(f"[bold]{len(requests)}[/] rollouts from {options.dataset} against {label}")
        relayed = RelayedBackend(backend, relay)
        try:
            async with run_batch(relayed, requests, max_in_flight=options.max_in_flight) as stream:
                async for result in stream:
                    rows[result.rollout_id] = _row(result, redactor)
                    # ATIF trajectory.json beside the artifacts, with the policy's token ids.
                    await anyio.to_thread.run_sync(
                        partial(save_trajectory, trajectories, result, secrets=secrets)
                    )
                    if sink:
                        # Secrets scrubbed as in trajectory.json (the policy trace included).
                        data = redactor.value(json.loads(result.model_dump_json()))
                        text = json.dumps(data, ensure_ascii=False, allow_nan=False)
                        sink.write(utf8_json_text(text)[1] + b"\n")
                        sink.flush()
        finally:
            await backend.aclose()
    console.print(f"trajectories and artifacts: {trajectories}/<rollout id>/")
    _report([rows[r.rollout_id] for r in requests if r.rollout_id in rows], scripted)
    return rows


@asynccontextmanager
async def _policy(url: str | None) -> AsyncIterator[tuple[str, bool]]:
    """The policy endpoint: the given URL, or the embedded scripted policy for the run."""
    if url:
        yield url, False
        return
    async with ScriptedPolicy() as policy:
        yield policy.base_url, True


def _report(rows: list[_Row], scripted: bool) -> None:
    table = Table(title="rollouts" + (" (policy answers are scripted)" if scripted else ""))
    for column in ("rollout", "status", "reward", "policy calls", "answer", "failure"):
        table.add_column(column)
    for row in rows:
        reward = "-" if row.reward is None else f"{row.reward:g}"
        table.add_row(
            row.rollout_id, row.status, reward, str(row.policy_calls), row.answer, row.failure
        )
    console.print(table)
    rewards = [r.reward for r in rows if r.reward is not None]
    failures = Counter(r.failure_category for r in rows if r.failure_category)
    mean = sum(rewards) / len(rewards) if rewards else float("nan")
    # One machine-readable summary line, never wrapped.
    print(
        json.dumps(
            {
                "rollouts": len(rows),
                "graded": len(rewards),
                "mean_reward": round(mean, 4) if rewards else None,
                "failures": dict(failures),
                "policy_calls": sum(r.policy_calls for r in rows),
            }
        )
    )
