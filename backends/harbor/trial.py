"""Building and running one Harbor ``Trial`` under our cancellation rules.

Building a trial for a local task is synchronous work behind Harbor's async ``Trial.create``
(loading and validating the task, hashing its files for the trial's lock, making the trial's
directories and loggers, constructing its environment): 10-20 ms of CPU in one piece. On the
serving loop, with thousands of rollouts in flight, that piece was every other rollout's lag
(the loop's p99 lag over 100 ms in ``bench_scale.py``), so it is built in a worker thread, and the task's hashes are computed once per version of the
task (``backends.harbor.taskhash``).

Harbor's trial cleans up when its task is cancelled once (records the cancellation, recovers
outputs, stops the sandbox under ``asyncio.shield``) and re-raises. A cancel scope would
cancel every await of that cleanup again, and the shielded stop would finish after we had
returned. So the trial runs in a task of its own, is cancelled exactly once, and is waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import anyio
from harbor.models.trial.config import TrialConfig
from harbor.models.trial.result import TrialResult
from harbor.trial.trial import Trial

from backends.harbor import taskhash

# How long a cancelled trial may take to stop its sandbox before we stop waiting.
TEARDOWN_TIMEOUT_SEC = 60.0
# Trials built at once, each in a thread: CPU-bound, so more would only share the GIL.
BUILDERS = anyio.CapacityLimiter(2)


async def create_trial(config: TrialConfig) -> Trial:
    """``Trial.create(config)``, run to completion in a worker thread on a loop of its own,
    holding no file descriptor for its log (``hold_no_log_file``).

    Nothing it makes is bound to that loop for a trial without a user agent (whose bridge
    Harbor would start there), which is all this package builds. A cancelled caller waits
    for the thread (milliseconds): nothing is left running.
    """
    taskhash.install()
    if config.user_agent is not None:
        trial = await Trial.create(config)
        hold_no_log_file(trial)
        return trial
    return await anyio.to_thread.run_sync(_create_blocking, config, limiter=BUILDERS)


def _create_blocking(config: TrialConfig) -> Trial:
    trial = asyncio.run(Trial.create(config))
    hold_no_log_file(trial)
    return trial


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


class _AppendPerRecord(logging.FileHandler):
    """A trial log that holds no file descriptor between records."""

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        self.close()  # the next record reopens it, in append mode


def hold_no_log_file(trial: Trial) -> None:
    """Swap the trial's log handler for one that opens ``trial.log`` per record.

    Harbor keeps each trial's log open for the trial's life: one descriptor per rollout in
    flight, which runs thousands of rollouts into the process's limit.
    """
    old = trial._log_handler
    if not isinstance(old, logging.FileHandler) or isinstance(old, _AppendPerRecord):
        return
    new = _AppendPerRecord(old.baseFilename, delay=True)
    new.setLevel(old.level)
    new.setFormatter(old.formatter)
    trial.logger.removeHandler(old)
    old.close()
    trial.logger.addHandler(new)
    trial._log_handler = new


_suffixes: set[str] = set()  # names Harbor gives below a trial's logger (".harbor.agents")
_recent: dict[str, None] = {}  # finished trials' loggers, for the next sweep (oldest first)
_swept_at = 0  # the registry's size after the last sweep


def forget_loggers(trial: Trial) -> None:
    """Drop the loggers Harbor made for this trial (about eight) once it is over.

    Harbor names a logger (and its environment's and agent's) after each trial, and the
    logging module keeps every logger ever named: a long-running orchestrator would keep them
    all. The names below a trial's are learnt by an occasional sweep (when the registry has
    doubled), then dropped directly: constant work per trial however many run.
    """
    global _swept_at
    registry = logging.Logger.manager.loggerDict
    name = trial.logger.name
    for suffix in ("", *_suffixes):
        registry.pop(name + suffix, None)
    _recent[name] = None
    if len(_recent) > 4096:
        del _recent[next(iter(_recent))]
    if len(registry) < max(256, 2 * _swept_at):
        return
    for key in list(registry):
        owner = _finished_owner(key)
        if owner is not None:
            _suffixes.add(key[len(owner) :])
            del registry[key]
    _recent.clear()
    _swept_at = len(registry)


def _finished_owner(key: str) -> str | None:
    """The finished trial's logger name ``key`` is or is below, if any."""
    end = len(key)
    while end > 0:
        if key[:end] in _recent:
            return key[:end]
        end = key.rfind(".", 0, end)
    return None
