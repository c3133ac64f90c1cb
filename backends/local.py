"""LocalBackend: run a workflow (and its grader) in this process, one fresh instance per rollout."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from backends.rollout.artifacts import default_rollout_root, make_artifacts_dir
from backends.rollout.backend import CancelDisposition
from backends.rollout.config import AgentWorkflowConfig, GraderConfig
from backends.rollout.context import AgentWorkflowContext, GraderContext, RolloutContext
from backends.rollout.errors import (
    ErrorCategory,
    Phase,
    RolloutFailure,
    RolloutValidationError,
    VerifierError,
    classify,
    must_propagate,
    user_code_failure,
)
from backends.rollout.loading import load_object
from backends.rollout.normalize import sample_from_output
from backends.rollout.request import RolloutRequest, RolloutResult, RolloutStatus
from backends.rollout.sample import RolloutSample, json_copy, sample_problem
from backends.rollout.workflow import AgentWorkflow, Grader


@dataclass
class _InFlight:
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    status: RolloutStatus = RolloutStatus.QUEUED
    context: RolloutContext | None = None  # set while the workflow runs, for live previews


class LocalBackend:
    """Runs ``workflow`` in-process for each request, then ``grader`` when grading is asked.

    Classes and configs may be objects or ``"module:attr"`` / ``"path/main.py:attr"`` strings.
    ``workflow_config.concurrency.max_concurrent`` bounds parallel executions (``None``: no
    bound); the grader runs in the same slot. The agent deadline counts time spent queued.
    Cancellation is cooperative: code that blocks the event loop keeps its slot until it
    yields, and a result that arrives after its deadline is still reported as a timeout.
    """

    def __init__(
        self,
        *,
        workflow: type[AgentWorkflow[Any]] | str,
        workflow_config: AgentWorkflowConfig | str | None = None,
        grader: type[Grader] | str | None = None,
        grader_config: GraderConfig | str | None = None,
        artifacts_root: Path | str | None = "default",
    ) -> None:
        self.workflow_cls = _require_subclass(load_object(workflow), AgentWorkflow, "workflow")
        self.workflow_config = load_object(workflow_config)
        self.grader_cls = (
            _require_subclass(load_object(grader), Grader, "grader") if grader else None
        )
        self.grader_config = load_object(grader_config)
        if artifacts_root == "default":
            artifacts_root = default_rollout_root()
        self.artifacts_root = Path(artifacts_root) if artifacts_root is not None else None
        limit = _max_concurrent(self.workflow_config)
        self._limiter = anyio.CapacityLimiter(limit) if limit else None
        self._in_flight: dict[str, _InFlight] = {}

    # -- the backend contract -------------------------------------------------------------

    async def execute(self, request: RolloutRequest) -> RolloutResult:
        rid = request.rollout_id
        if rid in self._in_flight:
            return RolloutResult.failed(rid, _invalid(f"rollout {rid!r} is already running"))
        entry = _InFlight()
        self._in_flight[rid] = entry
        try:
            with entry.scope:
                result = await self._execute(request, entry)
                # Code that never reaches a cancellation point (a worker thread, no awaits)
                # can finish after cancel() answered "cancelled": that answer must hold.
                if not entry.scope.cancel_called:
                    return result
            return _cancelled(rid, entry)
        finally:
            del self._in_flight[rid]

    def has_capacity(self) -> bool:
        return True

    def status(self, rollout_id: str) -> RolloutStatus | None:
        entry = self._in_flight.get(rollout_id)
        return entry.status if entry else None

    def cancel(
        self, ids: Iterable[str] | None = None, prefix: str | None = None, all: bool = False
    ) -> dict[str, CancelDisposition]:
        if all:
            chosen = list(self._in_flight)
        elif prefix is not None:
            chosen = [rid for rid in self._in_flight if rid.startswith(prefix)]
        else:
            chosen = list(ids or [])
        dispositions: dict[str, CancelDisposition] = {}
        for rid in chosen:
            entry = self._in_flight.get(rid)
            if entry is None:
                dispositions[rid] = CancelDisposition.NOT_FOUND
                continue
            queued = entry.status is RolloutStatus.QUEUED
            entry.scope.cancel()
            dispositions[rid] = (
                CancelDisposition.CANCELLED_QUEUED
                if queued
                else CancelDisposition.CANCELLED_RUNNING
            )
        return dispositions

    def rollout_context(self, rollout_id: str) -> RolloutContext | None:
        """The live context of a running workflow (its sample source), else ``None``."""
        entry = self._in_flight.get(rollout_id)
        return entry.context if entry else None

    def health(self) -> dict[str, Any]:
        running = sum(1 for e in self._in_flight.values() if e.status is not RolloutStatus.QUEUED)
        return {
            "backend": "local",
            "in_flight": len(self._in_flight),
            "running": running,
            "queued": len(self._in_flight) - running,
            "max_concurrent": self._limiter.total_tokens if self._limiter else None,
        }

    async def aclose(self) -> None:
        self.cancel(all=True)

    # -- one rollout -----------------------------------------------------------------------

    async def _execute(self, request: RolloutRequest, entry: _InFlight) -> RolloutResult:
        rid = request.rollout_id
        started = time.monotonic()
        if request.grade:
            problem = self._grading_problem(request)
            if problem:
                return RolloutResult.failed(rid, _invalid(problem))
        agent_deadline = _deadline(started, request.agent_timeout_sec)
        timings: dict[str, float] = {}
        acquired = False
        try:
            with anyio.CancelScope(deadline=agent_deadline) as agent_scope:
                if self._limiter is not None:
                    await self._limiter.acquire()
                    acquired = True
                entry.status = RolloutStatus.RUNNING
                timings["queued_sec"] = time.monotonic() - started
                # Off the event loop: a slow or remote filesystem must not stall other rollouts.
                artifacts_dir = (
                    await anyio.to_thread.run_sync(make_artifacts_dir, self.artifacts_root, rid)
                    if self.artifacts_root is not None
                    else None
                )
                try:
                    sample, info = await self._run_workflow(request, artifacts_dir)
                except BaseException as exc:  # sys.exit or a stray CancelledError too
                    if must_propagate(exc):
                        raise
                    return RolloutResult.failed(
                        rid, user_code_failure(exc, Phase.AGENT), timings=timings
                    )
            timings["agent_sec"] = time.monotonic() - started - timings.get("queued_sec", 0.0)
            if agent_scope.cancelled_caught or time.monotonic() >= agent_deadline:
                return RolloutResult.failed(
                    rid, _timed_out(Phase.AGENT, request.agent_timeout_sec), timings=timings
                )
            extra = {"workflow_info": info} if info else {}
            if entry.scope.cancel_called:  # execute() reports it; do not start the grader
                return _cancelled(rid, entry)
            if request.grade:
                entry.status = RolloutStatus.GRADING
                graded_at = time.monotonic()
                failure = await self._grade(request, sample, artifacts_dir)
                timings["grader_sec"] = time.monotonic() - graded_at
            elif problem := sample_problem(sample):
                failure = classify(RolloutValidationError(problem), Phase.AGENT)
            else:
                failure = None
            if failure is not None:
                return RolloutResult.failed(rid, failure, sample, timings=timings)
            return RolloutResult(
                rollout_id=rid,
                status=RolloutStatus.SUCCESS,
                sample=sample,
                timings=timings,
                extra_fields=extra,
            )
        finally:
            if acquired and self._limiter is not None:
                self._limiter.release()

    async def _run_workflow(
        self, request: RolloutRequest, artifacts_dir: Path | None
    ) -> tuple[RolloutSample, dict]:
        workflow = self.workflow_cls(config=_fresh(self.workflow_config))
        ctx = AgentWorkflowContext(
            prompt=json_copy(request.prompt),
            config=workflow.config,
            metadata=json_copy(request.metadata),
            artifacts_dir=artifacts_dir,
        )
        with RolloutContext(
            chat_completions_url=request.chat_completions_url,
            api_key=request.api_key,
            rollout_id=request.rollout_id,
        ) as rollout_context:
            entry = self._in_flight.get(request.rollout_id)
            if entry is not None:
                entry.context = rollout_context
            output = await workflow.run(ctx)
            return await sample_from_output(output, rollout_context)

    def _grading_problem(self, request: RolloutRequest) -> str | None:
        if self.grader_cls is None:
            return "grading was requested but this backend has no grader (pass grader=...)"
        if request.label is None and request.metadata is None:
            return (
                "grading was requested but the request has no label (ground truth) to grade against"
            )
        return None

    async def _grade(
        self, request: RolloutRequest, sample: RolloutSample, artifacts_dir: Path | None
    ) -> RolloutFailure | None:
        assert self.grader_cls is not None
        sample.label = request.label
        deadline = _deadline(time.monotonic(), request.grader_timeout_sec)
        with anyio.CancelScope(deadline=deadline) as scope:
            try:
                grader = self.grader_cls(config=_fresh(self.grader_config))
                ctx = GraderContext(
                    label=request.label,
                    sample=sample,
                    metadata=json_copy(request.metadata),
                    artifacts_dir=artifacts_dir,
                )
                await grader.grade(ctx)
            except BaseException as exc:  # sys.exit or a stray CancelledError too
                if must_propagate(exc):
                    raise
                return user_code_failure(exc, Phase.GRADING)
        if scope.cancelled_caught or time.monotonic() >= deadline:
            return _timed_out(Phase.GRADING, request.grader_timeout_sec)
        if sample.reward is None and not sample.remove_sample:
            return classify(
                VerifierError("the grader finished without calling ctx.set_reward()"), Phase.GRADING
            )
        # The grader may have set sample.reward or sample.metrics directly, skipping set_reward.
        problem = sample_problem(sample)
        if problem:
            return classify(VerifierError(problem), Phase.GRADING)
        return None


def _require_subclass(obj: Any, base: type, what: str) -> Any:
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise TypeError(f"{what} must be a subclass of {base.__name__}, got {obj!r}")
    return obj


def _max_concurrent(config: Any) -> int | None:
    concurrency = getattr(config, "concurrency", None)
    return getattr(concurrency, "max_concurrent", None)


def _fresh(config: Any) -> Any:
    # Each rollout gets its own copy, so one rollout's mutation cannot leak into the next.
    if config is None:
        return None
    try:
        return copy.deepcopy(config)
    except Exception:
        return config


def _deadline(start: float, timeout: float | None) -> float:
    return math.inf if timeout is None else start + timeout


def _cancelled(rid: str, entry: _InFlight) -> RolloutResult:
    phase = Phase.GRADING if entry.status is RolloutStatus.GRADING else Phase.AGENT
    failure = RolloutFailure(
        category=ErrorCategory.CANCELLED, phase=phase, message="rollout cancelled"
    )
    return RolloutResult.failed(rid, failure)


def _invalid(message: str) -> RolloutFailure:
    return classify(RolloutValidationError(message), Phase.SETUP)


def _timed_out(phase: Phase, timeout: float | None) -> RolloutFailure:
    what = "agent" if phase is Phase.AGENT else "grader"
    return RolloutFailure(
        category=ErrorCategory.TIMEOUT,
        phase=phase,
        message=f"{what} timeout of {timeout}s passed",
    )
