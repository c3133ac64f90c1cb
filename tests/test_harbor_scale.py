"""HarborBackend on SkyPilot at volume, over the fake SDK's latency model (nothing executed):
every rollout accounted for, transient create failures retried, and nothing per rollout kept
(loggers, file descriptors, sandboxes) once it is over. tests/benchmarks/bench_scale.py runs
the same path at thousands in flight."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import anyio
import pytest
from sky_support import FAKE

sys.path.insert(0, str(FAKE))
sys.path.insert(0, str(Path(__file__).parent / "benchmarks"))

from bench_scale import write_template
from sky_sandbox import sim

from backends import HarborBackend, RolloutRequest, RolloutStatus, collect
from backends.harbor import trial
from backends.sandbox import skyruns

pytestmark = [pytest.mark.anyio]


def _trial_logs_open() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").endswith("/trial.log")
        except OSError:
            continue
    return count


async def test_many_rollouts_leave_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SKYPILOT_API_SERVER_ENDPOINT", "sim://")
    monkeypatch.setenv("BACKENDS_HOME", str(tmp_path))
    engine = sim.configure(
        sim.LatencyModel(
            create_sec=0.05,
            exec_sec=0.005,
            transfer_sec=0.002,
            create_failure_rate=0.1,
            failing_first_creates=1,  # batched, 80 creates may be a few calls: one fails
        )
    )
    backend = HarborBackend(
        tasks_dir=write_template(tmp_path),
        agent="nop",
        environment="skypilot",
        trials_dir=tmp_path / "trials",
        artifacts=tmp_path / "out",
    )
    await backend.start()
    n = 80
    requests = [
        RolloutRequest(rollout_id=f"r{i}", prompt=[{"role": "user", "content": "Answer."}])
        for i in range(n)
    ]
    loggers = len(logging.Logger.manager.loggerDict)
    retries = skyruns.counters["create_retries"]
    held: list[int] = []

    async def watch() -> None:
        while True:
            held.append(_trial_logs_open())
            await anyio.sleep(0.05)

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        results = await collect(backend, requests, max_in_flight=n)
        tg.cancel_scope.cancel()
    assert sorted(r.rollout_id for r in results) == sorted(r.rollout_id for r in requests)
    for result in results:
        assert result.status is RolloutStatus.SUCCESS, result.failure
        assert result.reward == 1.0  # the modelled verifier's reward file
    # Transient create failures were retried, each counted.
    retried = skyruns.counters["create_retries"] - retries
    assert 0 < retried <= engine.counters.create_failures  # (a create out of tries is not)
    # Per rollout, nothing stays: no pod, no open trial log, (almost) no logger.
    # Many pods at once (trials run concurrently, not one after another); how many at the
    # peak depends on the machine's speed, since trials are built two at a time.
    assert engine.boxes == {} and engine.counters.peak_live > n // 4
    assert max(held) <= trial.BUILDERS.total_tokens  # only while Harbor builds a trial
    assert len(logging.Logger.manager.loggerDict) - loggers < n
    # The real SDK's .aio runs its sync client on the loop's default executor: widened.
    import asyncio

    executor = asyncio.get_running_loop()._default_executor  # type: ignore[attr-defined]
    assert executor is not None and executor._max_workers >= 256


def test_failed_trial_retention_scans_the_directory_once_and_survives_races(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from backends.harbor.files import Retention

    trials = tmp_path / "trials"
    long_ago = time.time() - 7200
    for i in range(30):
        (trials / f"old-{i}").mkdir(parents=True)
        os.utime(trials / f"old-{i}", (long_ago - i, long_ago - i))
    retention = Retention(max_failed=10)
    (trials / "first").mkdir()
    retention.finish(trials / "first", succeeded=False)
    assert len(list(trials.iterdir())) == 10
    # From now on a finishing trial never lists the directory (thousands may be in flight),
    # and a directory removed meanwhile by someone else is no error.
    monkeypatch.setattr(Path, "iterdir", lambda self: (_ for _ in ()).throw(AssertionError))
    errors: list[BaseException] = []

    def finish(start: int) -> None:
        for i in range(start, start + 25):
            path = trials / f"new-{i}"
            path.mkdir()
            if i % 5 == 0:
                path.rmdir()  # gone before its own finish
            try:
                retention.finish(path, succeeded=False)
            except BaseException as exc:
                errors.append(exc)

    workers = [threading.Thread(target=finish, args=(k * 100,)) for k in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert errors == []
    monkeypatch.undo()
    assert len(list(trials.iterdir())) == 10


def test_failed_trial_retention_leaves_another_runs_live_trials_alone(tmp_path: Path) -> None:
    """Two runs share the default trials directory: one's retention once removed the other's
    trial directory while that trial was still running."""
    from backends.harbor.files import Retention

    trials = tmp_path / "trials"
    (trials / "other-run-live").mkdir(parents=True)  # another process's, in flight
    (trials / "other-run-old").mkdir()  # a failed trial left long ago
    os.utime(trials / "other-run-old", (time.time() - 7200,) * 2)
    retention = Retention(max_failed=1)
    for name in ("mine-1", "mine-2"):
        (trials / name).mkdir()
        retention.finish(trials / name, succeeded=False)
    assert sorted(p.name for p in trials.iterdir()) == ["mine-2", "other-run-live"]
