"""The bundle cache's bookkeeping: who uses which entry, and pruning the ones nobody uses.

Entries are the built bundles (``bundles/<key>/``), the installed environments
(``environments/<key>/``), the wheelhouses (``bundles/wheelhouse/<target>/``) and the agent
runtimes (``runtimes/<name>-<key>/``, ``backends.runtimes``). Whoever
uses an entry holds a shared ``flock`` on its lock file (``<entry>.lock``) for as long as it
does: a backend for its whole life, a build while it links wheels. An install, and a removal,
hold it exclusively. So ``prune`` removes only entries nobody holds, in this process or any
other, and a crashed user's hold goes with its process. Each use stamps the entry, so pruning
by size goes least recently used first.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from backends.sandbox.settings import cache_dir

log = logging.getLogger(__name__)

STAMP = ".last-used"
COMPLETE = ".complete"  # a finished environment's or runtime's marker, written last
SIZE_FILE = ".size"
WHEELHOUSE = "wheelhouse"
# A stage dir (``.<key>.*``) this old belongs to a build or install that died.
STALE_STAGE_SEC = 24 * 3600
DEFAULT_MAX_BYTES = 20 * 1024**3
MAX_BYTES_ENV = "BACKENDS_BUNDLE_CACHE_MAX"
_SIZE_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


class Hold:
    """A held lock on one cache entry; ``release()`` (or the process's end) lets it go."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def release(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    @property
    def held(self) -> bool:
        return self.fd >= 0

    def __del__(self) -> None:  # a hold nobody keeps is no use of the entry
        self.release()


def lock_path(entry: Path) -> Path:
    return entry.with_name(entry.name + ".lock")


def try_hold(entry: Path, *, exclusive: bool = False) -> Hold | None:
    """Hold ``entry`` now, or ``None`` if someone holds it the other way (or at all, exclusive)."""
    path = lock_path(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        # A pruner unlinks the lock file of what it removed, while holding it: a lock taken
        # on that old file protects nothing, so take the one now at the path.
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return Hold(fd)
        os.close(fd)


def hold_blocking(entry: Path, *, exclusive: bool = False, poll_sec: float = 0.1) -> Hold:
    while (found := try_hold(entry, exclusive=exclusive)) is None:
        time.sleep(poll_sec)
    return found


async def hold(entry: Path, *, exclusive: bool = False, poll_sec: float = 0.1) -> Hold:
    """``try_hold`` until it succeeds, waiting off the event loop."""
    while True:  # flock has no async form: poll
        if (found := try_hold(entry, exclusive=exclusive)) is not None:
            return found
        await anyio.sleep(poll_sec)


async def hold_built(entry: Path, build: Callable[[], Awaitable[None]]) -> Hold:
    """Hold ``entry`` once it is complete (``entry/.complete``), calling ``build`` first if not.

    The build runs under the entry's exclusive lock, so concurrent callers in any process
    build once and the others find it built. A new build prunes the cache to its bound.
    """
    built = False
    while True:
        held = await hold(entry)
        if (entry / COMPLETE).is_file():
            break
        held.release()
        builder = await hold(entry, exclusive=True)
        try:
            if not (entry / COMPLETE).is_file():
                await build()
                built = True
        finally:
            builder.release()
    stamp(entry)
    if built:
        await anyio.to_thread.run_sync(prune_to_bound)
    return held


def stamp(entry: Path) -> None:
    """Record a use of ``entry`` (pruning by size removes the least recently used first)."""
    try:
        (entry / STAMP).touch()
    except OSError as exc:  # a read-only cache still works; it just prunes less well
        log.debug("could not stamp %s: %s", entry, exc)


def disk_size(path: Path) -> int:
    """Bytes of the files under ``path``, a hard-linked file counted once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for base, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(base, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def entry_size(entry: Path) -> int:
    """``entry``'s own size, measured once and kept beside it (entries never change)."""
    recorded = entry / SIZE_FILE
    try:
        return int(recorded.read_text())
    except (OSError, ValueError):
        pass
    size = disk_size(entry)
    try:
        recorded.write_text(str(size))
    except OSError:
        pass
    return size


def parse_size(text: str) -> int:
    """``"20G"``, ``"500m"``, ``"1024"`` as bytes; ``ValueError`` otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not match:
        raise ValueError(f"not a size: {text!r} (e.g. 20G, 500M)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


def parse_age(text: str) -> float:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"90s"`` as seconds; ``ValueError`` otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*", text.lower())
    if not match:
        raise ValueError(f"not a duration: {text!r} (e.g. 7d, 12h, 30m)")
    return float(match.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]


def configured_max_bytes() -> int | None:
    """The cache's size bound: ``BACKENDS_BUNDLE_CACHE_MAX`` (``none`` for no bound), or 20 GiB."""
    text = os.environ.get(MAX_BYTES_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_BYTES
    if text.lower() in {"none", "off"}:
        return None
    return parse_size(text)


@dataclass
class Entry:
    kind: str  # "environment", "bundle", "wheel" or "runtime"
    path: Path
    size_bytes: int
    last_used: float
    bundle: str | None = None  # an environment's bundle key

    def describe(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "path": str(self.path),
            "size_bytes": self.size_bytes,
            "last_used": self.last_used,
        }


@dataclass
class PruneReport:
    removed: list[Entry] = field(default_factory=list)
    in_use: list[Entry] = field(default_factory=list)  # would have gone, but are held
    kept_bytes: int = 0

    @property
    def freed_bytes(self) -> int:
        return sum(e.size_bytes for e in self.removed)


def _last_used(entry: Path) -> float:
    for probe in (entry / STAMP, entry):
        try:
            return probe.stat().st_mtime
        except OSError:
            continue
    return 0.0


def _environments(root: Path) -> list[Entry]:
    found = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if path.name.startswith(".") or not path.is_dir():
            continue
        try:
            bundle = json.loads((path / ".complete").read_text()).get("bundle")
        except (OSError, ValueError):
            bundle = None  # an install that never finished is removed like any other
        found.append(Entry("environment", path, entry_size(path), _last_used(path), bundle))
    return found


def _runtimes(root: Path) -> list[Entry]:
    return [
        Entry("runtime", path, entry_size(path), _last_used(path))
        for path in (sorted(root.iterdir()) if root.is_dir() else [])
        if not path.name.startswith(".") and path.is_dir()
    ]


def _bundles(root: Path) -> list[Entry]:
    found = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if path.name.startswith(".") or path.name == WHEELHOUSE or not path.is_dir():
            continue
        # The wheels are hard links into the wheelhouse: a bundle's own bytes are the rest.
        own = sum(
            p.stat().st_blocks * 512
            for p in path.rglob("*")
            if p.is_file() and not (p.parent.name == "wheels" and p.stat().st_nlink > 1)
        )
        found.append(Entry("bundle", path, own, _last_used(path), path.name))
    return found


def _unused_wheels(wheelhouse: Path) -> list[Entry]:
    """Wheels no bundle links any more (their only name is the wheelhouse's).

    A wheel's last use is when its last bundle let go of it: unlinking changes its ctime.
    """
    found = []
    for wheel in sorted(wheelhouse.glob("*.whl")):
        st = wheel.stat()
        if st.st_nlink == 1:
            found.append(Entry("wheel", wheel, st.st_blocks * 512, st.st_ctime))
    return found


def _remove(entry: Path) -> None:
    """Remove ``entry`` at once for anyone looking (a rename), then its files."""
    trash = entry.with_name(f".trash-{entry.name}-{uuid.uuid4().hex[:8]}")
    os.rename(entry, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _remove_leftovers(*roots: Path, now: float) -> None:
    """Stages of builds and installs that died, and lock files of entries that never were."""
    for root in roots:
        for path in root.glob(".*") if root.is_dir() else []:
            if path.is_dir() and now - _last_used(path) > STALE_STAGE_SEC:
                shutil.rmtree(path, ignore_errors=True)
        for lock in root.glob("*.lock") if root.is_dir() else []:
            entry = lock.with_name(lock.name.removesuffix(".lock"))
            if entry.exists():
                continue
            held = try_hold(entry, exclusive=True)
            if held is not None:  # else a build or install of it is under way
                lock.unlink(missing_ok=True)
                held.release()


def prune(
    *,
    max_bytes: int | None = None,
    older_than_sec: float | None = None,
    everything: bool = False,
    dry_run: bool = False,
    root: Path | None = None,
) -> PruneReport:
    """Remove cached environments, bundles, wheels and agent runtimes nobody holds.

    Goes least recently used first: with ``everything`` all of them; else each unused for
    longer than ``older_than_sec``, then more until the cache is at most ``max_bytes``.
    A bundle goes with its environments (they bind it); a wheel goes once no bundle links
    it. An entry someone holds is never removed: it is reported as in use.
    """
    root = root or cache_dir()
    bundles_root, envs_root = root / "bundles", root / "environments"
    runtimes_root = root / "runtimes"
    now = time.time()
    if not dry_run:
        _remove_leftovers(bundles_root, envs_root, runtimes_root, now=now)
    envs = _environments(envs_root)
    bundles = _bundles(bundles_root)
    runtimes = _runtimes(runtimes_root)
    wheelhouses = sorted(p for p in (bundles_root / WHEELHOUSE).glob("*") if p.is_dir())
    wheel_bytes = sum(disk_size(w) for w in wheelhouses)
    total = sum(e.size_bytes for e in [*envs, *bundles, *runtimes]) + wheel_bytes
    report = PruneReport()

    def due(entry: Entry) -> bool:
        if everything:
            return True
        if older_than_sec is not None and now - entry.last_used > older_than_sec:
            return True
        return max_bytes is not None and total > max_bytes

    def take(entry: Entry) -> bool:
        """Remove ``entry`` unless held; True if it went (or would, in a dry run)."""
        nonlocal total
        held = try_hold(entry.path, exclusive=True)
        if held is None:
            report.in_use.append(entry)
            return False
        try:
            if not dry_run:
                _remove(entry.path)
                lock_path(entry.path).unlink(missing_ok=True)
        finally:
            held.release()
        report.removed.append(entry)
        total -= entry.size_bytes
        return True

    by_bundle: dict[str, list[Entry]] = {}
    for env in envs:
        by_bundle.setdefault(env.bundle or "", []).append(env)
    # Environments and runtimes are the bulk (a few hundred MB each); a bundle is worth
    # removing once its environments are gone, and takes those that were left with it.
    for env in sorted([*envs, *runtimes], key=lambda e: e.last_used):
        if due(env):
            take(env)
    removed = {id(e) for e in report.removed}
    for bundle in sorted(bundles, key=lambda e: e.last_used):
        if not due(bundle):
            continue
        left = [e for e in by_bundle.get(bundle.path.name, []) if id(e) not in removed]
        if any(e in report.in_use for e in left) or not all(take(e) for e in left):
            report.in_use.append(bundle)  # a held environment binds it
            continue
        take(bundle)
    for wheelhouse in wheelhouses:
        # Wheels are only a download cache: they go when the cache is still too big, or old.
        if not (everything or (max_bytes is not None and total > max_bytes) or older_than_sec):
            continue
        held = try_hold(wheelhouse, exclusive=True)  # a build links from it meanwhile
        if held is None:
            continue
        try:
            for wheel in _unused_wheels(wheelhouse):
                if due(wheel):
                    if not dry_run:
                        wheel.path.unlink(missing_ok=True)
                    report.removed.append(wheel)
                    total -= wheel.size_bytes
        finally:
            held.release()
    report.kept_bytes = max(total, 0)
    return report


def prune_to_bound() -> None:
    """Prune to the configured bound; for after a new build or install (never raises)."""
    limit = configured_max_bytes()
    if limit is None:
        return
    try:
        report = prune(max_bytes=limit)
    except (OSError, ValueError) as exc:
        log.warning("pruning the bundle cache failed: %s", exc)
        return
    if report.removed:
        log.info(
            "bundle cache over %d MiB: removed %d entries (%d MiB)",
            limit // 1024**2,
            len(report.removed),
            report.freed_bytes // 1024**2,
        )
