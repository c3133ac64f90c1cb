"""A pod that vanishes under a running command (its lifetime over, a reaper, node loss) is
reported when it happens, as the sandbox ending (a retryable infrastructure failure), not after
the command's whole timeout as the command's own timeout."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
from harbor.models.trial.config import EnvironmentConfig
from harbor_support import write_task
from sky_support import fake_sky_server
from test_skypilot import SKY

from backends import HarborBackend, RolloutRequest, RolloutStatus, collect
from backends.rollout.errors import ErrorCategory, Phase
from backends.sandbox import skylive
from backends.sandbox.errors import SandboxNotRunningError

pytestmark = [pytest.mark.anyio]


@pytest.fixture(params=["killed", "hang"])
def lost_execs(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fake API server whose commands, when their pod is terminated, answer 137 or never."""
    monkeypatch.setenv("FAKE_SKY_LOST_EXECS", request.param)  # sky_sandbox.server's switch
    with fake_sky_server():
        yield request.param


@pytest.fixture(scope="module")
def fake_sky() -> Iterator[dict[str, str]]:
    with fake_sky_server() as env:
        yield env


async def _terminate_when_running(marker: str) -> None:
    """Terminate every pod once a process running ``marker`` shows (pods are host processes
    on the fake)."""
    import sky_sandbox

    while (await anyio.run_process(["pgrep", "-f", marker], check=False)).returncode != 0:
        await anyio.sleep(0.1)
    for box in await sky_sandbox.ls.aio():
        await box.terminate.aio()


@pytest.mark.sandbox
async def test_a_command_whose_pod_is_terminated_raises_sandbox_not_running(
    tmp_path: Path, lost_execs: str
) -> None:
    env = SKY.make(tmp_path, kwargs={"liveness_interval_sec": 1})
    await env.start(force_build=False)
    marker = f"sleep {random.randint(10**6, 10**7)}"
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_terminate_when_running, marker)
            started = time.monotonic()
            with pytest.raises(SandboxNotRunningError, match="is gone"):
                await env.exec(f"{marker}; echo done", timeout_sec=600)
            elapsed = time.monotonic() - started
    finally:
        await env.stop(delete=True)
    assert elapsed < 30, f"reported after {elapsed:.0f} s ({lost_execs})"


@pytest.mark.sandbox
async def test_with_liveness_off_the_listing_is_never_consulted(
    tmp_path: Path, fake_sky: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    env = SKY.make(tmp_path, kwargs={"liveness_interval_sec": 0})
    listed: list[float] = []

    async def counted(*args: Any, **kwargs: Any) -> bool:
        listed.append(time.monotonic())
        return False

    monkeypatch.setattr(skylive.pods, "lost", counted)
    await env.start(force_build=False)
    try:
        res = await env.exec("sleep 2; kill -KILL $$", timeout_sec=60)
    finally:
        await env.stop(delete=True)
    assert res.return_code == 137 and listed == []
    with pytest.raises(ValueError, match="liveness_interval_sec"):
        SKY.make(tmp_path, kwargs={"liveness_interval_sec": -1})


@pytest.mark.sandbox
async def test_a_command_killed_in_a_live_pod_is_an_ordinary_result(
    tmp_path: Path, fake_sky: dict[str, str]
) -> None:
    env = SKY.make(tmp_path, kwargs={"liveness_interval_sec": 1})
    await env.start(force_build=False)
    try:
        res = await env.exec("sleep 2; kill -KILL $$", timeout_sec=60)  # 137, pod still there
        assert res.return_code == 137
        assert (await env.exec("echo alive")).stdout == "alive\n"
    finally:
        await env.stop(delete=True)


@pytest.mark.sandbox
async def test_a_pod_lost_during_verification_is_a_retryable_infra_error_at_once(
    tmp_path: Path, lost_execs: str
) -> None:
    marker = f"sleep {random.randint(10**6, 10**7)}"
    write_task(tmp_path / "tasks", "slow", test=f"{marker}; echo 1 > /logs/verifier/reward.txt")
    backend = HarborBackend(
        agent="nop",
        tasks_dir=tmp_path / "tasks",
        task_mode="dataset",
        environment="skypilot",
        environment_config=EnvironmentConfig(kwargs={"liveness_interval_sec": 2}),
        trials_dir=tmp_path / "trials",
        artifacts=tmp_path / "out",
        infra_attempts=1,  # the first attempt's own failure, not a retry's
    )
    request = RolloutRequest(
        rollout_id="lost",
        prompt=[],
        metadata={"harbor_task_id": "slow"},
        grader_timeout_sec=300,
    )
    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_terminate_when_running, marker)
        [result] = await collect(backend, [request])
    elapsed = time.monotonic() - started
    await backend.aclose()
    assert result.status is RolloutStatus.FAILURE
    assert result.failure is not None
    assert result.failure.category is ErrorCategory.INFRA_ERROR, result.failure
    assert result.failure.retryable and result.failure.phase is Phase.GRADING
    assert "is gone" in result.failure.message
    assert elapsed < 120, f"reported after {elapsed:.0f} s, not when the pod went"


class _Listing:
    """An SDK whose ``ls`` answers what the test says (or fails)."""

    def __init__(self) -> None:
        self.boxes: list[Any] = []
        self.fails = False
        self.calls = 0
        self.ls = SimpleNamespace(aio=self._ls)

    async def _ls(self) -> list[Any]:
        self.calls += 1
        if self.fails:
            raise ConnectionError("API server unreachable")
        return self.boxes


async def test_only_a_listing_that_can_see_the_pod_judges_it() -> None:
    sdk, pods = _Listing(), skylive.Pods()
    pods.created("a", (None, None))
    pods.created("other-ctx", ("ctx-2", None))
    now = time.monotonic

    async def lost(name: str) -> bool:
        return await pods.lost(sdk, name, fresher_than=now())

    sdk.boxes = [SimpleNamespace(name="a", status="RUNNING")]
    assert not await lost("a")
    assert not await lost("other-ctx")  # never listed: another context's pods are not seen
    sdk.fails = True
    sdk.boxes = []
    assert not await lost("a")  # no answer says nothing
    sdk.fails = False
    assert await lost("a")  # gone from a listing of its own context
    sdk.boxes = [SimpleNamespace(name="a", status="SandboxStatus.FAILED")]
    assert await lost("a")
    sdk.boxes = [SimpleNamespace(name="a", status="SOME_STATE_NOT_DOCUMENTED")]
    assert not await lost("a")  # an unfamiliar status never fails a healthy rollout
    assert not await lost("never-made")
    # Listings are shared: many commands asking within the freshness window make one call.
    calls = sdk.calls
    asked = now() - 10
    for _ in range(5):
        await pods.lost(sdk, "a", fresher_than=asked)
    assert sdk.calls == calls


async def test_a_listing_that_hangs_says_nothing_and_holds_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The liveness check waits on the server's `ls`: one that never answers must neither
    judge the pod lost nor hold the command's result."""
    from backends.sandbox import skylive

    class HangingLs:
        async def aio(self) -> list[object]:
            await anyio.sleep(3600)
            return []

    class Sdk:
        ls = HangingLs()

    monkeypatch.setattr(skylive, "LISTING_TIMEOUT_SEC", 0.2)
    pods = skylive.Pods()
    pods.created("pod-1", (None, None))
    with anyio.fail_after(5):
        assert await pods.lost(Sdk(), "pod-1", fresher_than=time.monotonic()) is False
