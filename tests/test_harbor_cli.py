"""`backends run` over HarborBackend, as a user runs it from the README."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sandbox
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("how", ["entrypoint", "path"])
def test_backends_run_dataset_mode(tmp_path: Path, how: str) -> None:
    env = {**os.environ, "BACKENDS_HOME": str(tmp_path)}
    rows = subprocess.run(
        [sys.executable, "-m", "backends.harbor", str(ROOT / "tasks" / "harbor")],
        capture_output=True, text=True, check=True, env=env,
    ).stdout  # fmt: skip
    picked = [r for r in rows.splitlines() if '"failing-tests"' in r or '"artifacts"' in r]
    (tmp_path / "rows.jsonl").write_text("\n".join(picked) + "\n")
    # A ready HarborBackend from a rollout file, or the same tasks named with -p and -a.
    what = (
        [str(ROOT / "tasks" / "rollouts" / "harbor" / "main.py") + ":dataset"]
        if how == "entrypoint"
        else ["-p", str(ROOT / "tasks" / "harbor"), "-a", "oracle"]
    )
    cmd = [
        sys.executable, "-m", "backends.cli", "run", *what,
        "-d", str(tmp_path / "rows.jsonl"), "-o", str(tmp_path / "run"),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = (tmp_path / "run" / "results.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert sorted((r["task"], r["reward"]) for r in records) == [
        ("artifacts", 1.0),
        ("failing-tests", 0.0),
    ]
    results = [json.loads((tmp_path / "run" / r["result"]).read_text()) for r in records]
    rewards = sorted((r["extra_fields"]["harbor"]["task"], r["sample"]["reward"]) for r in results)
    assert rewards == [("artifacts", 1.0), ("failing-tests", 0.0)]
    # The artifacts land with the run's other files, beside each trajectory.
    rollouts = tmp_path / "run" / "rollouts"
    [arts] = [r for r in results if r["extra_fields"]["harbor"]["task"] == "artifacts"]
    folder = rollouts / arts["rollout_id"]
    assert (folder / "artifacts" / "app" / "report.txt").read_text() == "done\n"
    assert (folder / "trajectory.json").is_file()


def test_one_task_with_attempts_and_the_nop_agent(tmp_path: Path) -> None:
    """`-p TASK -k 2`: the task as it is, twice; `-a nop` fails it both times (reward 0)."""
    env = {**os.environ, "BACKENDS_HOME": str(tmp_path)}
    run_dir = tmp_path / "run"
    for agent, reward in (("oracle", 1.0), ("nop", 0.0)):
        cmd = [
            sys.executable, "-m", "backends.cli", "run", "-p",
            str(ROOT / "tasks" / "harbor" / "named-rewards"), "-a", agent, "-k", "2",
            "-o", str(run_dir / agent),
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        lines = (run_dir / agent / "results.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert sorted((r["row"], r["attempt"]) for r in records) == [(0, 0), (0, 1)]
        assert {(r["task"], r["reward"]) for r in records} == {("named-rewards", reward)}
        assert all(r["metrics"]["reward.style"] == 0.5 for r in records)
        assert any(k.startswith("harbor.") for k in records[0]["timings"])
        metrics = json.loads((run_dir / agent / "metrics.json").read_text())
        assert metrics["pass_at_k"] == {"1": reward, "2": reward}
        assert metrics["groups"][0]["task"] == "named-rewards"
