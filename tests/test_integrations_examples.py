"""The integration examples, run the way a user runs them: `backends run` on the scripted policy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli_run import REPO, full_results, run_cli


@pytest.mark.parametrize("example", ["strands-calculator", "openai-agents-calculator"])
def test_example_runs_with_tool_calls_through_the_relay(example: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_cli(
        "run",
        f"tasks/rollouts/{example}/main.py:backend",
        "--backend",
        "local",
        "-d",
        "tasks/data/calculator.jsonl",
        "-o",
        str(out),
        home=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = len((REPO / "tasks/data/calculator.jsonl").read_text().splitlines())
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    # Every row: a tool call, then the answer; both policy calls went through the relay.
    expected = {"rollouts": rows, "graded": rows, "mean_reward": 1.0, "failures": {}}
    assert expected.items() <= summary.items() and summary["policy_calls"] == 2 * rows
    for result in full_results(out):
        calls = result["extra_fields"]["policy_trace"]["calls"]
        assert [c["choices"][0]["finish_reason"] for c in calls] == ["tool_calls", "stop"]
        assert "unrelayed_assistant_turns" not in result["sample"]["extra_fields"]
        trajectory = out / "rollouts" / result["rollout_id"] / "trajectory.json"
        check = subprocess.run(
            [sys.executable, "-m", "harbor.utils.trajectory_validator", str(trajectory)],
            capture_output=True,
            text=True,
        )
        assert check.returncode == 0, check.stdout + check.stderr
        steps = [s for s in json.loads(trajectory.read_text())["steps"] if s["source"] == "agent"]
        assert all(s["metrics"]["completion_token_ids"] for s in steps)
