"""Where the provider keeps its caches and finds its image recipes."""

from __future__ import annotations

import os
from pathlib import Path

# Files of the shared layers (base rootfs, built layers, writable layers) are owned on disk by
# this range: sandbox uid n is host uid UID_BASE + n there. One uid-shifted copy serves every
# sandbox, each seeing it through an idmapped mount shifted to its own range.
UID_BASE = 100_000
UID_COUNT = 65_536


def sandbox_uid_ranges() -> tuple[int, int]:
    """(first host uid, number of ranges) of the ranges running sandboxes get, one each.

    `BACKENDS_SANDBOX_UID_BASE` (default 1,000,000) and `BACKENDS_SANDBOX_UID_RANGES`
    (default 4096): range k is [base + k * 65536, base + (k + 1) * 65536), and at most that
    many sandboxes run at once on the host. Pick a base no host user or subuid range uses.
    """
    base = int(os.environ.get("BACKENDS_SANDBOX_UID_BASE", 1_000_000))
    count = int(os.environ.get("BACKENDS_SANDBOX_UID_RANGES", 4096))
    if base < UID_BASE + UID_COUNT or count < 1 or base + count * UID_COUNT > 2**32 - 1:
        raise ValueError(
            f"sandbox uid ranges from {base}, {count} of them, must lie above the layers' range "
            f"({UID_BASE}..{UID_BASE + UID_COUNT - 1}) and below 2**32 - 1"
        )
    return base, count


_REPO_ROOT = Path(__file__).resolve().parents[2]


def cache_dir() -> Path:
    """Root of the rootfs, layer and run-state caches.

    `BACKENDS_CACHE` wins; otherwise /var/cache/backends when writable (root), else
    ~/.cache/backends. Never inside the repository.
    """
    if env := os.environ.get("BACKENDS_CACHE"):
        return Path(env)
    system = Path("/var/cache/backends")
    if os.geteuid() == 0:
        return system
    return Path.home() / ".cache" / "backends"


def images_dir() -> Path:
    """The `sandbox_images/` directory: rootfs recipes and the substitution table."""
    if env := os.environ.get("BACKENDS_SANDBOX_IMAGES"):
        return Path(env)
    return _REPO_ROOT / "sandbox_images"


def uid_lock_dir() -> Path:
    """Where uid-range leases are locked: host-wide, since host uids are.

    Two caches on one host (two users' BACKENDS_CACHE, CI beside a developer) must not lease
    the same range; /run is also emptied at boot, when no lease can still be held.
    """
    if env := os.environ.get("BACKENDS_UID_LOCKS"):
        return Path(env)
    return Path("/run/backends/uid-ranges") if os.geteuid() == 0 else cache_dir() / "uid-ranges"


def run_dir() -> Path:
    """Per-sandbox scratch state (overlay upper dirs, owner records)."""
    return cache_dir() / "run"


def private_dir(path: Path) -> Path:
    """Create `path` if needed and make it reachable by host root only (mode 0700).

    Layers hold files that are setuid to sandbox users (host uids from `UID_BASE`): a host
    user able to reach them could run one and become a sandbox's root on the host, free to
    rewrite the shared base layers. Overlays are mounted by host root, so 0700 costs nothing.
    """
    path.mkdir(parents=True, exist_ok=True)
    if path.stat().st_mode & 0o777 != 0o700:
        path.chmod(0o700)
    return path
