"""``backends run``: run a rollout over a dataset and print each reward."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Annotated, Any

import anyio
import typer
from rich.console import Console
from rich.table import Table

from backends.relay import Relay
from backends.relayed import TRACE_FIELD, RelayedBackend
from backends.rollout.backend import ExecutionBackend
from backends.rollout.batch import run_batch
from backends.rollout.dataset import DatasetError, requests_from_dataset
from backends.rollout.loading import EntrypointError, load_object
from backends.rollout.request import RolloutResult

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
    try:
        ok = anyio.run(
            _run,
            backend,
            dataset,
            policy_url,
            policy_key,
            samples,
            max_in_flight,
            agent_timeout,
            grader_timeout,
            output,
        )
    except DatasetError as exc:
        raise typer.BadParameter(str(exc), param_hint="--dataset") from None
    raise typer.Exit(0 if ok else 1)


async def _run(
    backend: ExecutionBackend,
    dataset: Path,
    policy_url: str | None,
    policy_key: str | None,
    samples: int,
    max_in_flight: int,
    agent_timeout: float | None,
    grader_timeout: float | None,
    output: Path | None,
) -> bool:
    requests = requests_from_dataset(
        dataset,
        n_samples=samples,
        agent_timeout_sec=agent_timeout,
        grader_timeout_sec=grader_timeout,
    )
    # Every policy call goes through the relay, which holds the endpoint's key and records
    # each call (token ids and logprobs included) against its rollout.
    async with (
        _policy(policy_url) as (base_url, scripted),
        Relay(upstream_url=base_url, upstream_api_key=policy_key) as relay,
    ):
        label = "scripted policy (no model)" if scripted else base_url
        console.print(f"[bold]{len(requests)}[/] rollouts from {dataset} against {label}")
        relayed = RelayedBackend(backend, relay)
        results: list[RolloutResult] = []
        sink = output.open("w", encoding="utf-8") if output else None
        try:
            async with run_batch(relayed, requests, max_in_flight=max_in_flight) as stream:
                async for result in stream:
                    results.append(result)
                    if sink:
                        sink.write(result.model_dump_json() + "\n")
                        sink.flush()
        finally:
            if sink:
                sink.close()
            await backend.aclose()
    _report(results, {r.rollout_id: i for i, r in enumerate(requests)}, scripted)
    return all(r.failure is None for r in results)


class _policy:
    """The policy endpoint: the given URL, or the embedded scripted policy for the run."""

    def __init__(self, url: str | None) -> None:
        self.url = url
        self._scripted: Any = None

    async def __aenter__(self) -> tuple[str, bool]:
        if self.url:
            return self.url, False
        from backends.relay.scripted import ScriptedPolicy

        self._scripted = ScriptedPolicy()
        policy = await self._scripted.__aenter__()
        return policy.base_url, True

    async def __aexit__(self, *exc: Any) -> None:
        if self._scripted is not None:
            await self._scripted.__aexit__(*exc)


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
