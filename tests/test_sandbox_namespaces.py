"""A process's namespaces, read from the host through its pidfd, while it exits.

An exiting process drops its namespaces before its pidfd turns readable, so /proc/PID/ns
answers ENOENT for a process that still looks alive; that is "gone" (ProcessLookupError,
which the callers handle: a sandbox that died), never an unexplained FileNotFoundError.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Iterator

import pytest

from backends.sandbox.launcher import Booted
from backends.sandbox.namespaces import open_namespaces, owner_uid


@pytest.fixture
def exited_child() -> Iterator[tuple[int, int]]:
    """(pid, pidfd) of a child that has exited and is not reaped yet (a zombie)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    assert poller.poll(10_000), "the child never exited"  # readable: it has exited
    try:
        yield pid, pidfd
    finally:
        os.waitpid(pid, 0)
        os.close(pidfd)


def test_the_namespaces_of_an_exited_process_are_gone_not_missing(
    exited_child: tuple[int, int],
) -> None:
    pid, pidfd = exited_child
    with pytest.raises(ProcessLookupError):
        open_namespaces(pidfd, ("net",))
    # What a public sandbox's network start asks: it reports a sandbox that died while
    # starting (SandboxStartError) only for ProcessLookupError.
    booted = Booted(process=None, init_pid=pid, keepalive=-1, init_fd=pidfd)  # type: ignore[arg-type]
    with pytest.raises(ProcessLookupError):
        booted.open_namespace("net")


def test_reading_processes_that_exit_meanwhile_only_ever_finds_them_gone() -> None:
    """The race itself (on the old code about 16 FileNotFoundErrors in 3 s of this): each
    child exits as soon as it is forked, while its namespaces and uid are read."""
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        pidfd = os.pidfd_open(pid)
        try:
            try:
                for fd in open_namespaces(pidfd, ("net", "mnt")):
                    os.close(fd)
            except ProcessLookupError:
                pass
            try:
                assert owner_uid(pidfd) == os.geteuid()
            except ProcessLookupError:
                pass
        finally:
            os.waitpid(pid, 0)
            os.close(pidfd)
