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


@functools.cache
def own_record() -> str:
    """This process's record (pid, start time and host never change while it runs)."""
    return record_of(os.getpid())


def record_of(pid: int) -> str:
    return f"{pid} {start_time(pid)} {host_identity()}\n"


def state(record: str) -> State:
    """Whether the record's owner is alive, dead, or not judgeable from here."""
    fields = record.split(maxsplit=2)
    if len(fields) < 2 or not fields[0].isdigit():
        return "dead"  # never written by a live owner (records are renamed into place)
    # Two fields: a record from before hosts were recorded, judged by this /proc as then.
    if len(fields) == 3 and fields[2].strip() != host_identity():
        return "unknown"
    return "alive" if start_time(int(fields[0])) == fields[1] else "dead"
