"""What a finished trial leaves on disk: artifacts copied to their sink, secrets scrubbed from
the trial directory, and trial directories kept only as long as a bounded retention allows.

Everything here is blocking file work: callers run it on a worker thread.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import fsspec

log = logging.getLogger(__name__)

REDACTED = b"[redacted]"
# Files larger than this are removed, not scanned, if they may hold a secret.
_SCAN_LIMIT = 64 * 1024 * 1024


# Paths the host can still open by name (the kernel's PATH_MAX is 4096) and a depth os.walk and
# os.fwalk can recurse to; a sandbox may leave deeper trees than either.
PATH_LIMIT = 4000
DEPTH_LIMIT = 256


def drop_unreachable(root: Path) -> int:
    """Remove what lies too deep under ``root`` to be handled by name; return subtrees removed.

    Directories are opened relative to their parent's fd, so nothing here needs a long path.
    """
    removed = 0
    base_depth = str(root).count("/")
    for folder, dirs, _files, folder_fd in os.fwalk(root, follow_symlinks=False):
        too_deep = folder.count("/") - base_depth >= DEPTH_LIMIT
        for name in list(dirs):
            if too_deep or len(os.fsencode(folder)) + len(os.fsencode(name)) + 1 > PATH_LIMIT:
                log.warning("%s: removing %s/%s, nested too deep to keep", root, folder, name)
                shutil.rmtree(name, dir_fd=folder_fd)
                dirs.remove(name)
                removed += 1
    return removed


def regular_files(root: Path) -> Iterable[Path]:
    """Regular files under ``root``; symlinks (which the sandbox may have planted) are skipped."""
    for folder, dirs, files in os.walk(root, followlinks=False):
        base = Path(folder)
        dirs[:] = [d for d in dirs if not (base / d).is_symlink()]
        for name in files:
            path = base / name
            if not path.is_symlink() and path.is_file():
                yield path


def scrub_secrets(root: Path, secrets: Iterable[str | None]) -> int:
    """Replace every secret in every file under ``root`` with ``[redacted]``; return files changed.

    Harbor saves the agent's kwargs (a model-driven agent's key among them) in clear in
    config.json and result.json, and an agent may echo its key into its logs. Fail closed: a
    file that cannot be rewritten is deleted.
    """
    needles = sorted({s.encode() for s in secrets if s and len(s) >= 8}, key=len, reverse=True)
    if not needles:
        return 0
    changed = drop_unscannable(root)
    for path in regular_files(root):
        try:
            data = path.read_bytes()
            scrubbed = data
            for needle in needles:
                scrubbed = scrubbed.replace(needle, REDACTED)
            if scrubbed != data:
                path.write_bytes(scrubbed)
                changed += 1
        except OSError as exc:
            log.warning("cannot scrub %s (%s): removing it", path, exc)
            path.unlink(missing_ok=True)
            changed += 1
    return changed


def drop_unscannable(root: Path) -> int:
    """Remove the files under ``root`` too large to scan for secrets; return how many.

    What the sandbox left may be huge (a sparse file counts in full once downloaded); a
    scrub that reads files whole (ours, and Harbor's own at the end of a trial) must never
    read one of those. Fail closed: a file that may hold a secret and cannot be scanned goes.
    """
    removed = 0
    for path in regular_files(root):
        try:
            if path.stat().st_size > _SCAN_LIMIT:
                log.warning("%s: removing %s, too large to scan for secrets", root, path)
                path.unlink()
                removed += 1
        except OSError as exc:
            log.warning("cannot check %s (%s): removing it", path, exc)
            path.unlink(missing_ok=True)
            removed += 1
    return removed


class ArtifactSink:
    """Where a rollout's artifacts go: an fsspec URL (a local directory by default).

    A rollout's files land under ``<url>/<rollout id>/artifacts/``, mirroring the trial's
    ``artifacts/`` folder (``logs/artifacts/...`` for what the agent wrote under
    /logs/artifacts, the task's configured paths beside it, and Harbor's manifest.json).
    """

    def __init__(self, url: str | Path) -> None:
        self.url = str(url)
        self.fs, self.root = fsspec.core.url_to_fs(self.url)

    @property
    def local_root(self) -> Path | None:
        """The sink's directory when it is on this machine's disk, else ``None``."""
        protocol = self.fs.protocol
        protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
        return Path(self.root) if "file" in protocols or "local" in protocols else None

    def location(self, rollout_id: str) -> str:
        return f"{self.root.rstrip('/')}/{rollout_id}/artifacts"

    def store(self, rollout_id: str, source: Path) -> list[str]:
        """Copy the regular files under ``source`` to the rollout's place; return their paths.

        A previous run's files under the same rollout id are removed first, so what is there
        belongs to this run.
        """
        target = self.location(rollout_id)
        if self.fs.exists(target):
            self.fs.rm(target, recursive=True)
        stored = []
        for path in regular_files(source) if source.is_dir() else []:
            relative = path.relative_to(source).as_posix()
            remote = f"{target}/{relative}"
            self.fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)
            self.fs.put_file(str(path), remote)
            stored.append(relative)
        return stored


@dataclass(frozen=True)
class Retention:
    """How many failed trial directories stay, and how much disk they may take together.

    Successful trials are removed as soon as their results are collected (unless asked to
    keep them); failed ones stay for diagnosis, oldest removed first past either bound. The
    trials directory is scanned once; after that each finished trial costs the same however
    many others are in flight (their directories are never looked at again).
    """

    keep_successful: bool = False
    max_failed: int = 100
    max_failed_mb: int = 1024
    _kept: dict[Path, tuple[float, int]] = field(default_factory=dict, compare=False)
    _scanned: list[bool] = field(default_factory=list, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False)

    def finish(
        self, trial_dir: Path, *, succeeded: bool, active: frozenset[str] = frozenset()
    ) -> None:
        if succeeded and not self.keep_successful:
            shutil.rmtree(trial_dir, ignore_errors=True)
            return
        with self._lock:
            if not self._scanned:
                self._kept.update(_entries(trial_dir.parent, active | {trial_dir.name}))
                self._scanned.append(True)
            entry = _entry(trial_dir)
            if entry is not None:
                self._kept[trial_dir] = entry
            doomed = _past_bounds(self._kept, self.max_failed, self.max_failed_mb)
            for path in doomed:
                del self._kept[path]
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)

    def prune(self, trials_dir: Path, *, active: frozenset[str] = frozenset()) -> list[Path]:
        """Remove the oldest trial directories past the bounds; return those removed.

        Directories named in ``active`` (trials still running) are neither counted nor removed.
        """
        entries = _entries(trials_dir, active)
        removed = _past_bounds(entries, self.max_failed, self.max_failed_mb)
        for path in removed:
            shutil.rmtree(path, ignore_errors=True)
        return removed


def _entry(path: Path) -> tuple[float, int] | None:
    """(mtime, disk use) of a trial directory; None if it is not one (or is gone)."""
    try:
        if path.is_symlink() or not path.is_dir():
            return None
        return path.stat().st_mtime, _size(path)
    except FileNotFoundError:  # removed meanwhile (another trial's pruning)
        return None


def _entries(trials_dir: Path, active: frozenset[str]) -> dict[Path, tuple[float, int]]:
    found = {}
    for child in trials_dir.iterdir() if trials_dir.is_dir() else []:
        if child.name not in active and (entry := _entry(child)) is not None:
            found[child] = entry
    return found


def _past_bounds(entries: dict[Path, tuple[float, int]], count: int, mb: int) -> list[Path]:
    """The directories to remove, oldest first past ``count`` or ``mb`` (newest kept)."""
    budget = mb * 1024 * 1024
    kept = used = 0
    doomed = []
    for path, (_, size) in sorted(entries.items(), key=lambda item: item[1][0], reverse=True):
        if kept < count and used + size <= budget:
            kept += 1
            used += size
        else:
            doomed.append(path)
    return doomed


def _size(root: Path) -> int:
    total = 0
    for path in regular_files(root):
        try:
            total += path.stat().st_blocks * 512
        except OSError:
            continue
    return total
