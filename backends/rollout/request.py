"""One rollout request and its result: the types every backend accepts and returns."""

from __future__ import annotations

import math
import re
from enum import StrEnum
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from backends.rollout.errors import ErrorCategory, Phase, RolloutFailure
from backends.rollout.route import PolicyRoute
from backends.rollout.sample import MessageDict, RolloutSample, check_messages
from backends.rollout.trace import RolloutTrace

# One path segment: usable in URLs and as a directory name, never "." or "..".
ROLLOUT_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,255}$")


def check_rollout_id(value: str) -> str:
    if not isinstance(value, str) or not ROLLOUT_ID_PATTERN.match(value):
        raise ValueError(
            f"rollout id {value!r} must be 1-256 characters of letters, digits, '.', '_', ':' "
            "or '-', starting with a letter or digit (no '/')"
        )
    return value


def check_timeout(value: float | None, what: str) -> float | None:
    if value is None:
        return None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number of seconds >= 0, got {value}")
    return float(value)


class RolloutRequest(BaseModel):
    """Everything a backend needs to run one rollout for one dataset row.

    ``label`` (the ground truth) reaches only the grader. ``chat_completions_url`` and
    ``api_key`` name the policy endpoint the trainer serves for this rollout; sandboxed
    backends hand the agent a relay route instead, never the key itself. ``policy_route`` is
    that route when a relay serves the rollout (set by ``RelayedBackend``, never serialized);
    backends read ``PolicyRoute.of(request)``.
    """

    model_config = ConfigDict(extra="forbid")

    rollout_id: str
    prompt: list[MessageDict]
    label: str | None = None
    metadata: dict[str, Any] | None = None
    agent_timeout_sec: float | None = None
    grader_timeout_sec: float | None = None
    grade: bool = True
    chat_completions_url: str | None = None
    api_key: str | None = None
    extra_fields: dict[str, Any] = Field(default_factory=dict)
    policy_route: PolicyRoute | None = Field(default=None, exclude=True, repr=False)

    @field_validator("rollout_id")
    @classmethod
    def _id(cls, value: str) -> str:
        return check_rollout_id(value)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        return check_messages(value, "prompt")

    @field_validator("agent_timeout_sec", "grader_timeout_sec")
    @classmethod
    def _timeouts(cls, value: float | None, info: Any) -> float | None:
        return check_timeout(value, info.field_name)


class RolloutStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    GRADING = "grading"
    SUCCESS = "success"
    FAILURE = "failure"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in {RolloutStatus.SUCCESS, RolloutStatus.FAILURE, RolloutStatus.CANCELLED}


# Where a result's policy trace sits in its JSON form (``extra_fields``), as it always has.
POLICY_TRACE_FIELD = "policy_trace"


class RolloutResult(BaseModel):
    """The outcome of one rollout.

    ``failure`` says which phase failed and why; a failed or cancelled rollout never carries a
    reward (``reward`` is ``None``, not 0), though its sample may be kept for diagnosis.
    ``policy_trace`` is the relay's record of the rollout's policy calls (relayed rollouts
    only); in the JSON form it sits at ``extra_fields["policy_trace"]``, where files written
    before it was typed have it too.
    """

    rollout_id: str
    status: RolloutStatus
    sample: RolloutSample | None = None
    failure: RolloutFailure | None = None
    timings: dict[str, float] = Field(default_factory=dict)
    extra_fields: dict[str, Any] = Field(default_factory=dict)
    policy_trace: RolloutTrace | None = Field(default=None, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _trace_from_extra_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(extra := data.get("extra_fields"), dict):
            if POLICY_TRACE_FIELD in extra and data.get("policy_trace") is None:
                extra = dict(extra)
                data = {
                    **data,
                    "extra_fields": extra,
                    "policy_trace": extra.pop(POLICY_TRACE_FIELD),
                }
        return data

    @model_serializer(mode="wrap")
    def _trace_into_extra_fields(
        self, handler: SerializerFunctionWrapHandler, info: SerializationInfo
    ) -> Any:
        data = handler(self)
        if self.policy_trace is not None and isinstance(data, dict) and "extra_fields" in data:
            trace = self.policy_trace.model_dump(mode=info.mode)
            data["extra_fields"] = {**data["extra_fields"], POLICY_TRACE_FIELD: trace}
        return data

    @property
    def reward(self) -> float | None:
        if self.status is not RolloutStatus.SUCCESS or self.sample is None:
            return None
        if self.sample.remove_sample:
            return None
        return self.sample.reward

    @property
    def err_category(self) -> ErrorCategory | None:
        return self.failure.category if self.failure else None

    @property
    def err_message(self) -> str | None:
        return self.failure.message if self.failure else None

    @classmethod
    def failed(
        cls,
        rollout_id: str,
        failure: RolloutFailure,
        sample: RolloutSample | None = None,
        **kwargs: Any,
    ) -> RolloutResult:
        status = (
            RolloutStatus.CANCELLED
            if failure.category is ErrorCategory.CANCELLED
            else RolloutStatus.FAILURE
        )
        if sample is not None and sample.reward is not None:
            sample = sample.model_copy(update={"reward": None})
        return cls(rollout_id=rollout_id, status=status, sample=sample, failure=failure, **kwargs)

    @classmethod
    def infra_failure(
        cls, rollout_id: str, message: str, phase: Phase = Phase.SETUP
    ) -> RolloutResult:
        failure = RolloutFailure(category=ErrorCategory.INFRA_ERROR, phase=phase, message=message)
        return cls.failed(rollout_id, failure)
