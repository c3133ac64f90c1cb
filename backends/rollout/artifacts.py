"""Where a rollout's files live on the host: ``<root>/<rollout_id>/{artifacts/,trajectory.json}``."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from backends.rollout.request import check_rollout_id

log = logging.getLogger(__name__)

ENV_HOME = "BACKENDS_HOME"


def default_rollout_root() -> Path:
    """``$BACKENDS_HOME/rollouts``, by default ``~/.backends/rollouts``."""
    home = os.environ.get(ENV_HOME)
    return (Path(home) if home else Path.home() / ".backends") / "rollouts"


def rollout_dir(root: Path, rollout_id: str) -> Path:
    return root / check_rollout_id(rollout_id)


def make_artifacts_dir(root: Path | None, rollout_id: str) -> Path | None:
    """Create the rollout's artifacts directory, empty; ``None`` when it cannot be made writable.

    A directory left by an earlier run of the same rollout id is removed first: otherwise its
    artifacts and trajectory.json would sit beside this run's results looking current.

    Workflows are told to check for ``None``, so a full or read-only disk costs the
    rollout its artifacts, not its result.
    """
    if root is None:
        return None
    folder = rollout_dir(root, rollout_id)
    path = folder / "artifacts"
    try:
        try:  # two plain mkdirs: the common case, cheaper than makedirs' checks
            os.mkdir(folder)
            os.mkdir(path)
        except FileNotFoundError:  # the root itself is new
            os.makedirs(path, exist_ok=True)
        except FileExistsError:  # a previous run's files: start this run from nothing
            shutil.rmtree(folder)
            os.makedirs(path)
    except OSError as exc:
        log.warning("no artifacts directory for rollout %s: %s", rollout_id, exc)
        return None
    if not os.access(path, os.W_OK | os.X_OK):
        log.warning("no artifacts directory for rollout %s: %s is not writable", rollout_id, path)
        return None
    return path
