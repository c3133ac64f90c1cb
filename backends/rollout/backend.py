"""The contract every execution backend honours, so servers and drivers treat them alike."""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from backends.rollout.request import RolloutRequest, RolloutResult, RolloutStatus


class CancelDisposition(StrEnum):
    CANCELLED_QUEUED = "cancelled_queued"
    CANCELLED_RUNNING = "cancelled_running"
    NOT_FOUND = "not_found"


@runtime_checkable
class ExecutionBackend(Protocol):
    """Runs rollouts. Failures are results, not exceptions.

    ``execute`` returns a ``RolloutResult`` for every request it accepts: a workflow error, a
    timeout, a sandbox fault or a cancellation each become a failed result with its category.
    It raises only when its own caller is cancelled (the cancellation propagates).
    """

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
