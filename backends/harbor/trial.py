"""Running one Harbor ``Trial`` under our cancellation rules.

Harbor's trial cleans up when its task is cancelled once (records the cancellation, recovers
outputs, stops the sandbox under ``asyncio.shield``) and re-raises. A cancel scope would
cancel every await of that cleanup again, and the shielded stop would finish after we had
returned. So the trial runs in a task of its own, is cancelled exactly once, and is waited for.
"""

from __future__ import annotations

import asyncio
import contextlib

import anyio
from harbor.models.trial.result import TrialResult
from harbor.trial.trial import Trial

# How long a cancelled trial may take to stop its sandbox before we stop waiting.
TEARDOWN_TIMEOUT_SEC = 60.0


async def run_to_end(trial: Trial) -> TrialResult:
    """``trial.run()``; if the caller is cancelled, cancel the trial and wait for its teardown."""
    task = asyncio.ensure_future(trial.run())
    try:
        return await asyncio.shield(task)
    except BaseException:
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True), anyio.move_on_after(TEARDOWN_TIMEOUT_SEC):
                await asyncio.wait([task])
        if task.done() and not task.cancelled():
            with contextlib.suppress(BaseException):
                task.exception()  # retrieved: its outcome no longer matters
        raise
