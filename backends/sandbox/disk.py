"""A sandbox's disk limit: its writable layer lives in a sparse ext4 image of `storage_mb`.

Why: the overlay's upper directory otherwise sits on the host filesystem, where one rollout
writing without bound would fill the disk under every other rollout (and the result store).
Inside the image a write past the limit fails with ENOSPC, in that sandbox only.

The image is made ahead of time (sparse, no journal, about 10 ms, already holding the
upper and work directories) and attached by the spawner in the sandbox's private mount
namespace on a loop device with autoclear: when the sandbox's last process is gone the
mount goes and the loop device detaches itself, even if its owner was SIGKILLed. The image
file is deleted with the sandbox's run directory. It grows only as the sandbox writes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from backends.sandbox.errors import HostPrerequisiteError

IMAGE = "disk.img"  # in the sandbox's run directory
MOUNT_POINT = "disk"  # where the image is mounted, in the sandbox's mount namespace only
MIN_STORAGE_MB = 16  # smaller ext4 file systems have too few inodes to be useful
LOOP_CONTROL = Path("/dev/loop-control")


def require_support(storage_mb: int) -> None:
    """Refuse clearly when this host cannot enforce a disk limit.

    Raises:
        HostPrerequisiteError: no mkfs.ext4, no loop devices, or a limit too small.
    """
    if storage_mb < MIN_STORAGE_MB:
        raise HostPrerequisiteError(
            f"storage_mb={storage_mb} is below the smallest enforceable disk ({MIN_STORAGE_MB} MB)"
        )
    missing = []
    if shutil.which("mkfs.ext4") is None:
        missing.append("mkfs.ext4 (apt-get install -y e2fsprogs)")
    if not LOOP_CONTROL.exists():
        missing.append(f"loop devices ({LOOP_CONTROL}; modprobe loop)")
    if missing:
        raise HostPrerequisiteError(
            f"the task sets storage_mb={storage_mb}, enforced with a loop-mounted ext4 disk, "
            f"but this host lacks {' and '.join(missing)}; pass enforce_storage=False to run "
            "without a disk limit"
        )


def format_image(image: Path, storage_mb: int, contents: Path) -> None:
    """Create a sparse ext4 image of `storage_mb` holding a copy of directory `contents`.

    Owners and modes are kept (`mkfs -d`). No journal (the layer is scratch, deleted at stop)
    and no room for online growth: half the mkfs time, 0.2 MB written instead of 4 MB. One
    inode per 8 KiB, so package installs with many small files do not run out first.

    Raises:
        OSError: mkfs failed (its message included).
    """
    # 0600: the image holds the sandbox's files, for host root's eyes only.
    with open(os.open(image, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.truncate(storage_mb * 1024 * 1024)
    res = subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-O", "^has_journal,^resize_inode", "-m", "0", "-i", "8192",
         "-E", "lazy_itable_init=1,nodiscard", "-d", str(contents), str(image)],
        capture_output=True,
        text=True,
    )  # fmt: skip
    if res.returncode != 0:
        os.unlink(image)
        raise OSError(f"mkfs.ext4 for a {storage_mb} MB sandbox disk failed: {res.stderr.strip()}")
