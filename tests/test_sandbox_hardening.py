"""Attacks on the local sandbox's own machinery, from inside a sandbox and from the host."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from backends.sandbox import cgroups
from backends.sandbox.contract import PROVIDERS
from backends.sandbox.errors import SandboxNotRunningError, SandboxStartError
from backends.sandbox.layers import layers_dir
from backends.sandbox.rootfs import rootfs_path

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.anyio,
    pytest.mark.skipif(os.geteuid() != 0, reason="local sandboxes need root"),
]
LOCAL = PROVIDERS[0]

# Watches for new processes in the sandbox and tries to see the host through their
# /proc/PID/root: an exec helper that joined the sandbox's user namespace while still host
# root with the host's root directory would show it.
WATCHER = r"""
import os, sys
marker, seen = sys.argv[1], set()
while True:
    for p in os.listdir("/proc"):
        if p.isdigit() and p not in seen:
            seen.add(p)
            try:
                if os.path.exists(f"/proc/{p}/root{marker}"):
                    open("/hit", "w").write(p)
                    sys.exit(0)
            except OSError:
                pass
    seen.clear()
"""


@pytest.fixture
def host_marker() -> Iterator[Path]:
    """A host file where any uid may look (pytest's tmp_path is under a 0700 directory,
    which would hide it from sandbox root even through a leaked host root directory)."""
    marker = Path(f"/var/tmp/backends-host-marker-{uuid.uuid4().hex}")
    marker.write_text("host\n")
    yield marker
    marker.unlink()


async def test_exec_helpers_never_expose_the_host_root(tmp_path: Path, host_marker: Path) -> None:
    marker = host_marker
    (tmp_path / "watch.py").write_text(WATCHER)
    env = LOCAL.make(tmp_path)
    await env.start(force_build=False)
    try:
        await env.upload_file(tmp_path / "watch.py", "/watch.py")
        await env.exec(f"nohup python3 /watch.py {marker} >/dev/null 2>&1 &")
        await anyio.sleep(0.5)  # let the watcher start
        for _ in range(100):  # unprotected, the first few execs were enough
            await env.exec("true")
        assert (await env.exec("test -e /hit")).return_code == 1, "saw the host's root"
    finally:
        await env.stop(delete=True)


def _as_nobody(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, user=65534, group=65534, extra_groups=[], capture_output=True, text=True
    )


async def test_host_users_cannot_reach_setuid_files_of_sandboxes(tmp_path: Path) -> None:
    env = LOCAL.make(tmp_path)
    await env.start(force_build=False)
    try:
        # Setuid to sandbox root, that is host uid 100000, the owner of the shared layers.
        await env.exec("cp /bin/bash /tmp/rootsh && chmod 4755 /tmp/rootsh")
        box = env._box  # type: ignore[attr-defined]
        planted = box.upper / "tmp" / "rootsh"
        assert planted.stat().st_mode & 0o4000
        shipped = rootfs_path("debian-bookworm") / "usr" / "bin" / "passwd"
        assert shipped.stat().st_mode & 0o4000
        for path in (planted, shipped):
            with pytest.raises(PermissionError):
                _as_nobody([str(path), "--version"])
        built = [layers_dir()] if layers_dir().exists() else []  # none on a fresh cache
        for d in (*built, shipped.parents[3], planted.parents[2]):
            assert d.stat().st_mode & 0o777 == 0o700, d
    finally:
        await env.stop(delete=True)


def test_two_event_loops_share_the_spawner(tmp_path: Path) -> None:
    """A layer build runs its own event loop: exits must reach the right loop, never lost."""

    async def many_execs(results: list[int]) -> None:
        env = LOCAL.make(tmp_path)
        await env.start(force_build=False)
        try:
            with anyio.fail_after(60):
                for _ in range(300):
                    results.append((await env.exec("true")).return_code)
        finally:
            await env.stop(delete=True)

    other: list[int] = []
    errors: list[BaseException] = []

    def in_thread() -> None:
        try:
            anyio.run(many_execs, other)
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=in_thread)
    thread.start()
    ours: list[int] = []
    anyio.run(many_execs, ours)
    thread.join(90)
    assert not errors and not thread.is_alive()
    assert ours == other == [0] * 300


def _groups(text: str) -> dict[str, str]:
    """/proc/PID/cgroup as {hierarchy: path} ("" is the v2 tree)."""
    return {line.split(":")[1]: line.split(":")[2] for line in text.split() if line}


async def test_every_process_starts_inside_the_sandbox_cgroups(tmp_path: Path) -> None:
    """Processes are born in their cgroups (not moved in after the fork): pid 1 in the init
    group, each command in an exec group of its own, what it forks at once with it, and all
    of them in the sandbox's group of every v1 hierarchy that holds a limit."""
    env = LOCAL.make(tmp_path, memory_mb=256, cpus=1)
    await env.start(force_build=False)
    try:
        box = env._box  # type: ignore[attr-defined]
        res = await env.exec(
            "cat /proc/1/cgroup; echo @; cat /proc/self/cgroup; echo @; "
            "sleep 5 & cat /proc/$!/cgroup; kill $!"
        )
        init, command, child = (_groups(part) for part in res.stdout.split("@"))
        second = _groups((await env.exec("cat /proc/self/cgroup")).stdout)
    finally:
        await env.stop(delete=True)
    top = f"/backends/{box.name}"
    assert init[""] == f"{top}/init"
    assert command[""] == child[""] == f"{top}/x0"
    assert second[""] == f"{top}/x1"
    v1 = [h for h in init if set(h.split(",")) & set(cgroups.layout().v1)]
    assert len(v1) == len(set(cgroups.layout().v1.values()))  # hybrid hosts: v1 limits
    for groups in (init, command, child, second):
        assert all(groups[h] == top for h in v1), groups


async def test_exec_never_enters_a_reused_pid(tmp_path: Path) -> None:
    """Commands enter by pid 1's pidfd: once it is gone, its pid number (perhaps reused by a
    host process) is never used to join namespaces."""
    env = LOCAL.make(tmp_path)
    await env.start(force_build=False)
    host = await anyio.open_process(["sleep", "60"])
    try:
        box = env._box  # type: ignore[attr-defined]
        booted = box._booted
        os.kill(booted.init_pid, signal.SIGKILL)  # sandbox root could do this via ptrace
        await booted.init_exited()
        booted.init_pid = host.pid  # as if the number had been reused by a host process
        with pytest.raises(SandboxNotRunningError):
            await env.exec("hostname; cat /etc/shadow")
    finally:
        host.kill()
        await host.wait()
        await env.stop(delete=True)


CHAIN = r"""
import io, tarfile
# Each link is checked while the names it goes through do not exist yet (so it resolves
# inside); the members added last make the chain climb eight levels: reward.txt -> /etc/shadow.
with tarfile.open("/crafted.tar", "w") as tar:
    def link(name, target):
        info = tarfile.TarInfo(name)
        info.type, info.linkname = tarfile.SYMTYPE, target
        tar.addfile(info)
    for k in range(1, 9):
        link(f"l{k}", f"m{k}/..")
    link("reward.txt", "l8/etc/shadow")
    for k in range(8, 1, -1):
        link(f"m{k}", f"l{k - 1}")
    link("m1", ".")
"""


async def test_download_link_chains_cannot_reach_the_host(tmp_path: Path) -> None:
    (tmp_path / "chain.py").write_text(CHAIN)
    env = LOCAL.make(tmp_path)
    await env.start(force_build=False)
    try:
        await env.upload_file(tmp_path / "chain.py", "/chain.py")
        # Root inside chooses what `tar` is, so the archive's order is the sandbox's to pick.
        setup = "python3 /chain.py && printf '#!/bin/sh\\nexec cat /crafted.tar\\n' > /usr/local/sbin/tar && chmod +x /usr/local/sbin/tar"
        assert (await env.exec(setup)).return_code == 0
        out = tmp_path / "verifier"
        await env.download_dir("/logs/verifier", out)
    finally:
        await env.stop(delete=True)
    for path in out.rglob("*"):
        assert not path.is_symlink() or path.resolve().is_relative_to(out.resolve()), path
    assert not (out / "reward.txt").exists()


async def test_a_start_failing_after_boot_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "bin" / "slirp4netns"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'no uplink today' >&2\nexit 1\n")
    fake.chmod(0o755)
    env = LOCAL.make(tmp_path, network_mode="public")
    await env.start(force_build=False)  # warm: pools, spawner, base image
    await env.stop(delete=True)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")

    async def failing_start() -> None:
        env = LOCAL.make(tmp_path, network_mode="public")
        with pytest.raises(SandboxStartError, match="no uplink today"):
            await env.start(force_build=False)

    await failing_start()  # what a first failure opens once and keeps (a lazy fd) is no leak
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        await failing_start()
    # A leak would add two per start for good; another thread's (a pool refill's) close soon.
    deadline = time.monotonic() + 10
    while len(os.listdir("/proc/self/fd")) > before and time.monotonic() < deadline:
        await anyio.sleep(0.05)
    assert len(os.listdir("/proc/self/fd")) <= before


async def test_end_processes_kills_all_but_pid_1_without_a_command(tmp_path: Path) -> None:
    """What `kill -KILL -1` by root inside does, from the host: daemons, a fork loop and a
    running command die, pid 1 lives on, and no command ran in the sandbox to do it."""
    env = LOCAL.make(tmp_path)
    await env.start(force_build=False)
    try:
        await env.exec(
            "setsid nohup sleep 4711 >/dev/null 2>&1 & "
            "nohup bash -c 'while :; do sleep 0.01 & done' >/dev/null 2>&1 &"
        )
        box = env._box  # type: ignore[attr-defined]
        async with anyio.create_task_group() as group:
            group.start_soon(env.exec, "sleep 4712")
            # Running, not just asked for: a command still being spawned would miss the kill
            # and keep the test waiting for its 4712 s.
            with anyio.fail_after(60):
                while not _runs(box, b"4712"):
                    await anyio.sleep(0.02)
            execs = box._exec_ids
            assert await env.end_processes()  # type: ignore[attr-defined]
            assert box._exec_ids is execs and next(execs) == 2  # no command was run for it
        assert set(box.cgroup.members()) == {box._booted.process.pid, box._booted.init_pid}
        res = await env.exec("ps -eo pid,args --no-headers")
        # Dead ones pid 1 has not reaped yet show as <defunct>; nothing else may be left.
        alive = [p.split() for p in res.stdout.splitlines() if not p.endswith("<defunct>")]
        assert alive[0] == ["1", "/dev/.init"], alive
        assert not [p for p in alive if "sleep" in p], res.stdout
    finally:
        await env.stop(delete=True)


def _runs(box: object, word: bytes) -> bool:
    """Does a process of the sandbox have `word` in its command line?"""
    for pid in box.cgroup.members():  # type: ignore[attr-defined]
        try:
            if word in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                return True
        except OSError:  # exited meanwhile
            continue
    return False


async def test_end_processes_never_signals_a_host_process(tmp_path: Path) -> None:
    """A pid read from the sandbox's cgroup may be reused by a host process before the kill:
    only a process still in the sandbox's cgroup is ever signalled."""
    host = await anyio.open_process(["sleep", "60"])
    try:
        cgroups.SandboxCgroup(f"sbx-{uuid.uuid4().hex[:8]}")._kill_member(host.pid)
        await anyio.sleep(0.1)
        assert host.returncode is None
    finally:
        host.kill()
        await host.wait()


REFUSE_CLONE3 = """
import errno, os, sys
import pyseccomp
only_clone3 = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
only_clone3.set_attr(pyseccomp.Attr.CTL_NNP, 0)  # root: no no_new_privs needed
only_clone3.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "clone3")
only_clone3.load()
os.execv(sys.argv[1], sys.argv[1:])
"""


async def test_where_clone3_is_refused_commands_still_start_in_their_cgroups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A container runtime's filter (or an old kernel) may refuse clone3: the spawner then
    forks and the child moves itself into its cgroup, the slow way, before it can fork."""
    import sys

    from backends.sandbox import launcher

    (tmp_path / "refuse.py").write_text(REFUSE_CLONE3)
    wrapper = tmp_path / "python"
    wrapper.write_text(
        f'#!/bin/sh\nexec {sys.executable} {tmp_path}/refuse.py {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setattr(launcher.sys, "executable", str(wrapper))
    monkeypatch.setattr(launcher, "_spawner", None)  # a spawner of its own, under the filter
    env = LOCAL.make(tmp_path, memory_mb=256)
    await env.start(force_build=False)
    try:
        box = env._box  # type: ignore[attr-defined]
        res = await env.exec("cat /proc/self/cgroup; sleep 5 & cat /proc/$!/cgroup; kill $!")
        zygote = launcher.spawner().proc.pid
        status = Path(f"/proc/{zygote}/status").read_text()  # noqa: ASYNC240
        assert "Seccomp:\t2" in status  # the spawner did run under the filter
    finally:
        await env.stop(delete=True)
        launcher.spawner().sock.close()  # ends that spawner
    lines = res.stdout.split()
    assert lines.count(f"0::/backends/{box.name}/x0") == 2, res
