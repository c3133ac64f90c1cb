"""Owner records: which process owns a sandbox (or a run of them), and whether it still lives.

A record is the owner's pid, its start time (so a reused pid is not taken for it) and where the
pid means that process: the host's name, its boot and its pid namespace. A cache or a home
shared by two hosts, two containers or two pid namespaces holds records whose pids mean nothing
in this /proc: those are "unknown", never "dead", so no reaper takes a live owner's sandboxes.
"""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path
from typing import Literal

State = Literal["alive", "dead", "unknown"]


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot, or None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@functools.cache
def host_identity() -> str:
    """Where a pid names this process: host name, boot id and pid namespace."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{socket.gethostname()} {boot} {os.readlink('/proc/self/ns/pid')}"


def write(directory: Path) -> None:
    """Record this process as the owner of ``directory``.

    Two files, so that a reaper of an older version (which reads ``owner`` as exactly a pid
    and a start time) still reads it: the host first, then the record, renamed into place.
    """
    (directory / "owner-host").write_text(host_identity() + "\n")
    (directory / "owner.new").write_text(f"{os.getpid()} {_own_start()}\n")
    (directory / "owner.new").rename(directory / "owner")


@functools.cache
def _own_start() -> str | None:
    return start_time(os.getpid())  # never changes while this process runs


def state_of(directory: Path) -> State:
    """Whether the owner recorded in ``directory`` is alive, dead, or not judgeable here.

    Raises:
        FileNotFoundError: no owner record (yet).
    """
    fields = (directory / "owner").read_text().split()
    if len(fields) != 2 or not fields[0].isdigit():
        return "dead"  # never written by a live owner (records are renamed into place)
    try:
        host = (directory / "owner-host").read_text().strip()
    except FileNotFoundError:
        host = host_identity()  # recorded by an older version, which knew no other host
    if host != host_identity():
        return "unknown"
    return "alive" if start_time(int(fields[0])) == fields[1] else "dead"
