"""The pool of sandbox run dirs and cgroups prepared ahead of time leaks nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from backends.sandbox.cgroups import SandboxCgroup
from backends.sandbox.runtime import reap_orphans
from backends.sandbox.settings import run_dir

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.skipif(os.geteuid() != 0, reason="local sandboxes need root"),
]

SCRIPT = f"""
import anyio, sys
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
from pathlib import Path
from backends.sandbox import runtime
from backends.sandbox.contract import PROVIDERS
async def main():
    env = PROVIDERS[0].make(Path(sys.argv[1]))
    await env.start(force_build=False)
    await env.stop(delete=True)
runtime.flush_cleanup()  # the pool refill runs on the cleanup thread
anyio.run(main)
runtime.flush_cleanup()
print(" ".join(n for ns in runtime._pool._ready.values() for n in ns), flush=True)
sys.stdin.readline()
"""


def _leftovers(name: str) -> list[str]:
    left = [str(d) for d in SandboxCgroup(name)._dirs if d.exists()]
    return left + ([str(run_dir() / name)] if (run_dir() / name).exists() else [])


def test_pool_entries_survive_reaping_and_go_at_exit(tmp_path: Path) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert owner.stdin is not None and owner.stdout is not None
    try:
        names = owner.stdout.readline().split()
        assert names, "no sandbox was prepared ahead of time"
        # Their owner lives: another process's reap_orphans must leave them alone.
        removed = reap_orphans()
        assert not set(names) & set(removed)
        assert all(_leftovers(n) for n in names)
    finally:
        owner.stdin.close()
        assert owner.wait(30) == 0
    assert [x for n in names for x in _leftovers(n)] == []
