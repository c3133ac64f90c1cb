"""Interrupting `backends run` over HarborBackend leaves no sandbox behind (SIGINT, SIGTERM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from host_support import marked, owned_by, running_sandboxes, unique_marker

from backends import HarborBackend

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


def start_batch(tmp_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`backends run` over two tasks whose agent sleeps; returns once both sandboxes run."""
    marker = unique_marker()
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
    busy = running_sandboxes(proc.pid)
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
    assert not running_sandboxes(proc.pid)
    assert left == set(), f"sandbox state of the interrupted run is left: {left}"


@pytest.mark.anyio
async def test_a_killed_runs_sandboxes_are_reaped_at_the_next_start(tmp_path: Path) -> None:
    proc, marker = start_batch(tmp_path)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30  # the spawner's kill is prompt; a loaded host, not always
    while marked(marker):
        assert time.monotonic() < deadline, "sandboxed processes outlived their orchestrator"
        time.sleep(0.1)
    assert owned_by(proc.pid), "nothing was left to reap"
    await HarborBackend(tasks_dir=ROOT / "tasks" / "harbor", task_mode="dataset").start()
    assert owned_by(proc.pid) == set()
