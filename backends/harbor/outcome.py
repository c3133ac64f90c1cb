"""One mapping from a Harbor trial's outcome to a rollout's reward or failure.

Harbor records an exception by its class name and classifies it in its error-policy table
(who failed, whether the reward is still a valid measurement). We add where in the trial it
struck (sandbox start, agent setup, agent, verifier) and turn that into our category and phase.
An infrastructure failure is retryable and never becomes a reward.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from harbor.models.trial.error_policy import FailureCause
from harbor.models.trial.result import ExceptionInfo, TimingInfo, TrialResult

from backends.rollout.errors import ErrorCategory, Phase, RolloutFailure

# Our sandbox's own errors, by the class name Harbor records: a provider fault is
# infrastructure; a task the sandbox cannot run (compose, GPUs, an unknown base image)
# is a validation error, the same on every attempt.
_SANDBOX_INFRA = frozenset(
    {"SandboxError", "SandboxStartError", "SandboxNotRunningError", "HostPrerequisiteError"}
)
_SANDBOX_INVALID = frozenset(
    {"UnsupportedTaskError", "ImageError", "BaseImageNotFoundError", "UnsupportedInstructionError"}
)
# A download the sandbox's unpacker refused for what it held (past a size limit, too deep, a
# member through a link): the agent's or the tests' own output, which a fresh sandbox would
# produce again, so never infrastructure.
_REFUSED_DOWNLOAD = re.compile(
    r"^backends\.sandbox\.(unpack\.DownloadTooLargeError|errors\.SandboxPathError):", re.M
)
# A sandbox ended by what ran inside it (its pid 1 exited, the OOM killer): the agent's (or
# the tests') doing, which a fresh sandbox would see again. Never a retried infra failure.
_SANDBOX_ENDED_INSIDE = "SandboxEndedError"
_TIMEOUTS = frozenset({"AgentTimeoutError", "VerifierTimeoutError", "ExecTimeoutError"})

_CAUSE_CATEGORY = {
    FailureCause.SANDBOX_FAILED: ErrorCategory.INFRA_ERROR,
    FailureCause.MODEL_PROVIDER_FAILED: ErrorCategory.POLICY_ERROR,
    FailureCause.HARBOR_FAILED: ErrorCategory.INTERNAL_ERROR,
    FailureCause.VERIFIER_FAILED: ErrorCategory.VERIFIER_ERROR,
    FailureCause.CANCELLED: ErrorCategory.CANCELLED,
    FailureCause.AGENT_EXHAUSTED_BUDGET: ErrorCategory.TIMEOUT,
    FailureCause.AGENT_REFUSED_TASK: ErrorCategory.AGENT_ERROR,
}

REWARD_KEY = "reward"


@dataclass
class TrialOutcome:
    """What a finished trial means for the rollout: a reward, or a failure."""

    reward: float | None = None
    rewards: dict[str, float] = field(default_factory=dict)
    step_rewards: dict[str, dict[str, float]] = field(default_factory=dict)
    failure: RolloutFailure | None = None
    retryable: bool = False
    stage: str | None = None  # where a failure struck: environment, agent_setup, agent, verifier
    exception_type: str | None = None


def _stage(result: TrialResult, info: ExceptionInfo) -> str:
    """The trial stage that was running when ``info`` was raised: the last one started."""
    steps = result.step_results or []
    timings: list[tuple[str, TimingInfo | None]] = [
        ("environment", result.environment_setup),
        ("agent_setup", result.agent_setup),
        ("agent", result.agent_execution),
        ("verifier", result.verifier),
    ]
    for step in steps:
        timings += [("agent", step.agent_execution), ("verifier", step.verifier)]
    started = [
        (timing.started_at, stage)
        for stage, timing in timings
        if timing is not None
        and timing.started_at is not None
        and timing.started_at <= info.occurred_at
    ]
    return max(started, key=lambda pair: pair[0])[1] if started else "environment"


_STAGE_PHASE = {
    "environment": Phase.SETUP,
    "agent_setup": Phase.SETUP,
    "agent": Phase.AGENT,
    "verifier": Phase.GRADING,
}


def _classify(result: TrialResult, info: ExceptionInfo) -> tuple[RolloutFailure, bool, str]:
    stage = _stage(result, info)
    phase = _STAGE_PHASE[stage]
    name = info.exception_type
    policy = info.policy
    traceback = info.exception_traceback or ""
    if name in _SANDBOX_INVALID:
        category, retry = ErrorCategory.VALIDATION_ERROR, False
    elif name == _SANDBOX_ENDED_INSIDE or _REFUSED_DOWNLOAD.search(traceback):
        category = (
            ErrorCategory.VERIFIER_ERROR if stage == "verifier" else ErrorCategory.AGENT_ERROR
        )
        retry = False
    elif name in _SANDBOX_INFRA or policy.cause is FailureCause.SANDBOX_FAILED:
        category, retry = ErrorCategory.INFRA_ERROR, True
    elif name in _TIMEOUTS:
        category, retry = ErrorCategory.TIMEOUT, False
    elif policy.cause in _CAUSE_CATEGORY:
        category = _CAUSE_CATEGORY[policy.cause]
        retry = False
    elif stage in ("environment", "agent_setup"):
        # Anything else before the agent ran: the machinery failed, a fresh sandbox may not.
        category, retry = ErrorCategory.INFRA_ERROR, True
    elif stage == "verifier":
        category, retry = ErrorCategory.VERIFIER_ERROR, False
    else:
        category, retry = ErrorCategory.AGENT_ERROR, False
    where = {
        "environment": "sandbox start",
        "agent_setup": "agent setup",
        "agent": "agent",
        "verifier": "verifier",
    }[stage]
    message = f"{where}: {name}: {info.exception_message}".rstrip(": ")
    return RolloutFailure(category=category, phase=phase, message=message), retry, stage


def _finite_rewards(raw: dict[str, float | int] | None) -> dict[str, float] | str:
    """The rewards as floats, or what is wrong with them."""
    out: dict[str, float] = {}
    for key, value in (raw or {}).items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"reward {key!r} is {value!r}, not a number"
        if not math.isfinite(value):
            return f"reward {key!r} is {value!r}, not a finite number"
        out[key] = float(value)
    return out


def outcome_of(result: TrialResult, *, verifier_expected: bool = True) -> TrialOutcome:
    """Map a finished trial to its outcome, with Harbor's reward semantics.

    The reward is ``rewards["reward"]`` (or the only named reward); every named reward and
    every step's rewards are kept. An exception whose reward Harbor deems valid (the agent ran
    out of budget or refused, and the verifier still graded) keeps the reward; any other
    exception is a failure. A verifier that produced no reward, or a non-finite one, is a
    verifier error.
    """
    outcome = TrialOutcome()
    for step in result.step_results or []:
        if step.verifier_result is not None and step.verifier_result.rewards:
            rewards = _finite_rewards(step.verifier_result.rewards)
            if isinstance(rewards, dict):
                outcome.step_rewards[step.step_name] = rewards
    exceptions = [
        e
        for e in [result.exception_info, *(s.exception_info for s in result.step_results or [])]
        if e is not None
    ]
    if exceptions and not (result.reward_valid and verifier_expected):
        first = exceptions[0]
        outcome.failure, outcome.retryable, outcome.stage = _classify(result, first)
        outcome.exception_type = first.exception_type
        return outcome
    if exceptions:
        outcome.exception_type = exceptions[0].exception_type
    if not verifier_expected:
        return outcome
    raw = result.verifier_result.rewards if result.verifier_result else None
    rewards = _finite_rewards(raw)
    if isinstance(rewards, str) or not rewards:
        problem = rewards if isinstance(rewards, str) else "the verifier produced no reward"
        outcome.failure = RolloutFailure(
            category=ErrorCategory.VERIFIER_ERROR, phase=Phase.GRADING, message=problem
        )
        outcome.stage = "verifier"
        return outcome
    outcome.rewards = rewards
    if REWARD_KEY in rewards:
        outcome.reward = rewards[REWARD_KEY]
    elif len(rewards) == 1:
        outcome.reward = next(iter(rewards.values()))
    else:
        outcome.failure = RolloutFailure(
            category=ErrorCategory.VERIFIER_ERROR,
            phase=Phase.GRADING,
            message=f"reward.json has no {REWARD_KEY!r} key among {sorted(rewards)}: "
            "name the reward to train on 'reward'",
        )
        outcome.stage = "verifier"
    return outcome
