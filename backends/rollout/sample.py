"""What a rollout produces: the workflow's output and the sample the grader scores."""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MessageDict = dict[str, Any]


def json_copy(value: Any) -> Any:
    """A deep copy of JSON-shaped data (dicts, lists, scalars), several times faster than
    ``copy.deepcopy`` on the hot path; anything else falls back to ``copy.deepcopy``."""
    kind = type(value)
    if kind is dict:
        return {k: json_copy(v) for k, v in value.items()}
    if kind is list:
        return [json_copy(v) for v in value]
    if kind in (str, int, float, bool) or value is None:
        return value
    return copy.deepcopy(value)


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def utf8_json_text(text: str) -> tuple[str, bytes]:
    """JSON text as saved or served, and its UTF-8 bytes; never fails on odd text.

    A lone surrogate (output bytes decoded with surrogateescape, say) has no UTF-8 form, so
    neither files, SQLite nor the wire can take it, and strict JSON parsers refuse its
    ``\\u`` escape: it becomes U+FFFD.
    """
    try:
        return text, text.encode()
    except UnicodeEncodeError:
        text = _LONE_SURROGATE.sub("\ufffd", text)
        return text, text.encode()


class MessageFormatError(TypeError, ValueError):
    """Messages are not a list of dicts with a role (a ValueError too, so pydantic reports it)."""


def check_messages(messages: Any, what: str = "messages") -> list[MessageDict]:
    """Return ``messages`` as a list of dicts, or raise ``MessageFormatError`` naming the problem."""
    if not isinstance(messages, list | tuple):
        raise MessageFormatError(
            f"{what} must be a list of message dicts, got {type(messages).__name__}"
        )
    out: list[MessageDict] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise MessageFormatError(f"{what}[{i}] must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise MessageFormatError(f"{what}[{i}] has no 'role' string")
        out.append(dict(message))
    return out


class AgentWorkflowOutput(BaseModel):
    """An explicit workflow result: the sample's messages plus finite numeric metrics.

    ``info`` is reserved and never reaches the grader.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    messages: list[MessageDict] | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    info: dict[str, Any] = Field(default_factory=dict)

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_are_dicts(cls, value: Any) -> Any:
        return None if value is None else check_messages(value)


class RolloutSample(BaseModel):
    """The one sample a rollout produces, as the grader and the trainer see it.

    ``trajectory_messages`` defaults to a deep copy of ``messages``; set it explicitly to
    control what is saved as the ATIF trajectory, or to ``None`` to save none.
    """

    model_config = ConfigDict(allow_inf_nan=False, validate_assignment=True)

    messages: list[MessageDict] = Field(default_factory=list)
    trajectory_messages: list[MessageDict] | None = None
    label: str | None = None
    reward: float | None = None
    remove_sample: bool = False
    metrics: dict[str, Any] = Field(default_factory=dict)
    extra_fields: dict[str, Any] = Field(default_factory=dict)

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_are_dicts(cls, value: Any) -> Any:
        return check_messages(value)

    @field_validator("reward", mode="before")
    @classmethod
    def _reward_is_a_number(cls, value: Any) -> Any:
        # Strict: lax mode would turn True into 1.0 and "1e308" into a float.
        if value is None:
            return None
        try:
            return check_reward(value)
        except TypeError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("trajectory_messages", mode="before")
    @classmethod
    def _trajectory_messages_are_dicts(cls, value: Any) -> Any:
        return None if value is None else check_messages(value, "trajectory_messages")

    @model_validator(mode="before")
    @classmethod
    def _default_trajectory(cls, data: Any) -> Any:
        # Unset means "same as messages"; an explicit None means "save no trajectory".
        if isinstance(data, Mapping) and "trajectory_messages" not in data:
            data = dict(data)
            try:
                data["trajectory_messages"] = json_copy(list(data.get("messages") or []))
            except Exception:  # uncopyable framework objects: keep the native sample only
                data["trajectory_messages"] = None
        return data

    def json_safe_metrics(self) -> dict[str, Any]:
        """Metrics with non-finite floats dropped, for the wire and for saved files."""
        return {k: v for k, v in self.metrics.items() if not _non_finite(v)}


def _non_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def check_reward(reward: Any) -> float:
    """A reward must be a finite real number; bools and strings are refused."""
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise TypeError(f"reward must be a number, got {type(reward).__name__}")
    value = float(reward)
    if not math.isfinite(value):
        raise ValueError(f"reward must be finite, got {value}")
    return value


def sample_problem(sample: RolloutSample) -> str | None:
    """What is wrong with the sample's reward or metrics, or ``None``.

    Checked when the result is built: ``sample.metrics[...] = nan`` mutates the dict in place,
    which no validator sees.
    """
    if sample.reward is not None:
        try:
            check_reward(sample.reward)
        except (TypeError, ValueError) as exc:
            return str(exc)
    for key, value in sample.metrics.items():
        if not isinstance(value, int | float) or not math.isfinite(value):
            return f"metrics[{key!r}] must be a finite number, got {value!r}"
    return None
