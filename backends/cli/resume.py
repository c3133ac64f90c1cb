"""Opening a run directory: a new run, or the rest of an earlier one.

A directory that holds a run (its ``run.json``) is resumed when the inputs are the same: the
slots without a finished try run, as do cancelled ones (a run stopped by a signal) and, with
``--retry-failed``, failures of the phases or categories named; every other result is kept.
Different inputs are refused, naming what changed. One process at a time holds a run
directory (a lock on its results file), so two resumes never interleave their lines.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends.cli.runfiles import (
    MANIFEST_FILE,
    ROLLOUTS_DIR,
    ResultRecord,
    RunFileError,
    RunManifest,
    Session,
    Slot,
    current_records,
    read_manifest,
    write_json_atomic,
)
from backends.rollout.artifacts import ENV_HOME
from backends.rollout.errors import ErrorCategory, Phase
from backends.rollout.request import ROLLOUT_ID_PATTERN

RETRY_ALL = "all"
LOCK_FILE = ".lock"


class RunDirError(ValueError):
    """The run directory cannot be used; the message says why and what to do."""


def retry_selectors(text: str | None) -> frozenset[str]:
    """``--retry-failed setup,infra_error``: phases, categories or ``all``, checked."""
    if not text:
        return frozenset()
    known = {p.value for p in Phase} | {c.value for c in ErrorCategory} | {RETRY_ALL}
    picked = frozenset(part.strip() for part in text.split(",") if part.strip())
    unknown = sorted(picked - known)
    if unknown or not picked:
        raise RunDirError(
            f"--retry-failed takes phases ({', '.join(p.value for p in Phase)}), failure "
            f"categories ({', '.join(c.value for c in ErrorCategory)}) or 'all'; "
            f"not {', '.join(unknown) or repr(text)}"
        )
    return picked


def wants_retry(record: ResultRecord, selectors: frozenset[str]) -> bool:
    """Whether a slot's current try runs again: cancelled always, failures if selected."""
    if record.status == "cancelled":
        return True
    failure = record.failure
    if failure is None or record.status != "failure":
        return False
    return bool(
        RETRY_ALL in selectors
        or str(failure.phase) in selectors
        or str(failure.category) in selectors
    )


@dataclass
class OpenRun:
    """A run directory ready for this session."""

    run_dir: Path
    manifest: RunManifest
    records: dict[Slot, ResultRecord]  # the current try of each finished slot
    session: int  # 1 for a new run
    resumed: bool
    lock_fd: int
    redo: set[Slot] = field(default_factory=set)  # finished slots this session runs again

    @property
    def run_id(self) -> str:
        return self.manifest.run_id

    def runs(self, slot: Slot) -> bool:
        """Whether this session runs ``slot``."""
        return slot not in self.records or slot in self.redo

    def rollout_id(self, slot: Slot) -> str:
        """Each session's try of a slot has its own id, so no two tries share a folder."""
        row, attempt = slot
        base = f"{self.run_id}.row-{row}-{attempt}"
        return base if self.session == 1 else f"{base}.s{self.session}"

    def save_manifest(self) -> None:
        write_json_atomic(self.run_dir / MANIFEST_FILE, self.manifest)

    def close(self) -> None:
        os.close(self.lock_fd)


def open_run(
    run_dir: Path | None,
    *,
    inputs: dict[str, Any],
    display: dict[str, str],
    rows: int,
    attempts: int,
    success_threshold: float,
    retry: frozenset[str],
    argv: list[str],
) -> OpenRun:
    """Create a run directory (``run_dir``, or a new one under ``$BACKENDS_HOME/runs``), or
    resume the run in ``run_dir``. Raises ``RunDirError`` saying why it cannot."""
    if run_dir is None:
        run_dir = _new_run_dir()
    elif run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"{run_dir} is a file: -o names the run's directory")
    manifest = _manifest(run_dir)
    if manifest is None:
        if run_dir.is_dir() and any(p.name != LOCK_FILE for p in run_dir.iterdir()):
            raise RunDirError(
                f"{run_dir} is not empty and holds no run (no {MANIFEST_FILE}): a run directory "
                "holds one run only (its files would mix with another's)"
            )
        if not ROLLOUT_ID_PATTERN.match(run_dir.name):
            raise RunDirError(
                f"{run_dir.name!r} cannot name a run (it starts every rollout id): use letters, "
                "digits, '.', '_' or '-'"
            )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunDirError(f"cannot create {run_dir}: {exc.strerror or exc}") from None
    lock_fd = _lock(run_dir)
    try:
        manifest = _manifest(run_dir)  # again, under the lock
        resumed = manifest is not None
        if manifest is None:
            manifest = RunManifest(
                run_id=run_dir.name,
                created_at=time.time(),
                inputs=inputs,
                display=display,
                success_threshold=success_threshold,
                attempts=attempts,
                rows=rows,
            )
            records: dict[Slot, ResultRecord] = {}
        else:
            if changes := manifest.changes(inputs):
                raise RunDirError(
                    f"{run_dir} holds a run of other inputs, so it cannot be resumed with "
                    f"these: {'; '.join(changes)}. Rerun with the run's own inputs, or give a "
                    "new run directory (-o)"
                )
            try:
                records = current_records(run_dir)
            except RunFileError as exc:
                raise RunDirError(str(exc)) from None
        session = len(manifest.sessions) + 1
        manifest.sessions.append(Session(started_at=time.time(), argv=argv))
        opened = OpenRun(run_dir, manifest, records, session, resumed, lock_fd)
        opened.redo = {slot for slot, r in records.items() if wants_retry(r, retry)}
        (run_dir / ROLLOUTS_DIR).mkdir(exist_ok=True)
        opened.save_manifest()
        return opened
    except BaseException:
        os.close(lock_fd)
        raise


def _manifest(run_dir: Path) -> RunManifest | None:
    try:
        return read_manifest(run_dir)
    except RunFileError as exc:
        raise RunDirError(str(exc)) from None


def _lock(run_dir: Path) -> int:
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise RunDirError(
            f"{run_dir} is in use by another `backends run` (pid {holder}): one run at a time"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _new_run_dir() -> Path:
    home = os.environ.get(ENV_HOME)
    runs = (Path(home) if home else Path.home() / ".backends") / "runs"
    while True:
        # Time first, so runs sort; random after, so two started in the same second differ;
        # mkdir without exist_ok, so no two runs ever get the same one.
        run_id = time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)
        try:
            runs.mkdir(parents=True, exist_ok=True)
            (runs / run_id).mkdir()
        except FileExistsError:
            continue
        except OSError as exc:
            raise RunDirError(
                f"cannot create a run directory under {runs}: {exc.strerror or exc}"
            ) from None
        return runs / run_id


def redacted_argv(argv: Iterable[str], secrets_: Iterable[str | None]) -> list[str]:
    from backends.trajectory import redact_text

    return [redact_text(a, secrets_) for a in argv]


__all__ = ["OpenRun", "RunDirError", "open_run", "retry_selectors", "wants_retry"]
