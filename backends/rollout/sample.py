"""What a rollout produces: the workflow's output and the sample the grader scores."""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

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
    """Messages are not a list of JSON-shaped dicts with a role (a ValueError too, so pydantic
    reports it)."""


# Deeper than this is not a conversation: a hostile row or a cycle's worth of nesting, which
# would exhaust the recursion limit of every JSON encoder downstream.
MAX_JSON_DEPTH = 100
# Python refuses to print an int of more than 4300 digits (sys.int_info); stay below it.
_MAX_INT_BITS = 14_000


def json_problem(value: Any, where: str, *, strict_text: bool = False) -> str | None:
    """Why ``value`` cannot be saved or sent as JSON, naming the path (``where.a[2].b``), or
    ``None``. JSON here means dicts with string keys, lists, strings, finite numbers, booleans
    and ``None``. ``strict_text`` also refuses lone surrogates (which have no UTF-8 form).
    """
    found = _problem(value, 0, strict_text)
    if found is None:
        return None
    path, message = found
    text = where + "".join(reversed(path))
    if len(text) > 120:  # a path 100 levels deep says no more than its two ends
        text = f"{text[:60]}...{text[-40:]}"
    return f"{text}: {message}"


def _problem(value: Any, depth: int, strict_text: bool) -> tuple[list[str], str] | None:
    # Recursive (depth is bounded); the path is built only on the way out of an error. Exact
    # types first: this runs on every message of every rollout.
    kind = type(value)
    if kind is str or (kind not in _LEAF_KINDS and isinstance(value, str)):
        if strict_text and _LONE_SURROGATE.search(value):
            return [], "text with a lone surrogate (not encodable as UTF-8)"
        return None
    if kind is dict or kind is list or kind is tuple:
        pass
    elif value is None or kind is bool or isinstance(value, bool):
        return None
    elif isinstance(value, int):
        return None if value.bit_length() <= _MAX_INT_BITS else ([], "integer too large")
    elif isinstance(value, float):
        return None if math.isfinite(value) else ([], f"{value} is not a finite number")
    elif not isinstance(value, dict | list | tuple):
        return [], f"{kind.__name__} is not JSON (use text, numbers, lists or dicts)"
    if depth >= MAX_JSON_DEPTH:
        return [], f"nested deeper than {MAX_JSON_DEPTH} levels"
    depth += 1
    if isinstance(value, dict):
        for key, item in value.items():
            if type(key) is not str and not isinstance(key, str):
                return [], f"key {key!r} is not a string"
            if type(item) is str and not strict_text:
                continue  # the common case, without a call
            if found := _problem(item, depth, strict_text):
                found[0].append(f".{key}")
                return found
        return None
    for i, item in enumerate(value):
        if found := _problem(item, depth, strict_text):
            found[0].append(f"[{i}]")
            return found
    return None


_LEAF_KINDS = frozenset({dict, list, tuple, int, float, bool, type(None)})


def validation_summary(exc: ValidationError) -> str:
    """The first problem pydantic found, in one line (its full text repeats the input)."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    if not errors:
        return str(exc)
    first = errors[0]
    where = ".".join(str(part) for part in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    # The message often names the path itself (messages[1].content: ...).
    return (message if message.startswith(where) else f"{where}: {message}") + more


def check_json[T](value: T, where: str) -> T:
    """``value`` if it is JSON (see ``json_problem``), else ``MessageFormatError`` naming the path."""
    if problem := json_problem(value, where):
        raise MessageFormatError(problem)
    return value


def check_messages(messages: Any, what: str = "messages") -> list[MessageDict]:
    """Return ``messages`` as a list of dicts, or raise ``MessageFormatError`` naming the problem:
    a message that is not a dict, has no role, or holds something JSON cannot carry (content,
    tool calls and every other field), so no serialization error can happen later."""
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
        out.append(check_json(dict(message), f"{what}[{i}]"))
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

    @field_validator("info")
    @classmethod
    def _info_is_json(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_json(value, "info")


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

    @field_validator("extra_fields")
    @classmethod
    def _extra_fields_are_json(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_json(value, "extra_fields")

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
    """What is wrong with the sample's reward, metrics, messages or extra fields, or ``None``.

    Checked when the result is built: ``sample.metrics[...] = nan`` or
    ``sample.messages[-1]["content"] = b"..."`` mutates in place, which no validator sees.
    """
    if sample.reward is not None:
        try:
            check_reward(sample.reward)
        except (TypeError, ValueError) as exc:
            return str(exc)
    for key, value in sample.metrics.items():
        if not isinstance(value, int | float) or not math.isfinite(value):
            return f"metrics[{key!r}] must be a finite number, got {value!r}"
    return (
        json_problem(sample.messages, "messages")
        or json_problem(sample.trajectory_messages, "trajectory_messages")
        or json_problem(sample.extra_fields, "extra_fields")
    )
