"""The pool of sandbox run dirs and cgroups prepared ahead of time leaks nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
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


@pytest.mark.anyio
async def test_a_collector_with_another_cache_leaves_our_sandboxes_alone(tmp_path: Path) -> None:
    """Cgroups are host-wide; owner records are per cache. A reaper running with another
    BACKENDS_CACHE took every live sandbox of ours for an orphan and removed its cgroup."""
    from backends.sandbox.contract import PROVIDERS

    env = PROVIDERS[0].make(tmp_path / "trial")
    await env.start(force_build=False)
    try:
        other = {**os.environ, "BACKENDS_CACHE": str(tmp_path / "another-cache")}
        code = "from backends.sandbox.runtime import reap_orphans; print(reap_orphans())"
        reaped = await anyio.run_process([sys.executable, "-c", code], env=other)
        assert reaped.stdout.decode().strip() == "[]", reaped.stdout
        result = await env.exec("echo alive")
        assert result.stdout == "alive\n", result
    finally:
        await env.stop(delete=True)


HOLDER = f"""
import anyio, sys
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
from pathlib import Path
from backends.sandbox.contract import PROVIDERS
async def main():
    env = PROVIDERS[0].make(Path(sys.argv[1]))
    await env.start(force_build=False)
    try:
        print(env._box.name, flush=True)
        sys.stdin.readline()
        print((await env.exec("echo alive")).stdout, end="", flush=True)
    finally:
        await env.stop(delete=True)
anyio.run(main)
"""


def test_a_collector_leaves_alone_an_owner_in_another_pid_namespace(tmp_path: Path) -> None:
    """A container sharing the cache owns sandboxes under pids this /proc does not show: the
    reaper once judged them dead and removed them from under their live owner."""
    owner = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert owner.stdin is not None and owner.stdout is not None
    try:
        name = owner.stdout.readline().strip()
        assert (run_dir() / name / "owner").exists(), name
        assert name not in reap_orphans()
        owner.stdin.write("\n")
        owner.stdin.flush()
        assert owner.stdout.readline() == "alive\n"
    finally:
        owner.stdin.close()
        assert owner.wait(30) == 0
