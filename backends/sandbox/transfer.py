"""Moving files across the sandbox wall as tar streams, without ever writing outside a target.

Uploads are packed on the host and unpacked by `tar` running inside the sandbox as sandbox
root, so every path (and every symlink an agent may have planted) resolves inside the
sandbox's own mount tree, and in-sandbox root is an unprivileged host uid anyway. Downloads
are packed inside and unpacked on the host by `safe_extract`, which keeps modes and the
symlinks that stay inside the target, and refuses any member that would land outside it.
Archives pass through temporary files, never whole through memory: a large transfer costs
disk, not RAM.
"""

from __future__ import annotations

import logging
import os
import posixpath
import stat
import tarfile
from pathlib import Path
from typing import BinaryIO

from backends.sandbox.errors import SandboxPathError

log = logging.getLogger(__name__)


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


def _inside(root: str, path: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def safe_extract(archive: BinaryIO, dest: Path, *, rename_single: str | None = None) -> None:
    """Unpack a tar file produced inside a sandbox (read from its start) into host dir `dest`.

    Regular files, directories and symlinks are extracted with their permission bits, minus
    setuid/setgid; devices and FIFOs are skipped. A symlink is kept only if it resolves inside
    `dest`: host tools (Harbor, running as root) read downloaded logs, and a planted link to
    /root/.ssh/id_rsa must not become a file they read. Skipped links are logged by name.
    `dest` keeps its own mode and owner. With `rename_single`, the archive's one member must
    be a regular file, written to `dest / rename_single`.

    Raises:
        SandboxPathError: a member (or a hard link's target) would land outside `dest`,
            including through a symlink extracted earlier.
        IsADirectoryError: `rename_single` was asked for and the member is a directory.
        OSError: `rename_single` was asked for and the member is not a regular file.
    """
    dest.mkdir(parents=True, exist_ok=True)
    root = os.path.realpath(dest)
    uid, gid = os.geteuid(), os.getegid()
    dropped: list[str] = []

    def check(member: tarfile.TarInfo, _path: str) -> tarfile.TarInfo | None:
        if rename_single is not None:
            if member.isdir():
                raise IsADirectoryError(f"{member.name} is a directory: use download_dir")
            if not member.isfile():
                raise OSError(f"{member.name} is not a regular file")
            member = member.replace(name=rename_single, deep=False)
        name = member.name
        if name.rstrip("/") in ("", "."):  # the target directory itself: it stays as it is
            return None
        if member.isdev() or member.isfifo():
            return None
        here = os.path.join(root, name)
        if name.startswith("/") or not _inside(root, os.path.realpath(here)):
            raise SandboxPathError(f"download member {name!r} would be written outside {dest}")
        if member.islnk() and not _inside(
            root, os.path.realpath(os.path.join(root, member.linkname))
        ):
            raise SandboxPathError(
                f"download member {name!r} is a hard link to {member.linkname!r} outside {dest}"
            )
        if member.issym():
            target = os.path.join(os.path.dirname(here), member.linkname)
            if member.linkname.startswith("/") or not _inside(root, os.path.realpath(target)):
                dropped.append(f"{name} -> {member.linkname}")
                return None
        mode = member.mode & ~(stat.S_ISUID | stat.S_ISGID) if member.mode is not None else None
        return member.replace(mode=mode, uid=uid, gid=gid, uname="", gname="", deep=False)

    archive.seek(0)
    with tarfile.open(fileobj=archive, mode="r:") as tar:
        for member in tar:
            # One member at a time, so the realpath check sees symlinks extracted before it.
            tar.extract(member, root, filter=check)
            if rename_single is not None:
                break
    # A link checked while a name it goes through did not exist yet can point elsewhere once
    # a later member creates that name: check every link again in the finished tree.
    dropped += _drop_escaping_links(root)
    if dropped:
        log.warning(
            "download into %s skipped %d symlink(s) pointing outside it: %s",
            dest,
            len(dropped),
            ", ".join(dropped[:20]),
        )


def _drop_escaping_links(root: str) -> list[str]:
    """Remove symlinks under root that resolve outside it, until none does."""
    dropped: list[str] = []
    while True:
        removed = False
        for top, dirs, files in os.walk(root):
            for name in (*dirs, *files):
                path = os.path.join(top, name)
                if os.path.islink(path) and not _inside(root, os.path.realpath(path)):
                    dropped.append(f"{os.path.relpath(path, root)} -> {os.readlink(path)}")
                    os.unlink(path)
                    removed = True
        if not removed:
            return dropped
