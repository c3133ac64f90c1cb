"""Creating SkyPilot sandboxes in batches: identical creates that arrive together become one
``create(..., num_sandboxes=N)`` call, the SDK's documented way to make many at once.

A create joins the open batch of its spec (every create argument but the name) or opens one.
A batch accepts creates for ``window`` seconds, and after that for as long as it waits for
admission (``max_concurrent_creates`` calls in flight), up to ``max_size``; so under load
batches grow, and a create alone waits at most ``window`` longer than before. A batch of one
is an ordinary create under the creator's own name; a larger one is named
``bk-<run id>-<batch id>``, and the SDK names its members ``<that>-0001``, ``-0002``, ...:
every name keeps the run's prefix, so the reaper finds them after a crash.

The call runs in a task of the batcher's (one per event loop), never in a waiting creator's,
so a creator cancelled mid-call cancels nothing for the others: its sandbox, once made, is
terminated instead of handed over. A call that fails has every member the listing shows
terminated, and is retried (backoff, a fresh name) when the failure is transient; a creator
whose batch failed for good gets the error. ``aclose()`` waits for the calls in flight and
terminates what no creator took.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import tenacity

from backends.sandbox import skylive, skyruns, skysdk
from backends.sandbox.errors import SandboxStartError

log = logging.getLogger(__name__)

DEFAULT_WINDOW_SEC = 0.02
DEFAULT_MAX_SIZE = 32
CLOSE_GRACE_SEC = 60.0  # how long aclose() lets calls in flight finish before cancelling them
RELEASE_TIMEOUT_SEC = 60.0


@dataclass(frozen=True)
class Policy:
    """How one sandbox's creates are made: these must match for creates to share a batch."""

    window: float = DEFAULT_WINDOW_SEC
    max_size: int = DEFAULT_MAX_SIZE
    max_concurrent: int = 64
    attempts: int = 4
    jitter: float = 0.05


@dataclass(eq=False)
class _Batch:
    spec: dict[str, Any]
    policy: Policy
    creators: list[tuple[str, asyncio.Future[Any]]] = field(default_factory=list)
    full: anyio.Event = field(default_factory=anyio.Event)

    def waiting(self) -> list[tuple[str, asyncio.Future[Any]]]:
        """(session id, future) of each creator still waiting."""
        return [(session, fut) for session, fut in self.creators if not fut.done()]


class Batcher:
    """The batches of one event loop; see the module's docstring."""

    def __init__(self) -> None:
        self._open: dict[Any, _Batch] = {}
        self._tasks: dict[asyncio.Task[None], anyio.CancelScope] = {}

    async def create(
        self, sdk: Any, run: skyruns.Run, spec: dict[str, Any], session_id: str, policy: Policy
    ) -> Any:
        """A sandbox made from ``spec`` (create's keyword arguments but ``name``): named for
        ``session_id`` if it is made alone, a member of a batch otherwise."""
        key = (_freeze(spec), policy)
        batch = self._open.get(key)
        if batch is None:
            batch = self._open[key] = _Batch(spec, policy)
            self._spawn(lambda: self._run(sdk, run, key, batch))
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        batch.creators.append((session_id, future))
        if len(batch.creators) >= policy.max_size:
            self._close(key, batch)
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                self._hand_back(sdk, run, future.result())  # made, but no longer wanted
            future.cancel()
            raise

    def _spawn(self, work: Callable[[], Awaitable[None]]) -> None:
        """Run ``work`` in a task of the batcher's, cancelled only by ``aclose``."""
        scope = anyio.CancelScope()

        async def owned() -> None:
            with scope:
                await work()

        task = asyncio.get_running_loop().create_task(owned())
        self._tasks[task] = scope
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("a SkyPilot create task failed", exc_info=exc)

    def _close(self, key: Any, batch: _Batch) -> None:
        """No more creators join ``batch``."""
        if self._open.get(key) is batch:
            del self._open[key]
        batch.full.set()

    async def _run(self, sdk: Any, run: skyruns.Run, key: Any, batch: _Batch) -> None:
        failure: Exception = SandboxStartError(
            "the sandbox create was cancelled: the backend is closing"
        )
        try:
            with anyio.move_on_after(batch.policy.window):
                await batch.full.wait()
            await self._attempts(sdk, run, key, batch)
        except Exception as exc:  # each creator gets it; the task itself ends quietly
            failure = exc
        finally:
            self._close(key, batch)
            for _, fut in batch.waiting():
                fut.set_exception(failure)

    async def _attempts(self, sdk: Any, run: skyruns.Run, key: Any, batch: _Batch) -> None:
        policy = batch.policy
        retrying = tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(policy.attempts),
            wait=tenacity.wait_random_exponential(multiplier=0.5, max=10),
            retry=tenacity.retry_if_exception(_retryable),
            reraise=True,
        )
        attempt = 0
        async for try_ in retrying:
            with try_:
                attempt += 1
                # Admission per call (a backoff holds no slot); creators join until it is had.
                async with skyruns.admission(policy.max_concurrent):
                    if policy.jitter:
                        await anyio.sleep(random.uniform(0, policy.jitter))
                    self._close(key, batch)
                    creators = batch.waiting()
                    if not creators:
                        return  # every creator went away before its sandbox was asked for
                    skyruns.counters["creates"] += 1
                    skyruns.counters["create_retries"] += attempt > 1
                    boxes = await self._call(sdk, run, batch.spec, creators, attempt)
                for (_, fut), box in zip(creators, boxes, strict=True):
                    if fut.done():  # its creator was cancelled during the call
                        self._hand_back(sdk, run, box)
                    else:
                        fut.set_result(box)

    async def _call(
        self,
        sdk: Any,
        run: skyruns.Run,
        spec: dict[str, Any],
        creators: list[tuple[str, asyncio.Future[Any]]],
        attempt: int,
    ) -> list[Any]:
        """One create call for ``creators``; when it fails, nothing of it is left."""
        batch = None
        if len(creators) == 1:
            names = [skyruns.sandbox_name(run, creators[0][0], retry=attempt)]
        else:
            batch = skyruns.batch_name(run)
            names = [skyruns.member_name(batch, i) for i in range(1, len(creators) + 1)]
        run.live.update(names)  # a half-made batch is reaped at exit (or after a crash) too
        try:
            if batch is None:
                boxes = [await sdk.create.aio(name=names[0], **spec)]
            else:
                boxes = list(await sdk.create.aio(name=batch, num_sandboxes=len(names), **spec))
            run.live.update(box.name for box in boxes)
            if len(boxes) != len(names):
                raise ShortBatchError(
                    f"asked for {len(names)} sandboxes in one create, the server made {len(boxes)}"
                )
            run.held.update(box.name for box in boxes)
            skyruns.counters["sandboxes_created"] += len(boxes)
            return boxes
        except BaseException:
            # The server may have made some or all of them and the answer been lost:
            # terminate what the listing shows now, not at exit, before a retry makes more.
            with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_TIMEOUT_SEC):
                await release(sdk, run, names, batch)
            raise

    def _hand_back(self, sdk: Any, run: skyruns.Run, box: Any) -> None:
        """Terminate a sandbox made for a creator that no longer wants it (in a task of ours:
        the creator is being cancelled)."""

        async def terminate() -> None:
            with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_TIMEOUT_SEC):
                await release(sdk, run, [box.name])

        self._spawn(terminate)

    async def aclose(self) -> None:
        """Wait for the calls in flight (cancelling them after ``CLOSE_GRACE_SEC``); what no
        creator took is terminated."""
        with anyio.move_on_after(CLOSE_GRACE_SEC):
            while self._tasks:
                await asyncio.wait(list(self._tasks))
        while self._tasks:
            for scope in self._tasks.values():
                scope.cancel()
            await asyncio.wait(list(self._tasks))


class ShortBatchError(SandboxStartError):
    """The server answered a batch create with fewer sandboxes than asked (retried)."""


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, ShortBatchError) or skysdk.is_transient(exc)


async def release(sdk: Any, run: skyruns.Run, names: list[str], batch: str | None = None) -> None:
    """Terminate every listed sandbox among ``names`` or, for a ``batch``, named as its
    members are (``<batch>-0001``, ...; however many the server made). A name not listed
    stays in ``run.live``: a create the server still works on may make it later, and the
    exit hook looks again."""
    try:
        listed = {box.name: box for box in await sdk.ls.aio()}
    except Exception as exc:
        log.warning("%s: could not list sandboxes after a failed create: %s", names[0], exc)
        return
    member = re.compile(rf"{re.escape(batch)}-\d+") if batch is not None else None
    for name, box in listed.items():
        if name not in names and not (member is not None and member.fullmatch(name)):
            continue
        try:
            await box.terminate.aio(wait=True)
        except Exception as exc:  # kept in run.live: the exit hook or the reaper tries again
            log.warning("%s: could not terminate after a failed create: %s", name, exc)
            continue
        run.live.discard(name)
        run.held.discard(name)
        skylive.pods.forget(name)


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


_batchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Batcher] = (
    weakref.WeakKeyDictionary()
)


def batcher() -> Batcher:
    """This event loop's batcher."""
    loop = asyncio.get_running_loop()
    found = _batchers.get(loop)
    if found is None:
        found = _batchers[loop] = Batcher()
    return found


async def aclose() -> None:
    """Close this event loop's batcher (``HarborBackend.aclose`` does): see ``Batcher.aclose``."""
    found = _batchers.get(asyncio.get_running_loop())
    if found is not None:
        await found.aclose()
