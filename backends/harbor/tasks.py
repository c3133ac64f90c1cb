"""Which Harbor task a rollout runs, and the instruction its agent reads.

Dataset mode: ``tasks_dir`` holds many tasks and each request names one by
``metadata["harbor_task_id"]``, a path relative to ``tasks_dir``. Template mode: ``tasks_dir`` is
one task and each request's prompt becomes its instruction.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from backends.rollout.errors import RolloutValidationError
from backends.rollout.request import RolloutRequest

TASK_ID_KEY = "harbor_task_id"


def is_task_dir(path: Path) -> bool:
    return (path / "task.toml").is_file()


def has_tests(task_dir: Path) -> bool:
    """Whether the task grades itself: ``tests/test.sh`` at the top or in every step."""
    if (task_dir / "tests" / "test.sh").is_file():
        return True
    steps = task_dir / "steps"
    step_dirs = [d for d in steps.iterdir() if d.is_dir()] if steps.is_dir() else []
    return bool(step_dirs) and all((d / "tests" / "test.sh").is_file() for d in step_dirs)


def resolve_task_id(tasks_dir: Path, task_id: Any) -> Path:
    """The task directory ``task_id`` names inside ``tasks_dir``.

    Raises ``RolloutValidationError`` for anything but a relative path to a task that stays
    inside ``tasks_dir``: absolute paths, ``..``, and symlinks that lead out are refused.
    """
    if not isinstance(task_id, str) or not task_id.strip():
        raise RolloutValidationError(
            f"metadata[{TASK_ID_KEY!r}] must name a task: a non-empty relative path, "
            f"got {task_id!r}"
        )
    relative = PurePosixPath(task_id)
    if relative.is_absolute() or "\\" in task_id or "\0" in task_id:
        raise RolloutValidationError(
            f"metadata[{TASK_ID_KEY!r}]={task_id!r} must be a path relative to the tasks directory"
        )
    if ".." in relative.parts:
        raise RolloutValidationError(f"metadata[{TASK_ID_KEY!r}]={task_id!r} must not contain '..'")
    root = tasks_dir.resolve()
    candidate = root.joinpath(*relative.parts)
    resolved = candidate.resolve()
    if not resolved.is_relative_to(root):
        raise RolloutValidationError(
            f"metadata[{TASK_ID_KEY!r}]={task_id!r} leads outside {tasks_dir} through a symlink"
        )
    if not is_task_dir(resolved):
        raise RolloutValidationError(
            f"metadata[{TASK_ID_KEY!r}]={task_id!r}: {tasks_dir} has no Harbor task there "
            "(no task.toml)"
        )
    return resolved


def discover_tasks(tasks_dir: Path | str) -> list[str]:
    """Every task id under ``tasks_dir`` (directories holding a task.toml), sorted.

    A task's own subdirectories are not searched, and neither are symlinked directories.
    """
    root = Path(tasks_dir).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"tasks directory {tasks_dir} does not exist")
    if is_task_dir(root):
        raise ValueError(
            f"{tasks_dir} is itself one Harbor task: dataset mode needs a directory of tasks "
            "(use task_mode='template' for one task)"
        )
    found: list[str] = []
    pending = [root]
    while pending:
        folder = pending.pop()
        for child in sorted(folder.iterdir()):
            if not child.is_dir() or child.is_symlink() or child.name.startswith("."):
                continue
            if is_task_dir(child):
                found.append(child.relative_to(root).as_posix())
            else:
                pending.append(child)
    return sorted(found)


def _rollout_id(task_id: str, sample: int) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]", "-", task_id).strip("-.") or "task"
    return f"{safe[:200]}-{sample}"


def dataset_requests(
    tasks_dir: Path | str,
    *,
    task_ids: Iterable[str] | None = None,
    n_samples: int = 1,
    agent_timeout_sec: float | None = None,
    grader_timeout_sec: float | None = None,
) -> list[RolloutRequest]:
    """One request per task of ``tasks_dir`` (and per sample), for batches and the CLI.

    Rollout ids are ``<task id>-<sample>`` with ``/`` and other unusual characters as ``-``.
    """
    ids = list(task_ids) if task_ids is not None else discover_tasks(tasks_dir)
    return [
        RolloutRequest(
            rollout_id=_rollout_id(task_id, sample),
            prompt=[],
            metadata={TASK_ID_KEY: task_id},
            agent_timeout_sec=agent_timeout_sec,
            grader_timeout_sec=grader_timeout_sec,
        )
        for task_id in ids
        for sample in range(n_samples)
    ]


def dataset_rows(tasks_dir: Path | str) -> list[str]:
    """JSONL rows (``{"metadata": {"harbor_task_id": ...}}``) for ``backends run -d``."""
    return [
        json.dumps({"metadata": {TASK_ID_KEY: task_id}}) for task_id in discover_tasks(tasks_dir)
    ]


# -- template mode: the prompt as the instruction ---------------------------------------------


def _text(content: Any) -> str:
    """A message's content as text: strings as they are, text parts joined, others named."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = []
        for part in content:
            if isinstance(part, Mapping):
                if isinstance(part.get("text"), str):
                    parts.append(part["text"])
                elif part.get("type"):
                    parts.append(f"[{part['type']} omitted]")
            elif isinstance(part, str):
                parts.append(part)
        return "\n".join(parts)
    return str(content)


def render_instruction(prompt: Sequence[Mapping[str, Any]]) -> str:
    """The request's messages as the instruction text a Harbor agent reads.

    A native agent takes one instruction: the system turns come first, then the user's
    request, as plain text. A lone user message is its text exactly. Conversations with
    earlier assistant or tool turns keep each turn under a heading naming its role, so the
    agent reads who said what (never a JSON dump of the messages).
    """
    roles = [str(m.get("role")) for m in prompt]
    if not prompt:
        return ""
    if set(roles) <= {"system", "developer", "user"} and roles.count("user") <= 1:
        system = [_text(m.get("content")) for m in prompt if m.get("role") != "user"]
        user = [_text(m.get("content")) for m in prompt if m.get("role") == "user"]
        return "\n\n".join(t.strip() for t in [*system, *user] if t.strip())
    sections = []
    for message in prompt:
        role = str(message.get("role", "user")).capitalize()
        sections.append(f"## {role}\n\n{_text(message.get('content')).strip()}")
    return "\n\n".join(sections)
