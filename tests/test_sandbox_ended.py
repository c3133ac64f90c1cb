"""Who ended a local sandbox: the host (an infrastructure failure, worth a retry) or what ran
inside it (its own failure). Root inside can neither trace, rewrite nor SIGKILL its pid 1, so
a pid 1 killed by SIGKILL with no OOM kill is the host's doing, and anything else is not."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from harbor.environments.base import BaseEnvironment
from harbor_support import _init_of

from backends.sandbox.contract import PROVIDERS
from backends.sandbox.errors import SandboxEndedError, SandboxNotRunningError

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.anyio,
    pytest.mark.skipif(os.geteuid() != 0, reason="local sandboxes need root"),
]
EXIT_GROUP_0 = bytes.fromhex("b8e700000031ff0f05")  # mov eax, 231; xor edi, edi; syscall


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[BaseEnvironment]:
    sandbox = PROVIDERS[0].make(tmp_path)
    await sandbox.start(force_build=False)
    try:
        yield sandbox
    finally:
        await sandbox.stop(delete=True)


def make_exit(pid: int) -> None:
    """Write exit_group(0) where pid's blocked read restarts (its syscall instruction)."""
    pc = int(Path(f"/proc/{pid}/syscall").read_text().split()[-1], 16)
    fd = os.open(f"/proc/{pid}/mem", os.O_RDWR)
    try:
        os.pwrite(fd, EXIT_GROUP_0, pc - 2)
    finally:
        os.close(fd)


async def init_pid(env: BaseEnvironment) -> int:
    found = await env.exec("readlink /proc/1/ns/pid", user="root")
    return _init_of(found.stdout.strip())


async def test_root_inside_cannot_reach_pid_1(env: BaseEnvironment) -> None:
    probe = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.ptrace(16, 1, 0, 0), ctypes.get_errno())\n"  # PTRACE_ATTACH
        "for path in ('/proc/1/mem', '/proc/1/task/1/mem'):\n"
        "    try:\n"
        "        os.open(path, os.O_RDWR)\n"
        "        print('opened', path)\n"
        "    except OSError as e:\n"
        "        print(e.errno)\n"
        "print(os.system('prlimit --pid 1 --cpu=1:1 2>/dev/null') != 0)\n"
    )
    res = await env.exec(f'python3 -c "{probe}"', user="root")
    assert res.stdout.split("\n")[:4] == ["-1 1", "13", "13", "True"], res.stdout + res.stderr
    assert (await env.exec("kill -9 1; kill -SEGV 1; echo alive", user="root")).stdout == "alive\n"


async def test_pid_1_ended_from_inside_is_not_the_hosts_failure(env: BaseEnvironment) -> None:
    """Pid 1 made to exit (here by the test writing exit_group into it from the host, which
    nothing inside can do any more) is reported as ended from inside."""
    pid = await init_pid(env)
    make_exit(pid)
    os.kill(pid, signal.SIGCHLD)  # bash handles it: the read is interrupted and restarted
    with pytest.raises(SandboxEndedError, match="ended from inside"):
        for _ in range(50):
            await env.exec("sleep 0.1")


async def test_pid_1_killed_from_the_host_is_an_infrastructure_failure(
    env: BaseEnvironment,
) -> None:
    os.kill(await init_pid(env), signal.SIGKILL)
    with pytest.raises(SandboxNotRunningError, match="killed from the host") as raised:
        for _ in range(50):
            await env.exec("sleep 0.1")
    assert not isinstance(raised.value, SandboxEndedError)
