"""Unpacking a download archive on the host, where every byte of it is the sandbox's to choose.

Root inside the sandbox decides what `tar` is, so the archive is hostile input read by host
root. Nothing here trusts a path check made in user space: every member is reached through
directory fds opened one component at a time with `O_NOFOLLOW` (the kernel refuses to follow
any symlink on the way, however long the path), files are written under a temporary name and
renamed into place (never opened through an existing name), and each symlink this call made is
resolved afterwards by the kernel with `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)` and
removed if it leaves the target. Nothing the call did not create is ever removed.

Sizes are bounded on the apparent size (a sparse 1 TiB file counts as 1 TiB), in total and per
file for the files host tools parse whole (`PARSED_FILE_LIMITS`); modes are masked so no
setuid, setgid, sticky or group/world-writable entry lands on the host.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fnmatch
import functools
import logging
import os
import posixpath
import stat
import struct
import tarfile
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from backends.sandbox.errors import SandboxPathError

log = logging.getLogger(__name__)

# Files a host reader (Harbor's verifier and trial code) loads whole into memory: larger is
# refused, naming the file, instead of taking the host's memory (a sparse 3 GiB reward.txt
# once did).
PARSED_FILE_LIMITS = {
    "reward.txt": 1024 * 1024,
    "reward.json": 1024 * 1024,
    "trajectory.json": 64 * 1024 * 1024,
    "ctrf.json": 64 * 1024 * 1024,
    # Harbor's mini-swe-agent class (and ours, backends.runtimes) parse the native one.
    "mini-swe-agent.trajectory.json": 64 * 1024 * 1024,
    # Harbor's opencode class parses the agent's output file.
    "opencode.txt": 64 * 1024 * 1024,
}
# The same by base-name pattern, with a bound on all of a download's files of the pattern
# together: (per file, total). Harbor's claude-code and codex classes convert the session
# `*.jsonl` files in the agent's logs, any name, each line whole (a sparse file is one line).
PARSED_PATTERN_LIMITS = {
    "*.jsonl": (32 * 1024 * 1024, 64 * 1024 * 1024),
}
# Host-side mode mask: rwxr-xr-x at most.
MODE_MASK = 0o755
# Header bytes (long names, pax records, sparse maps) read for one member: tarfile keeps them
# in memory, so a hostile archive must not make one header gigabytes long.
MAX_HEADER_BYTES = 8 * 1024 * 1024
CHUNK = 1024 * 1024
# Deepest member path accepted (in components): deeper is refused by name. It bounds the
# recursion and the directory descriptors one download needs.
MAX_DEPTH = 256

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

SYS_OPENAT2 = 437  # the same number on every architecture
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
_libc = ctypes.CDLL(None, use_errno=True)


_Writer = Callable[[str, int], None]  # makes an entry by name in a directory fd
Copy = Callable[[int], None]  # writes a regular member's data into an fd
Member = tuple[tarfile.TarInfo, Copy | None]


class DownloadTooLargeError(OSError):
    """The download holds more than the caller allows (in total, or one parsed file)."""


def parsed_file_limits(name: str) -> tuple[str, int, int | None] | None:
    """For a file host readers parse whole, by its base name: the name or pattern it is
    limited under, the limit per file and the limit for all such files together."""
    base = posixpath.basename(name)
    if base in PARSED_FILE_LIMITS:
        return base, PARSED_FILE_LIMITS[base], None
    for pattern, (per_file, total) in PARSED_PATTERN_LIMITS.items():
        if fnmatch.fnmatchcase(base, pattern):
            return pattern, per_file, total
    return None


def _open_beneath(root_fd: int, path: str, flags: int, resolve: int = 0) -> int:
    """openat2 of `path` under the directory fd `root_fd`, never leaving it: an fd, or -1."""
    how = struct.pack("=QQQ", flags | os.O_CLOEXEC, 0, RESOLVE_BENEATH | resolve)
    return int(_libc.syscall(SYS_OPENAT2, root_fd, os.fsencode(path), how, len(how)))


def _resolved_beneath(root_fd: int, path: str) -> os.stat_result | None:
    """The entry `path` (relative to the directory fd `root_fd`) resolves to, per the kernel,
    if it exists inside the root; None for a dangling path, `..` past the root, an absolute
    symlink, a magic link or a loop.
    """
    fd = _open_beneath(root_fd, path, os.O_PATH, RESOLVE_NO_MAGICLINKS)
    if fd < 0:  # ENOSYS before Linux 5.6: no way to ask the kernel, so nothing is inside
        return None
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def resolves_beneath(root_fd: int, path: str) -> bool:
    """Does `path` resolve to an existing entry inside the directory fd `root_fd`?

    A dangling path counts as outside: a later download into the same directory could make
    its missing names links that turn it into a way out.
    """
    return _resolved_beneath(root_fd, path) is not None


def _links_under(root_fd: int) -> set[str]:
    """Every symlink in the tree of `root_fd`, as paths relative to it.

    Directories are reopened by path, through no symlink, so a wide tree holds no more than
    one descriptor at a time; parts deeper than PATH_MAX are not seen (a download drops every
    link of its own it cannot resolve, so none of them is there).
    """
    links: set[str] = set()
    pending = [""]
    while pending:
        rel = pending.pop()
        fd = _open_beneath(root_fd, rel or ".", _DIR_FLAGS, RESOLVE_NO_SYMLINKS)
        if fd < 0:
            continue
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    path = f"{rel}{entry.name}"
                    if entry.is_symlink():
                        links.add(path)
                    elif entry.is_dir(follow_symlinks=False):
                        pending.append(path + "/")
        finally:
            os.close(fd)
    return links


class _BoundedReader:
    """The archive as tarfile sees it: header reads are capped per member."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.header_bytes = 0

    def read(self, size: int = -1) -> bytes:
        if size < 0 or self.header_bytes + size > MAX_HEADER_BYTES:
            raise SandboxPathError("download archive has a header larger than 8 MiB")
        self.header_bytes += size
        return self.raw.read(size)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()


@dataclass
class _Extraction:
    root_fd: int
    dest: Path
    max_bytes: int
    total: int = 0
    parsed: dict[str, int] = field(default_factory=dict)  # bytes of parsed files, by pattern
    dirs: dict[tuple[str, ...], int] = field(default_factory=dict)  # open dir fds by path
    created: list[tuple[tuple[str, ...], bool]] = field(default_factory=list)  # (path, is_dir)
    files: set[tuple[str, ...]] = field(default_factory=set)  # regular files written
    links: list[tuple[str, ...]] = field(default_factory=list)  # symlinks written
    modes: list[tuple[tuple[str, ...], int]] = field(default_factory=list)  # dirs, set last
    dropped: list[str] = field(default_factory=list)
    outside_before: set[str] = field(default_factory=set)  # the target's links leading out

    def close(self) -> None:
        for fd in self.dirs.values():
            os.close(fd)
        self.dirs.clear()

    def directory(self, parts: tuple[str, ...]) -> int:
        """The fd of directory `parts` under the root, made if missing, never via a symlink."""
        if not parts:
            return self.root_fd
        fd = self.dirs.get(parts)
        if fd is not None:
            return fd
        parent = self.directory(parts[:-1])
        name = parts[-1]
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
            self.created.append((parts, True))
        except FileExistsError:
            pass
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError as e:
            if e.errno not in (errno.ENOTDIR, errno.ELOOP):
                raise
            raise SandboxPathError(
                f"download member path {'/'.join(parts)!r} goes through a symlink or a "
                f"non-directory in {self.dest}"
            ) from None
        if len(self.dirs) >= 256:  # wide trees: do not hoard descriptors (keep our ancestors)
            for key in [k for k in self.dirs if parts[: len(k)] != k]:
                os.close(self.dirs.pop(key))
        self.dirs[parts] = fd
        return fd

    def charge(self, name: str, size: int) -> None:
        """Count a file's apparent size against the total and its parsed-file limits."""
        self.charge_parsed(f"download member {name!r}", name, size)
        self.total += size
        if self.total > self.max_bytes:
            raise DownloadTooLargeError(
                f"download is larger than {self.max_bytes} bytes (max_download_bytes), counting "
                "sparse files at their full size"
            )

    def charge_parsed(self, what: str, name: str, size: int) -> None:
        """Count a file (or a link to one) the host may parse whole against its limits."""
        limits = parsed_file_limits(name)
        if limits is None:
            return
        group, per_file, total = limits
        if size > per_file:
            raise DownloadTooLargeError(
                f"{what} is {size} bytes; files named like it are read whole by the host and "
                f"may be at most {per_file} bytes"
            )
        self.parsed[group] = self.parsed.get(group, 0) + size
        if total is not None and self.parsed[group] > total:
            raise DownloadTooLargeError(
                f"{what} is {size} bytes, which brings the download's {group} files to "
                f"{self.parsed[group]}; the host reads them all whole, and at most {total} bytes"
            )

    def place(self, parts: tuple[str, ...], write: _Writer) -> None:
        """Create an entry under a fresh temporary name, then rename it over `parts`."""
        parent = self.directory(parts[:-1])
        temp = f".backends-download-{uuid.uuid4().hex[:16]}"
        try:
            write(temp, parent)
        except BaseException:  # a half-written member is no member: nothing of it stays
            _remove(temp, parent)
            raise
        existed = _exists(parts[-1], parent)
        try:
            os.rename(temp, parts[-1], src_dir_fd=parent, dst_dir_fd=parent)
        except OSError as e:
            _remove(temp, parent)
            if e.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise SandboxPathError(
                    f"download member {'/'.join(parts)!r} would replace a directory in {self.dest}"
                ) from None
            raise
        if not existed:
            self.created.append((parts, False))
        self.files.discard(parts)

    def undo(self) -> None:
        """Remove what this call created (newest first); directories only once empty."""
        for parts, is_dir in reversed(self.created):
            try:
                parent = self.directory(parts[:-1])
                if is_dir:
                    os.rmdir(parts[-1], dir_fd=parent)
                    fd = self.dirs.pop(parts, None)
                    if fd is not None:
                        os.close(fd)
                else:
                    os.unlink(parts[-1], dir_fd=parent)
            except (OSError, SandboxPathError):
                continue


def _exists(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _remove(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def _member_parts(name: str, dest: Path) -> tuple[str, ...]:
    if name.startswith("/"):
        raise SandboxPathError(f"download member {name!r} would be written outside {dest}")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if ".." in parts:
        raise SandboxPathError(f"download member {name!r} would be written outside {dest}")
    if len(parts) > MAX_DEPTH:
        raise SandboxPathError(
            f"download member {name[:200]!r}... is {len(parts)} directories deep; at most "
            f"{MAX_DEPTH} are accepted"
        )
    return parts


def _link_stays_inside(parts: tuple[str, ...], target: str) -> bool:
    """The lexical half of the symlink check: relative, and not climbing out of the root."""
    if not target or target.startswith("/") or "\x00" in target:
        return False
    joined = posixpath.normpath(posixpath.join("/".join(parts[:-1]) or ".", target))
    return joined != ".." and not joined.startswith("../")


def _copy_data(archive: BinaryIO, member: tarfile.TarInfo, fd: int) -> None:
    """Write a regular member's data into fd; a sparse member's holes stay holes."""
    # (where in the archive, where in the file, how many bytes): sparse data lies back to back.
    pieces: list[tuple[int, int, int]] = []
    pos = member.offset_data
    sparse: list[tuple[int, int]] = getattr(member, "sparse", None) or [(0, member.size)]
    for offset, length in sparse:
        pieces.append((pos, offset, length))
        pos += length
    for pos, offset, size in pieces:
        archive.seek(pos)
        while size > 0:
            chunk = archive.read(min(CHUNK, size))
            if not chunk:
                raise SandboxPathError(f"download archive ends inside {member.name!r}")
            os.pwrite(fd, chunk, offset)
            offset += len(chunk)
            size -= len(chunk)
    os.ftruncate(fd, member.size)


def into(
    archive: BinaryIO,
    dest: Path,
    *,
    max_bytes: int,
    rename_single: str | None = None,
) -> None:
    """Unpack a tar file produced inside a sandbox (read from its start) into host dir `dest`.

    Regular files, directories, hard links (to files this call wrote) and symlinks (only those
    resolving inside `dest`; the others are logged and skipped) are extracted with their
    permission bits masked by `MODE_MASK` and owned by the caller; devices and FIFOs are
    skipped. `dest` keeps its own mode. With `rename_single`, the archive's one member must
    be a regular file, written to `dest / rename_single`. On any error, what this call
    created is removed again.

    Raises:
        SandboxPathError: a member would land outside `dest` or go through a symlink, or
            would replace a directory; or the archive is malformed.
        DownloadTooLargeError: more than `max_bytes` in total (apparent sizes), or a file in
            `PARSED_FILE_LIMITS` above its limit.
        IsADirectoryError: `rename_single` was asked for and the member is a directory.
        OSError: `rename_single` was asked for and the member is not a regular file.
    """
    archive.seek(0)
    reader = _BoundedReader(archive)
    members = (
        (member, functools.partial(_copy_data, archive, member)) for member in _members(reader)
    )
    into_members(members, dest, max_bytes=max_bytes, rename_single=rename_single)


def into_members(
    members: Iterable[Member],
    dest: Path,
    *,
    max_bytes: int,
    rename_single: str | None = None,
) -> None:
    """`into` for members from any source: each a TarInfo (name, type, mode, size, link
    name, mtime) and, for a regular file, a function writing its data into an fd. Every
    check of `into` applies, whoever made the members.
    """
    dest.mkdir(parents=True, exist_ok=True)
    root_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    state = _Extraction(root_fd, dest, max_bytes)
    try:
        # The host's own links that already lead out are left alone; any other that does
        # once this download is in goes. One regular file (download_file) makes no link, and
        # its target's parent may be any large host directory: no walk then.
        if rename_single is None:
            state.outside_before = {
                p for p in _links_under(root_fd) if not resolves_beneath(root_fd, p)
            }
        try:
            came = False
            for member, copy in members:
                came = True
                if rename_single is not None:
                    _check_single(member)
                    member = member.replace(name=rename_single, deep=False)
                _extract_member(state, member, copy)
                if rename_single is not None:
                    break
            if rename_single is not None and not came:  # tar skips a socket, say
                raise FileNotFoundError(f"the download of {rename_single} holds no file")
            for parts, mode in reversed(state.modes):
                os.chmod(state.directory(parts), mode)
            if rename_single is None:
                _drop_escaping_links(state)
        except BaseException:
            state.undo()
            raise
    finally:
        state.close()
        os.close(root_fd)
    if state.dropped:
        log.warning(
            "download into %s skipped %d symlink(s) pointing outside it: %s",
            dest,
            len(state.dropped),
            ", ".join(state.dropped[:20]),
        )


def _members(reader: _BoundedReader) -> Iterator[tarfile.TarInfo]:
    try:
        tar = tarfile.open(fileobj=reader, mode="r:")  # type: ignore[call-overload]
        while True:
            reader.header_bytes = 0
            member = tar.next()
            if member is None:
                return
            tar.members.clear()  # kept by tarfile for random access we never do
            yield member
    except tarfile.TarError as e:
        raise SandboxPathError(f"download archive is malformed: {e}") from None


def _check_single(member: tarfile.TarInfo) -> None:
    if member.isdir():
        raise IsADirectoryError(f"{member.name} is a directory: use download_dir")
    if not member.isfile():
        raise OSError(f"{member.name} is not a regular file")


def _extract_member(state: _Extraction, member: tarfile.TarInfo, copy: Copy | None) -> None:
    parts = _member_parts(member.name, state.dest)
    if not parts:  # the target directory itself: it stays as it is
        return
    mode = (member.mode or 0) & MODE_MASK
    if member.isdir():
        state.directory(parts)
        state.modes.append((parts, mode | 0o700))
    elif member.isfile():
        assert copy is not None, member.name
        state.charge(member.name, member.size)

        def write(temp: str, parent: int) -> None:
            fd = os.open(temp, _FILE_FLAGS, 0o600, dir_fd=parent)
            try:
                copy(fd)
                os.fchmod(fd, mode)
                with contextlib.suppress(OverflowError, ValueError, OSError):
                    os.utime(fd, (member.mtime, member.mtime))
            finally:
                os.close(fd)

        state.place(parts, write)
        state.files.add(parts)
    elif member.islnk():
        source = _member_parts(member.linkname, state.dest)
        if source not in state.files:
            raise SandboxPathError(
                f"download member {member.name!r} is a hard link to {member.linkname!r}, "
                "which is not a file of this download"
            )
        # Our own copy: opening the link's directory may evict the source's from the cache.
        src_dir = os.dup(state.directory(source[:-1]))
        try:
            size = os.stat(source[-1], dir_fd=src_dir).st_size
            state.charge_parsed(f"download member {member.name!r}", member.name, size)
            state.place(
                parts,
                lambda temp, parent: os.link(
                    source[-1], temp, src_dir_fd=src_dir, dst_dir_fd=parent, follow_symlinks=False
                ),
            )
        finally:
            os.close(src_dir)
        state.files.add(parts)
    elif member.issym():
        if not _link_stays_inside(parts, member.linkname):
            state.dropped.append(f"{member.name} -> {member.linkname}")
            return
        state.place(parts, lambda temp, parent: os.symlink(member.linkname, temp, dir_fd=parent))
        state.links.append(parts)
    # Devices, FIFOs and anything else: nothing a host tool needs from a sandbox.


def _drop_escaping_links(state: _Extraction) -> None:
    """Remove the target's symlinks that do not resolve, per the kernel, to an existing entry
    inside it, and refuse the download if one named like a parsed file leads to a larger file.

    Judged once the whole tree is in, over the whole target (links of an earlier download
    into it may lead somewhere new through what this one wrote), all before any is removed:
    a chain through an escaping link escapes too, where after that link's removal it would
    only dangle. Links of the target that led outside before this call are left alone.
    """
    made = {"/".join(p) for p in state.links}
    escaping = []
    for path in sorted(_links_under(state.root_fd) | made):
        resolved = _resolved_beneath(state.root_fd, path)
        if resolved is None:
            if path in made or path not in state.outside_before:
                escaping.append(path)
            continue
        if stat.S_ISREG(resolved.st_mode):
            try:
                state.charge_parsed(
                    f"download link {path!r} leads to a file that", path, resolved.st_size
                )
            except DownloadTooLargeError:
                # Removed even when an earlier download made it: the file it leads to may
                # have been replaced by this one, which undoing this call cannot put back.
                parts = tuple(path.split("/"))
                os.unlink(parts[-1], dir_fd=state.directory(parts[:-1]))
                raise
    for path in escaping:
        parts = tuple(path.split("/"))
        parent = state.directory(parts[:-1])
        try:
            target = os.readlink(parts[-1], dir_fd=parent)
        except OSError:
            continue
        state.dropped.append(f"{path} -> {target}")
        os.unlink(parts[-1], dir_fd=parent)
