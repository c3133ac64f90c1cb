"""Killing the orchestrator mid-batch leaks nothing: the next start (or `backends sandbox reap`)
finds and removes every sandbox of the dead run, for local and SkyPilot sandboxes alike."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harbor_support import Sleeps
from host_support import marked
from sky_support import create_calls, fake_sky_server, inject_create_faults

from backends import HarborBackend
from backends.sandbox.runtime import list_sandboxes
from backends.sandbox.settings import run_dir

pytestmark = [pytest.mark.sandbox, pytest.mark.anyio]

TESTS = Path(__file__).parent
TASKS = TESTS.parent / "tasks" / "harbor"
BATCH = ["artifacts", "named-rewards", "failing-tests"]

ORCHESTRATOR = """
import anyio
from harbor.models.trial.config import EnvironmentConfig
from backends import HarborBackend, collect
from backends.harbor import dataset_requests

async def main():
    backend = HarborBackend(tasks_dir={tasks!r}, task_mode="dataset", agent="harbor_support:Sleeps",
                            environment={environment!r}, trials_dir={trials!r}, max_concurrent=3,
                            environment_config=EnvironmentConfig(kwargs={kwargs!r}))
    requests = [r for r in dataset_requests({tasks!r}) if r.metadata["harbor_task_id"] in {batch!r}]
    await collect(backend, requests)

anyio.run(main)
"""


@pytest.fixture(scope="module")
def fake_sky() -> Iterator[dict[str, str]]:
    with fake_sky_server() as env:
        yield env


def _sleepers() -> int:
    return len(marked(Sleeps.marker))


def _cli(*args: str, env: dict[str, str]) -> str:
    res = subprocess.run(
        [sys.executable, "-m", "backends.cli", "sandbox", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


def _kill_mid_batch(
    environment: str, tmp_path: Path, env: dict[str, str], kwargs: dict[str, object] | None = None
) -> int:
    script = ORCHESTRATOR.format(
        tasks=str(TASKS),
        environment=environment,
        trials=str(tmp_path / "trials"),
        batch=BATCH,
        kwargs=kwargs or {},
    )
    path = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    owner = subprocess.Popen(
        [sys.executable, "-c", script],
        env={**os.environ, **env, **Sleeps.env(), "PYTHONPATH": path},
    )
    try:
        deadline = time.monotonic() + 120
        while _sleepers() < 2 * len(BATCH):  # every agent is running: the batch is mid-way
            assert owner.poll() is None, "the orchestrator ended before it was killed"
            assert time.monotonic() < deadline, "the batch's agents never all started"
            time.sleep(0.1)
    finally:
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
    return owner.pid


def _owned_by(pid: int) -> set[str]:
    """Sandboxes whose owner record names ``pid``."""
    owned = set()
    for name, _ in list_sandboxes():
        try:
            if (run_dir() / name / "owner").read_text().split()[0] == str(pid):
                owned.add(name)
        except (OSError, IndexError):
            continue
    return owned


async def test_local_sandboxes_of_a_killed_run_are_reaped_at_the_next_start(
    tmp_path: Path,
) -> None:
    pid = _kill_mid_batch("local", tmp_path, {})
    dead = _owned_by(pid)
    assert len(dead) >= len(BATCH)  # each trial's sandbox (the pool's spares may add more)
    listed = _cli("ls", "-p", "local", env={})
    # (Other processes sharing the cache may reap some first: those still here are listed.)
    assert all(f"{name} │     │ dead" in listed for name in _owned_by(pid)), listed
    # Starting again reaps them (the killed owner's processes died with it).
    await HarborBackend(tasks_dir=TASKS, task_mode="dataset", agent="nop").start()
    assert not _owned_by(pid)
    assert _sleepers() == 0


# Every create of the batch in one call: the killed run's pods are that call's members.
ONE_CREATE = {"batch_window_sec": 5.0, "batch_max_size": len(BATCH)}


@pytest.mark.parametrize("kwargs", [{"batch_max_size": 1}, ONE_CREATE], ids=["alone", "batched"])
async def test_skypilot_sandboxes_of_a_killed_run_are_terminated_at_the_next_start(
    tmp_path: Path, fake_sky: dict[str, str], kwargs: dict[str, object]
) -> None:
    import sky_sandbox

    await inject_create_faults()  # counts from here
    _kill_mid_batch("skypilot", tmp_path, fake_sky, kwargs)
    calls = await create_calls()
    sizes = [len(c["names"]) for c in calls]
    assert sizes == ([len(BATCH)] if kwargs is ONE_CREATE else [1] * len(BATCH)), calls
    # The pods outlived their orchestrator, as on a cluster: still running, listed as dead.
    left = [s.name for s in await sky_sandbox.ls.aio()]
    assert sorted(left) == sorted(n for c in calls for n in c["names"])
    assert _sleepers() >= 2 * len(BATCH)
    listed = _cli("ls", "-p", "skypilot", env=fake_sky)
    assert listed.count(" dead ") == len(BATCH), listed
    await HarborBackend(
        tasks_dir=TASKS, task_mode="dataset", agent="nop", environment="skypilot"
    ).start()
    assert await sky_sandbox.ls.aio() == [] and _sleepers() == 0
    assert "0 sandbox(es) reaped" in _cli("reap", "-p", "skypilot", env=fake_sky)


async def test_reap_by_run_terminates_a_named_runs_sandboxes(
    tmp_path: Path, fake_sky: dict[str, str]
) -> None:
    import sky_sandbox

    from backends.sandbox import skyruns

    boxes = await sky_sandbox.create.aio(
        name="bk-00c0ffee-x", num_sandboxes=2, image="ubuntu:24.04"
    )
    other = await sky_sandbox.create.aio(name="someone-elses", image="ubuntu:24.04")
    try:
        # Not recorded on this host: left alone by default, taken when named.
        assert "0 sandbox(es) reaped" in _cli("reap", "-p", "skypilot", env=fake_sky)
        out = _cli("reap", "-p", "skypilot", "--run", "00c0ffee", env=fake_sky)
        assert sorted(b.name for b in boxes) == sorted(
            line.split()[1] for line in out.splitlines() if line.startswith("reaped ")
        )
        assert [s.name for s in await sky_sandbox.ls.aio()] == [other.name]
        assert skyruns.run_of(other.name) is None
    finally:
        await other.terminate.aio()
