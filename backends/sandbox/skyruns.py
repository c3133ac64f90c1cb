"""Which run owns which SkyPilot sandbox, so none outlives its run for long.

Every sandbox name starts ``bk-<run id>-``. The run id is this process's, recorded with its
owner (pid and start time, and the host, boot and pid namespace that pid belongs to) under
``$BACKENDS_HOME/skypilot-runs/`` when it creates its first sandbox. At exit the run terminates what it still holds; after a crash, the next start (or
``backends sandbox reap``) finds the runs whose owner is gone and terminates their sandboxes.
A sandbox whose run is not recorded on this host (or was recorded from another pid namespace
sharing the directory) belongs to someone else and is left alone;
its lifetime (``ttl_sec``) reaps it in the end.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import re
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
from harbor.environments.skypilot import _sanitize_dns_name

from backends.rollout.artifacts import ENV_HOME
from backends.sandbox import owners

log = logging.getLogger(__name__)

NAME = re.compile(r"^bk-([0-9a-f]{8})-")
MAX_NAME = 53  # Harbor 0.25.0's limit for sandbox names (not documented by SkyPilot)


def runs_dir() -> Path:
    home = os.environ.get(ENV_HOME)
    return (Path(home) if home else Path.home() / ".backends") / "skypilot-runs"


@dataclass
class Run:
    id: str
    registered: bool = False
    live: set[str] = field(default_factory=set)  # names tried or created, not terminated
    held: set[str] = field(default_factory=set)  # those of ``live`` the server said it made

    @property
    def record(self) -> Path:
        return runs_dir() / self.id

    def register(self) -> None:
        """Record this process as the run's owner (once), before its first sandbox."""
        if self.registered:
            return
        self.record.parent.mkdir(parents=True, exist_ok=True)
        self.record.write_text(
            f"{os.getpid()} {owners.start_time(os.getpid())} {owners.host_identity()}\n"
        )
        self.registered = True
        atexit.register(self.close)

    def close(self) -> None:
        """Terminate what this run still holds, and forget the run only once none of it can
        be left: a terminate that fails (the API server unreachable at exit) keeps the
        record, so the next start finds the owner dead and reaps (as after a crash)."""
        if self.live:
            from backends.sandbox import skysdk

            try:
                self.live -= release(skysdk.load(), sorted(self.live))
            except Exception as exc:
                # Names whose create failed may never have been made: no one to warn about
                # (the record stays, so the next start's reaper still looks for them).
                held = sorted(self.live & self.held)
                if held:
                    log.warning(
                        "could not terminate this run's SkyPilot sandboxes (%s): %s",
                        ", ".join(held),
                        exc,
                    )
                else:
                    log.info("could not look for this run's failed SkyPilot creates: %s", exc)
            self.held &= self.live
        if not self.live:
            with contextlib.suppress(FileNotFoundError):
                self.record.unlink()


_current: Run | None = None

# This process's sandbox creations: attempts, and retries of transient failures among them.
# Creates are calls to the server: one may make a batch of sandboxes.
counters = {"creates": 0, "create_retries": 0, "sandboxes_created": 0}


_current_lock = threading.Lock()  # sandboxes are constructed in trial-building threads too


def current() -> Run:
    global _current
    with _current_lock:
        if _current is None:
            _current = Run(uuid.uuid4().hex[:8])
        return _current


def sandbox_name(run: Run, session_id: str, retry: int = 1) -> str:
    """A DNS-safe name of at most 53 characters that keeps the run's prefix.

    Sanitizing lowercases and maps ``._`` to ``-``, so ids such as ``Row-A`` and ``row-a`` or
    ``a.b`` and ``a_b`` would meet: whenever it changed the id, a hash of the exact id is
    appended, so each sandbox keeps a name of its own.
    """
    prefix = f"bk-{run.id}-"
    exact = f"{session_id}-r{retry}" if retry > 1 else session_id
    room = MAX_NAME - len(prefix)
    slug = _sanitize_dns_name(exact, max_len=room)
    if slug != exact:
        digest = hashlib.sha256(exact.encode()).hexdigest()[:10]
        slug = f"{slug[: room - len(digest) - 1].rstrip('-')}-{digest}"
    return prefix + slug


def batch_name(run: Run) -> str:
    """A fresh name for a batch create; the SDK names its members ``<name>-0001``, ..."""
    return f"bk-{run.id}-b{uuid.uuid4().hex[:8]}"


def member_name(batch: str, index: int) -> str:
    """The documented name of a batch create's ``index``-th sandbox (from 1)."""
    return f"{batch}-{index:04d}"


def run_of(name: str) -> str | None:
    match = NAME.match(name)
    return match.group(1) if match else None


def owner_state(run_id: str) -> str:
    """``"alive"``, ``"dead"`` (recorded here, its owner gone) or ``"unknown"`` (not ours).

    A record made on another host, boot or pid namespace (a shared ``$BACKENDS_HOME``) is
    unknown: its pid means nothing in this ``/proc``, so its run is never judged dead here.
    """
    try:
        pid, start, host = (runs_dir() / run_id).read_text().split(maxsplit=2)
    except (FileNotFoundError, ValueError):
        return "unknown"
    if host.strip() != owners.host_identity():
        return "unknown"
    return "alive" if owners.start_time(int(pid)) == start else "dead"


_admission: dict[tuple[int, int], anyio.Semaphore] = {}


@contextlib.asynccontextmanager
async def admission(limit: int) -> AsyncIterator[None]:
    """At most ``limit`` creations in flight in this process (per event loop)."""
    import asyncio

    key = (id(asyncio.get_running_loop()), limit)
    sem = _admission.get(key)
    if sem is None:
        sem = _admission[key] = anyio.Semaphore(limit)
    async with sem:
        yield


def terminate(sdk: ModuleType, names: list[str]) -> list[str]:
    """Terminate these sandboxes by name (sync SDK); returns the names terminated."""
    return _terminate(sdk, names)[0]


def release(sdk: ModuleType, names: list[str]) -> set[str]:
    """Terminate these sandboxes; returns the names now gone (terminated, or not listed)."""
    done, absent = _terminate(sdk, names)
    return {*done, *absent}


def _terminate(sdk: ModuleType, names: list[str]) -> tuple[list[str], list[str]]:
    done, absent = [], []
    by_name = {s.name: s for s in sdk.ls()}
    for name in names:
        box = by_name.get(name)
        if box is None:
            absent.append(name)
            continue
        try:
            box.terminate(wait=True)
            done.append(name)
        except Exception as exc:
            log.warning("could not terminate SkyPilot sandbox %s: %s", name, exc)
    return done, absent


def listing(sdk: ModuleType) -> list[dict[str, Any]]:
    """This server's sandboxes with the run that owns each and its owner's state."""
    rows = []
    for box in sdk.ls():
        run_id = run_of(box.name)
        rows.append(
            {
                "name": box.name,
                "status": getattr(box, "status", "?"),
                "run": run_id,
                "owner": owner_state(run_id) if run_id else "not ours",
            }
        )
    return rows


def reap(sdk: ModuleType, runs: set[str] | None = None) -> list[str]:
    """Terminate the sandboxes of runs whose owner died (or of ``runs``, if named).

    Returns the names terminated; forgets each dead run's record once it holds nothing.
    """
    rows = listing(sdk)
    doomed = [
        r["name"]
        for r in rows
        if r["run"] and (r["run"] in runs if runs is not None else r["owner"] == "dead")
    ]
    done = terminate(sdk, doomed) if doomed else []
    left = {run_of(r["name"]) for r in rows if r["name"] not in done}
    for record in runs_dir().glob("*") if runs_dir().is_dir() else []:
        if record.name not in left and owner_state(record.name) == "dead":
            record.unlink(missing_ok=True)
    if done:
        log.warning(
            "terminated %d SkyPilot sandbox(es) of dead runs: %s", len(done), ", ".join(done)
        )
    return done
