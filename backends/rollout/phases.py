"""One rollout as named phases, top to bottom: admit, provision, run the agent, grade, finalize.

A backend writes a ``RolloutPhases`` subclass (what it does in each phase, made fresh per
rollout) and ``run_phases`` drives it. The driver owns what every backend must get right the
same way: the concurrency slot, the agent and grader deadlines, timings, turning each phase's
exception into the result's failure, the checks on the reward, and a ``finalize`` that runs
whatever happened.

    admit       the request is refused before anything starts (validation error, setup phase)
    [slot]      wait for the backend's concurrency limiter; counted in the agent deadline
    provision   artifacts directory, sandbox...; unknown errors are infra errors (retryable)
    run_agent   the agent produces the sample; unknown errors are agent errors
    grade       (``request.grade`` only) set the reward; unknown errors are verifier errors
    finalize    release what provision made, shielded from cancellation, always
"""

from __future__ import annotations

import logging
import math
import time
from abc import ABC, abstractmethod
from typing import Any

import anyio

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
from backends.rollout.inflight import Tracked
from backends.rollout.request import RolloutRequest, RolloutResult, RolloutStatus
from backends.rollout.route import PolicyRoute
from backends.rollout.sample import RolloutSample, sample_problem
from backends.rollout.watchdog import Watch, watching

log = logging.getLogger(__name__)


class RolloutPhases(ABC):
    """What a backend does in each phase of one rollout. Each hook fails its phase by raising.

    ``route`` is the rollout's policy route (``PolicyRoute.of(request)``); ``extra_fields`` go
    on a successful result.
    """

    # The verifier error of a grade phase that set no reward.
    no_reward_message = "grading finished without a reward"

    def __init__(self, request: RolloutRequest, tracked: Tracked) -> None:
        self.request = request
        self.tracked = tracked
        self.route = PolicyRoute.of(request)
        self.extra_fields: dict[str, Any] = {}

    def admit(self) -> None:
        """Refuse a request this backend cannot run: raise ``RolloutValidationError``."""
        return None  # optional hook

    async def provision(self) -> None:
        """Make what the agent runs in (an artifacts directory, a sandbox)."""
        return None  # optional hook

    @abstractmethod
    async def run_agent(self) -> RolloutSample:
        """Run the agent; return its sample (unscored)."""

    async def grade(self, sample: RolloutSample) -> None:
        """Set ``sample.reward`` (or ``remove_sample``). Called only when ``request.grade``."""
        raise VerifierError(f"{type(self).__name__} cannot grade")

    async def finalize(self) -> None:
        """Release what ``provision`` made. Shielded from cancellation: keep it bounded."""
        return None  # optional hook


async def run_phases(
    phases: RolloutPhases, *, limiter: anyio.CapacityLimiter | None = None
) -> RolloutResult:
    """Drive ``phases`` through one rollout; every outcome is a result (see the module doc).

    Raises only when the caller is cancelled; ``phases.tracked.scope`` (``InFlight.run``)
    turns a ``cancel()`` into a cancelled result. The event-loop watchdog watches it: time
    other rollouts block the loop is added to its deadlines, and a result whose own code
    blocked the loop says so.
    """
    with watching(phases.request.rollout_id) as watch:
        result = await _drive(phases, limiter, watch)
    return watch.annotate(result)


async def _drive(
    phases: RolloutPhases, limiter: anyio.CapacityLimiter | None, watch: Watch
) -> RolloutResult:
    request, tracked = phases.request, phases.tracked
    rid = request.rollout_id
    started = time.monotonic()
    try:
        phases.admit()
    except Exception as exc:
        return RolloutResult.failed(rid, classify(exc, Phase.SETUP))
    agent_deadline = _deadline(started, request.agent_timeout_sec)
    timings: dict[str, float] = {}
    acquired = provisioned = False
    try:
        with watch.deadline(agent_deadline) as agent_scope:
            if limiter is not None:
                await limiter.acquire()
                acquired = True
            tracked.status = RolloutStatus.RUNNING
            timings["queued_sec"] = time.monotonic() - started
            provisioned = True
            try:
                await phases.provision()
            except Exception as exc:
                return RolloutResult.failed(rid, classify(exc, Phase.SETUP), timings=timings)
            timings["setup_sec"] = time.monotonic() - started - timings["queued_sec"]
            try:
                sample = await phases.run_agent()
            except BaseException as exc:  # sys.exit or a stray CancelledError too
                if must_propagate(exc):
                    raise
                return RolloutResult.failed(
                    rid, user_code_failure(exc, Phase.AGENT), timings=timings
                )
        timings["agent_sec"] = time.monotonic() - started - sum(timings.values())
        if agent_scope.cancelled_caught or time.monotonic() >= agent_scope.deadline:
            return RolloutResult.failed(
                rid, _timed_out(Phase.AGENT, request.agent_timeout_sec), timings=timings
            )
        if tracked.cancel_called:  # InFlight.run reports it; do not start grading
            return tracked.cancelled_result()
        if request.grade:
            tracked.status = RolloutStatus.GRADING
            failure = await _grade(phases, sample, timings, watch)
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
            extra_fields=phases.extra_fields,
        )
    finally:
        if provisioned:
            await _finalize(phases)
        if acquired:
            assert limiter is not None
            limiter.release()


async def _grade(
    phases: RolloutPhases, sample: RolloutSample, timings: dict[str, float], watch: Watch
) -> RolloutFailure | None:
    request = phases.request
    sample.label = request.label
    graded_at = time.monotonic()
    deadline = _deadline(graded_at, request.grader_timeout_sec)
    try:
        with watch.deadline(deadline) as scope:
            try:
                await phases.grade(sample)
            except BaseException as exc:  # sys.exit or a stray CancelledError too
                if must_propagate(exc):
                    raise
                return user_code_failure(exc, Phase.GRADING)
    finally:
        timings["grader_sec"] = time.monotonic() - graded_at
    if scope.cancelled_caught or time.monotonic() >= scope.deadline:
        return _timed_out(Phase.GRADING, request.grader_timeout_sec)
    if sample.reward is None and not sample.remove_sample:
        return classify(VerifierError(phases.no_reward_message), Phase.GRADING)
    # The grader may have set sample.reward or sample.metrics directly, skipping set_reward.
    if problem := sample_problem(sample):
        return classify(VerifierError(problem), Phase.GRADING)
    return None


async def _finalize(phases: RolloutPhases) -> None:
    if type(phases).finalize is RolloutPhases.finalize:
        return  # nothing to release: skip the shielded scope (LocalBackend's hot path)
    with anyio.CancelScope(shield=True):
        try:
            await phases.finalize()
        except Exception:
            # The result stands; what finalize could not release is the backend's to report.
            log.exception("finalizing rollout %s failed", phases.request.rollout_id)


def _deadline(start: float, timeout: float | None) -> float:
    return math.inf if timeout is None else start + timeout


def _timed_out(phase: Phase, timeout: float | None) -> RolloutFailure:
    what = "agent" if phase is Phase.AGENT else "grader"
    return RolloutFailure(
        category=ErrorCategory.TIMEOUT,
        phase=phase,
        message=f"{what} timeout of {timeout}s passed",
    )
