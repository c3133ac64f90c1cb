"""Batches: bounded in flight, results as they finish, one bad rollout never hides the others."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from backends import (
    AgentWorkflow,
    AgentWorkflowContext,
    ErrorCategory,
    Grader,
    GraderContext,
    LocalBackend,
    RolloutRequest,
    RolloutResult,
    RolloutStatus,
    collect,
    run_batch,
)
from backends.rollout.dataset import DatasetError, requests_from_dataset

pytestmark = pytest.mark.anyio


class Echo(AgentWorkflow[Any]):
    running = 0
    peak = 0

    async def run(self, ctx: AgentWorkflowContext[Any]) -> Any:
        meta = ctx.metadata or {}
        Echo.running += 1
        Echo.peak = max(Echo.peak, Echo.running)
        try:
            await anyio.sleep(meta.get("sleep", 0.01))
        finally:
            Echo.running -= 1
        if meta.get("crash"):
            raise RuntimeError("row crashed")
        if meta.get("wrong_type"):
            return 42
        return [*ctx.prompt, {"role": "assistant", "content": meta.get("answer", "ok")}]


class Match(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        assert ctx.sample is not None
        ctx.set_reward(float(ctx.sample.messages[-1]["content"] == ctx.label))


def req(rid: str, **metadata: Any) -> RolloutRequest:
    return RolloutRequest(
        rollout_id=rid,
        prompt=[{"role": "user", "content": "q"}],
        label="ok",
        metadata=metadata or {"answer": "ok"},
    )


async def test_results_arrive_as_they_finish_within_the_bound(tmp_path: Path) -> None:
    Echo.peak = 0
    backend = LocalBackend(workflow=Echo, grader=Match, artifacts_root=tmp_path)
    # Slow by far: on a starved host five 0.01 s rollouts once took longer than 0.3 s.
    requests = [req("slow", sleep=3, answer="ok")] + [req(f"fast{i}") for i in range(5)]
    order: list[str] = []
    async with run_batch(backend, requests, max_in_flight=3) as results:
        async for result in results:
            order.append(result.rollout_id)
    assert sorted(order) == sorted(r.rollout_id for r in requests)
    assert order[-1] == "slow"
    assert Echo.peak == 3


async def test_bad_rows_fail_alone_and_the_rest_finish(tmp_path: Path) -> None:
    backend = LocalBackend(workflow=Echo, grader=Match, artifacts_root=tmp_path)
    requests = [
        req("good1"),
        req("crash", crash=True),
        req("wrong", wrong_type=True),
        req("good2"),
    ]
    results = {r.rollout_id: r for r in await collect(backend, requests, max_in_flight=4)}
    assert results["good1"].reward == 1.0 and results["good2"].reward == 1.0
    assert results["crash"].err_category is ErrorCategory.AGENT_ERROR
    assert results["wrong"].err_category is ErrorCategory.VALIDATION_ERROR
    assert results["crash"].reward is None and results["wrong"].reward is None


class Exploding:
    """A backend that breaks its contract by raising."""

    async def execute(self, request: RolloutRequest) -> RolloutResult:
        if request.rollout_id == "boom":
            raise RuntimeError("backend bug")
        return RolloutResult(rollout_id=request.rollout_id, status=RolloutStatus.SUCCESS)


async def test_a_backend_that_raises_still_yields_one_result_per_request() -> None:
    results = await collect(Exploding(), [req("boom"), req("fine")])  # type: ignore[arg-type]
    by_id = {r.rollout_id: r for r in results}
    assert by_id["boom"].err_category is ErrorCategory.INTERNAL_ERROR
    assert "backend bug" in (by_id["boom"].err_message or "")
    assert by_id["fine"].status is RolloutStatus.SUCCESS


async def test_leaving_early_cancels_the_rest(tmp_path: Path) -> None:
    backend = LocalBackend(workflow=Echo, grader=Match, artifacts_root=tmp_path)
    requests = [req("quick")] + [req(f"slow{i}", sleep=30) for i in range(3)]
    with anyio.fail_after(5):
        async with run_batch(backend, requests, max_in_flight=4) as results:
            first = await results.receive()
    assert first.rollout_id == "quick"
    assert backend.health()["in_flight"] == 0


def test_dataset_rows_become_requests(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    rows = [
        {"system_prompt": "Be brief.", "user_prompt": "2+2?", "ground_truth": 4},
        {"user_prompt": "Capital of France?", "ground_truth": "Paris", "metadata": {"k": 1}},
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    requests = requests_from_dataset(data, n_samples=2, agent_timeout_sec=5)
    assert [r.rollout_id for r in requests] == ["row-0-0", "row-0-1", "row-1-0", "row-1-1"]
    assert requests[0].prompt == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
    ]
    assert requests[0].label == "4"
    assert requests[2].metadata == {"k": 1}
    assert requests[3].extra_fields == {"row_index": 1, "run_index": 1}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"user_prompt": "a"}\nnot json\n', ":2: not valid JSON"),
        ("[1, 2]\n", ":1: a row must be a JSON object"),
        ('{"ground_truth": "x"}\n', ":1: a row needs user_prompt"),
        ('{"user_prompt": "a", "metadata": "nope"}\n', ":1:"),
    ],
)
def test_malformed_dataset_lines_are_named(tmp_path: Path, content: str, message: str) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text(content)
    with pytest.raises(DatasetError, match=message):
        requests_from_dataset(data)


def test_missing_dataset_is_named(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        requests_from_dataset(tmp_path / "nope.jsonl")


class StrayCancel(AgentWorkflow[Any]):
    async def run(self, ctx: AgentWorkflowContext[Any]) -> Any:
        if (ctx.metadata or {}).get("stray"):
            future = asyncio.get_running_loop().create_future()
            future.cancel()
            await future  # a CancelledError that is no cancellation of this rollout
        return [*ctx.prompt, {"role": "assistant", "content": "ok"}]


async def test_a_stray_cancelled_error_never_makes_a_row_vanish(tmp_path: Path) -> None:
    backend = LocalBackend(workflow=StrayCancel, grader=Match, artifacts_root=tmp_path)
    requests = [req("a"), req("stray", stray=True), req("b")]
    with anyio.fail_after(5):
        results = {r.rollout_id: r for r in await collect(backend, requests)}
    assert set(results) == {"a", "stray", "b"}
    assert results["stray"].err_category is ErrorCategory.AGENT_ERROR
    assert results["a"].reward == 1.0 and results["b"].reward == 1.0


class BaseRaising:
    """A backend that breaks its contract with a BaseException."""

    async def execute(self, request: RolloutRequest) -> RolloutResult:
        if request.rollout_id == "cancel":
            raise asyncio.CancelledError()
        if request.rollout_id == "exit":
            sys.exit(1)
        return RolloutResult(rollout_id=request.rollout_id, status=RolloutStatus.SUCCESS)


async def test_a_backend_raising_cancelled_or_exit_still_yields_a_result() -> None:
    with anyio.fail_after(5):
        results = await collect(BaseRaising(), [req("cancel"), req("exit"), req("fine")])  # type: ignore[arg-type]
    by_id = {r.rollout_id: r for r in results}
    assert by_id["cancel"].err_category is ErrorCategory.INTERNAL_ERROR
    assert by_id["exit"].err_category is ErrorCategory.INTERNAL_ERROR
    assert by_id["fine"].status is RolloutStatus.SUCCESS


class Counting(AgentWorkflow[Any]):
    started = 0

    async def run(self, ctx: AgentWorkflowContext[Any]) -> Any:
        Counting.started += 1
        return [*ctx.prompt, {"role": "assistant", "content": "ok"}]


async def test_a_slow_consumer_bounds_pending_work_and_may_leave_early(tmp_path: Path) -> None:
    Counting.started = 0
    backend = LocalBackend(workflow=Counting, grader=Match, artifacts_root=None)
    requests = [req(f"r{i}") for i in range(2000)]
    consumed = 0
    with anyio.fail_after(10):
        async with run_batch(backend, requests, max_in_flight=4) as results:
            async for _ in results:
                consumed += 1
                await anyio.sleep(0.005)  # a slow consumer: writing files, a trainer step
                assert Counting.started <= consumed + 4
                if consumed == 10:
                    break  # leaving early is supported: no BrokenResourceError
    assert backend.health()["in_flight"] == 0


def broken_requests() -> Any:
    for i in range(3):
        yield req(f"ok{i}")
    raise ValueError("bad row 3")


async def test_a_failing_requests_iterable_keeps_started_rollouts_and_raises_unwrapped(
    tmp_path: Path,
) -> None:
    backend = LocalBackend(workflow=Echo, grader=Match, artifacts_root=tmp_path)
    got: list[str] = []
    with anyio.fail_after(5), pytest.raises(ValueError, match="bad row 3"):
        async with run_batch(backend, broken_requests(), max_in_flight=2) as results:
            async for result in results:
                got.append(result.rollout_id)
    assert sorted(got) == ["ok0", "ok1", "ok2"]
    assert backend.health()["in_flight"] == 0


async def test_a_consumer_error_comes_back_unwrapped(tmp_path: Path) -> None:
    backend = LocalBackend(workflow=Echo, grader=Match, artifacts_root=tmp_path)
    with anyio.fail_after(5), pytest.raises(OSError, match="No space"):
        async with run_batch(backend, [req(f"r{i}", sleep=0.01 * i) for i in range(4)]) as results:
            async for _ in results:
                raise OSError(28, "No space left on device")
    assert backend.health()["in_flight"] == 0
