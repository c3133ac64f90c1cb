"""``backends run``: run a rollout over a dataset and print each reward."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import anyio
import typer
from rich.console import Console
from rich.table import Table

from backends.relay import Relay
from backends.relay.scripted import ScriptedPolicy
from backends.relayed import TRACE_FIELD, RelayedBackend
from backends.rollout.artifacts import default_rollout_root
from backends.rollout.backend import ExecutionBackend
from backends.rollout.batch import run_batch
from backends.rollout.dataset import DatasetError, requests_from_dataset
from backends.rollout.loading import EntrypointError, load_object
from backends.rollout.request import RolloutResult
from backends.trajectory import save_trajectory

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
    options = _Options(
        dataset=dataset,
        policy_url=policy_url,
        policy_key=policy_key,
        samples=samples,
        max_in_flight=max_in_flight,
        agent_timeout=agent_timeout,
        grader_timeout=grader_timeout,
        output=output,
        token_ids=token_ids if token_ids is not None else policy_url is None,
    )
    try:
        ok = anyio.run(_run, backend, options)
    except DatasetError as exc:
        raise typer.BadParameter(str(exc), param_hint="--dataset") from None
    raise typer.Exit(0 if ok else 1)


@dataclass(frozen=True)
class _Options:
    dataset: Path
    policy_url: str | None
    policy_key: str | None
    samples: int
    max_in_flight: int
    agent_timeout: float | None
    grader_timeout: float | None
    output: Path | None
    token_ids: bool


async def _run(backend: ExecutionBackend, options: _Options) -> bool:
    requests = requests_from_dataset(
        options.dataset,
        n_samples=options.samples,
        agent_timeout_sec=options.agent_timeout,
        grader_timeout_sec=options.grader_timeout,
    )
    trajectories = getattr(backend, "artifacts_root", None) or default_rollout_root()
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
        label = "scripted policy (no model)" if scripted else base_url
        console.print(f"[bold]{len(requests)}[/] rollouts from {options.dataset} against {label}")
        relayed = RelayedBackend(backend, relay)
        results: list[RolloutResult] = []
        sink = options.output.open("w", encoding="utf-8") if options.output else None
        try:
            async with run_batch(relayed, requests, max_in_flight=options.max_in_flight) as stream:
                async for result in stream:
                    results.append(result)
                    # ATIF trajectory.json beside the artifacts, with the policy's token ids.
                    await anyio.to_thread.run_sync(save_trajectory, trajectories, result)
                    if sink:
                        sink.write(result.model_dump_json() + "\n")
                        sink.flush()
        finally:
            if sink:
                sink.close()
            await backend.aclose()
    console.print(f"trajectories and artifacts: {trajectories}/<rollout id>/")
    _report(results, {r.rollout_id: i for i, r in enumerate(requests)}, scripted)
    return all(r.failure is None for r in results)


@asynccontextmanager
async def _policy(url: str | None) -> AsyncIterator[tuple[str, bool]]:
    """The policy endpoint: the given URL, or the embedded scripted policy for the run."""
    if url:
        yield url, False
        return
    async with ScriptedPolicy() as policy:
        yield policy.base_url, True


def _report(results: list[RolloutResult], order: dict[str, int], scripted: bool) -> None:
    results.sort(key=lambda r: order.get(r.rollout_id, len(order)))
    table = Table(title="rollouts" + (" (policy answers are scripted)" if scripted else ""))
    for column in ("rollout", "status", "reward", "policy calls", "answer", "failure"):
        table.add_column(column)
    calls = 0
    for result in results:
        trace = result.extra_fields.get(TRACE_FIELD) or {}
        n_calls = len(trace.get("calls", []))
        calls += n_calls
        answer = ""
        if result.sample and result.sample.messages:
            answer = str(result.sample.messages[-1].get("content") or "")[:40]
        failure = (
            f"{result.failure.category}: {result.failure.message[:60]}" if result.failure else ""
        )
        reward = "-" if result.reward is None else f"{result.reward:g}"
        table.add_row(result.rollout_id, result.status, reward, str(n_calls), answer, failure)
    console.print(table)
    rewards = [r.reward for r in results if r.reward is not None]
    failures = Counter(str(r.failure.category) for r in results if r.failure)
    mean = sum(rewards) / len(rewards) if rewards else float("nan")
    # One machine-readable summary line, never wrapped.
    print(
        json.dumps(
            {
                "rollouts": len(results),
                "graded": len(rewards),
                "mean_reward": round(mean, 4) if rewards else None,
                "failures": dict(failures),
                "policy_calls": calls,
            }
        )
    )
