"""Interrupting `backends run` over HarborBackend leaves no sandbox behind (SIGINT, SIGTERM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from backends import HarborBackend
from backends.sandbox import cgroups
from backends.sandbox.settings import run_dir

pytestmark = pytest.mark.sandbox
ROOT = Path(__file__).resolve().parents[1]

MAIN = """
from harbor_support import Sleeps

from backends import HarborBackend


class SleepsHere(Sleeps):
    script = "nohup sleep {marker} >/dev/null 2>&1 & sleep {marker}"


backend = HarborBackend(
    tasks_dir={tasks!r}, task_mode="dataset", agent=SleepsHere, trials_dir={trials!r},
    artifacts={out!r}, max_concurrent=4,
)
"""


def marked(marker: str) -> list[str]:
    found = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True)
    return found.stdout.split()


def owned_by(pid: int) -> set[str]:
    """Names of the sandboxes (and pool entries) whose owner record names process ``pid``."""
    names = set()
    for folder in run_dir().iterdir() if run_dir().is_dir() else []:
        try:
            if (folder / "owner").read_text().split()[0] == str(pid):
                names.add(folder.name)
        except (OSError, IndexError):
            continue
    return names


def start_batch(tmp_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`backends run` over two tasks whose agent sleeps; returns once both sandboxes run."""
    marker = str(41_000_000 + uuid.uuid4().int % 1_000_000)
    (tmp_path / "main.py").write_text(
        MAIN.format(
            marker=marker,
            tasks=str(ROOT / "tasks" / "harbor"),
            trials=str(tmp_path / "trials"),
            out=str(tmp_path / "out"),
        )
    )
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        '{"metadata": {"harbor_task_id": "workdir-copy"}}\n'
        '{"metadata": {"harbor_task_id": "artifacts"}}\n'
    )
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "BACKENDS_HOME": str(tmp_path)}
    cmd = [sys.executable, "-m", "backends.cli", "run", "main.py:backend", "-d", str(rows)]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 90
    while len(marked(marker)) < 6:  # per sandbox: bash, the daemon and the foreground sleep
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the sandboxes never started: {proc.communicate()[0]!r}")
        time.sleep(0.2)
    busy = [n for n in owned_by(proc.pid) if cgroups.SandboxCgroup(n).members()]
    assert len(busy) == 2, busy  # the checks below see both live sandboxes
    return proc, marker


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_batch_leaves_no_sandbox(tmp_path: Path, signum: signal.Signals) -> None:
    proc, marker = start_batch(tmp_path)
    try:
        proc.send_signal(signum)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert b"2 cancelled" in output, output.decode()
    assert marked(marker) == []
    left = owned_by(proc.pid)
    assert not [n for n in left if cgroups.SandboxCgroup(n).members()]
    assert left == set(), f"sandbox state of the interrupted run is left: {left}"


@pytest.mark.anyio
async def test_a_killed_runs_sandboxes_are_reaped_at_the_next_start(tmp_path: Path) -> None:
    proc, marker = start_batch(tmp_path)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while marked(marker):
        assert time.monotonic() < deadline, "sandboxed processes outlived their orchestrator"
        time.sleep(0.1)
    assert owned_by(proc.pid), "nothing was left to reap"
    await HarborBackend(tasks_dir=ROOT / "tasks" / "harbor", task_mode="dataset").start()
    assert owned_by(proc.pid) == set()
