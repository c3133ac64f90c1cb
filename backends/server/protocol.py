"""The trainer-facing wire protocol: request and response bodies, headers, status vocabulary.

Field names follow the reference SDK (osmosis-ai 0.3.8) so trainers built for it talk to us
unchanged. Our richer failure (category, phase, message) travels as the extra field
``failure``; ``err_category`` keeps the reference vocabulary, which such trainers parse as an
enum and would reject if it held a category they do not know.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from backends.rollout.errors import ErrorCategory
from backends.rollout.request import (
    RolloutRequest,
    RolloutResult,
    RolloutStatus,
    check_rollout_id,
    check_timeout,
)
from backends.rollout.sample import MessageDict, check_messages

# The reference trainers send this header; ours is accepted as an alias.
LEASE_HEADER = "x-osmosis-rollout-lease"
LEASE_HEADER_ALIAS = "x-backends-rollout-lease"

# Our categories, spelled in the reference's six-value vocabulary for ``err_category``.
WIRE_CATEGORY: dict[ErrorCategory, str | None] = {
    ErrorCategory.AGENT_ERROR: "agent_error",
    ErrorCategory.TIMEOUT: "timeout",
    ErrorCategory.VALIDATION_ERROR: "validation_error",
    ErrorCategory.POLICY_ERROR: "http_error",
    ErrorCategory.INFRA_ERROR: "internal_error",
    ErrorCategory.VERIFIER_ERROR: "agent_error",
    ErrorCategory.CANCELLED: None,
    ErrorCategory.LEASE_EXPIRED: "lease_expired",
    ErrorCategory.INTERNAL_ERROR: "internal_error",
}


class RolloutInitRequest(BaseModel):
    """``POST /rollout``. Unknown fields are ignored so newer trainers still get through.

    Strict: ``"grade": "no"`` is not false, nor ``"5"`` five seconds (422 instead).
    """

    model_config = ConfigDict(extra="ignore", strict=True)

    rollout_id: str
    initial_messages: list[MessageDict]
    chat_completions_url: str
    llm_api_key: str | None = None
    label: str | None = None
    metadata: dict[str, Any] | None = None
    grade: bool = True
    agent_timeout_sec: float | None = None
    grader_timeout_sec: float | None = None
    extra_fields: dict[str, Any] | None = None

    @field_validator("rollout_id")
    @classmethod
    def _id(cls, value: str) -> str:
        return check_rollout_id(value)

    @field_validator("initial_messages", mode="before")
    @classmethod
    def _messages(cls, value: Any) -> Any:
        try:
            return check_messages(value, "initial_messages")
        except TypeError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("llm_api_key")
    @classmethod
    def _key(cls, value: str | None) -> str | None:
        if value is not None and not value:
            raise ValueError("llm_api_key must be non-empty when given")
        return value

    @field_validator("agent_timeout_sec", "grader_timeout_sec")
    @classmethod
    def _timeouts(cls, value: float | None, info: Any) -> float | None:
        return check_timeout(value, info.field_name)

    def to_request(self) -> RolloutRequest:
        # Every field was validated above; constructing skips a second validation pass.
        return RolloutRequest.model_construct(
            rollout_id=self.rollout_id,
            prompt=self.initial_messages,
            label=self.label,
            metadata=self.metadata,
            agent_timeout_sec=self.agent_timeout_sec,
            grader_timeout_sec=self.grader_timeout_sec,
            grade=self.grade,
            chat_completions_url=self.chat_completions_url,
            api_key=self.llm_api_key,
            extra_fields=dict(self.extra_fields or {}),
        )


class CancelRolloutsRequest(BaseModel):
    """``POST /rollout/cancel``: exactly one of ``ids``, ``prefix`` or ``all: true``.

    Strict: only JSON ``true`` selects everything (``"yes"`` or ``1`` is a 422, not a purge).
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    ids: list[str] | None = None
    prefix: str | None = None
    all: bool = False

    @model_validator(mode="after")
    def _exactly_one(self) -> CancelRolloutsRequest:
        chosen = (self.ids is not None) + (self.prefix is not None) + bool(self.all)
        if chosen != 1:
            raise ValueError("give exactly one of 'ids', 'prefix' or 'all': true")
        if self.prefix is not None and not self.prefix:
            raise ValueError("prefix must be non-empty (use 'all': true to cancel everything)")
        return self


class RolloutInitResponse(BaseModel):
    rollout_id: str
    status: Literal["queued"] = "queued"
    polling_lease_token: str
    result_wait_timeout_sec: float
    polling_lease_timeout_sec: float


class RolloutResultResponse(BaseModel):
    """``GET /rollout/{id}/result``: the final result, or the live status on a poll timeout."""

    model_config = ConfigDict(extra="allow")

    rollout_id: str
    status: RolloutStatus
    sample: dict[str, Any] | None = None
    err_message: str | None = None
    err_category: str | None = None
    failure: dict[str, Any] | None = None


class CancelRolloutsResponse(BaseModel):
    dispositions: dict[str, str] = Field(default_factory=dict)


class ProtocolError(Exception):
    """A request the server refuses: carries the status code and the response body."""

    def __init__(self, status: int, detail: Any, headers: dict[str, str] | None = None):
        super().__init__(detail if isinstance(detail, str) else json.dumps(detail))
        self.status = status
        self.detail = detail
        self.headers = headers or {}


def invalid(loc: list[str | int], msg: str, kind: str = "value_error") -> ProtocolError:
    """A 422 shaped like FastAPI's, so existing trainers parse it: ``loc`` names the field."""
    return ProtocolError(422, [{"loc": ["body", *loc], "msg": msg, "type": kind}])


def from_validation_error(exc: ValidationError) -> ProtocolError:
    detail = [
        {
            "loc": ["body", *err["loc"]],
            "msg": err["msg"].removeprefix("Value error, "),
            "type": err["type"],
        }
        for err in exc.errors(include_url=False, include_input=False, include_context=False)
    ]
    return ProtocolError(422, detail)


def result_body(result: RolloutResult) -> dict[str, Any]:
    """The wire shape of a finished result.

    The reward is nulled unless the rollout succeeded (a failure is never a reward of 0),
    ``trajectory_messages`` is dropped (it is saved as ``trajectory.json`` instead) and
    non-finite metrics are dropped so the body is valid JSON.
    """
    body: dict[str, Any] = {"rollout_id": result.rollout_id, "status": result.status.value}
    sample = result.sample
    if sample is not None:
        body["sample"] = {
            "messages": sample.messages,
            "label": sample.label,
            "reward": result.reward,
            "remove_sample": sample.remove_sample,
            "metrics": sample.json_safe_metrics(),
            "extra_fields": _json_safe(sample.extra_fields),
        }
    failure = result.failure
    if failure is not None:
        body["err_message"] = failure.message
        body["err_category"] = WIRE_CATEGORY.get(failure.category, "internal_error")
        body["failure"] = {
            "category": failure.category.value,
            "phase": failure.phase.value,
            "message": failure.message,
        }
    return body


def _json_safe(value: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, item in value.items():
        if isinstance(item, float) and not math.isfinite(item):
            continue
        try:
            json.dumps(item)
        except (TypeError, ValueError):
            continue
        out[key] = item
    return out
