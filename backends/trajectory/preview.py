"""Live previews: a small, redacted ATIF snapshot of a running rollout's latest steps.

A preview keeps at most the ``max_steps`` most recent steps, renumbered from 1 (each step's
original number is kept in ``extra.original_step_id``), clips long strings and deep or wide
values, drops token ids and logprobs, redacts credentials everywhere (the rollout's API key,
authorization values, URL credentials, sensitive keys), and drops the oldest steps until the
document fits in ``max_bytes``. It is diagnostic only: it never touches the sample.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from harbor.models.trajectories import Trajectory

from backends.rollout.artifacts import rollout_dir
from backends.trajectory.atif import to_trajectory
from backends.trajectory.redact import Redactor, is_sensitive_key
from backends.trajectory.save import write_atomic

PREVIEW_FILE = "preview.json"
PREVIEW_INTERVAL_SEC = 3.0
MAX_PREVIEW_STEPS = 100
MAX_PREVIEW_BYTES = 900 * 1024
MAX_STRING_CHARS = 16_384
MAX_ITEMS = 1_000
MAX_DEPTH = 20
_TOKEN_FIELDS = ("prompt_token_ids", "completion_token_ids", "logprobs")


def build_preview(
    messages: Sequence[Mapping[str, Any]],
    *,
    rollout_id: str,
    secrets: Iterable[str | None] = (),
    status: str | None = None,
    max_steps: int = MAX_PREVIEW_STEPS,
    max_bytes: int = MAX_PREVIEW_BYTES,
) -> dict[str, Any] | None:
    """The preview document for ``messages``, or ``None`` when there is nothing to show."""
    if not messages or max_steps <= 0:
        return None
    trajectory = to_trajectory(messages, session_id=rollout_id)
    redactor = Redactor(secrets)
    all_steps = trajectory.to_json_dict()["steps"]
    steps = [_clean_step(step, redactor) for step in all_steps[-max_steps:]]
    truncated = len(all_steps) > len(steps)
    agent = trajectory.agent
    doc: dict[str, Any] = {
        "schema_version": trajectory.schema_version,
        "session_id": rollout_id,
        "trajectory_id": rollout_id,
        "agent": {"name": agent.name, "version": agent.version}
        | ({"model_name": redactor.text(agent.model_name)} if agent.model_name else {}),
        "steps": [],
        "extra": {
            "backends": {
                "rollout_id": rollout_id,
                "preview": True,
                "status": status,
                "total_steps": len(all_steps),
                "truncated": truncated,
                "updated_at": datetime.now(UTC).isoformat(),
            }
        },
    }
    budget = max_bytes - len(_dumps(doc)) - 16
    sizes = [len(_dumps(step)) + 2 for step in steps]
    # Drop the oldest steps until the rest fit; a lone step too big becomes a placeholder.
    while steps and sum(sizes) > budget:
        steps.pop(0)
        sizes.pop(0)
        doc["extra"]["backends"]["truncated"] = True
    if not steps:
        last = all_steps[-1]
        steps = [
            {
                "step_id": 1,
                "source": "system",
                "message": "[preview omitted: the latest step is larger than the preview limit]",
                "extra": {"original_step_id": last["step_id"], "original_source": last["source"]},
            }
        ]
    for i, step in enumerate(steps, start=1):
        step["step_id"] = i
    doc["steps"] = steps
    Trajectory.model_validate(doc)  # a preview is a valid ATIF document too
    return doc


def write_preview(root: Path, rollout_id: str, doc: Mapping[str, Any]) -> Path:
    """Atomically write ``<root>/<rollout_id>/preview.json``."""
    path = rollout_dir(root, rollout_id) / PREVIEW_FILE
    write_atomic(path, _dumps(doc).encode())
    return path


def _clean_step(step: dict[str, Any], redactor: Redactor) -> dict[str, Any]:
    metrics = step.get("metrics")
    if isinstance(metrics, dict):
        for name in _TOKEN_FIELDS:
            metrics.pop(name, None)
    extra = dict(step.get("extra") or {})
    extra["original_step_id"] = step["step_id"]
    step["extra"] = extra
    cleaned = _clip(step, redactor, 0)
    assert isinstance(cleaned, dict)
    return cleaned


def _clip(value: Any, redactor: Redactor, depth: int) -> Any:
    if isinstance(value, str):
        # Cut first (with a margin, so a secret straddling the final cut is still whole and
        # redacted), then redact: redacting megabytes only to clip them is wasted work.
        text = redactor.text(value[: MAX_STRING_CHARS + 1024])
        if len(value) > MAX_STRING_CHARS:
            cut = len(value) - MAX_STRING_CHARS
            text = text[:MAX_STRING_CHARS] + f"... [{cut} characters clipped]"
        return text
    if depth >= MAX_DEPTH and isinstance(value, dict | list):
        return "[clipped: nested too deep]"
    if isinstance(value, dict):
        items = list(value.items())[:MAX_ITEMS]
        return {
            key: ("[REDACTED]" if _sensitive(key, item) else _clip(item, redactor, depth + 1))
            for key, item in items
        }
    if isinstance(value, list):
        return [_clip(item, redactor, depth + 1) for item in value[:MAX_ITEMS]]
    return value


def _sensitive(key: str, item: Any) -> bool:
    return isinstance(item, str) and bool(item) and is_sensitive_key(key)


def _dumps(doc: Any) -> str:
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":"), default=str)
