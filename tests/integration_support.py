"""Run a workflow the way `backends run` does: LocalBackend behind the relay, scripted policy."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from backends import LocalBackend, RolloutRequest, RolloutResult
from backends.relay import Relay, Script, ScriptedPolicy
from backends.relayed import RelayedBackend
from backends.trajectory import save_trajectory

# The scripted policy calls the multiply tool for "multiply A by B", then states the product.
TOOL_SCRIPT = Script.model_validate(
    {
        "name": "tools",
        "rules": [
            {
                "name": "multiply",
                "prompt": r"(?i)multiply (?P<a>-?\d+) (?P<op>\*) (?P<b>-?\d+)",
                "turns": [
                    {"tool_calls": [{"name": "multiply", "arguments": {"a": "{a}", "b": "{b}"}}]},
                    {"content": "{result}"},
                ],
            }
        ],
    }
)


@contextlib.asynccontextmanager
async def relayed_local(
    workflow: Any, grader: Any, tmp_path: Path, script: Script | None = None
) -> AsyncIterator[RelayedBackend]:
    async with (
        ScriptedPolicy(script) as policy,
        Relay(upstream_url=policy.base_url, request_token_ids=True) as relay,
    ):
        backend = LocalBackend(workflow=workflow, grader=grader, artifacts_root=tmp_path)
        yield RelayedBackend(backend, relay)


def request(rid: str, question: str, label: str) -> RolloutRequest:
    return RolloutRequest(
        rollout_id=rid, prompt=[{"role": "user", "content": question}], label=label
    )


def valid_trajectory(root: Path, result: RolloutResult) -> dict[str, Any]:
    """Save the result's ATIF trajectory and check it with Harbor's validator."""
    import json

    path = save_trajectory(root, result)
    assert path is not None
    check = subprocess.run(
        [sys.executable, "-m", "harbor.utils.trajectory_validator", str(path)],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    data: dict[str, Any] = json.loads(path.read_text())
    return data
