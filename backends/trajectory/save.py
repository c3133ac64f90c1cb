"""Save a finished rollout's sample as ``<root>/<rollout_id>/trajectory.json``.

Saving is best effort: a sample that cannot be converted, or a disk that refuses the write,
costs the trajectory and a log line, never the result. The rollout's own LLM API key (and any
other secret handed in) is replaced wherever it appears; the rest is saved as produced.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import tempfile
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from harbor.models.trajectories import Metrics, Trajectory

from backends.rollout.artifacts import rollout_dir
from backends.rollout.request import POLICY_TRACE_FIELD, RolloutResult
from backends.trajectory.atif import to_trajectory
from backends.trajectory.policy_metrics import agent_step_metrics as policy_step_metrics
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
    trace = result.extra_fields.get(POLICY_TRACE_FIELD)
    if agent_step_metrics is None and isinstance(trace, Mapping):
        # Relayed rollouts: each agent step gets the token ids and logprobs of its own call.
        agent_step_metrics = policy_step_metrics(sample.trajectory_messages, trace)
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


class TrajectoryWriter:
    """Saves trajectories from one background thread, so that no result waits for its file.

    Best effort and bounded: at most ``max_pending`` trajectories wait; past that a new one is
    dropped with a log line (a result is never delayed or changed for a file). ``close`` saves
    those still waiting, then stops the thread. ``submit`` may be called from any thread.
    """

    def __init__(self, root: Path | str, *, max_pending: int = 1024) -> None:
        self.root = Path(root)
        self._queue: queue.Queue[Any] = queue.Queue(max_pending)
        self._thread: threading.Thread | None = None
        self.saved = 0
        self.dropped = 0

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="trajectories", daemon=True)
            self._thread.start()

    def submit(self, result: RolloutResult, *, secrets: Iterable[str | None] = ()) -> bool:
        """Queue ``result``'s trajectory; ``False`` if there is none, or it was dropped."""
        sample = result.sample
        if sample is None or not sample.trajectory_messages:
            return False
        try:
            self._queue.put_nowait((result, tuple(secrets)))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning(
                    "trajectory writer is %d behind: dropped %d trajectories so far (rollout %s)",
                    self._queue.maxsize,
                    self.dropped,
                    result.rollout_id,
                )
            return False
        return True

    def close(self, timeout: float | None = None) -> None:
        """Save what is queued (for up to ``timeout`` seconds), then stop. Blocks."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            result, secrets = item
            if save_trajectory(self.root, result, secrets=secrets) is not None:
                self.saved += 1


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
