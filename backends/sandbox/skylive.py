"""Whether a SkyPilot sandbox still exists, for the commands that wait on one.

A pod can vanish under a running command: its lifetime ran out, a reaper terminated it, its
node was lost. The command's handle may then never answer, and a verifier would wait out its
whole timeout to report a ``timeout`` that no retry may fix. The SDK has no call for one
sandbox's state (no ``get(name)``), so the process keeps one listing (``ls``), refreshed at
most once per ``interval`` and shared by every command that asks: one call per interval
however many pods are busy.

A pod counts as lost once a listing asked for after its creation shows it failed, or leaves it
out where the listing can see: the default context and namespace, or one where an earlier
listing showed a pod of ours. A pod the listing cannot see (another cluster context) is never
judged by it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import anyio

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_SEC = 15.0
# States that mean the pod is gone or going; any other (the SDK's set is not documented beyond
# "FAILED") counts as alive, so an unfamiliar status never fails a healthy rollout.
GONE = frozenset(
    {"FAILED", "ERROR", "TERMINATED", "TERMINATING", "DELETED", "DELETING", "STOPPED", "EXPIRED"}
)

Scope = tuple[str | None, str | None]  # (context name, namespace) a pod was created in


# The longest one listing of the server's sandboxes may take before it counts as no answer.
LISTING_TIMEOUT_SEC = 10.0


@dataclass
class _Listing:
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    at: float = -math.inf  # monotonic time the last successful listing was asked for
    states: dict[str, str] = field(default_factory=dict)  # name -> status


@dataclass
class Pods:
    """This process's pods, and the latest listing of the server's."""

    pods: dict[str, tuple[Scope, float]] = field(default_factory=dict)  # name -> scope, made at
    # Where the listing is known to see: the default context and namespace, and any other
    # once a listing has shown a pod of ours made there.
    visible: set[Scope] = field(default_factory=lambda: {(None, None)})
    _latest: tuple[asyncio.AbstractEventLoop, _Listing] | None = None  # its lock is the loop's

    def created(self, name: str, scope: Scope) -> None:
        self.pods[name] = (scope, time.monotonic())

    def forget(self, name: str) -> None:
        self.pods.pop(name, None)

    def _listing(self) -> _Listing:
        loop = asyncio.get_running_loop()
        if self._latest is None or self._latest[0] is not loop:
            self._latest = (loop, _Listing())
        return self._latest[1]

    async def lost(self, sdk: Any, name: str, *, fresher_than: float) -> bool:
        """Whether a listing asked for after ``fresher_than`` (monotonic) shows ``name`` lost.

        A listing that fails says nothing (``False``): the command's own deadline remains.
        """
        if name not in self.pods:
            return False
        listing = self._listing()
        async with listing.lock:  # the first caller lists; the others read its answer
            if listing.at <= fresher_than:
                asked = time.monotonic()
                boxes = None
                # A listing that hangs says nothing either, and must not hold the command's
                # result (nor every other command waiting on this lock).
                with anyio.move_on_after(LISTING_TIMEOUT_SEC):
                    try:
                        boxes = await sdk.ls.aio()
                    except Exception as exc:
                        log.debug("could not list SkyPilot sandboxes: %s", exc)
                if boxes is None:
                    return False
                listing.states = {box.name: str(box.status).upper() for box in boxes}
                self.visible |= {s for n, (s, _) in self.pods.items() if n in listing.states}
                listing.at = asked
        return self._judged_lost(name, listing)

    def _judged_lost(self, name: str, listing: _Listing) -> bool:
        entry = self.pods.get(name)
        if entry is None:
            return False
        scope, made = entry
        if listing.at <= made:  # asked before the pod existed
            return False
        state = listing.states.get(name)
        if state is not None:
            return state.rsplit(".", 1)[-1] in GONE  # "FAILED" or "SandboxStatus.FAILED"
        return scope in self.visible


pods = Pods()
