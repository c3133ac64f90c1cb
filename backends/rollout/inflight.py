"""The rollouts a backend has in flight: their status, cancel scopes and live contexts.

Every backend answers ``status``, ``cancel`` and ``health`` from the same bookkeeping, and every
backend must keep the promise ``cancel`` makes: once it answered "cancelled", the rollout's
result is a cancelled one, even if the work finished anyway.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import anyio

from backends.rollout.backend import CancelDisposition
from backends.rollout.context import RolloutContext
from backends.rollout.errors import (
    ErrorCategory,
    Phase,
    RolloutFailure,
    RolloutValidationError,
    classify,
)
from backends.rollout.request import RolloutRequest, RolloutResult, RolloutStatus


@dataclass
class Tracked:
    """One rollout in flight. ``context`` is set while a workflow runs, for live previews."""

    rollout_id: str
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    status: RolloutStatus = RolloutStatus.QUEUED
    context: RolloutContext | None = None

    @property
    def cancel_called(self) -> bool:
        return self.scope.cancel_called

    def cancelled_result(self) -> RolloutResult:
        phase = Phase.GRADING if self.status is RolloutStatus.GRADING else Phase.AGENT
        failure = RolloutFailure(
            category=ErrorCategory.CANCELLED, phase=phase, message="rollout cancelled"
        )
        return RolloutResult.failed(self.rollout_id, failure)


class InFlight:
    """The rollouts one backend is running, by id."""

    def __init__(self) -> None:
        self._entries: dict[str, Tracked] = {}

    async def run(
        self, request: RolloutRequest, body: Callable[[Tracked], Awaitable[RolloutResult]]
    ) -> RolloutResult:
        """Run ``body`` as the tracked rollout ``request.rollout_id``.

        A second rollout with an id already in flight is refused (validation error); a
        cancelled rollout returns a cancelled result whatever ``body`` returned.
        """
        rid = request.rollout_id
        if rid in self._entries:
            message = f"rollout {rid!r} is already running"
            return RolloutResult.failed(rid, classify(RolloutValidationError(message), Phase.SETUP))
        entry = Tracked(rid)
        self._entries[rid] = entry
        try:
            with entry.scope:
                result = await body(entry)
                # Code that never reaches a cancellation point (a worker thread, no awaits)
                # can finish after cancel() answered "cancelled": that answer must hold.
                if not entry.cancel_called:
                    return result
            return entry.cancelled_result()
        finally:
            del self._entries[rid]

    def get(self, rollout_id: str) -> Tracked | None:
        return self._entries.get(rollout_id)

    def status(self, rollout_id: str) -> RolloutStatus | None:
        entry = self._entries.get(rollout_id)
        return entry.status if entry else None

    def cancel(
        self, ids: Iterable[str] | None = None, prefix: str | None = None, all: bool = False
    ) -> dict[str, CancelDisposition]:
        """``ExecutionBackend.cancel``: cancel the chosen rollouts, saying what each one was."""
        if all:
            chosen = list(self._entries)
        elif prefix is not None:
            chosen = [rid for rid in self._entries if rid.startswith(prefix)]
        else:
            chosen = list(ids or [])
        dispositions: dict[str, CancelDisposition] = {}
        for rid in chosen:
            entry = self._entries.get(rid)
            if entry is None:
                dispositions[rid] = CancelDisposition.NOT_FOUND
                continue
            queued = entry.status is RolloutStatus.QUEUED
            entry.scope.cancel()
            dispositions[rid] = (
                CancelDisposition.CANCELLED_QUEUED
                if queued
                else CancelDisposition.CANCELLED_RUNNING
            )
        return dispositions

    def counts(self) -> dict[str, int]:
        """``in_flight``, ``running`` and ``queued``, for ``health``."""
        running = sum(1 for e in self._entries.values() if e.status is not RolloutStatus.QUEUED)
        total = len(self._entries)
        return {"in_flight": total, "running": running, "queued": total - running}
