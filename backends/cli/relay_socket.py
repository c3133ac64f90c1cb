"""The folder a run's relay socket lives in: short, private, and removed even after a crash.

A Unix socket path has a 108-byte limit and run directories can be long, so the socket gets a
fresh folder in the temporary directory. A run killed outright (SIGKILL, the OOM killer) cannot
remove its folder; each folder records its owner, and the next run removes those whose owner
is dead.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from backends.sandbox import owners

PREFIX = "backends-relay-"


@contextlib.asynccontextmanager
async def socket_dir() -> AsyncIterator[Path]:
    """A new private folder for the relay's socket, removed on the way out."""
    remove_stale()
    with tempfile.TemporaryDirectory(prefix=PREFIX, ignore_cleanup_errors=True) as name:
        folder = Path(name)
        owners.write(folder)
        yield folder


def remove_stale(parent: Path | None = None) -> list[Path]:
    """Remove this user's socket folders whose run is dead; returns them.

    Folders without an owner record (being made right now, or left by an older version) and
    those of live runs, other users or other hosts and pid namespaces are left alone.
    """
    removed = []
    for folder in (parent or Path(tempfile.gettempdir())).glob(PREFIX + "*"):
        try:
            if folder.is_symlink() or folder.stat().st_uid != os.geteuid():
                continue
            if owners.state_of(folder) != "dead":
                continue
        except OSError:  # gone, not a folder, or no owner record
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed
