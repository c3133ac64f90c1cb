"""A finished Harbor trial as a ``RolloutSample``: chat messages, reward, metrics.

Messages come from the agent's ATIF trajectory (``agent/trajectory.json``; one per step in
multi-step tasks) when it wrote one; agents that write none (oracle, nop) give the
instruction as the only message.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from harbor.models.trajectories import Step, Trajectory
from harbor.models.trial.paths import TrialPaths
from harbor.models.trial.result import TimingInfo, TrialResult

from backends.harbor.outcome import TrialOutcome
from backends.rollout.sample import MessageDict, RolloutSample

log = logging.getLogger(__name__)

TRAJECTORY_FILE = "trajectory.json"


def _content(message: Any) -> Any:
    if isinstance(message, str):
        return message
    return [part.model_dump(exclude_none=True) for part in message]


def _step_messages(step: Step, *, last: bool = False) -> list[MessageDict]:
    if step.source == "system":
        return [{"role": "system", "content": _content(step.message)}]
    if step.source == "user":
        return [{"role": "user", "content": _content(step.message)}]
    reply: MessageDict = {"role": "assistant", "content": _content(step.message)}
    if step.reasoning_content:
        reply["reasoning_content"] = step.reasoning_content
    if step.tool_calls:
        reply["tool_calls"] = [
            {
                "id": call.tool_call_id,
                "type": "function",
                "function": {"name": call.function_name, "arguments": json.dumps(call.arguments)},
            }
            for call in step.tool_calls
        ]
    messages = [reply]
    # The final step's observation reached no model call: the sample ends with the answer.
    for result in step.observation.results if step.observation and not last else []:
        content = _content(result.content) if result.content is not None else ""
        if result.source_call_id:
            messages.append(
                {"role": "tool", "tool_call_id": result.source_call_id, "content": content}
            )
        else:
            # Agents like terminus-2 feed each observation back as the next user turn.
            messages.append({"role": "user", "content": content})
    return messages


def messages_from_trajectory(trajectory: Trajectory) -> list[MessageDict]:
    """A trajectory's steps as chat messages (copied context, from earlier runs, left out).

    Observations without a tool call id (terminus-2 feeds each one back as the next user
    turn) become user messages; the final step's observation, which no model saw, is left out.
    """
    messages: list[MessageDict] = []
    steps = [step for step in trajectory.steps if not step.is_copied_context]
    for index, step in enumerate(steps):
        messages.extend(_step_messages(step, last=index == len(steps) - 1))
    return messages


def agent_trajectories(trial_dir: Path, step_names: Iterable[str]) -> list[Trajectory]:
    """The agent's trajectories, in step order; one that is missing or invalid is skipped."""
    paths = TrialPaths(trial_dir=trial_dir)
    names = list(step_names)
    candidates = (
        [paths.step_agent_dir(name) / TRAJECTORY_FILE for name in names]
        if names
        else [paths.agent_dir / TRAJECTORY_FILE]
    )
    found = []
    for path in candidates:
        if path.is_symlink() or not path.is_file():
            continue
        try:
            found.append(Trajectory.model_validate_json(path.read_text()))
        except (OSError, ValueError) as exc:
            log.warning("ignoring the agent's trajectory %s: %s", path, exc)
    return found


def _seconds(timing: TimingInfo | None) -> float | None:
    if timing is None or timing.started_at is None or timing.finished_at is None:
        return None
    return (timing.finished_at - timing.started_at).total_seconds()


def _sum(timings: Iterable[TimingInfo | None]) -> float | None:
    values = [s for s in (_seconds(t) for t in timings) if s is not None]
    return sum(values) if values else None


def phase_timings(result: TrialResult) -> dict[str, float]:
    """Harbor's phase durations in seconds: environment, agent setup, agent, verifier, total."""
    steps = result.step_results or []
    values = {
        "environment_setup_sec": _seconds(result.environment_setup),
        "agent_setup_sec": _seconds(result.agent_setup),
        "agent_sec": _seconds(result.agent_execution)
        if not steps
        else _sum(s.agent_execution for s in steps),
        "verifier_sec": _seconds(result.verifier) if not steps else _sum(s.verifier for s in steps),
    }
    if result.started_at and result.finished_at:
        values["trial_sec"] = (result.finished_at - result.started_at).total_seconds()
    return {k: v for k, v in values.items() if v is not None}


def token_metrics(result: TrialResult) -> dict[str, float]:
    n_input, n_cache, n_output, cost = result.compute_token_cost_totals()
    values = {
        "n_input_tokens": n_input,
        "n_cache_tokens": n_cache,
        "n_output_tokens": n_output,
        "cost_usd": cost,
    }
    return {k: float(v) for k, v in values.items() if v is not None}


def reward_metrics(outcome: TrialOutcome) -> dict[str, float]:
    """Named rewards as ``reward.<name>``, each step's as ``step.<step>.<name>``."""
    metrics = {f"reward.{name}": value for name, value in outcome.rewards.items()}
    for step, rewards in outcome.step_rewards.items():
        metrics.update({f"step.{step}.{name}": value for name, value in rewards.items()})
    return metrics


def build_sample(
    result: TrialResult,
    outcome: TrialOutcome,
    trial_dir: Path,
    *,
    instruction: str,
    step_names: Iterable[str] = (),
) -> RolloutSample:
    trajectories = agent_trajectories(trial_dir, step_names)
    messages: list[MessageDict] = []
    for trajectory in trajectories:
        messages.extend(messages_from_trajectory(trajectory))
    if not messages:
        messages = [{"role": "user", "content": instruction}]
    metrics: dict[str, Any] = {
        **{f"harbor.{k}": v for k, v in phase_timings(result).items()},
        **token_metrics(result),
        **reward_metrics(outcome),
    }
    return RolloutSample(messages=messages, reward=outcome.reward, metrics=metrics)
