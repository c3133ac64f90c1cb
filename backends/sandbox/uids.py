"""Host uid ranges for running sandboxes: one per sandbox, leased race-free across processes.

Per-uid kernel limits (key quotas, inotify instances, user processes, message queues) are
counted per host uid, so sandboxes sharing one range would share them: one sandbox could
exhaust them for all others. Each running sandbox leases a range of its own, like a subuid
range. A lease is a `flock` on the range's lock file, held by the owner and by the spawner
until the sandbox's last process is gone; the kernel drops it when both have let go or died,
so a crashed owner never leaks a range and no two live sandboxes ever share one.

A fork server (`backends.sandbox.forkserver`) runs as a range's root, which owns the user
namespace of every sandbox of that range and may enter it: it `keep`s the range leased for as
long as it runs, even once no sandbox uses it, and this process hands such ranges to its next
sandboxes first (so the server goes on serving them, and no other process gets the range).
"""

from __future__ import annotations

import fcntl
import os
import threading
from dataclasses import dataclass

from backends.sandbox.errors import SandboxStartError
from backends.sandbox.settings import UID_COUNT, private_dir, sandbox_uid_ranges, uid_lock_dir

# Each process starts its search at a home of its own and takes the first free range from
# there: processes rarely collide, and one reuses the few ranges it had (the spawner keeps
# the idmap of each at hand).
_HOME_STRIDE = 7919


@dataclass
class Lease:
    base: int  # host uid of sandbox root; the range's other ids follow it
    fd: int  # the locked file: whoever holds a copy keeps the range

    def release(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with _lock:
                if _live.get(self.base) == fd:
                    del _live[self.base]
                if self.base in _kept:
                    _kept[self.base].in_use = False
            os.close(fd)


@dataclass
class _Kept:
    fd: int  # a copy of the range's locked file, held by this module
    keepers: int = 1  # fork servers running as the range's root
    in_use: bool = True  # a sandbox of this process runs in the range


class Keep:
    """The range of host uid `base` kept leased while a fork server runs as its root."""

    def __init__(self, base: int) -> None:
        self.base = base
        self._held = True

    def release(self) -> None:
        with _lock:
            if not self._held:
                return
            self._held = False
            kept = _kept[self.base]
            kept.keepers -= 1
            if kept.keepers == 0:
                del _kept[self.base]
                os.close(kept.fd)


_lock = threading.Lock()
_live: dict[int, int] = {}  # base -> fd of the lease of a sandbox of this process
_kept: dict[int, _Kept] = {}  # base -> what keeps the range leased for fork servers


def keep(base: int) -> Keep | None:
    """Keep the range whose root is host uid `base` leased until `release()`; None when no
    sandbox of this process leases it now (then it may be another's)."""
    with _lock:
        if base in _kept:
            _kept[base].keepers += 1
        elif base in _live:
            _kept[base] = _Kept(os.dup(_live[base]))
        else:
            return None
    return Keep(base)


def lease() -> Lease:
    """Lease a free range: first one this process keeps for its fork servers, else any.

    Raises:
        SandboxStartError: every range is in use (that many sandboxes run on this host).
    """
    first, count = sandbox_uid_ranges()
    with _lock:
        for kept_base, kept in _kept.items():
            if not kept.in_use and first <= kept_base < first + count * UID_COUNT:
                kept.in_use = True
                fd = _live[kept_base] = os.dup(kept.fd)
                return Lease(kept_base, fd)
    found = _lease_free()
    with _lock:
        _live[found.base] = found.fd
    return found


def _lease_free() -> Lease:
    base, count = sandbox_uid_ranges()
    locks = private_dir(uid_lock_dir())
    start = os.getpid() * _HOME_STRIDE
    for i in range(count):
        k = (start + i) % count
        fd = os.open(locks / f"{k}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return Lease(base + k * UID_COUNT, fd)
    raise SandboxStartError(
        f"all {count} sandbox uid ranges are in use (BACKENDS_SANDBOX_UID_RANGES)"
    )
