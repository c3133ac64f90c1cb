"""Save a finished rollout's sample as ``<root>/<rollout_id>/trajectory.json``.

Saving is best effort: a sample that cannot be converted, or a disk that refuses the write,
costs the trajectory and a log line, never the result. The rollout's own LLM API key (and any
other secret handed in) is replaced wherever it appears; the rest is saved as produced.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from harbor.models.trajectories import Metrics, Trajectory

from backends.rollout.artifacts import rollout_dir
from backends.rollout.request import RolloutResult
from backends.trajectory.atif import to_trajectory
from backends.trajectory.redact import Redactor

log = logging.getLogger(__name__)

TRAJECTORY_FILE = "trajectory.json"


def trajectory_of(
    result: RolloutResult,
    *,
    agent_step_metrics: Sequence[Metrics | Mapping[str, Any] | None] | None = None,
) -> Trajectory | None:
    """The ATIF document of a result's sample; ``None`` when there is nothing to save.

    A sample whose ``trajectory_messages`` is ``None`` asked for no trajectory.
    """
    sample = result.sample
    if sample is None or not sample.trajectory_messages:
        return None
    extra: dict[str, Any] = {
        "rollout_id": result.rollout_id,
        "status": result.status.value,
        "reward": result.reward,
    }
    if sample.metrics:
        extra["sample_metrics"] = sample.json_safe_metrics()
    if result.failure is not None:
        extra["failure"] = result.failure.model_dump(mode="json")
    return to_trajectory(
        sample.trajectory_messages,
        session_id=result.rollout_id,
        agent_step_metrics=agent_step_metrics,
        extra={"backends": extra},
    )


def save_trajectory(
    root: Path,
    result: RolloutResult,
    *,
    secrets: Iterable[str | None] = (),
    agent_step_metrics: Sequence[Metrics | Mapping[str, Any] | None] | None = None,
) -> Path | None:
    """Write the trajectory; return its path, or ``None`` if skipped or failed. Never raises."""
    try:
        trajectory = trajectory_of(result, agent_step_metrics=agent_step_metrics)
        if trajectory is None:
            return None
        text = json.dumps(trajectory.to_json_dict(), indent=2, ensure_ascii=False, default=str)
        text = Redactor(secrets).secrets_only(text)
        path = rollout_dir(root, result.rollout_id) / TRAJECTORY_FILE
        write_atomic(path, text.encode())
        return path
    except Exception as exc:  # best effort by contract: the result matters, the file does not
        log.warning("could not save the trajectory of rollout %s: %s", result.rollout_id, exc)
        return None


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` so readers see the old file or the new one, never half of either."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with_suppressed_unlink(tmp)
        raise


def with_suppressed_unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
