"""An ATIF ``trajectory.json`` as steps a page can show: who spoke, what was said, which tools
were called with which arguments, and what each call observed.

The file is parsed with Harbor's own ``Trajectory`` model. One that is too large, not JSON or
not ATIF is described (and its start shown as text) rather than trusted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harbor.models.trajectories import Trajectory
from pydantic import ValidationError

from backends.report.files import read_bounded
from backends.rollout.sample import validation_summary

MAX_TRAJECTORY_BYTES = 64 * 1024 * 1024  # the sandbox download limit for trajectory.json
TEXT_CHARS = 100_000  # of any one message or observation, on the page


@dataclass(frozen=True)
class ToolCallView:
    call_id: str
    name: str
    arguments: str  # JSON, indented


@dataclass(frozen=True)
class ObservationView:
    call_id: str | None
    content: str


@dataclass(frozen=True)
class StepView:
    number: int
    source: str  # system, user, agent
    message: str
    reasoning: str = ""
    model: str = ""
    tool_calls: list[ToolCallView] = field(default_factory=list)
    observations: list[ObservationView] = field(default_factory=list)
    metrics: str = ""  # one line: tokens, token ids, logprobs


@dataclass(frozen=True)
class TrajectoryView:
    steps: list[StepView]
    agent: str = ""
    problem: str | None = None  # why the file could not be shown as steps
    raw: str | None = None  # the start of such a file, as text


def load_trajectory(path: Path) -> TrajectoryView:
    data = read_bounded(path, MAX_TRAJECTORY_BYTES)
    if data is None:
        return TrajectoryView([], problem="trajectory.json is missing, not a file, or over 64 MiB")
    try:
        trajectory = Trajectory.model_validate(json.loads(data))
    except (ValueError, RecursionError) as exc:
        summary = validation_summary(exc) if isinstance(exc, ValidationError) else str(exc)
        raw = data[:TEXT_CHARS].decode("utf-8", errors="replace")
        return TrajectoryView([], problem=f"trajectory.json is not ATIF: {summary}", raw=raw)
    agent = " ".join(p for p in (trajectory.agent.name, trajectory.agent.model_name or "") if p)
    return TrajectoryView([_step(s) for s in trajectory.steps], agent=agent)


def _step(step: Any) -> StepView:
    calls = [
        ToolCallView(
            call_id=c.tool_call_id,
            name=c.function_name,
            arguments=_clip(json.dumps(c.arguments, indent=2, ensure_ascii=False, default=str)),
        )
        for c in step.tool_calls or []
    ]
    observations = [
        ObservationView(call_id=r.source_call_id, content=_clip(_content(r.content)))
        for r in (step.observation.results if step.observation else [])
    ]
    return StepView(
        number=step.step_id,
        source=step.source,
        message=_clip(_content(step.message)),
        reasoning=_clip(step.reasoning_content or ""),
        model=step.model_name or "",
        tool_calls=calls,
        observations=observations,
        metrics=_metrics(step.metrics),
    )


def _content(content: Any) -> str:
    """Text, with each image or audio part named by its path (never loaded)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.type == "text":
            parts.append(part.text or "")
        else:
            where = getattr(part.source, "path", "") if part.source else ""
            parts.append(f"[{part.type}: {where}]")
    return "\n".join(parts)


def _metrics(metrics: Any) -> str:
    if metrics is None:
        return ""
    shown = []
    if metrics.prompt_tokens is not None:
        shown.append(f"{metrics.prompt_tokens} prompt tokens")
    if metrics.completion_tokens is not None:
        shown.append(f"{metrics.completion_tokens} completion tokens")
    if metrics.completion_token_ids:
        shown.append(f"{len(metrics.completion_token_ids)} token ids")
    if metrics.logprobs:
        shown.append(f"{len(metrics.logprobs)} logprobs")
    latency = (metrics.extra or {}).get("latency_s")
    if isinstance(latency, int | float):
        shown.append(f"{latency * 1000:.0f} ms")
    return ", ".join(shown)


def _clip(text: str) -> str:
    if len(text) <= TEXT_CHARS:
        return text
    return text[:TEXT_CHARS] + f"\n[... {len(text) - TEXT_CHARS} more characters]"
