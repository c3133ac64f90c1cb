"""Run many rollouts on one backend with a bound on how many are in flight."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

import anyio
from anyio.abc import ObjectReceiveStream

from backends.rollout.backend import ExecutionBackend
from backends.rollout.errors import ErrorCategory, Phase, RolloutFailure, describe
from backends.rollout.request import RolloutRequest, RolloutResult


@asynccontextmanager
async def run_batch(
    backend: ExecutionBackend,
    requests: Iterable[RolloutRequest],
    *,
    max_in_flight: int = 8,
) -> AsyncIterator[ObjectReceiveStream[RolloutResult]]:
    """Yield a stream of results in the order they finish.

    Every request yields exactly one result: a backend that raises instead of returning a
    failed result still yields an ``internal_error`` result for that request, so one bad
    rollout never hides the others. Leaving the block early cancels what is still running.

        async with run_batch(backend, requests, max_in_flight=16) as results:
            async for result in results:
                ...
    """
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    send, receive = anyio.create_memory_object_stream[RolloutResult](max_buffer_size=1024)
    slots = anyio.Semaphore(max_in_flight)

    async def one(request: RolloutRequest) -> None:
        try:
            result = await backend.execute(request)
        except Exception as exc:
            result = RolloutResult.failed(
                request.rollout_id,
                RolloutFailure(
                    category=ErrorCategory.INTERNAL_ERROR,
                    phase=Phase.SETUP,
                    message=f"backend raised instead of returning a result: {describe(exc)}",
                ),
            )
        finally:
            slots.release()
        await send.send(result)

    async def feed() -> None:
        async with send, anyio.create_task_group() as inner:
            for request in requests:
                # Take the slot before starting the task, so a huge batch is never all tasks at once.
                await slots.acquire()
                inner.start_soon(one, request)

    async with anyio.create_task_group() as tg:
        tg.start_soon(feed)
        try:
            async with receive:
                yield receive
        finally:
            tg.cancel_scope.cancel()


async def collect(
    backend: ExecutionBackend, requests: Iterable[RolloutRequest], *, max_in_flight: int = 8
) -> list[RolloutResult]:
    """Run a batch and return every result, in the order they finished."""
    async with run_batch(backend, requests, max_in_flight=max_in_flight) as results:
        return [result async for result in results]
