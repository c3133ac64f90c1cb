"""The contract every execution backend honours, so servers and drivers treat them alike."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

import anyio

from backends.rollout.request import RolloutRequest, RolloutResult, RolloutStatus


class CancelDisposition(StrEnum):
    CANCELLED_QUEUED = "cancelled_queued"
    CANCELLED_RUNNING = "cancelled_running"
    NOT_FOUND = "not_found"


@runtime_checkable
class ExecutionBackend(Protocol):
    """Runs rollouts. Failures are results, not exceptions.

    Lifespan: ``start`` (warm up), then any number of ``execute`` calls, then ``aclose``. The
    rollout server, ``run_batch``/``collect`` and ``backends run`` call ``start`` before the
    first rollout; it may be called more than once (see ``Startup``).

    ``execute`` returns a ``RolloutResult`` for every request it accepts: a workflow error, a
    timeout, a sandbox fault or a cancellation each become a failed result with its category.
    It raises only when its own caller is cancelled (the cancellation propagates).
    """

    async def start(self) -> None:
        """Pay one-time costs (imports, image layers, pools) before the first rollout.

        Idempotent: later calls return at once. Raises when the backend cannot run rollouts at
        all (a missing prerequisite, a task directory that does not load); the server then
        fails its startup instead of failing every rollout.
        """
        ...

    async def execute(self, request: RolloutRequest) -> RolloutResult: ...

    def status(self, rollout_id: str) -> RolloutStatus | None:
        """Live status (queued, running, grading) of a rollout in flight, else ``None``."""
        ...

    def has_capacity(self) -> bool:
        """``False`` asks the caller to back off (the server answers 429)."""
        ...

    def cancel(
        self, ids: Iterable[str] | None = None, prefix: str | None = None, all: bool = False
    ) -> dict[str, CancelDisposition]:
        """Cancel queued or running rollouts; each one's ``execute`` returns a cancelled result."""
        ...

    def health(self) -> dict[str, Any]: ...

    async def aclose(self) -> None:
        """Cancel what is still running and release every resource (sandboxes included)."""
        ...


class Startup:
    """Runs a backend's warm-up once however many callers ask: concurrent callers wait for the
    first, a finished warm-up returns at once, and a failed one is raised and tried again by
    the next caller."""

    def __init__(self, warm_up: Callable[[], Awaitable[None]]) -> None:
        self._warm_up = warm_up
        self._lock = anyio.Lock()
        self.done = False

    async def __call__(self) -> None:
        if self.done:
            return
        async with self._lock:
            if not self.done:
                await self._warm_up()
                self.done = True


async def start_backend(backend: object) -> None:
    """Await ``backend.start()``; a backend written before ``start`` joined the contract (no
    such method) has nothing to warm up."""
    start = getattr(backend, "start", None)
    if start is not None:
        await start()
