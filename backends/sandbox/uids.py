"""Host uid ranges for running sandboxes: one per sandbox, leased race-free across processes.

Per-uid kernel limits (key quotas, inotify instances, user processes, message queues) are
counted per host uid, so sandboxes sharing one range would share them: one sandbox could
exhaust them for all others. Each running sandbox leases a range of its own, like a subuid
range. A lease is a `flock` on the range's lock file, held by the owner and by the spawner
until the sandbox's last process is gone; the kernel drops it when both have let go or died,
so a crashed owner never leaks a range and no two live sandboxes ever share one.
"""

from __future__ import annotations

import fcntl
import os
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
            os.close(fd)


def lease() -> Lease:
    """Lease a free range.

    Raises:
        SandboxStartError: every range is in use (that many sandboxes run on this host).
    """
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
