"""Fork servers: commands forked from a pre-imported interpreter into live local sandboxes.

Real sandboxes throughout: a host sandbox holding the servers and trial sandboxes the commands
are forked into, with this checkout and its virtualenv bound at their own paths (as a bundle's
environment is), and probes written as modules the forked interpreter runs like `python -m`.
"""

from __future__ import annotations

import json
import os
import select
import signal
import site
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from harbor.models.task.config import EnvironmentConfig
from harbor.models.trial.paths import TrialPaths

from backends.bundle.warm import open_paths
from backends.sandbox.errors import SandboxNotRunningError
from backends.sandbox.forkserver import ForkServers, ForkServerUnavailable, owner_uid
from backends.sandbox.local import LocalSandbox
from backends.sandbox.settings import UID_COUNT, sandbox_uid_ranges, uid_lock_dir

pytestmark = [pytest.mark.sandbox, pytest.mark.anyio, pytest.mark.timeout(600)]

ROOT = Path(__file__).parents[1]
PYTHON = os.path.realpath(sys.executable)  # the host's interpreter, bound at its own path
SITE = Path(site.getsitepackages()[0])
ENV = {"PYTHONPATH": f"{ROOT}:{SITE}", "PYTHONDONTWRITEBYTECODE": "1"}

PROBE = """
import ctypes, errno, json, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)

def attempt(fn):
    try:
        result = fn()
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
    return "ok" if result in (None, 0) else errno.errorcode.get(ctypes.get_errno(), "failed")

server = int(sys.argv[1])
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
report = {
    "pid": os.getpid(),
    "uid": os.getuid(),
    "cwd": os.getcwd(),
    "env": dict(os.environ),
    "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
    "procs": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
    "cgroup": open("/proc/self/cgroup").read(),
    "seccomp": status["Seccomp"].strip(),
    "no_new_privs": status["NoNewPrivs"].strip(),
    "sid_is_pid": os.getsid(0) == os.getpid(),
    "limits": open("/proc/self/limits").read(),
    "umask": os.umask(0o22),
    "caps": [status[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")],
    "ids": [status["Uid"].split(), status["Gid"].split(), status["Groups"].split()],
    "sigs": [status[k].strip() for k in ("SigBlk", "SigIgn")],
    "other_trial": os.path.exists(sys.argv[2]),
    "own_file": os.path.exists(sys.argv[3]),
    "unshare_user": attempt(lambda: os.unshare(os.CLONE_NEWUSER)),
    "mount": attempt(lambda: libc.mount(b"none", b"/mnt", b"tmpfs", 0, None)),
    "setns": attempt(lambda: os.setns(os.open("/proc/self/ns/net", os.O_RDONLY), 0)),
    # Against the fork server: its host pid is not in this pid namespace.
    "kill_server": attempt(lambda: os.kill(server, signal.SIGKILL)),
    "ptrace_server": attempt(lambda: libc.ptrace(16, server, None, None)),  # PTRACE_ATTACH
    "server_mem": attempt(lambda: open(f"/proc/{server}/mem", "rb").read(1)),
    "server_parent": os.getppid(),
    "kill_all": attempt(lambda: os.kill(-1, signal.SIGKILL)),
}
print(json.dumps(report))
sys.exit(int(sys.argv[4]))
"""

SLEEPER = """
import sys, time
print("started", flush=True)
time.sleep(float(sys.argv[1]))
print("done", flush=True)
"""

READER = """
import sys
print(open(sys.argv[1]).read())
"""


def _sandbox(tmp: Path, name: str, probes: Path) -> LocalSandbox:
    paths = TrialPaths(trial_dir=tmp / name)
    paths.mkdir()
    binds = [{"source": str(p), "target": str(p), "read_only": True} for p in (ROOT, SITE, probes)]
    return LocalSandbox(
        environment_dir=tmp / "no-dockerfile",
        environment_name=name,
        session_id=f"fork-{name}",
        trial_paths=paths,
        task_env_config=EnvironmentConfig(docker_image="debian:12"),
        network="none",
        host_python=True,
        extra_binds=binds,
    )


@pytest.fixture
def probes(tmp_path: Path) -> Path:
    folder = tmp_path / "probes"
    folder.mkdir()
    for name, text in (("probe", PROBE), ("sleeper", SLEEPER), ("reader", READER)):
        (folder / f"{name}.py").write_text(textwrap.dedent(text))
    return folder


@pytest.fixture
async def host(tmp_path: Path, probes: Path) -> AsyncIterator[LocalSandbox]:
    box = _sandbox(tmp_path, "host", probes)
    await box.start(force_build=False)
    try:
        await open_paths(box, [Path(sys.base_prefix), ROOT, SITE, probes])
        yield box
    finally:
        await box.stop(delete=True)


@pytest.fixture
async def servers(host: LocalSandbox, probes: Path) -> AsyncIterator[ForkServers]:
    forks = ForkServers(host.sandbox, python=PYTHON, cwd=str(probes), preload=("json:dumps", [1]))
    try:
        yield forks
    finally:
        forks.close()


@pytest.fixture
async def trials(tmp_path: Path, probes: Path) -> AsyncIterator[list[LocalSandbox]]:
    boxes = [_sandbox(tmp_path, f"trial{i}", probes) for i in range(2)]
    for box in boxes:
        await box.start(force_build=False)
    try:
        yield boxes
    finally:
        for box in boxes:
            await box.stop(delete=True)


def server_pid(servers: ForkServers) -> int:
    (server,) = servers.servers()
    return server.proc.pid


def alive(pid: int) -> bool:
    """Is `pid` running? A zombie is not, nor a process reaped while we look (its /proc
    entry then answers ENOENT, or ESRCH once open)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return "State:\tZ" not in status and "State:\tX" not in status


async def test_a_forked_command_is_confined_as_an_exec_is(
    servers: ForkServers, trials: list[LocalSandbox], probes: Path
) -> None:
    mine, other = trials
    secret = f"/secret-{uuid.uuid4().hex}"
    await other.exec(f"touch {secret}", user="root")
    await mine.exec("touch /mine", user="root")
    await mine.exec_forked(servers, [PYTHON, "-m", "sleeper", "0"], env=ENV, user="root")
    server = server_pid(servers)
    argv = [PYTHON, "-m", "probe", str(server), secret, "/mine", "3"]
    forked = await mine.exec_forked(servers, argv, env=ENV, user="root")
    assert forked.return_code == 3, forked.stderr  # its own exit code
    report = json.loads(forked.stdout)
    cold = await mine.exec(f"cd {probes} && exec {' '.join(argv)}", env=ENV, user="root")
    baseline = json.loads(cold.stdout)

    # In the trial's pid namespace, seeing only the trial's processes: its pid 1 and itself.
    assert report["procs"] == [1, report["pid"]] and report["server_parent"] == 0
    # In the trial's cgroups (every hierarchy), an exec group of its own, as a cold exec.
    name = mine.sandbox.name
    assert (
        report["cgroup"].count(f"/backends/{name}")
        == baseline["cgroup"].count(f"/backends/{name}")
        >= 2
    )
    assert report["other_trial"] is False and report["own_file"] is True
    # The exec's hardening: seccomp, no_new_privs, a session of its own, no fds but 0-2.
    assert report["seccomp"] == baseline["seccomp"] == "2"
    assert report["no_new_privs"] == "1"
    assert report["sid_is_pid"] is True
    # What it inherits from no shell: the same limits, umask, capabilities, ids, signals.
    for same in ("limits", "umask", "caps", "ids", "sigs"):
        assert report[same] == baseline[same], same
    assert report["fds"] == [0, 1, 2, 3]  # 3: the listing's own
    assert report["unshare_user"] == baseline["unshare_user"] == "EPERM"
    assert report["mount"] == baseline["mount"] == "EPERM"
    assert report["setns"] == "EPERM"
    # Exactly the exec's environment (a shell would add PWD, SHLVL and _).
    shell_vars = {"PWD", "SHLVL", "_", "OLDPWD"}
    assert report["env"] == {k: v for k, v in baseline["env"].items() if k not in shell_vars}
    assert report["uid"] == 0 and report["cwd"] == str(probes)
    # The fork server is out of reach: not named, not traced, not read, not killed.
    assert report["kill_server"] == "ESRCH"
    assert report["ptrace_server"] in ("ESRCH", "EPERM")
    assert report["server_mem"] == "ENOENT"
    assert alive(server)
    again = await mine.exec_forked(servers, [PYTHON, "-m", "sleeper", "0"], env=ENV, user="root")
    assert again.stdout.split() == ["started", "done"] and server_pid(servers) == server


async def test_the_server_never_holds_what_a_command_reads(
    servers: ForkServers, trials: list[LocalSandbox]
) -> None:
    mine = trials[0]
    canary = f"CANARY-{uuid.uuid4().hex}"
    path = f"/input-{uuid.uuid4().hex}"  # the request names it: the search must find that
    await mine.exec(f"echo {canary} > {path}", user="root")
    result = await mine.exec_forked(servers, [PYTHON, "-m", "reader", path], env=ENV, user="root")
    assert canary in result.stdout  # the command read it, inside
    memory = _memory(server_pid(servers))
    assert path.encode() in memory
    assert canary.encode() not in memory


def _memory(pid: int) -> bytes:
    """Everything readable in a process's memory (as host root)."""
    chunks = []
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            if not perms.startswith("r"):
                continue
            start, end = (int(x, 16) for x in span.split("-"))
            try:
                mem.seek(start)
                chunks.append(mem.read(end - start))
            except (OSError, OverflowError, ValueError):
                continue
    return b"".join(chunks)


async def test_killing_the_server_mid_batch_loses_no_command(
    servers: ForkServers, trials: list[LocalSandbox], probes: Path
) -> None:
    results: list[tuple[str, str, Any]] = []

    async def one(box: LocalSandbox, seconds: str) -> None:
        argv = [PYTHON, "-m", "sleeper", seconds]
        try:
            forked = await box.exec_forked(servers, argv, env=ENV, user="root")
            results.append((seconds, "forked", forked))
        except ForkServerUnavailable:  # what BundleAgent does: run it cold
            cold = await box.exec(f"cd {probes} && {' '.join(argv)}", env=ENV, user="root")
            results.append((seconds, "cold", cold))

    mine = trials[0]
    await mine.exec_forked(servers, [PYTHON, "-m", "sleeper", "0"], env=ENV, user="root")
    first = server_pid(servers)
    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(one, mine, "3")
        with anyio.fail_after(60):  # bwrap and pid 1, then a launcher and a command each
            while len(set(mine.sandbox.cgroup.members())) < 2 + 2 * 3:
                await anyio.sleep(0.02)
        os.kill(first, signal.SIGKILL)
        for i in range(4):
            tg.start_soon(one, trials[i % 2], "0.2")
    assert len(results) == 7
    for _, _, r in results:
        assert (r.return_code, r.stdout.split()) == (0, ["started", "done"]), r.stderr
    # Those running when it died finished, forked; later ones ran cold (they met the dead
    # server) or were forked from a new one.
    assert [how for seconds, how, _ in results if seconds == "3"] == ["forked"] * 3
    assert not alive(first) and all(alive(s.proc.pid) for s in servers.servers())


async def test_stopping_a_trial_ends_its_forked_command(
    servers: ForkServers, trials: list[LocalSandbox]
) -> None:
    mine = trials[0]
    members: list[int] = []

    async def run() -> None:
        with pytest.raises(SandboxNotRunningError):
            await mine.exec_forked(servers, [PYTHON, "-m", "sleeper", "60"], env=ENV, user="root")

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        with anyio.fail_after(120):
            while len(members) < 4:  # bwrap, pid 1, the launcher and the command
                await anyio.sleep(0.05)
                members = list(set(mine.sandbox.cgroup.members()))
        pidfds = [os.pidfd_open(p) for p in members]
        await mine.stop(delete=True)
    try:
        assert all(select.select([fd], [], [], 0)[0] for fd in pidfds)  # every one exited
    finally:
        for fd in pidfds:
            os.close(fd)
    assert alive(server_pid(servers))


def _leased_elsewhere(uid: int) -> bool:
    """Is the uid range whose root is `uid` leased, as another process sees it?"""
    base, _ = sandbox_uid_ranges()
    lock = uid_lock_dir() / f"{(uid - base) // UID_COUNT}.lock"
    code = "import fcntl, os, sys; fcntl.flock(os.open(sys.argv[1], os.O_RDWR), 6)"  # EX|NB
    return subprocess.run([sys.executable, "-c", code, str(lock)]).returncode != 0


async def test_a_servers_uid_range_is_leased_to_no_one_else_while_it_runs(
    servers: ForkServers, trials: list[LocalSandbox], probes: Path, tmp_path: Path
) -> None:
    """The server runs as its range's root, which may enter any sandbox of the range: once
    the trial it served stopped, the range went back to the host while the server ran on."""
    mine = trials[0]
    await mine.exec_forked(servers, [PYTHON, "-m", "sleeper", "0"], env=ENV, user="root")
    (server,) = servers.servers()
    await mine.stop(delete=True)
    assert alive(server.proc.pid) and _leased_elsewhere(server.uid)
    # This process's next sandbox gets that range, and the same server serves it.
    again = _sandbox(tmp_path, "again", probes)
    await again.start(force_build=False)
    try:
        assert owner_uid(again.sandbox.init_pidfd) == server.uid
        done = await again.exec_forked(servers, [PYTHON, "-m", "sleeper", "0"], env=ENV)
        assert done.stdout.split() == ["started", "done"] and servers.servers() == [server]
    finally:
        await again.stop(delete=True)
    servers.close()
    assert not _leased_elsewhere(server.uid)


async def test_a_server_that_cannot_start_says_why_and_nothing_ran(
    host: LocalSandbox, trials: list[LocalSandbox], probes: Path
) -> None:
    broken = ForkServers(
        host.sandbox, python=PYTHON, cwd=str(probes), preload=("no_such_module:f", [])
    )
    try:
        with pytest.raises(ForkServerUnavailable, match="no_such_module"):
            await trials[0].exec_forked(broken, [PYTHON, "-m", "sleeper", "0"], env=ENV)
        assert broken.servers() == []
    finally:
        broken.close()


async def test_a_preload_that_shares_writable_memory_is_refused(
    host: LocalSandbox, trials: list[LocalSandbox], probes: Path
) -> None:
    # An anonymous mmap is shared: every fork would write through to it, and one rollout's
    # data would reach the next one forked from the same server.
    (probes / "sharer.py").write_text(
        "import mmap\nboard = []\ndef make():\n    board.append(mmap.mmap(-1, 4096))\n"
    )
    sharing = ForkServers(host.sandbox, python=PYTHON, cwd=str(probes), preload=("sharer:make", []))
    try:
        with pytest.raises(ForkServerUnavailable, match="shared writable memory"):
            await trials[0].exec_forked(sharing, [PYTHON, "-m", "sleeper", "0"], env=ENV)
        assert sharing.servers() == []
    finally:
        sharing.close()


def test_a_crashed_owner_leaves_no_fork_server(tmp_path: Path) -> None:
    """The owner SIGKILLed: its spawner ends the host sandbox, servers included."""
    script = tmp_path / "owner.py"
    script.write_text(
        textwrap.dedent(f"""
        import anyio, sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import test_forkserver as t
        from pathlib import Path

        async def main():
            tmp = Path({str(tmp_path)!r})
            probes = tmp / "probes"
            probes.mkdir()
            (probes / "sleeper.py").write_text(t.SLEEPER)
            host, trial = t._sandbox(tmp, "host", probes), t._sandbox(tmp, "trial", probes)
            await host.start(force_build=False)
            await trial.start(False)
            await t.open_paths(host, [Path(t.sys.base_prefix), t.ROOT, t.SITE, probes])
            forks = t.ForkServers(host.sandbox, python=t.PYTHON, cwd=str(probes))
            await trial.exec_forked(forks, [t.PYTHON, "-m", "sleeper", "0"], env=t.ENV)
            print(t.server_pid(forks), flush=True)
            await anyio.sleep(600)

        anyio.run(main)
        """)
    )
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        pid = int(owner.stdout.readline())
        assert alive(pid)
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 30
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)
