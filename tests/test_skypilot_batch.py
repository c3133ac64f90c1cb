"""Batch creation of SkyPilot sandboxes (``create(num_sandboxes=N)``) over the fake API server:
fewer create calls than sandboxes, each creator its own sandbox, nothing leaked when a creator
is cancelled or a batch fails, and a failure never a reward."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from harbor.models.trial.config import EnvironmentConfig
from harbor_support import _ShellAgent, write_task
from sky_support import create_calls, fake_sky_server, inject_create_faults

from backends import HarborBackend, RolloutRequest, RolloutStatus, collect
from backends.rollout.errors import ErrorCategory
from backends.sandbox import skybatch, skyruns, skysdk
from backends.sandbox.contract import PROVIDERS

pytestmark = [pytest.mark.sandbox, pytest.mark.anyio]

SKY = next(p for p in PROVIDERS if p.name == "skypilot")
# Long enough that creates started together share a batch even on a loaded machine.
BATCHED = {"batch_window_sec": 1.0, "batch_max_size": 32, "admission_jitter_sec": 0}


@pytest.fixture(scope="module")
def fake_sky() -> Iterator[dict[str, str]]:
    with fake_sky_server() as env:
        yield env


@pytest.fixture
async def faults(fake_sky: dict[str, str]) -> AsyncIterator[None]:
    """Each test counts the create calls from its start; no fault outlives it."""
    await inject_create_faults()
    yield
    await inject_create_faults()


async def _ours() -> set[str]:
    import sky_sandbox

    prefix = f"bk-{skyruns.current().id}-"
    return {s.name for s in await sky_sandbox.ls.aio() if s.name.startswith(prefix)}


async def _start_all(envs: list[Any]) -> list[BaseException | None]:
    errors: list[BaseException | None] = [None] * len(envs)

    async def start(i: int) -> None:
        try:
            await envs[i].start(force_build=False)
        except Exception as exc:
            errors[i] = exc

    async with anyio.create_task_group() as tg:
        for i in range(len(envs)):
            tg.start_soon(start, i)
    return errors


async def test_sandboxes_started_together_share_create_calls_and_each_gets_its_own(
    tmp_path: Path, faults: None
) -> None:
    envs = [SKY.make(tmp_path / str(i), kwargs=BATCHED) for i in range(5)]
    assert await _start_all(envs) == [None] * 5
    try:
        calls = await create_calls()
        assert len(calls) == 1 and len(calls[0]["names"]) == 5, calls
        # The documented naming: <name>-0001, ...; the run's prefix kept for the reaper.
        base = calls[0]["names"][0].removesuffix("-0001")
        assert calls[0]["names"] == [f"{base}-{i:04d}" for i in range(1, 6)]
        assert skyruns.run_of(base) == skyruns.current().id
        names = [env._sandbox_name for env in envs]  # type: ignore[attr-defined]
        assert sorted(names) == calls[0]["names"]
        # Each one its own pod: a file written in one is in no other.
        await envs[0].exec("echo mine > /tmp/claim")
        seen = [(await env.exec("cat /tmp/claim")).return_code for env in envs]
        assert seen == [0, 1, 1, 1, 1]
    finally:
        for env in envs:
            await env.stop(delete=True)
    assert await _ours() == set()


async def test_a_create_alone_is_an_ordinary_create_under_its_own_name(
    tmp_path: Path, faults: None
) -> None:
    env = SKY.make(tmp_path, kwargs={"batch_window_sec": 0.01})
    await env.start(force_build=False)
    try:
        calls = await create_calls()
        assert [c["names"] for c in calls] == [[env._sandbox_name]]  # type: ignore[attr-defined]
        assert env._sandbox_name == skyruns.sandbox_name(skyruns.current(), env.session_id)  # type: ignore[attr-defined]
    finally:
        await env.stop(delete=True)


async def test_different_specs_never_share_a_batch(tmp_path: Path, faults: None) -> None:
    envs = [SKY.make(tmp_path / str(i), kwargs=BATCHED, cpus=1 + i % 2) for i in range(4)]
    assert await _start_all(envs) == [None] * 4
    try:
        calls = await create_calls()
        assert sorted(len(c["names"]) for c in calls) == [2, 2]
        for call in calls:
            cpus = {e.task_env_config.cpus for e in envs if e._sandbox_name in call["names"]}  # type: ignore[attr-defined]
            assert len(cpus) == 1, calls
    finally:
        for env in envs:
            await env.stop(delete=True)


async def test_creators_cancelled_before_and_during_the_call_leak_nothing(
    tmp_path: Path, faults: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = _HeldCreates(monkeypatch)  # so "during the call" is during it, however loaded
    envs = [SKY.make(tmp_path / str(i), kwargs=BATCHED) for i in range(4)]
    scopes = [anyio.CancelScope() for _ in envs]
    errors: list[BaseException | None] = [None] * 4

    async def start(i: int) -> None:
        with scopes[i]:
            try:
                await envs[i].start(force_build=False)
            except Exception as exc:
                errors[i] = exc

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(start, i)
        await anyio.sleep(0.3)
        scopes[0].cancel()  # before the call: the batch asks for one fewer
        with anyio.fail_after(60):
            await held.entered.wait()
        scopes[1].cancel()  # during the call: its sandbox is made, then terminated
        held.gate.set()
    assert errors == [None] * 4
    assert [len(c["names"]) for c in await create_calls()] == [3]
    assert scopes[0].cancelled_caught and scopes[1].cancelled_caught
    try:
        assert envs[0]._sandbox is None  # type: ignore[attr-defined]
        for env in envs[2:]:
            assert (await env.exec("true")).return_code == 0
    finally:
        for env in envs[2:]:
            await env.stop(delete=True)
        await skybatch.aclose()
    assert await _ours() == set()
    assert not skyruns.current().held


async def test_a_creator_cancelled_as_its_sandbox_arrives_hands_it_back(
    tmp_path: Path, faults: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch answered and its future was set, but the creator is cancelled before it
    runs again: the sandbox it never saw is terminated, not left running."""
    envs = [SKY.make(tmp_path / str(i), kwargs=BATCHED) for i in range(3)]
    loop = asyncio.get_running_loop()
    starts = [loop.create_task(env.start(force_build=False)) for env in envs]
    create = envs[0].sdk.create.aio  # type: ignore[attr-defined]

    async def answer_then_cancel_the_first(*args: Any, **kwargs: Any) -> Any:
        boxes = await create(*args, **kwargs)
        loop.call_soon(starts[0].cancel)  # runs after the results are set, before it wakes
        return boxes

    monkeypatch.setattr(envs[0].sdk.create, "aio", answer_then_cancel_the_first)  # type: ignore[attr-defined]
    done = await asyncio.gather(*starts, return_exceptions=True)
    assert isinstance(done[0], asyncio.CancelledError) and done[1:] == [None, None], done
    try:
        assert [len(c["names"]) for c in await create_calls()] == [3]
    finally:
        for env in envs[1:]:
            await env.stop(delete=True)
        await skybatch.aclose()
    assert await _ours() == set()


async def test_a_batch_that_failed_half_made_is_cleaned_up_and_retried(
    tmp_path: Path, faults: None
) -> None:
    await inject_create_faults({"make": "half", "status": 503})
    envs = [SKY.make(tmp_path / str(i), kwargs=BATCHED) for i in range(4)]
    before = skyruns.counters["create_retries"]
    assert await _start_all(envs) == [None] * 4
    try:
        first, second = await create_calls()
        assert len(first["names"]) == len(second["names"]) == 4
        assert not set(first["names"]) & set(second["names"])  # a fresh name for the retry
        # The two the failed call made are gone; the retry's four are the ones in use.
        assert await _ours() == set(second["names"])
        assert sorted(env._sandbox_name for env in envs) == second["names"]  # type: ignore[attr-defined]
        assert skyruns.counters["create_retries"] == before + 1
    finally:
        for env in envs:
            await env.stop(delete=True)
    assert await _ours() == set()


async def test_a_batch_that_fails_for_good_fails_every_creator_and_leaks_nothing(
    tmp_path: Path, faults: None
) -> None:
    await inject_create_faults({"make": "half", "status": 500})  # not transient: not retried
    envs = [SKY.make(tmp_path / str(i), kwargs=BATCHED) for i in range(4)]
    errors = await _start_all(envs)
    assert all(e is not None and "injected" in str(e) for e in errors), errors
    assert len(await create_calls()) == 1
    assert await _ours() == set()


async def test_cleaning_up_a_failed_create_terminates_only_its_own_sandboxes(
    tmp_path: Path, faults: None
) -> None:
    """A name that merely starts like the failed create's is another sandbox: left alone."""
    import sky_sandbox

    env = SKY.make(tmp_path)
    own = skyruns.sandbox_name(skyruns.current(), env.session_id)
    bystander = await sky_sandbox.create.aio(name=f"{own}-0001", image="ubuntu:24.04")
    try:
        await inject_create_faults({"make": "all", "status": 500})
        with pytest.raises(Exception, match="injected"):
            await env.start(force_build=False)
        assert await _ours() == {bystander.name}
    finally:
        await bystander.terminate.aio()


class Claims(_ShellAgent):
    """Claims its sandbox: a second claim in one sandbox fails the task's tests."""

    script = "echo claimed >> /tmp/claims"


# Reward 1 only in a sandbox of its own, with the task's env reaching the tests' command.
CLAIM_TEST = (
    '[ "$(wc -l < /tmp/claims)" = 1 ] && [ "$FROM_TASK" = task-env ] '
    "&& echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt"
)


def _claims_backend(tmp_path: Path, **kwargs: Any) -> HarborBackend:
    write_task(
        tmp_path / "tasks", "claims", test=CLAIM_TEST, toml='env = { FROM_TASK = "task-env" }\n'
    )
    return HarborBackend(
        tasks_dir=tmp_path / "tasks",
        task_mode="dataset",
        agent=Claims,
        environment="skypilot",
        environment_config=EnvironmentConfig(kwargs=BATCHED),
        trials_dir=tmp_path / "trials",
        artifacts=tmp_path / "out",
        max_concurrent=6,
        **kwargs,
    )


def _requests(n: int) -> list[RolloutRequest]:
    return [
        RolloutRequest(rollout_id=f"claim-{i}", prompt=[], metadata={"harbor_task_id": "claims"})
        for i in range(n)
    ]


async def test_a_batch_of_rollouts_makes_fewer_creates_and_each_gets_its_reward(
    tmp_path: Path, faults: None
) -> None:
    backend = _claims_backend(tmp_path)
    results = await collect(backend, _requests(6), max_in_flight=6)
    await backend.aclose()
    assert {r.rollout_id: (r.status, r.reward) for r in results} == {
        f"claim-{i}": (RolloutStatus.SUCCESS, 1.0) for i in range(6)
    }, [r.failure for r in results]
    calls = await create_calls()
    assert len(calls) < 6 and sum(len(c["names"]) for c in calls) == 6, calls
    # Nothing of a rollout (nor the task's env) is in a create: it goes with each command.
    assert all(c["spec"]["env"] == {} for c in calls), calls
    assert await _ours() == set()


async def test_rollouts_whose_batch_fails_are_infra_errors_never_rewards(
    tmp_path: Path, faults: None
) -> None:
    await inject_create_faults(*[{"make": "half", "status": 500}] * 6)
    backend = _claims_backend(tmp_path, infra_attempts=1)
    results = await collect(backend, _requests(4), max_in_flight=4)
    await backend.aclose()
    assert len(results) == 4
    for result in results:
        assert result.reward is None and result.failure is not None, result
        assert result.failure.category is ErrorCategory.INFRA_ERROR, result.failure
        assert result.failure.retryable, result.failure
    assert await _ours() == set()


class _HeldCreates:
    """Every create call from now on waits for ``gate``, as on a cluster still scheduling."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered, self.gate, self.cancelled = anyio.Event(), anyio.Event(), anyio.Event()
        sdk = skysdk.load()
        create = sdk.create.aio

        async def held(*args: Any, **kwargs: Any) -> Any:
            self.entered.set()
            try:
                await self.gate.wait()
            except anyio.get_cancelled_exc_class():
                self.cancelled.set()
                raise
            return await create(*args, **kwargs)

        monkeypatch.setattr(sdk.create, "aio", held)


async def test_closing_one_backend_leaves_another_backends_creates_alone(
    tmp_path: Path, faults: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An eval backend closed beside a training backend in one event loop: its close neither
    waits for nor cancels the other's creates in flight (review N2: it cancelled them, so each
    rollout was retried as an infra error, or failed on its last attempt)."""
    monkeypatch.setattr(skybatch, "CLOSE_GRACE_SEC", 0.5)  # what a close lets others finish
    a, b = _claims_backend(tmp_path / "a"), _claims_backend(tmp_path / "b")
    [done] = await collect(a, _requests(1))
    assert (done.status, done.reward) == (RolloutStatus.SUCCESS, 1.0), done.failure
    held = _HeldCreates(monkeypatch)  # a cluster still scheduling b's pods
    results: list[Any] = []

    async def run_b() -> None:
        results.extend(await collect(b, _requests(3), max_in_flight=3))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run_b)
        with anyio.fail_after(60):
            await held.entered.wait()
        with anyio.fail_after(20):  # was CLOSE_GRACE_SEC (60 s) spent waiting for b's work
            await a.aclose()
        held.gate.set()
    assert not held.cancelled.is_set()
    await b.aclose()
    assert {r.rollout_id: (r.status, r.reward) for r in results} == {
        f"claim-{i}": (RolloutStatus.SUCCESS, 1.0) for i in range(3)
    }, [r.failure for r in results]
    assert [r.extra_fields.get("infra_retries") for r in results] == [None] * 3
    assert sum(len(c["names"]) for c in await create_calls()) == 4  # none made twice
    assert await _ours() == set()


async def test_closing_a_backend_still_ends_its_own_creates_in_flight(
    tmp_path: Path, faults: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its close reaches the batches its sandboxes joined: a create still in flight after the
    grace is cancelled, and nothing of it is left running."""
    monkeypatch.setattr(skybatch, "CLOSE_GRACE_SEC", 0.5)
    backend = _claims_backend(tmp_path)
    held = _HeldCreates(monkeypatch)
    async with anyio.create_task_group() as tg:
        tg.start_soon(collect, backend, _requests(2))
        with anyio.fail_after(60):
            await held.entered.wait()
        with anyio.fail_after(20):
            await backend.aclose()
    assert held.cancelled.is_set()
    assert await _ours() == set()


def test_the_fake_makes_a_batch_as_documented_sync_and_aio(fake_sky: dict[str, str]) -> None:
    import sky_sandbox

    boxes = sky_sandbox.create(name="bk-00000000-doc", num_sandboxes=2, image="ubuntu:24.04")
    try:
        assert isinstance(boxes, list)
        assert [b.name for b in boxes] == ["bk-00000000-doc-0001", "bk-00000000-doc-0002"]
    finally:
        for box in boxes:
            box.terminate()
    with pytest.raises(ValueError, match="num_sandboxes"):
        sky_sandbox.create(name="x", num_sandboxes=0, image="ubuntu:24.04")
    with pytest.raises(ValueError, match="at most 53"):  # the members' names count
        sky_sandbox.create(name="a" * 50, num_sandboxes=2, image="ubuntu:24.04")

    async def aio() -> list[str]:
        made = await sky_sandbox.create.aio(
            name="bk-00000000-aio", num_sandboxes=1, image="ubuntu:24.04"
        )
        for box in made:
            await box.terminate.aio()
        return [b.name for b in made]

    assert anyio.run(aio) == ["bk-00000000-aio-0001"]
