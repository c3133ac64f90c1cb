"""Where the provider keeps its caches and finds its image recipes."""

from __future__ import annotations

import os
from pathlib import Path

# In-sandbox root is this host uid; the 65536 ids above it are the sandbox's users.
# Every sandbox shares the range (each in its own user namespace), so one uid-shifted
# base rootfs and one layer cache serve them all.
UID_BASE = 100_000
UID_COUNT = 65_536

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
