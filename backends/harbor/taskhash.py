"""A task's content hashes, computed once per version of the task rather than once per trial.

Harbor hashes the trial's whole task directory twice while building each trial: for the
trial's lock (``Packager.compute_content_hash``) and for its result (``Task.checksum``). Each
is a walk of the tree with every path matched against the task's file filter: about a fifth of
a trial's CPU in ``bench_scale.py``, for the same answer whenever the task has not changed.

Harbor has no seam to hand it a local task's hash (its lock takes one only for package tasks),
so ``install()`` wraps both with a memo. The memo's key is the task directory and a
fingerprint of its tree: every entry's path, type, size, inode, mtime and ctime. Any write
moves a file's ctime, which cannot be set back, so an edited task is hashed again. The
answers are the functions' own; only repeats are skipped.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harbor.models.task.task import Task
from harbor.publisher.packager import Packager

_MEMO_SIZE = 256  # task versions remembered (a dataset's tasks, each once)
_installed = False
_install_lock = threading.Lock()


def fingerprint(root: Path) -> str:
    """A digest of the tree's metadata: it changes when any entry is added, removed, renamed,
    written or replaced. Symlinks are followed as Harbor's hashing does (each directory once)."""
    digest = hashlib.sha256()
    seen: set[tuple[int, int]] = set()
    for top, dirs, files in os.walk(root, followlinks=True):
        st = os.stat(top)
        if (st.st_dev, st.st_ino) in seen:
            dirs[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirs.sort()
        for name in sorted(files) + dirs:
            path = os.path.join(top, name)
            try:
                st = os.stat(path)
                link = os.readlink(path) if os.path.islink(path) else ""
            except OSError as exc:  # a dangling link: its presence is the fingerprint
                digest.update(f"{path}\0{type(exc).__name__}\n".encode())
                continue
            digest.update(
                f"{path}\0{link}\0{st.st_mode}\0{st.st_size}\0{st.st_ino}\0"
                f"{st.st_mtime_ns}\0{st.st_ctime_ns}\n".encode()
            )
    return digest.hexdigest()


class _Memo:
    """A small thread-safe LRU: trials are built in worker threads."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, task_dir: Path, compute: Callable[[], Any]) -> Any:
        resolved = task_dir.resolve()
        key = (str(resolved), fingerprint(resolved))
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        value = compute()  # outside the lock: two first builds of one task both hash it
        with self._lock:
            self._items[key] = value
            if len(self._items) > self._size:
                self._items.popitem(last=False)
        return value


def install() -> None:
    """Memoize Harbor's two task hashes in this process (idempotent)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        content_hash = Packager.compute_content_hash
        checksum = Task.checksum.fget
        assert checksum is not None
        hashes, checksums = _Memo(_MEMO_SIZE), _Memo(_MEMO_SIZE)

        def memo_content_hash(task_dir: Path) -> tuple[str, list[Path]]:
            def compute() -> tuple[str, tuple[Path, ...]]:
                digest, files = content_hash(task_dir)
                return digest, tuple(files)  # kept immutable; each caller gets its own list

            digest, files = hashes.get(Path(task_dir), compute)
            return digest, list(files)

        def memo_checksum(task: Task) -> str:
            return str(checksums.get(task.task_dir, lambda: checksum(task)))

        Packager.compute_content_hash = staticmethod(memo_content_hash)  # type: ignore[method-assign]
        Task.checksum = property(memo_checksum)  # type: ignore[method-assign,assignment]
        _installed = True
