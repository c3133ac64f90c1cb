"""Namespaces of a live process, seen from the host: their fds, a socket made in one.

The process is named by a pidfd, so a pid reused by another process is never mistaken for
it: a namespace is read through /proc/PID and trusted only if the pidfd's process is still
alive afterwards. A process that is exiting drops its namespaces before its pidfd turns
readable, and one reaped leaves no /proc/PID: both answer ENOENT (a read after the reap
ESRCH), which means the process is gone, as its callers are told.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from backends.sandbox.pidfds import has_exited


def open_namespaces(pidfd: int, names: Sequence[str]) -> list[int]:
    """fds of the namespaces `names` (as /proc/PID/ns names them) of the live process `pidfd`.

    Raises:
        ProcessLookupError: it is gone (its number may be someone else's by now).
    """
    pid = pid_of(pidfd)
    fds: list[int] = []
    try:
        for name in names:
            with _gone_if_missing(pid):
                fds.append(os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC))
        if has_exited(pidfd):  # exited: those may be another's
            raise ProcessLookupError(f"process {pid} is gone")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


@contextlib.contextmanager
def _gone_if_missing(pid: int) -> Iterator[None]:
    """Turn /proc/PID's answers for a process that is exiting or reaped into ProcessLookupError."""
    try:
        yield
    except (FileNotFoundError, ProcessLookupError) as e:
        raise ProcessLookupError(f"process {pid} is gone") from e


def pid_of(pidfd: int) -> int:
    """The pid of the live process `pidfd` (in this process's pid namespace)."""
    for line in Path(f"/proc/self/fdinfo/{pidfd}").read_text().splitlines():
        if line.startswith("Pid:"):
            pid = int(line.split()[1])
            if pid > 0:
                return pid
    raise ProcessLookupError("the process of that pidfd is gone")


def owner_uid(pidfd: int) -> int:
    """The host uid a live process runs as (for a sandbox's pid 1: its range's root)."""
    pid = pid_of(pidfd)
    with _gone_if_missing(pid):
        status = Path(f"/proc/{pid}/status").read_text()
    for line in status.splitlines():
        if line.startswith("Uid:"):
            uid = int(line.split()[2])  # effective
            if has_exited(pidfd):
                raise ProcessLookupError(f"process {pid} is gone")
            return uid
    raise ProcessLookupError(f"process {pid} has no status")


def listen_in_namespace(pidfd: int, host: str, port: int, backlog: int) -> socket.socket:
    """A TCP socket listening on `host:port` in the network namespace of the live process
    `pidfd`.

    Raises:
        ProcessLookupError: that process is gone.
        OSError: the port cannot be bound there.
    """
    (netns,) = open_namespaces(pidfd, ("net",))
    made: list[socket.socket] = []
    failed: list[BaseException] = []

    def inside() -> None:
        # setns changes only this thread's namespace, and the thread ends right after: no
        # other socket of this process is ever made in the sandbox's namespace.
        try:
            os.setns(netns, os.CLONE_NEWNET)
            made.append(socket.create_server((host, port), backlog=backlog))
        except BaseException as e:
            failed.append(e)

    try:
        thread = threading.Thread(target=inside, name="listen-in-namespace")
        thread.start()
        thread.join()
    finally:
        os.close(netns)
    if failed:
        raise failed[0]
    return made[0]
