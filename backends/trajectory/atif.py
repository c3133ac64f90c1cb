"""Chat messages -> an ATIF ``Trajectory``, built with Harbor's own models.

Roles map as ``system``/``developer`` -> system step, ``user`` -> user step, ``assistant`` ->
agent step (text, reasoning, tool calls). ``tool``/``function`` messages become observation
results on the agent step that called them; with no agent step before them they become a
system step. Usage, model names and timestamps appear only when the messages carry them:
nothing is invented. ``agent_step_metrics`` lets a caller that knows more (the relay's trace:
token ids, logprobs) attach metrics to the n-th agent step; they override the message's own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from importlib import metadata as _metadata
from typing import Any

from harbor.models.trajectories import (
    Agent,
    FinalMetrics,
    Metrics,
    Observation,
    ObservationResult,
    Step,
    ToolCall,
    Trajectory,
)

AGENT_NAME = "backends"

try:
    AGENT_VERSION = _metadata.version("backends")
except _metadata.PackageNotFoundError:  # running from a source tree
    AGENT_VERSION = "0.0.0"

_SYSTEM_ROLES = {"system", "developer"}
_TOOL_ROLES = {"tool", "function"}


def to_trajectory(
    messages: Sequence[Mapping[str, Any]],
    *,
    session_id: str | None = None,
    agent_step_metrics: Sequence[Metrics | Mapping[str, Any] | None] | None = None,
    model_name: str | None = None,
    extra: dict[str, Any] | None = None,
) -> Trajectory:
    """Convert ``messages`` (OpenAI chat-completions shaped) to a validated trajectory.

    Raises ``ValueError`` when there are no messages (ATIF needs at least one step) and
    pydantic's ``ValidationError`` if the result breaks the schema.
    """
    if not messages:
        raise ValueError("a trajectory needs at least one message")
    builder = _Builder(list(agent_step_metrics or []))
    for message in messages:
        builder.add(message)
    steps = builder.steps
    models = [s.model_name for s in steps if s.model_name]
    agent = Agent(
        name=AGENT_NAME,
        version=AGENT_VERSION,
        model_name=model_name or (models[0] if models else None),
    )
    return Trajectory(
        session_id=session_id,
        trajectory_id=session_id,
        agent=agent,
        steps=steps,
        final_metrics=_final_metrics(steps),
        extra=extra or None,
    )


class _Builder:
    def __init__(self, agent_step_metrics: list[Metrics | Mapping[str, Any] | None]) -> None:
        self.steps: list[Step] = []
        self.agent_steps = 0
        self.agent_step_metrics = agent_step_metrics

    def add(self, message: Mapping[str, Any]) -> None:
        role = str(message.get("role") or "")
        if role == "assistant":
            self._agent(message)
        elif role in _TOOL_ROLES and self.steps and self.steps[-1].source == "agent":
            self._observation(self.steps[-1], message)
        elif role in _SYSTEM_ROLES or role in _TOOL_ROLES:
            self._plain("system", message, keep_role=role not in {"system"})
        else:
            self._plain("user", message, keep_role=role != "user")

    def _plain(self, source: str, message: Mapping[str, Any], *, keep_role: bool) -> None:
        extra = _leftovers(message, {"role", "content", "timestamp", "created_at"})
        if keep_role:
            extra["original_role"] = message.get("role")
        self.steps.append(
            Step(
                step_id=len(self.steps) + 1,
                timestamp=_timestamp(message),
                source=source,  # type: ignore[arg-type]
                message=text_of(message.get("content")),
                extra=extra or None,
            )
        )

    def _agent(self, message: Mapping[str, Any]) -> None:
        index = self.agent_steps
        self.agent_steps += 1
        calls = [
            _tool_call(call, index, i) for i, call in enumerate(message.get("tool_calls") or [])
        ]
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        known = {
            "role", "content", "tool_calls", "reasoning_content", "reasoning", "model",
            "usage", "timestamp", "created_at",
        }  # fmt: skip
        extra = _leftovers(message, known)
        self.steps.append(
            Step(
                step_id=len(self.steps) + 1,
                timestamp=_timestamp(message),
                source="agent",
                model_name=message.get("model") if isinstance(message.get("model"), str) else None,
                message=text_of(message.get("content")),
                reasoning_content=reasoning if isinstance(reasoning, str) else None,
                tool_calls=calls or None,
                metrics=self._metrics(index, message),
                extra=extra or None,
            )
        )

    def _metrics(self, index: int, message: Mapping[str, Any]) -> Metrics | None:
        given = self.agent_step_metrics[index] if index < len(self.agent_step_metrics) else None
        own = _usage_metrics(message.get("usage"))
        if given is None:
            return own
        given_fields = (
            given.model_dump(exclude_none=True) if isinstance(given, Metrics) else dict(given)
        )
        merged = {**(own.model_dump(exclude_none=True) if own else {}), **given_fields}
        return Metrics(**merged)

    def _observation(self, step: Step, message: Mapping[str, Any]) -> None:
        call_id = message.get("tool_call_id")
        known_ids = {c.tool_call_id for c in step.tool_calls or []}
        extra = _leftovers(message, {"role", "content", "tool_call_id"})
        source_call_id = call_id if isinstance(call_id, str) and call_id in known_ids else None
        if call_id is not None and source_call_id is None:
            extra["tool_call_id"] = call_id  # names no call of this step; kept, not linked
        if message.get("role") == "function":
            extra["original_role"] = "function"
        result = ObservationResult(
            source_call_id=source_call_id,
            content=text_of(message.get("content")),
            extra=extra or None,
        )
        if step.observation is None:
            step.observation = Observation(results=[result])
        else:
            step.observation.results.append(result)


def _tool_call(call: Any, step_index: int, i: int) -> ToolCall:
    call = call if isinstance(call, Mapping) else {"function": {"name": str(call)}}
    function = call.get("function") if isinstance(call.get("function"), Mapping) else {}
    name = function.get("name") or call.get("name") or "unknown"
    arguments = function.get("arguments", call.get("arguments"))
    call_id = call.get("id") or f"call_{step_index + 1}_{i + 1}"
    return ToolCall(
        tool_call_id=str(call_id),
        function_name=str(name),
        arguments=_arguments(arguments),
    )


def _arguments(raw: Any) -> dict[str, Any]:
    if raw is None or raw == "":
        return {}
    if isinstance(raw, Mapping):
        return dict(raw)
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except ValueError:
            return {"_raw": raw}
        return parsed if isinstance(parsed, dict) else {"_value": parsed}
    return {"_value": raw}


def text_of(content: Any) -> str:
    """Flatten chat content to text; parts that are not text are kept as JSON."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") in {
                "text",
                "input_text",
                "output_text",
            }:
                pieces.append(str(part.get("text", "")))
            elif isinstance(part, str):
                pieces.append(part)
            else:
                pieces.append(json.dumps(part, default=str, ensure_ascii=False))
        return "\n".join(pieces)
    return json.dumps(content, default=str, ensure_ascii=False)


def _usage_metrics(usage: Any) -> Metrics | None:
    if not isinstance(usage, Mapping):
        return None
    prompt = _int(usage.get("prompt_tokens", usage.get("input_tokens")))
    completion = _int(usage.get("completion_tokens", usage.get("output_tokens")))
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    cached = _int(details.get("cached_tokens")) if isinstance(details, Mapping) else None
    cost = usage.get("cost_usd", usage.get("cost"))
    cost = float(cost) if isinstance(cost, int | float) and not isinstance(cost, bool) else None
    if prompt is None and completion is None and cached is None and cost is None:
        return None
    return Metrics(
        prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached, cost_usd=cost
    )


def _final_metrics(steps: list[Step]) -> FinalMetrics:
    def total(field: str) -> Any:
        values = [getattr(s.metrics, field) for s in steps if s.metrics is not None]
        values = [v for v in values if v is not None]
        return sum(values) if values else None

    return FinalMetrics(
        total_prompt_tokens=total("prompt_tokens"),
        total_completion_tokens=total("completion_tokens"),
        total_cached_tokens=total("cached_tokens"),
        total_cost_usd=total("cost_usd"),
        total_steps=len(steps),
    )


def _timestamp(message: Mapping[str, Any]) -> str | None:
    value = message.get("timestamp", message.get("created_at"))
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        try:
            return datetime.fromtimestamp(value, UTC).isoformat()
        except (OverflowError, OSError, ValueError):
            return None
    if isinstance(value, str):
        try:
            datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
        return value
    return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _leftovers(message: Mapping[str, Any], known: set[str]) -> dict[str, Any]:
    # Fields ATIF has no place for (a message's "name", provider extras) ride along in extra.
    out: dict[str, Any] = {}
    for key, value in message.items():
        if key in known or value is None:
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            value = repr(value)
        out[str(key)] = value
    return out
