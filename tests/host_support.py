"""What a test may look at on a host it shares: its own sandboxes and its own marked processes.

Other suites (another engineer's, CI) run beside this one on the same host and cache: a test
that counts every `sleep N` on the host, or every sandbox in the cache, fails on theirs.
"""

from __future__ import annotations

import os
import subprocess
import uuid

from backends.sandbox import cgroups
from backends.sandbox.settings import run_dir


def unique_marker() -> str:
    """A number for `sleep <marker>` that no other test or suite on the host runs."""
    return str(10_000_000 + uuid.uuid4().int % 90_000_000)


def marked(marker: str) -> list[str]:
    """Pids of the processes running `sleep <marker>`."""
    found = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True)
    return found.stdout.split()


def owned_by(pid: int) -> set[str]:
    """Names of the sandboxes (and pool entries) whose owner record names process ``pid``."""
    names = set()
    for folder in run_dir().iterdir() if run_dir().is_dir() else []:
        try:
            if (folder / "owner").read_text().split()[0] == str(pid):
                names.add(folder.name)
        except (OSError, IndexError):
            continue
    return names


def running_sandboxes(pid: int | None = None) -> list[str]:
    """Sandboxes of process ``pid`` (this one by default) that still have a process.

    Prepared but unused pool entries have none.
    """
    ours = owned_by(os.getpid() if pid is None else pid)
    return sorted(n for n in ours if cgroups.SandboxCgroup(n).members())
