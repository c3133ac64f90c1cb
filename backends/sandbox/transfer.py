"""Moving files across the sandbox wall as tar streams, without ever writing outside a target.

Uploads are packed on the host and unpacked by `tar` running inside the sandbox as sandbox
root, so every path (and every symlink an agent may have planted) resolves inside the
sandbox's own mount tree, and in-sandbox root is an unprivileged host uid anyway. Downloads
are packed inside and unpacked on the host by `backends.sandbox.unpack`, which treats the
archive as hostile. Archives pass through temporary files, never whole through memory: a
large transfer costs disk, not RAM.
"""

from __future__ import annotations

import os
import posixpath
import tarfile
from pathlib import Path
from typing import BinaryIO

from backends.sandbox.errors import SandboxPathError


def sandbox_path(path: str | os.PathLike[str], workdir: str = "/") -> str:
    """Normalize a path inside the sandbox; relative paths start at `workdir`.

    Raises:
        SandboxPathError: the path climbs above the sandbox root with `..`, or holds a NUL.
    """
    raw = os.fspath(path)
    if "\x00" in raw or raw == "":
        raise SandboxPathError(f"invalid sandbox path {raw!r}")
    full = raw if raw.startswith("/") else posixpath.join(workdir, raw)
    depth = 0
    for part in full.split("/"):
        if part in ("", "."):
            continue
        depth = depth - 1 if part == ".." else depth + 1
        if depth < 0:
            raise SandboxPathError(f"sandbox path {raw!r} escapes the sandbox root")
    return posixpath.normpath(full).replace("//", "/")


def _root_owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
    # Like `docker cp`: what the host sends belongs to root inside.
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def pack(source: Path, arcname: str, out: BinaryIO) -> None:
    """Tar a host file or directory tree into `out` (symlinks kept as links, modes kept)."""
    if not source.exists() and not source.is_symlink():
        raise FileNotFoundError(f"upload source {source} does not exist")
    with tarfile.open(fileobj=out, mode="w") as tar:
        tar.add(str(source), arcname=arcname, filter=_root_owned)
    out.seek(0)


def pack_dir_contents(source: Path, out: BinaryIO) -> None:
    """Tar the contents of a host directory into `out`, to be merged into a target directory."""
    if not source.is_dir():
        raise NotADirectoryError(f"upload source {source} is not a directory")
    with tarfile.open(fileobj=out, mode="w") as tar:
        for child in sorted(source.iterdir()):
            tar.add(str(child), arcname=child.name, filter=_root_owned)
    out.seek(0)
