"""Run many rollouts on one backend with a bound on how many are in flight."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

import anyio
from anyio.abc import ObjectReceiveStream

from backends.rollout.backend import ExecutionBackend, start_backend
from backends.rollout.errors import (
    ErrorCategory,
    Phase,
    RolloutFailure,
    describe,
    must_propagate,
)
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
    rollout never hides the others. At most ``max_in_flight`` rollouts are running or waiting
    to be read. Leaving the block early cancels what is still running. If ``requests`` raises,
    feeding stops, the rollouts already started are still yielded, and then its exception is
    raised as is (as is an exception raised by the consumer). The backend's ``start`` is
    awaited first; its exception is raised before any rollout starts.

        async with run_batch(backend, requests, max_in_flight=16) as results:
            async for result in results:
                ...
    """
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    await start_backend(backend)  # warm-up before the first rollout (idempotent)
    # No buffer: a finished result keeps its slot until the consumer takes it, so at most
    # max_in_flight rollouts are running or waiting to be read.
    send, receive = anyio.create_memory_object_stream[RolloutResult](max_buffer_size=0)
    slots = anyio.Semaphore(max_in_flight)
    feed_error: Exception | None = None
    consumer_error: Exception | None = None

    async def one(request: RolloutRequest) -> None:
        try:
            try:
                result = await backend.execute(request)
            except BaseException as exc:  # a stray CancelledError or sys.exit too
                if must_propagate(exc):
                    raise
                result = _internal(request, exc)
            try:
                await send.send(result)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # the consumer left early; nobody wants this result
        finally:
            slots.release()

    async def feed() -> None:
        nonlocal feed_error
        async with send, anyio.create_task_group() as inner:
            try:
                pending = iter(requests)
                while True:
                    # The slot first, then the next request: a streamed dataset builds a
                    # request only when it can start, a huge batch is never all tasks at once,
                    # and a generator told to stop is asked before anything more starts.
                    await slots.acquire()
                    try:
                        request = next(pending)
                    except BaseException:  # the end, or a broken iterable (raised below)
                        slots.release()
                        raise
                    inner.start_soon(one, request)
            except StopIteration:
                pass
            except Exception as exc:
                # A broken requests iterable: stop feeding, let the started rollouts finish
                # and be read, and raise it (unwrapped) when the stream ends.
                feed_error = exc

    async with anyio.create_task_group() as tg:
        tg.start_soon(feed)
        try:
            async with receive:
                yield receive
        except Exception as exc:
            consumer_error = exc  # raised below, outside the task group, so not wrapped
        finally:
            tg.cancel_scope.cancel()
    if consumer_error is not None:
        raise consumer_error
    if feed_error is not None:
        raise feed_error


def _internal(request: RolloutRequest, exc: BaseException) -> RolloutResult:
    return RolloutResult.failed(
        request.rollout_id,
        RolloutFailure(
            category=ErrorCategory.INTERNAL_ERROR,
            phase=Phase.SETUP,
            message=f"backend raised instead of returning a result: {describe(exc)}",
        ),
    )


async def collect(
    backend: ExecutionBackend, requests: Iterable[RolloutRequest], *, max_in_flight: int = 8
) -> list[RolloutResult]:
    """Run a batch and return every result, in the order they finished."""
    async with run_batch(backend, requests, max_in_flight=max_in_flight) as results:
        return [result async for result in results]
