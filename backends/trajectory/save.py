"""Save a finished rollout's sample as ``<root>/<rollout_id>/trajectory.json``.

Saving is best effort: a sample that cannot be converted, or a disk that refuses the write,
costs the trajectory and a log line, never the result. Secrets are scrubbed with the same
``Redactor`` the live previews use: the rollout's own LLM API key (and any other secret handed
in), plus authorization values, URL credentials and well-known key shapes in any text.
"""

from __future__ import annotations

import asyncio
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
from backends.rollout.request import RolloutResult
from backends.rollout.sample import utf8_json_text
from backends.trajectory.atif import to_trajectory
from backends.trajectory.policy_metrics import agent_step_metrics as policy_step_metrics
from backends.trajectory.redact import Redactor

log = logging.getLogger(__name__)

TRAJECTORY_FILE = "trajectory.json"
# Larger trajectories (a long prompt's token ids) are written compact: indenting millions of
# ids one per line took seconds and tripled the file.
INDENT_BELOW_CHARS = 1_000_000


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
    trace = result.policy_trace
    if agent_step_metrics is None and trace is not None:
        # Relayed rollouts: each agent step gets the token ids and logprobs of its own call.
        agent_step_metrics = policy_step_metrics(
            sample.trajectory_messages, trace.model_dump(mode="json")
        )
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
        path = rollout_dir(root, result.rollout_id) / TRAJECTORY_FILE
        if trajectory is None:
            # No sample this time: a trajectory left by an earlier run would pass for this one's.
            path.unlink(missing_ok=True)
            return None
        doc = Redactor(secrets).value(trajectory.to_json_dict())
        text = json.dumps(doc, ensure_ascii=False, default=str)
        if len(text) < INDENT_BELOW_CHARS:  # indented for reading; json indents only in Python
            text = json.dumps(doc, indent=2, ensure_ascii=False, default=str)
        write_atomic(path, utf8_json_text(text)[1])
        return path
    except Exception as exc:  # best effort by contract: the result matters, the file does not
        log.warning("could not save the trajectory of rollout %s: %s", result.rollout_id, exc)
        return None


class TrajectoryWriter:
    """Saves trajectories from one background thread, so that no result waits for its file.

    At most ``max_pending`` trajectories wait in memory; past that, ``submit`` waits (in the
    event loop, never in a thread) until the writer catches up, so a burst slows the saving of
    files instead of losing them. Call ``submit`` after the result is published: it never
    delays a result. ``close`` saves those still queued, then stops the thread.
    """

    def __init__(self, root: Path | str, *, max_pending: int = 1024) -> None:
        self.root = Path(root)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._max_pending = max_pending
        self._slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.saved = 0

    def start(self) -> None:
        """Start the writer thread; call from the event loop that will submit."""
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._slots = asyncio.Semaphore(self._max_pending)
            self._thread = threading.Thread(target=self._run, name="trajectories", daemon=True)
            self._thread.start()

    async def submit(self, result: RolloutResult, *, secrets: Iterable[str | None] = ()) -> bool:
        """Queue ``result``'s trajectory, waiting for room; ``False`` if it has none."""
        sample = result.sample
        if sample is None or not sample.trajectory_messages:
            return False
        if self._slots is None:
            raise RuntimeError("TrajectoryWriter.start() was not called")
        await self._slots.acquire()
        self._queue.put((result, tuple(secrets)))
        return True

    def close(self, timeout: float | None = None) -> None:
        """Save what is queued (for up to ``timeout`` seconds), then stop. Blocks."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            result, secrets = item
            try:
                if save_trajectory(self.root, result, secrets=secrets) is not None:
                    self.saved += 1
            finally:
                self._release()

    def _release(self) -> None:
        if self._loop is not None and self._slots is not None:
            try:
                self._loop.call_soon_threadsafe(self._slots.release)
            except RuntimeError:  # the loop has closed: nobody is waiting any more
                pass


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
