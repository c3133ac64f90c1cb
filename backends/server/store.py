"""The server's durable state: one SQLite file, written by one thread with group commit.

What "durable" means here: ``accept`` and ``finish`` return futures that resolve only once
the row is committed, and the server answers 202 (acceptance) and serves a final result only
after that. The file runs in WAL mode with ``synchronous=NORMAL``: a commit survives the
server process dying (kill -9, OOM, a crash), which is what a training run meets; on power
loss or an OS crash the last few commits may roll back (pass ``synchronous="FULL"`` to pay
an fsync per batch and keep those too). Many requests in flight share one transaction, so
the cost per rollout stays small under load while each one still waits for its own commit.

The LLM API key of a rollout is never written here: callers store requests without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
ACCEPTED = "accepted"  # in flight: running states are not persisted, a restart cannot resume them

_SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    rollout_id   TEXT PRIMARY KEY,
    status       TEXT NOT NULL,
    lease_sha256 TEXT NOT NULL,
    accepted_at  REAL NOT NULL,
    finished_at  REAL,
    request      TEXT NOT NULL,
    result       TEXT
);
CREATE INDEX IF NOT EXISTS rollouts_by_finish ON rollouts (finished_at);
"""

_INSERT = (
    "INSERT OR REPLACE INTO rollouts (rollout_id, status, lease_sha256, accepted_at, request) "
    "VALUES (?, ?, ?, ?, ?)"
)
_FINISH = "UPDATE rollouts SET status = ?, finished_at = ?, result = ? WHERE rollout_id = ?"
_DELETE = "DELETE FROM rollouts WHERE rollout_id = ?"


class StateFileBusyError(RuntimeError):
    """Another live server holds this state file."""


class StoreFailedError(RuntimeError):
    """The writer thread has stopped: nothing more can be committed until a restart."""


@dataclass(frozen=True, slots=True)
class StoredRollout:
    """A row as loaded at start-up."""

    rollout_id: str
    status: str
    lease_sha256: str
    finished_at: float | None
    result: str | None


_Op = tuple[str, tuple[Any, ...], "asyncio.Future[None] | None"]
_STOP: Any = object()


class Store:
    """A SQLite state file with a single writer thread.

    Open it with ``open()`` from inside the event loop that will await its futures; close it
    with ``aclose()``, which commits everything queued before returning. One process at a
    time: a second server on the same file gets ``StateFileBusyError``. A write that fails
    fails its own future only; should the writer thread itself stop, ``failure`` says why and
    every write fails at once with ``StoreFailedError``.
    """

    def __init__(self, path: Path | str, *, synchronous: str = "NORMAL") -> None:
        if synchronous.upper() not in {"OFF", "NORMAL", "FULL", "EXTRA"}:
            raise ValueError(f"synchronous must be OFF, NORMAL, FULL or EXTRA, not {synchronous!r}")
        self.path = Path(path)
        self.synchronous = synchronous.upper()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conn: sqlite3.Connection | None = None
        self._lock_fd: int | None = None
        self.failure: str | None = None  # why the writer stopped, if it did
        self.batches = 0  # commits so far: lets tests and benchmarks see the grouping

    # -- lifecycle -------------------------------------------------------------------------

    def open(
        self,
        *,
        retention_sec: float,
        interrupted: Callable[[str], tuple[str, str]],
    ) -> list[StoredRollout]:
        """Open (or create) the file and return every retained rollout.

        Rows past retention are deleted. Rows still in flight belong to a server that died:
        ``interrupted(rollout_id)`` gives each its final ``(status, result_json)``, committed
        before this returns, so they are never lost and never read as a reward.
        """
        self._loop = asyncio.get_running_loop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock()
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._conn = conn
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={self.synchronous}")
        conn.executescript(_SCHEMA)
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        now = time.time()
        with _transaction(conn):
            conn.execute(
                "DELETE FROM rollouts WHERE finished_at IS NOT NULL AND finished_at < ?",
                (now - retention_sec,),
            )
            lost = [
                row[0]
                for row in conn.execute(
                    "SELECT rollout_id FROM rollouts WHERE status = ?", (ACCEPTED,)
                )
            ]
            for rid in lost:
                status, result = interrupted(rid)
                conn.execute(_FINISH, (status, now, result, rid))
        rows = [
            StoredRollout(*row)
            for row in conn.execute(
                "SELECT rollout_id, status, lease_sha256, finished_at, result FROM rollouts"
            )
        ]
        if lost:
            log.warning(
                "%d rollout(s) were in flight when the previous server stopped; "
                "they are reported as infrastructure failures",
                len(lost),
            )
        self._thread = threading.Thread(target=self._write_loop, name="rollout-store", daemon=True)
        self._thread.start()
        return rows

    async def aclose(self) -> None:
        """Commit what is queued, stop the writer and close the file."""
        if self._thread is not None:
            self._queue.put(_STOP)
            thread = self._thread
            await asyncio.get_running_loop().run_in_executor(None, thread.join)
            self._thread = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- writes ----------------------------------------------------------------------------

    def accept(
        self, rollout_id: str, lease_sha256: str, accepted_at: float, request_json: str
    ) -> asyncio.Future[None]:
        """Record an accepted rollout; the future resolves once it is committed."""
        return self._submit(
            _INSERT, (rollout_id, ACCEPTED, lease_sha256, accepted_at, request_json)
        )

    def finish(
        self, rollout_id: str, status: str, finished_at: float, result_json: str
    ) -> asyncio.Future[None]:
        """Record a final result; the future resolves once it is committed."""
        return self._submit(_FINISH, (status, finished_at, result_json, rollout_id))

    def forget(self, rollout_id: str) -> None:
        """Delete a rollout past retention (nobody waits for this one)."""
        if self.failure is None:
            self._queue.put((_DELETE, (rollout_id,), None))

    def _submit(self, sql: str, params: tuple[Any, ...]) -> asyncio.Future[None]:
        if self._thread is None or self._loop is None:
            raise RuntimeError("the store is not open")
        if self.failure is not None:
            raise StoreFailedError(self.failure)
        future: asyncio.Future[None] = self._loop.create_future()
        self._queue.put((sql, params, future))
        return future

    # -- the writer thread -----------------------------------------------------------------

    def _write_loop(self) -> None:
        assert self._conn is not None and self._loop is not None
        conn, loop = self._conn, self._loop
        stopping = False
        batch: list[_Op] = []
        try:
            while not stopping:
                batch = []
                item = self._queue.get()
                # Take everything queued meanwhile: one commit covers the whole batch.
                while True:
                    if item is _STOP:
                        stopping = True
                    else:
                        batch.append(item)
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                if not batch:
                    continue
                errors = self._commit(conn, batch)
                self.batches += 1
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
                    loop.call_soon_threadsafe(_resolve, batch, errors)
        except BaseException as exc:
            # Only a bug gets here (_commit catches every error of a write). Say so loudly and
            # fail every waiter: a dead writer must never leave a request hanging.
            log.critical("the state file writer stopped", exc_info=exc)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._writer_died, batch, exc)

    def _writer_died(self, batch: list[Any], exc: BaseException) -> None:
        # On the event loop, the only thread that submits: nothing is queued after this.
        self.failure = f"the state file writer stopped: {type(exc).__name__}: {exc}"
        pending = list(batch)
        while True:
            try:
                pending.append(self._queue.get_nowait())
            except queue.Empty:
                break
        # Fail every waiter. What broke the writer may be a malformed item: trust no shape.
        for item in pending:
            future = item[-1] if isinstance(item, tuple) and item else None
            if isinstance(future, asyncio.Future) and not future.done():
                future.set_exception(StoreFailedError(self.failure))

    @staticmethod
    def _commit(conn: sqlite3.Connection, batch: list[_Op]) -> dict[int, BaseException]:
        # Any error, not only sqlite3.Error: a value SQLite cannot take (a lone surrogate, a
        # huge int) raises something else, and must fail its own write, not the writer.
        try:
            with _transaction(conn):
                for sql, params, _ in batch:
                    conn.execute(sql, params)
            return {}
        except Exception:
            # One bad statement must not fail its neighbours: retry each on its own.
            errors: dict[int, BaseException] = {}
            for i, (sql, params, _) in enumerate(batch):
                try:
                    with _transaction(conn):
                        conn.execute(sql, params)
                except Exception as exc:
                    log.error("state file write failed: %s", exc)
                    errors[i] = exc
            return errors

    def _lock(self) -> None:
        lock_path = self.path.with_name(self.path.name + ".lock")
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StateFileBusyError(
                f"state file {self.path} is in use by another rollout server"
            ) from None
        self._lock_fd = fd


@contextlib.contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        # SQLite rolls back on its own after some errors (disk full, I/O error); a second
        # ROLLBACK would then fail and hide the real error.
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _resolve(batch: list[_Op], errors: dict[int, BaseException]) -> None:
    for i, (_, _, future) in enumerate(batch):
        if future is None or future.done():
            continue
        error = errors.get(i)
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
