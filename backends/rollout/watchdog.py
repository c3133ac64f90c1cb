"""Event-loop watchdog: who blocked the loop, and time given back to those who did not.

In-process rollouts share one event loop. A workflow that calls ``time.sleep(10)`` (or
crunches numbers without awaiting) stops every other rollout for that long, and their
deadlines pass while they could not run. The watchdog makes that visible and fair:

- on the loop, a heartbeat (a timer every ``BEAT_SEC``) measures how late it ran: a lag past
  ``THRESHOLD_SEC`` is a blocked loop;
- a thread, reading the heartbeat, looks while the loop is stuck: the task running on it,
  hence the rollout (a context variable its tasks inherit), and the loop thread's stack;
- when the loop runs again the episode is settled on the loop: the rollout whose code blocked
  it is charged (its result says so, a warning names it and the line), and every other watched
  rollout's deadlines move later by the time it was blocked.

``run_phases`` watches every rollout; the cost is a context variable and a set entry per
rollout, and 20 timer callbacks a second while any rollout runs (``bench_server.py`` measures
it). ``BACKENDS_LOOP_WATCHDOG=off`` turns it off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import sys
import sysconfig
import threading
import time
import weakref
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import FrameType

import anyio

from backends.rollout.errors import ErrorCategory
from backends.rollout.request import RolloutResult

log = logging.getLogger(__name__)

BEAT_SEC = 0.05
THRESHOLD_SEC = 0.25  # a later heartbeat than this is a blocked loop
BLOCKED_FIELD = "event_loop_blocked"  # on the result of a rollout whose code blocked the loop
_MAX_PLACES = 5
ENV_SWITCH = "BACKENDS_LOOP_WATCHDOG"
ENABLED = os.environ.get(ENV_SWITCH, "on").lower() not in {"off", "0", "false", "no"}


@dataclass(eq=False)
class Watch:
    """One rollout as the watchdog sees it."""

    rollout_id: str
    scopes: list[anyio.CancelScope] = field(default_factory=list)  # deadlines to move
    blocked_sec: float = 0.0  # how long its own code blocked the loop
    places: list[str] = field(default_factory=list)  # where (file:line in function)
    credited_sec: float = 0.0  # deadline time given back: others blocked the loop
    dog: LoopWatchdog | None = None

    @contextlib.contextmanager
    def deadline(self, deadline: float) -> Iterator[anyio.CancelScope]:
        """``anyio.CancelScope(deadline=deadline)``, whose deadline moves later by the loop
        time other code blocks while inside."""
        with anyio.CancelScope(deadline=deadline) as scope:
            self.scopes.append(scope)
            try:
                yield scope
            finally:
                # Code that blocked the loop runs on without yielding to the heartbeat:
                # settle now, so the phase's deadline check sees whose time it was.
                if self.dog is not None:
                    self.dog.catch_up()
                self.scopes.remove(scope)

    def annotate(self, result: RolloutResult) -> RolloutResult:
        """``result``, saying so if this rollout's own code blocked the loop."""
        if not self.blocked_sec:
            return result
        where = ", ".join(self.places) or "an unknown place"
        blame = f"its own code blocked the event loop for {self.blocked_sec:.1f}s (at {where})"
        update: dict[str, object] = {
            "extra_fields": {
                **result.extra_fields,
                BLOCKED_FIELD: {"seconds": round(self.blocked_sec, 3), "at": self.places},
            }
        }
        failure = result.failure
        if failure is not None and failure.category is ErrorCategory.TIMEOUT:
            update["failure"] = failure.model_copy(
                update={"message": f"{failure.message}; {blame}"}
            )
        return result.model_copy(update=update)

    def _credit(self, seconds: float) -> None:
        self.credited_sec += seconds
        for scope in self.scopes:
            if math.isfinite(scope.deadline):
                scope.deadline += seconds


_current: ContextVar[Watch | None] = ContextVar("backends_loop_watch", default=None)


@contextlib.contextmanager
def watching(rollout_id: str) -> Iterator[Watch]:
    """Watch the rollout run inside (and every task it starts) on the running event loop.
    Outside asyncio (trio) the watch is inert."""
    dog = _watchdog()
    watch = Watch(rollout_id, dog=dog)
    token = _current.set(watch)
    if dog is not None:
        dog.add(watch)
    try:
        yield watch
    finally:
        if dog is not None:
            dog.discard(watch)
        _current.reset(token)


_dogs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopWatchdog] = (
    weakref.WeakKeyDictionary()
)


def _watchdog() -> LoopWatchdog | None:
    if not ENABLED:
        return None
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None  # trio
    dog = _dogs.get(loop)
    if dog is None:
        dog = _dogs[loop] = LoopWatchdog(loop)
    return dog


@dataclass(frozen=True)
class _Suspect:
    beat: int  # the heartbeat the loop was stuck after
    watch: Watch | None
    place: str


class LoopWatchdog:
    """The heartbeat and the watching thread of one event loop (made on first use)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        beat_sec: float = BEAT_SEC,
        threshold_sec: float = THRESHOLD_SEC,
    ) -> None:
        self.loop = loop
        self.beat_sec = beat_sec
        self.threshold_sec = threshold_sec
        self._loop_thread = threading.get_ident()
        self._watches: set[Watch] = set()
        self._beats = 0
        self._due = 0.0  # when the next heartbeat should run (loop time)
        self._timer: asyncio.TimerHandle | None = None
        self._suspect: _Suspect | None = None  # written by the thread, read on the loop
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, watch: Watch) -> None:
        self._watches.add(watch)
        if self._timer is None:
            self._schedule(self.loop.time())
        if self._thread is None:
            self._thread = threading.Thread(target=self._look, name="loop-watchdog", daemon=True)
            self._thread.start()
        self._wake.set()

    def discard(self, watch: Watch) -> None:
        self._watches.discard(watch)

    # -- on the loop -----------------------------------------------------------------------

    def _schedule(self, now: float) -> None:
        self._due = now + self.beat_sec
        self._timer = self.loop.call_at(self._due, self._beat)

    def catch_up(self) -> None:
        """Settle a block the heartbeat has not seen yet. Called on the loop by a rollout's
        own code: if the loop is late, nothing else ran since, so that code blocked it."""
        if self._timer is not None and self.loop.time() - self._due > self.threshold_sec:
            self._timer.cancel()
            self._beat(_current.get())

    def _beat(self, running: Watch | None = None) -> None:
        now = self.loop.time()
        lag = now - self._due
        if lag > self.threshold_sec:
            suspect = self._suspect
            if suspect is None or suspect.beat != self._beats:
                suspect = None
            if running is not None and (suspect is None or suspect.watch is not running):
                suspect = _Suspect(self._beats, running, "unknown")
            self._settle(lag, suspect)
        self._beats += 1
        if self._watches:
            self._schedule(now)
        else:
            self._timer = None  # idle: the next watched rollout starts it again

    def _settle(self, lag: float, suspect: _Suspect | None) -> None:
        culprit = suspect.watch if suspect else None
        place = suspect.place if suspect else "unknown"
        if culprit is not None:
            culprit.blocked_sec += lag
            if place not in culprit.places and len(culprit.places) < _MAX_PLACES:
                culprit.places.append(place)
        # With no culprit seen, nobody is credited: whoever blocked might be among them.
        innocent = [w for w in self._watches if w is not culprit] if suspect else []
        for watch in innocent:
            watch._credit(lag)
        if culprit is not None:
            who = f"rollout {culprit.rollout_id} at {place}"
        elif suspect is not None:
            who = f"code outside any rollout at {place}"
        else:
            who = "nothing in particular (a saturated loop, or a block too short to see)"
        # A named culprit is worth a warning; a busy loop running late, only a note.
        log.log(
            logging.WARNING if suspect is not None else logging.INFO,
            "the event loop was blocked for %.1fs by %s; %d other rollout(s) got that time "
            "added to their deadlines",
            lag, who, len(innocent),
        )  # fmt: skip

    # -- on the watching thread ------------------------------------------------------------

    def _look(self) -> None:
        while not self.loop.is_closed():
            if not self._watches:
                self._wake.clear()
                if not self._watches:  # nothing to watch: sleep until a rollout starts
                    self._wake.wait(1.0)
                continue
            time.sleep(self.beat_sec)
            beats = self._beats
            late = self.loop.time() - self._due
            stale = self._suspect is None or self._suspect.beat != beats
            if self._timer is not None and late > self.threshold_sec and stale:
                self._suspect = self._sample(beats)

    def _sample(self, beat: int) -> _Suspect:
        # Safe from another thread: a dict lookup and an immutable context mapping.
        task = asyncio.current_task(self.loop)
        watch = task.get_context().get(_current) if task is not None else None
        frame = sys._current_frames().get(self._loop_thread)
        return _Suspect(beat, watch, _place(frame))


_STDLIB = tuple(
    os.path.realpath(sysconfig.get_paths()[key]) + os.sep for key in ("stdlib", "platstdlib")
)


def _place(frame: FrameType | None) -> str:
    """The innermost frame outside the standard library, as ``file.py:12 in function``."""
    innermost = frame
    while frame is not None and os.path.realpath(frame.f_code.co_filename).startswith(_STDLIB):
        frame = frame.f_back
    frame = frame or innermost
    if frame is None:
        return "unknown"
    name = os.path.basename(frame.f_code.co_filename)
    return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"
