"""Base root filesystems: resolving an image name, building and caching the tree.

A base rootfs is built once by a recipe in `sandbox_images/` (debootstrap, ~1 minute), then
shifted so its owners are the sandbox's uid range (in-sandbox root = host `UID_BASE`): without
the shift every file would appear as `nobody` inside and root could not modify anything.
Builds go to a staging directory and are renamed into place, under a file lock, so parallel
first uses build once and an interrupted build leaves nothing half-made.

Run `python -m backends.sandbox.rootfs` to build (or verify) the default base ahead of time.
"""

from __future__ import annotations

import fcntl
import fnmatch
import hashlib
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from backends.sandbox.errors import BaseImageNotFoundError, HostPrerequisiteError
from backends.sandbox.settings import UID_BASE, cache_dir, images_dir, private_dir

log = logging.getLogger(__name__)
MARKER = ".backends-rootfs.json"
DEFAULT_IMAGE = "backends/base"


@dataclass(frozen=True)
class Substitution:
    image: str  # the image asked for
    rootfs: str  # name of the [rootfs.<name>] recipe serving it
    note: str


def _table() -> dict:
    path = images_dir() / "substitutions.toml"
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError as e:
        raise HostPrerequisiteError(f"substitution table {path} is missing") from e


def resolve_image(image: str) -> Substitution:
    """Find the local rootfs standing in for a base image.

    Raises:
        BaseImageNotFoundError: no entry of sandbox_images/substitutions.toml matches.
    """
    table = _table()
    for entry in table.get("substitute", []):
        if fnmatch.fnmatchcase(image, entry["image"]):
            return Substitution(image=image, rootfs=entry["rootfs"], note=entry.get("note", ""))
    known = ", ".join(e["image"] for e in table.get("substitute", []))
    raise BaseImageNotFoundError(
        f"base image {image!r} is not available locally: no registry is reachable and "
        f"sandbox_images/substitutions.toml has no entry for it (known: {known})"
    )


def _recipe(name: str) -> tuple[Path, str, str]:
    entry = _table().get("rootfs", {}).get(name)
    if entry is None:
        raise BaseImageNotFoundError(f"substitution table names rootfs {name!r} but has no recipe")
    script = images_dir() / entry["recipe"]
    digest = hashlib.sha256(script.read_bytes() + json.dumps(entry, sort_keys=True).encode())
    return script, entry.get("suite", ""), digest.hexdigest()[:16]


@contextmanager
def file_lock(name: str) -> Iterator[None]:
    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def rootfs_path(name: str) -> Path:
    return cache_dir() / "rootfs" / name


def ensure_rootfs(name: str) -> Path:
    """Return the cached rootfs `name`, building it first if missing or out of date.

    Raises:
        HostPrerequisiteError: the recipe failed (its output is in the message).
    """
    script, suite, digest = _recipe(name)
    dest = rootfs_path(name)
    private_dir(dest.parent)
    if _is_current(dest, digest):
        return dest
    with file_lock(f"rootfs-{name}"):
        if _is_current(dest, digest):
            return dest
        log.warning("building base rootfs %r with %s (one time, about a minute)", name, script)
        staging = dest.with_name(f".{name}.staging")
        if staging.exists():
            shutil.rmtree(staging)
        staging.parent.mkdir(parents=True, exist_ok=True)
        res = subprocess.run(
            [str(script), str(staging), suite], capture_output=True, text=True, check=False
        )
        if res.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            tail = (res.stderr or res.stdout)[-2000:]
            raise HostPrerequisiteError(f"building rootfs {name!r} with {script} failed:\n{tail}")
        shift_ownership(staging, UID_BASE)
        (staging / MARKER).write_text(json.dumps({"name": name, "recipe": digest}))
        if dest.exists():
            old = dest.with_name(f".{name}.old")
            dest.rename(old)
            shutil.rmtree(old)
        staging.rename(dest)
    return dest


def _is_current(dest: Path, digest: str) -> bool:
    try:
        return json.loads((dest / MARKER).read_text()).get("recipe") == digest
    except (OSError, ValueError):
        return False


def shift_ownership(root: Path, offset: int) -> None:
    """Add `offset` to the owner and group of every file under root (once, after a build).

    chown clears setuid/setgid bits, so they are put back afterwards.
    """
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames, ""]:
            p = os.path.join(dirpath, name) if name else dirpath
            st = os.lstat(p)
            if st.st_uid >= offset:
                continue
            os.lchown(p, st.st_uid + offset, st.st_gid + offset)
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                os.chmod(p, stat.S_IMODE(st.st_mode))


def main() -> None:
    from backends.sandbox.launcher import init_binary

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    image = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_IMAGE
    sub = resolve_image(image)
    path = ensure_rootfs(sub.rootfs)
    print(f"{image} -> rootfs {sub.rootfs} at {path}; pid 1 at {init_binary()}")


if __name__ == "__main__":
    main()
