"""End to end through the command line, the way a user runs the main job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BACKENDS = [sys.executable, "-m", "backends.cli"]


def run_cli(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BACKENDS_HOME": str(home), "COLUMNS": "200"}
    return subprocess.run(
        [*BACKENDS, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_main_job_on_embedded_defaults_prints_rewards(tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    proc = run_cli("run", "-o", str(out), home=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "scripted" in proc.stdout
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    dataset_rows = len((REPO / "tasks/data/arithmetic.jsonl").read_text().splitlines())
    assert summary["rollouts"] == dataset_rows
    assert summary["mean_reward"] == 1.0  # the scripted policy computes arithmetic exactly
    results = [json.loads(line) for line in out.read_text().splitlines()]
    results_by_id = {r["rollout_id"]: r for r in results}
    assert len(results) == dataset_rows
    assert all(r["status"] == "success" and r["sample"]["reward"] == 1.0 for r in results)
    # Each rollout's artifacts landed in its own directory under BACKENDS_HOME.
    replies = list((tmp_path / "rollouts").glob("row-*/artifacts/reply.txt"))
    assert len(replies) == dataset_rows
    # Beside them, an ATIF trajectory that Harbor's validator accepts, whose agent step carries
    # the token ids and logprobs the policy sampled, as the relay recorded them.
    trajectory = tmp_path / "rollouts" / "row-0-0" / "trajectory.json"
    check = subprocess.run(
        [sys.executable, "-m", "harbor.utils.trajectory_validator", str(trajectory)],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    agent_step = next(
        s for s in json.loads(trajectory.read_text())["steps"] if s["source"] == "agent"
    )
    assert agent_step["message"] == results_by_id["row-0-0"]["sample"]["messages"][-1]["content"]
    trace_call = results_by_id["row-0-0"]["extra_fields"]["policy_trace"]["calls"][0]
    assert agent_step["metrics"]["completion_token_ids"] == trace_call["choices"][0]["token_ids"]
    assert len(agent_step["metrics"]["logprobs"]) == len(
        agent_step["metrics"]["completion_token_ids"]
    )


def test_unknown_entrypoint_is_named(tmp_path: Path) -> None:
    proc = run_cli("run", "tasks/rollouts/arithmetic/main.py:nothing_here", home=tmp_path)
    assert proc.returncode == 2
    assert "nothing_here" in proc.stderr


def test_malformed_dataset_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"user_prompt": "ok", "ground_truth": "1"}\n{broken\n')
    proc = run_cli("run", "-d", str(bad), home=tmp_path)
    assert proc.returncode == 2
    assert "bad.jsonl:2: not valid JSON" in proc.stderr
