"""Harbor's agent-log conversion runs in a worker thread and is always waited for: a trial
cancelled meanwhile ends only once the conversion has, however the cancel arrives."""

from __future__ import annotations

import asyncio
import resource
import time

import anyio
import pytest

from backends.harbor.agent_logs import _to_the_end

pytestmark = pytest.mark.anyio
WORK_S = 0.6


def _loop_thread_cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_THREAD)
    return use.ru_utime + use.ru_stime


def _conversion(done: list[float]):
    def convert() -> None:
        time.sleep(WORK_S)
        done.append(time.monotonic())

    return convert


async def test_a_cancel_scope_waits_without_spinning_and_absorbs_its_own_cancel() -> None:
    done: list[float] = []
    cpu = _loop_thread_cpu()
    with anyio.move_on_after(0.05) as scope:
        await _to_the_end(_conversion(done))
    returned = time.monotonic()
    assert scope.cancelled_caught  # the scope's own cancel, not one escaping it
    assert done and done[0] <= returned
    # Waiting costs the loop nothing: the old wait woke on every re-sent cancel (~100% CPU).
    assert _loop_thread_cpu() - cpu < WORK_S / 3


async def test_a_cancelled_trial_task_ends_cancelled_after_the_conversion() -> None:
    done: list[float] = []
    task = asyncio.ensure_future(_to_the_end(_conversion(done)))
    await asyncio.sleep(0.05)
    task.cancel()  # how Harbor's trial task is cancelled
    with pytest.raises(asyncio.CancelledError):
        await task
    assert done and done[0] <= time.monotonic()


async def test_the_conversions_error_is_raised_to_the_trial() -> None:
    def broken() -> None:
        raise ValueError("unreadable session file")

    with pytest.raises(ValueError, match="unreadable session file"):
        await _to_the_end(broken)
