"""LocalBackend: return shapes, grading, deadlines, cancellation, the concurrency bound."""

from __future__ import annotations

import asyncio
import math
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from backends import (
    AgentWorkflow,
    AgentWorkflowConfig,
    AgentWorkflowContext,
    AgentWorkflowOutput,
    ConcurrencyConfig,
    ErrorCategory,
    Grader,
    GraderContext,
    LocalBackend,
    Phase,
    RolloutRequest,
    RolloutResult,
    RolloutSample,
    RolloutStatus,
    SampleSource,
    get_rollout_context,
)
from backends.rollout import watchdog
from backends.rollout.backend import CancelDisposition

pytestmark = pytest.mark.anyio

PROMPT = [{"role": "user", "content": "What is 6 * 7?"}]


def request(rid: str = "r1", **kwargs: Any) -> RolloutRequest:
    kwargs.setdefault("prompt", PROMPT)
    kwargs.setdefault("label", "42")
    return RolloutRequest(rollout_id=rid, **kwargs)


def answer(ctx: AgentWorkflowContext[Any], text: str = "42") -> list[dict[str, Any]]:
    return [*ctx.prompt, {"role": "assistant", "content": text}]


class ListWorkflow(AgentWorkflow[AgentWorkflowConfig]):
    async def run(self, ctx: AgentWorkflowContext[AgentWorkflowConfig]) -> Any:
        return answer(ctx)


class OutputWorkflow(AgentWorkflow[AgentWorkflowConfig]):
    async def run(self, ctx: AgentWorkflowContext[AgentWorkflowConfig]) -> Any:
        return AgentWorkflowOutput(
            messages=answer(ctx), metrics={"steps": 1.0}, info={"private_note": 1}
        )


class _History(SampleSource):
    def __init__(self, messages: list[dict[str, Any]]) -> None:
        self.messages = messages

    async def get_sample(self) -> RolloutSample:
        return RolloutSample(messages=self.messages)


class SourceWorkflow(AgentWorkflow[AgentWorkflowConfig]):
    async def run(self, ctx: AgentWorkflowContext[AgentWorkflowConfig]) -> None:
        context = get_rollout_context()
        assert context is not None
        context.set_sample_source(_History(answer(ctx)))


class NoneWithoutSource(AgentWorkflow[AgentWorkflowConfig]):
    async def run(self, ctx: AgentWorkflowContext[AgentWorkflowConfig]) -> None:
        return None


class ExactMatch(Grader):
    seen: list[GraderContext] = []

    async def grade(self, ctx: GraderContext) -> None:
        ExactMatch.seen.append(ctx)
        assert ctx.sample is not None
        ctx.set_reward(1.0 if ctx.sample.messages[-1]["content"] == ctx.label else 0.0)


async def run_one(backend: LocalBackend, req: RolloutRequest | None = None) -> RolloutResult:
    return await backend.execute(req or request())


@pytest.mark.parametrize("workflow", [ListWorkflow, OutputWorkflow, SourceWorkflow])
async def test_three_return_shapes_become_one_graded_sample(workflow: type, tmp_path: Path) -> None:
    backend = LocalBackend(workflow=workflow, grader=ExactMatch, artifacts_root=tmp_path)
    result = await run_one(backend)
    assert result.status is RolloutStatus.SUCCESS, result.failure
    assert result.reward == 1.0
    assert result.sample is not None
    assert result.sample.messages[-1] == {"role": "assistant", "content": "42"}
    assert result.sample.label == "42"


async def test_output_metrics_kept_and_info_never_reaches_the_grader(tmp_path: Path) -> None:
    ExactMatch.seen.clear()
    backend = LocalBackend(workflow=OutputWorkflow, grader=ExactMatch, artifacts_root=tmp_path)
    result = await run_one(backend)
    assert result.sample is not None and result.sample.metrics == {"steps": 1.0}
    assert result.extra_fields["workflow_info"] == {"private_note": 1}
    grader_ctx = ExactMatch.seen[-1]
    assert grader_ctx.sample is not None
    assert "private_note" not in grader_ctx.sample.model_dump_json()


async def test_none_without_a_source_is_a_clear_validation_error(tmp_path: Path) -> None:
    backend = LocalBackend(workflow=NoneWithoutSource, grader=ExactMatch, artifacts_root=tmp_path)
    result = await run_one(backend)
    assert result.status is RolloutStatus.FAILURE
    assert result.failure is not None
    assert result.failure.category is ErrorCategory.VALIDATION_ERROR
    assert "no sample source" in result.failure.message
    assert result.reward is None


class WrongType(AgentWorkflow[AgentWorkflowConfig]):
    async def run(self, ctx: AgentWorkflowContext[AgentWorkflowConfig]) -> Any:
        return "42"


class NanMetric(AgentWorkflow[AgentWorkflowConfig]):
    async def run(self, ctx: AgentWorkflowContext[AgentWorkflowConfig]) -> Any:
        return AgentWorkflowOutput(messages=answer(ctx), metrics={"score": math.nan})


@pytest.mark.parametrize(
    ("workflow", "category", "text"),
    [
        (WrongType, ErrorCategory.VALIDATION_ERROR, "not str"),
        # Built by the workflow itself, yet bad output, not a crash: named by its field.
        (NanMetric, ErrorCategory.VALIDATION_ERROR, "metrics.score: Input should be a finite"),
    ],
)
async def test_bad_workflow_output_names_the_problem(
    workflow: type, category: ErrorCategory, text: str, tmp_path: Path
) -> None:
    backend = LocalBackend(workflow=workflow, grader=ExactMatch, artifacts_root=tmp_path)
    result = await run_one(backend)
    assert result.failure is not None
    assert result.failure.category is category
    assert text in result.failure.message
    assert result.reward is None


class Raises(AgentWorkflow[AgentWorkflowConfig]):
    async def run(self, ctx: AgentWorkflowContext[AgentWorkflowConfig]) -> Any:
        raise RuntimeError("tool crashed")


async def test_workflow_exception_is_an_agent_error_with_reward_none(tmp_path: Path) -> None:
    backend = LocalBackend(workflow=Raises, grader=ExactMatch, artifacts_root=tmp_path)
    result = await run_one(backend)
    assert result.failure is not None
    assert result.failure.category is ErrorCategory.AGENT_ERROR
    assert result.failure.phase is Phase.AGENT
    assert "tool crashed" in result.failure.message
    assert result.reward is None


class WrongAnswer(AgentWorkflow[AgentWorkflowConfig]):
    async def run(self, ctx: AgentWorkflowContext[AgentWorkflowConfig]) -> Any:
        return answer(ctx, "41")


async def test_a_wrong_answer_is_success_with_reward_zero(tmp_path: Path) -> None:
    backend = LocalBackend(workflow=WrongAnswer, grader=ExactMatch, artifacts_root=tmp_path)
    result = await run_one(backend)
    assert result.status is RolloutStatus.SUCCESS
    assert result.reward == 0.0


class LabelPeeker(AgentWorkflow[AgentWorkflowConfig]):
    async def run(self, ctx: AgentWorkflowContext[AgentWorkflowConfig]) -> Any:
        blob = repr(vars(ctx)) + repr(ctx.prompt) + repr(get_rollout_context())
        return answer(ctx, "leaked" if "SECRET-LABEL" in blob else "clean")


async def test_ground_truth_never_reaches_the_workflow(tmp_path: Path) -> None:
    backend = LocalBackend(workflow=LabelPeeker, grader=ExactMatch, artifacts_root=tmp_path)
    result = await run_one(backend, request(label="SECRET-LABEL"))
    assert result.sample is not None
    assert result.sample.messages[-1]["content"] == "clean"


class ArtifactWriter(AgentWorkflow[AgentWorkflowConfig]):
    async def run(self, ctx: AgentWorkflowContext[AgentWorkflowConfig]) -> Any:
        assert ctx.artifacts_dir is not None
        await anyio.Path(ctx.artifacts_dir / "run.log").write_text("started\n")
        return answer(ctx)


async def test_each_rollout_gets_its_own_artifacts_dir(tmp_path: Path) -> None:
    backend = LocalBackend(workflow=ArtifactWriter, grader=ExactMatch, artifacts_root=tmp_path)
    await run_one(backend, request("a"))
    await run_one(backend, request("b"))
    assert (tmp_path / "a" / "artifacts" / "run.log").read_text() == "started\n"
    assert (tmp_path / "b" / "artifacts" / "run.log").exists()


class NoneDirCheck(AgentWorkflow[AgentWorkflowConfig]):
    async def run(self, ctx: AgentWorkflowContext[AgentWorkflowConfig]) -> Any:
        return answer(ctx, "none" if ctx.artifacts_dir is None else "dir")


async def test_artifacts_dir_is_none_when_it_cannot_be_made(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    backend = LocalBackend(workflow=NoneDirCheck, grader=ExactMatch, artifacts_root=blocker)
    result = await run_one(backend)
    assert result.sample is not None and result.sample.messages[-1]["content"] == "none"


class Counting(AgentWorkflow[AgentWorkflowConfig]):
    instances: list[Counting] = []

    def __init__(self, config: AgentWorkflowConfig | None = None) -> None:
        super().__init__(config)
        Counting.instances.append(self)

    async def run(self, ctx: AgentWorkflowContext[AgentWorkflowConfig]) -> Any:
        assert ctx.config is not None
        ctx.config.calls = getattr(ctx.config, "calls", 0) + 1  # type: ignore[attr-defined]
        return answer(ctx, str(ctx.config.calls))  # type: ignore[attr-defined]


async def test_fresh_workflow_and_config_per_rollout(tmp_path: Path) -> None:
    config = AgentWorkflowConfig(name="count")
    backend = LocalBackend(workflow=Counting, workflow_config=config, artifacts_root=tmp_path)
    results = [await run_one(backend, request(f"r{i}", grade=False)) for i in range(3)]
    assert [r.sample.messages[-1]["content"] for r in results if r.sample] == ["1", "1", "1"]
    assert len({id(w) for w in Counting.instances[-3:]}) == 3
    assert not hasattr(config, "calls")


class Sleeper(AgentWorkflow[AgentWorkflowConfig]):
    running = 0
    peak = 0

    async def run(self, ctx: AgentWorkflowContext[AgentWorkflowConfig]) -> Any:
        Sleeper.running += 1
        Sleeper.peak = max(Sleeper.peak, Sleeper.running)
        try:
            await anyio.sleep(float((ctx.metadata or {}).get("sleep", 0.05)))
        finally:
            Sleeper.running -= 1
        return answer(ctx)


async def test_max_concurrent_bounds_parallel_executions(tmp_path: Path) -> None:
    Sleeper.peak = 0
    config = AgentWorkflowConfig(name="s", concurrency=ConcurrencyConfig(max_concurrent=2))
    backend = LocalBackend(
        workflow=Sleeper, workflow_config=config, grader=ExactMatch, artifacts_root=tmp_path
    )
    results: list[RolloutResult] = []

    async def one(i: int) -> None:
        results.append(await run_one(backend, request(f"r{i}")))

    async with anyio.create_task_group() as tg:
        for i in range(6):
            tg.start_soon(one, i)
    assert Sleeper.peak == 2
    assert all(r.reward == 1.0 for r in results)


async def test_agent_timeout_counts_time_spent_queued(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The loop watchdog gives rollouts back the time a late loop cost them, and a starved
    # host makes the loop late (it once saved "second"): off, so only the queue counts here.
    monkeypatch.setattr(watchdog, "ENABLED", False)
    config = AgentWorkflowConfig(name="s", concurrency=ConcurrencyConfig(max_concurrent=1))
    backend = LocalBackend(
        workflow=Sleeper, workflow_config=config, grader=ExactMatch, artifacts_root=tmp_path
    )
    results: dict[str, RolloutResult] = {}

    async def one(rid: str, sleep: float) -> None:
        req = request(rid, metadata={"sleep": sleep}, agent_timeout_sec=3)
        results[rid] = await backend.execute(req)

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, "first", 2)  # 1 s to spare, for a loaded host (0.1 s was too few)
        await anyio.sleep(0.01)
        # Alone this would finish in 1.5 s, but it waits 2 s for the slot: 3.5 s > 3 s.
        tg.start_soon(one, "second", 1.5)
    assert results["first"].status is RolloutStatus.SUCCESS
    second = results["second"]
    assert second.failure is not None
    assert second.failure.category is ErrorCategory.TIMEOUT
    assert second.reward is None


class BlockingPastDeadline(AgentWorkflow[AgentWorkflowConfig]):
    async def run(self, ctx: AgentWorkflowContext[AgentWorkflowConfig]) -> Any:
        import time

        time.sleep(0.3)  # blocks the loop: the deadline cannot interrupt it
        return answer(ctx)


async def test_result_after_the_deadline_is_still_a_timeout(tmp_path: Path) -> None:
    backend = LocalBackend(
        workflow=BlockingPastDeadline, grader=ExactMatch, artifacts_root=tmp_path
    )
    result = await run_one(backend, request(agent_timeout_sec=0.1))
    assert result.failure is not None and result.failure.category is ErrorCategory.TIMEOUT


class SlowGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        await anyio.sleep(5)
        ctx.set_reward(1.0)


async def test_grader_timeout_is_a_grading_timeout(tmp_path: Path) -> None:
    backend = LocalBackend(workflow=ListWorkflow, grader=SlowGrader, artifacts_root=tmp_path)
    with anyio.fail_after(3):
        result = await run_one(backend, request(grader_timeout_sec=0.1))
    assert result.failure is not None
    assert result.failure.category is ErrorCategory.TIMEOUT
    assert result.failure.phase is Phase.GRADING
    assert result.reward is None
    assert result.sample is not None  # kept for diagnosis


class ForgetfulGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        return None


class NanGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        ctx.set_reward(math.nan)


@pytest.mark.parametrize(
    ("grader", "text"), [(ForgetfulGrader, "set_reward"), (NanGrader, "finite")]
)
async def test_grader_without_a_usable_reward_is_a_verifier_error(
    grader: type, text: str, tmp_path: Path
) -> None:
    backend = LocalBackend(workflow=ListWorkflow, grader=grader, artifacts_root=tmp_path)
    result = await run_one(backend)
    assert result.failure is not None
    assert result.failure.category is ErrorCategory.VERIFIER_ERROR
    assert text in result.failure.message
    assert result.reward is None


async def test_grading_without_grader_or_label_is_a_validation_error(tmp_path: Path) -> None:
    no_grader = LocalBackend(workflow=ListWorkflow, artifacts_root=tmp_path)
    result = await run_one(no_grader)
    assert result.failure is not None
    assert result.failure.category is ErrorCategory.VALIDATION_ERROR
    assert "no grader" in result.failure.message

    graded = LocalBackend(workflow=ListWorkflow, grader=ExactMatch, artifacts_root=tmp_path)
    result = await run_one(graded, request(label=None))
    assert result.failure is not None
    assert result.failure.category is ErrorCategory.VALIDATION_ERROR
    assert "no label" in result.failure.message

    ungraded = await run_one(no_grader, request("u", grade=False))
    assert ungraded.status is RolloutStatus.SUCCESS and ungraded.reward is None


async def test_cancel_stops_a_running_rollout_and_reports_it_cancelled(tmp_path: Path) -> None:
    backend = LocalBackend(workflow=Sleeper, grader=ExactMatch, artifacts_root=tmp_path)
    results: list[RolloutResult] = []

    async def one() -> None:
        results.append(await backend.execute(request("long", metadata={"sleep": 30})))

    with anyio.fail_after(30):  # a hang guard: generous for a loaded host
        async with anyio.create_task_group() as tg:
            tg.start_soon(one)
            while backend.status("long") is not RolloutStatus.RUNNING:
                await anyio.sleep(0.01)
            dispositions = backend.cancel(ids=["long", "missing"])
    assert dispositions == {
        "long": CancelDisposition.CANCELLED_RUNNING,
        "missing": CancelDisposition.NOT_FOUND,
    }
    assert results[0].status is RolloutStatus.CANCELLED
    assert results[0].failure is not None
    assert results[0].failure.category is ErrorCategory.CANCELLED
    assert results[0].reward is None
    assert backend.status("long") is None


async def test_cancel_by_prefix_reaches_queued_rollouts(tmp_path: Path) -> None:
    config = AgentWorkflowConfig(name="s", concurrency=ConcurrencyConfig(max_concurrent=1))
    backend = LocalBackend(
        workflow=Sleeper, workflow_config=config, grader=ExactMatch, artifacts_root=tmp_path
    )
    results: dict[str, RolloutResult] = {}

    async def one(rid: str) -> None:
        results[rid] = await backend.execute(request(rid, metadata={"sleep": 30}))

    with anyio.fail_after(30):  # a hang guard: generous for a loaded host
        async with anyio.create_task_group() as tg:
            for rid in ("job-a", "job-b", "other"):
                tg.start_soon(one, rid)
            while backend.status("job-a") is not RolloutStatus.RUNNING:
                await anyio.sleep(0.01)
            dispositions = backend.cancel(prefix="job-")
            assert dispositions["job-b"] is CancelDisposition.CANCELLED_QUEUED
            while backend.status("other") is not RolloutStatus.RUNNING:  # the slot they freed
                await anyio.sleep(0.01)
            backend.cancel(all=True)
    assert {rid: r.status for rid, r in results.items()} == {
        "job-a": RolloutStatus.CANCELLED,
        "job-b": RolloutStatus.CANCELLED,
        "other": RolloutStatus.CANCELLED,
    }


def test_classes_load_from_strings_and_bad_references_are_named(tmp_path: Path) -> None:
    main = tmp_path / "myroll" / "main.py"
    main.parent.mkdir()
    main.write_text(
        "from backends import AgentWorkflow\n"
        "class W(AgentWorkflow):\n"
        "    async def run(self, ctx):\n"
        "        return []\n"
    )
    backend = LocalBackend(workflow=f"{main}:W", artifacts_root=None)
    assert backend.workflow_cls.__name__ == "W"
    with pytest.raises(ImportError, match="has no attribute 'Missing'"):
        LocalBackend(workflow=f"{main}:Missing")
    with pytest.raises(ImportError, match="no_such_module"):
        LocalBackend(workflow="no_such_module:W")
    with pytest.raises(TypeError, match="subclass of AgentWorkflow"):
        LocalBackend(workflow="backends:Grader")


# -- cancellation that user code never notices, stray CancelledError, sys.exit ------------------


class ThreadWorkflow(AgentWorkflow[AgentWorkflowConfig]):
    async def run(self, ctx: AgentWorkflowContext[AgentWorkflowConfig]) -> Any:
        if (ctx.metadata or {}).get("thread"):
            # A worker thread is not a cancellation point: cancel() cannot stop it.
            await anyio.to_thread.run_sync(time.sleep, 0.3)
        return answer(ctx)


class ThreadGrader(Grader):
    calls = 0

    async def grade(self, ctx: GraderContext) -> None:
        ThreadGrader.calls += 1
        if ctx.metadata and ctx.metadata.get("grader_thread"):
            await anyio.to_thread.run_sync(time.sleep, 0.3)
        ctx.set_reward(1.0)


@pytest.mark.parametrize(
    ("metadata", "status", "phase", "graded"),
    [
        ({"thread": True}, RolloutStatus.RUNNING, Phase.AGENT, 0),
        ({"grader_thread": True}, RolloutStatus.GRADING, Phase.GRADING, 1),
    ],
)
async def test_cancel_holds_even_when_user_code_never_reaches_a_cancellation_point(
    metadata: dict[str, Any], status: RolloutStatus, phase: Phase, graded: int, tmp_path: Path
) -> None:
    ThreadGrader.calls = 0
    backend = LocalBackend(workflow=ThreadWorkflow, grader=ThreadGrader, artifacts_root=tmp_path)
    results: list[RolloutResult] = []

    async def one() -> None:
        results.append(await backend.execute(request("t", metadata=metadata)))

    with anyio.fail_after(30):  # a hang guard: generous for a loaded host
        async with anyio.create_task_group() as tg:
            tg.start_soon(one)
            while backend.status("t") is not status:
                await anyio.sleep(0.01)
            assert backend.cancel(ids=["t"]) == {"t": CancelDisposition.CANCELLED_RUNNING}
    assert results[0].status is RolloutStatus.CANCELLED
    assert results[0].reward is None
    assert results[0].failure is not None and results[0].failure.phase is phase
    assert ThreadGrader.calls == graded  # cancelled before grading: the grader never starts


class StrayCancelWorkflow(AgentWorkflow[AgentWorkflowConfig]):
    async def run(self, ctx: AgentWorkflowContext[AgentWorkflowConfig]) -> Any:
        # Awaiting a future that something else cancelled: nobody cancelled this rollout.
        future = asyncio.get_running_loop().create_future()
        future.cancel()
        await future


class StrayCancelGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        raise asyncio.CancelledError()


class ExitWorkflow(AgentWorkflow[AgentWorkflowConfig]):
    async def run(self, ctx: AgentWorkflowContext[AgentWorkflowConfig]) -> Any:
        sys.exit(3)


class ExitGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        sys.exit("bye")


@pytest.mark.parametrize(
    ("workflow", "grader", "category", "phase", "message"),
    [
        (StrayCancelWorkflow, ExactMatch, ErrorCategory.AGENT_ERROR, Phase.AGENT, "CancelledError"),
        (
            ListWorkflow,
            StrayCancelGrader,
            ErrorCategory.VERIFIER_ERROR,
            Phase.GRADING,
            "CancelledError",
        ),
        (ExitWorkflow, ExactMatch, ErrorCategory.AGENT_ERROR, Phase.AGENT, "sys.exit(3)"),
        (ListWorkflow, ExitGrader, ErrorCategory.VERIFIER_ERROR, Phase.GRADING, "sys.exit('bye')"),
    ],
)
async def test_stray_cancellation_and_sys_exit_are_the_user_codes_failure(
    workflow: type,
    grader: type,
    category: ErrorCategory,
    phase: Phase,
    message: str,
    tmp_path: Path,
) -> None:
    backend = LocalBackend(workflow=workflow, grader=grader, artifacts_root=tmp_path)
    with anyio.fail_after(30):  # a hang guard: generous for a loaded host
        result = await run_one(backend)
    assert result.status is RolloutStatus.FAILURE and result.reward is None
    assert result.failure is not None
    assert (result.failure.category, result.failure.phase) == (category, phase)
    assert message in result.failure.message
    assert backend.status("r1") is None


async def test_caller_cancellation_still_propagates(tmp_path: Path) -> None:
    backend = LocalBackend(workflow=Sleeper, grader=ExactMatch, artifacts_root=tmp_path)
    with anyio.move_on_after(0.05) as scope:
        await backend.execute(request("c", metadata={"sleep": 30}))
    assert scope.cancelled_caught
    assert backend.status("c") is None


class DirectGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        assert ctx.sample is not None and ctx.metadata is not None
        if "metric" in ctx.metadata:
            ctx.sample.metrics["acc"] = ctx.metadata["metric"]  # in place: no validator sees it
            ctx.set_reward(1.0)
        else:
            ctx.sample.reward = ctx.metadata["reward"]


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({"metric": math.nan}, "metrics['acc'] must be a finite number"),
        ({"metric": math.inf}, "metrics['acc'] must be a finite number"),
        ({"metric": "high"}, "metrics['acc'] must be a finite number"),
        ({"reward": True}, "reward must be a number"),
        ({"reward": "1e308"}, "reward must be a number"),
    ],
)
async def test_bad_reward_or_metrics_set_directly_are_a_verifier_error(
    metadata: dict[str, Any], message: str, tmp_path: Path
) -> None:
    backend = LocalBackend(workflow=OutputWorkflow, grader=DirectGrader, artifacts_root=tmp_path)
    result = await run_one(backend, request(metadata=metadata))
    assert result.status is RolloutStatus.FAILURE and result.reward is None
    assert result.failure is not None
    assert result.failure.category is ErrorCategory.VERIFIER_ERROR
    assert result.failure.phase is Phase.GRADING
    assert message in result.failure.message


class _NanMetrics(SampleSource):
    async def get_sample(self) -> RolloutSample:
        sample = RolloutSample(messages=[{"role": "assistant", "content": "42"}])
        sample.metrics["loss"] = math.nan  # in place: no validator sees it
        return sample


class NanMetricsWorkflow(AgentWorkflow[AgentWorkflowConfig]):
    async def run(self, ctx: AgentWorkflowContext[AgentWorkflowConfig]) -> None:
        context = get_rollout_context()
        assert context is not None
        context.set_sample_source(_NanMetrics())


async def test_bad_workflow_metrics_fail_an_ungraded_rollout(tmp_path: Path) -> None:
    backend = LocalBackend(workflow=NanMetricsWorkflow, artifacts_root=tmp_path)
    result = await run_one(backend, request(grade=False))
    assert result.status is RolloutStatus.FAILURE
    assert result.failure is not None
    assert result.failure.category is ErrorCategory.VALIDATION_ERROR
    assert "metrics['loss'] must be a finite number" in result.failure.message
