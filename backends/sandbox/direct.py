"""File transfers done by the host through a live sandbox's root directory, with no process
started inside (a `tar` in the sandbox costs a spawn and two execs, ~5 ms, per transfer).

The host opens `/proc/<pid 1>/root` once and reaches every path under it with `openat2`:
`RESOLVE_IN_ROOT` resolves the sandbox's symlinks as they resolve inside (absolute ones and
`..` stay in its root), `RESOLVE_NO_MAGICLINKS` refuses `/proc/*/root`-style jumps, and a
tree is walked one component at a time with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
RESOLVE_NO_XDEV`. Host root must not become a way for the sandbox to reach what sandbox root
cannot, so every descriptor used must lie on a mount the sandbox made for itself (its overlay
root, its tmpfs instances): not on procfs or sysfs (host root could read /proc/kcore there),
not on a bind of a host path (host root could read a 0600 file sandbox root cannot). Uploads
create files with the sandbox root's host uid and gid as the thread's filesystem ids
(`setfsuid`), so they carry no host capability and land owned by root inside, as `tar` run by
sandbox root makes them.

Anything outside that (a path on another mount, a file sandbox root's uid may not write, a
special file to upload) raises `Unsupported` and the caller falls back to the `tar` path,
whose behaviour this matches: same files, modes, links and errors. Downloads feed
`backends.sandbox.unpack.into_members`, so every host-side check of a tar download applies.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import stat
import struct
import tarfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from backends.sandbox.unpack import MAX_DEPTH, Member

SYS_OPENAT2 = 437  # the same number on every architecture
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10
_IN_ROOT = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS
_CHILD = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
# setfsuid/setfsgid: per thread in the kernel (glibc does not broadcast them to all threads).
_SETFS = {"x86_64": (122, 123), "aarch64": (151, 152)}
# What a sandbox makes for itself; procfs, sysfs, devpts, mqueue... are never read or written.
OWN_FILESYSTEMS = ("overlay", "tmpfs")
CHUNK = 1024 * 1024
# Entries one transfer walks before leaving it to tar (whose archive the download limit
# bounds): a listing is streamed, but a tree of millions is not worth a thread.
MAX_ENTRIES = 10_000
# Levels one walk descends before leaving the tree to tar (one descriptor each).
MAX_WALK_DEPTH = 32
_libc = ctypes.CDLL(None, use_errno=True)


class Unsupported(Exception):
    """This transfer needs the in-sandbox path (the reason says why)."""


class Watch:
    """Ends a transfer running in a worker thread from outside: past its deadline, once the
    caller gave up (`stop`), or past `MAX_ENTRIES` entries. Checked per entry and per chunk."""

    def __init__(self, timeout_sec: float, what: str) -> None:
        self.deadline = time.monotonic() + timeout_sec
        self.what = what
        self.stopped = threading.Event()
        self.entries = MAX_ENTRIES

    def stop(self) -> None:
        self.stopped.set()

    def check(self) -> None:
        if self.stopped.is_set():
            raise TransferAbandonedError(f"{self.what} was given up by its caller")
        if time.monotonic() > self.deadline:
            raise TimeoutError(f"{self.what} took too long")

    def entry(self) -> None:
        self.check()
        self.entries -= 1
        if self.entries < 0:
            raise Unsupported(f"more than {MAX_ENTRIES} entries")


class TransferAbandonedError(Exception):
    """The caller stopped waiting (cancelled); the worker thread ends here."""


def _openat2(dir_fd: int, path: str, flags: int, resolve: int, mode: int = 0) -> int:
    how = struct.pack("=QQQ", flags | os.O_CLOEXEC, mode, resolve)
    fd = int(_libc.syscall(SYS_OPENAT2, dir_fd, os.fsencode(path), how, len(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


def _mount_id(fd: int) -> int:
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            for line in f:
                if line.startswith(b"mnt_id:"):
                    return int(line.split()[1])
    except OSError as e:  # EMFILE, ...: this host is short of something; tar may not be
        raise Unsupported(f"cannot read fdinfo: {e.strerror}") from None
    raise Unsupported("no mount id in fdinfo (kernel too old)")


def _mounts(path: str) -> list[tuple[int, str, str]]:
    """(mount id, device, filesystem type) of each line of a mountinfo file."""
    rows = []
    with open(path) as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            rows.append((int(fields[0]), fields[2], fields[sep + 1]))
    return rows


class SandboxRoot:
    """The root directory of one live sandbox, as the host reaches it.

    Not thread-safe to `close()` while a transfer runs; the owner closes it at teardown.
    """

    def __init__(self, init_pid: int, alive: Callable[[], bool], uid: int, gid: int) -> None:
        """Open pid 1's root; `alive` (asked after opening) proves the pid was not reused."""
        if platform.machine() not in _SETFS:
            raise Unsupported(f"no setfsuid number known for {platform.machine()}")
        self.uid, self.gid = uid, gid
        self._lock = threading.Lock()
        self.fd = os.open(f"/proc/{init_pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            mounts = _mounts(f"/proc/{init_pid}/mountinfo")
            if not alive():
                raise ProcessLookupError(f"the sandbox's pid 1 ({init_pid}) is gone")
            host_devices = {device for _, device, _ in _mounts("/proc/self/mountinfo")}
            # A mount of the sandbox's own: a filesystem instance the host does not have.
            self.own_mounts = frozenset(
                mount_id
                for mount_id, device, fstype in mounts
                if fstype in OWN_FILESYSTEMS and device not in host_devices
            )
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        with self._lock:
            fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    @contextlib.contextmanager
    def _root(self) -> Iterator[int]:
        """A descriptor of the root for one transfer: a concurrent close() cannot pull it
        (or hand its number to another file) from under the transfer."""
        with self._lock:
            if self.fd < 0:
                raise Unsupported("the sandbox is stopped")
            fd = os.dup(self.fd)
        try:
            yield fd
        finally:
            os.close(fd)

    def _check_own(self, fd: int, path: str) -> None:
        if _mount_id(fd) not in self.own_mounts:
            raise Unsupported(f"{path} is not on a filesystem of the sandbox's own")

    def _resolve(self, root: int, path: str, flags: int) -> int:
        """An fd of sandbox path `path`, resolved as inside; on a mount of its own."""
        try:
            fd = _openat2(root, path.lstrip("/") or ".", flags, _IN_ROOT)
        except OSError as e:
            if e.errno == errno.ENOENT:
                raise FileNotFoundError(errno.ENOENT, "no such file in the sandbox", path) from None
            raise Unsupported(f"{path}: {e.strerror}") from None
        try:
            self._check_own(fd, path)
        except BaseException:
            os.close(fd)
            raise
        return fd

    # -- downloads ----------------------------------------------------------------------

    def file_member(self, path: str, watch: Watch) -> Iterator[Member]:
        """The one regular file at sandbox path `path` (symlinks followed inside)."""
        with self._root() as root:
            fd = self._resolve(root, path, os.O_PATH)
        try:
            st = os.fstat(fd)
            info = _info(os.path.basename(path.rstrip("/")) or "file", st)
            if stat.S_ISREG(st.st_mode):
                yield info, _copier(fd, st.st_size, watch)
            else:
                yield info, None  # unpack names the problem (a directory, not a file)
        finally:
            os.close(fd)

    def tree_members(self, path: str, watch: Watch) -> Iterator[Member]:
        """The tree at sandbox path `path`: itself as ".", then everything under it (symlinks
        as links, devices and FIFOs as such), each entry opened by its parent's fd."""
        with self._root() as root:
            fd = self._resolve(root, path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            st = os.fstat(fd)
            yield _info(".", st), None
            yield from self._walk(fd, "", 1, watch)
        finally:
            os.close(fd)

    def _walk(self, dir_fd: int, prefix: str, depth: int, watch: Watch) -> Iterator[Member]:
        """The entries under directory `dir_fd`, listed first: a tree costs one descriptor
        per level at most (and `MAX_WALK_DEPTH` levels), whatever it holds."""
        if depth > MAX_WALK_DEPTH:
            raise Unsupported(f"tree deeper than {MAX_WALK_DEPTH}")
        names = []
        with os.scandir(dir_fd) as scan:
            for entry in scan:
                watch.entry()
                names.append(entry.name)
        for name in names:
            watch.check()
            rel = f"{prefix}{name}"
            found = self._entry(dir_fd, name, rel, watch)
            if found is None:
                continue
            members, dir_inode = found
            yield from members
            if dir_inode is None:
                continue
            try:
                sub = _openat2(dir_fd, name, os.O_RDONLY | os.O_DIRECTORY, _CHILD)
            except OSError as e:
                raise Unsupported(f"{rel}: {e.strerror}") from None
            try:
                if os.fstat(sub).st_ino != dir_inode:
                    raise Unsupported(f"{rel} was replaced while read")
                self._check_own(sub, rel)
                yield from self._walk(sub, f"{rel}/", depth + 1, watch)
            finally:
                os.close(sub)

    def _entry(
        self, dir_fd: int, name: str, rel: str, watch: Watch
    ) -> tuple[Iterator[Member], int | None] | None:
        """The members entry `name` of `dir_fd` gives and, for a directory, its inode
        number (the walk goes in next); None if it is gone since listed."""
        try:
            fd = _openat2(dir_fd, name, os.O_PATH | os.O_NOFOLLOW, _CHILD)
        except OSError as e:
            if e.errno == errno.ENOENT:  # removed while we listed: as tar, skipped
                return None
            raise Unsupported(f"{rel}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            info = _info(rel, st)
            if stat.S_ISREG(st.st_mode):
                self._check_own(fd, rel)
                return _file_member(fd, info, watch), None  # it closes fd
            if stat.S_ISLNK(st.st_mode):
                try:
                    info.linkname = os.readlink(name, dir_fd=dir_fd)
                except OSError as e:  # replaced while we looked
                    raise Unsupported(f"{rel}: {e.strerror}") from None
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        # Directories (entered by the walk), links, and devices, FIFOs and sockets, which
        # unpack skips: none of them is opened for reading here.
        return iter([(info, None)]), st.st_ino if stat.S_ISDIR(st.st_mode) else None

    # -- uploads ------------------------------------------------------------------------

    def upload(self, source: Path, target: str, watch: Watch, *, contents: bool) -> None:
        """Copy host `source` to sandbox path `target` (with `contents`, merge a directory's
        contents into `target`), as sandbox root would: owned by root inside, modes kept."""
        if not source.exists() and not source.is_symlink():
            raise FileNotFoundError(f"upload source {source} does not exist")
        if contents and not source.is_dir():
            raise NotADirectoryError(f"upload source {source} is not a directory")
        parent_path, name = (target, "") if contents else target.rstrip("/").rsplit("/", 1)
        ids = _FilesystemIds(self.uid, self.gid)
        with self._root() as root, ids.sandbox():
            parent = self._make_dirs(root, parent_path or "/")
            try:
                if contents:
                    for child in _children(source, ids):
                        self._put(child, parent, child.name, 1, ids, watch)
                else:
                    self._put(source, parent, name, 1, ids, watch)
            finally:
                os.close(parent)

    def replace_dirs(self, dirs: dict[str, int], watch: Watch) -> None:
        """Put an empty root-owned directory of the given mode at each sandbox path, moving
        whatever stood there (a file, a link, a tree of any depth) aside in its parent.

        The path itself is made of real directories too: a link or a file in place of a
        parent (`/logs -> /proc/self/cwd`, which resolves to each reader's own directory) is
        moved aside and replaced, so every later reader of the path finds this directory.
        """
        ids = _FilesystemIds(self.uid, self.gid)
        with self._root() as root, ids.sandbox():
            for path, mode in dirs.items():
                watch.check()
                *parents, name = [p for p in path.split("/") if p]
                fd = os.dup(root)
                try:
                    for part in parents:
                        parent, fd = fd, -1
                        try:
                            fd = self._real_dir(parent, part, 0o755, fresh=False)
                        finally:
                            os.close(parent)
                    os.close(self._real_dir(fd, name, mode, fresh=True))
                except OSError as e:  # a race: `rm -rf` inside then
                    raise Unsupported(f"cannot replace {path}: {e.strerror}") from None
                finally:
                    if fd >= 0:
                        os.close(fd)

    def _real_dir(self, parent: int, name: str, mode: int, *, fresh: bool) -> int:
        """The fd of directory `name` in `parent`, on a mount of the sandbox's own and
        reached through no link; what stands there otherwise is moved aside for a new one.
        With `fresh`, a directory there is moved aside too."""
        try:
            fd = _openat2(parent, name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, _CHILD)
        except OSError as e:
            if e.errno == errno.EXDEV:  # a mount point: renaming it would detach it
                raise Unsupported(f"{name} is a mount point") from None
            if e.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                raise
        else:
            if not fresh and _mount_id(fd) in self.own_mounts:
                return fd
            os.close(fd)
            if not fresh:
                raise Unsupported(f"{name} is not on a filesystem of the sandbox's own")
        with contextlib.suppress(FileNotFoundError):
            aside = f".backends-replaced-{name}-{uuid.uuid4().hex[:12]}"
            os.rename(name, aside, src_dir_fd=parent, dst_dir_fd=parent)
        os.mkdir(name, 0o700, dir_fd=parent)
        fd = _openat2(parent, name, os.O_RDONLY | os.O_DIRECTORY, _CHILD)
        try:
            self._own_by_root(fd)
            os.fchmod(fd, mode)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _own_by_root(self, fd: int) -> None:
        """Root's group too (in a setgid directory a new entry takes the directory's group),
        before the mode is set: chmod keeps setgid only for the owner's own group."""
        os.fchown(fd, self.uid, self.gid)

    def _make_dirs(self, root: int, path: str) -> int:
        """`mkdir -p` of sandbox path `path`; its fd."""
        parts = [p for p in path.split("/") if p]
        missing: list[str] = []
        while True:
            try:
                fd = self._resolve(root, "/".join(parts) or "/", os.O_RDONLY | os.O_DIRECTORY)
                break
            except FileNotFoundError:
                if not parts:
                    raise Unsupported("the sandbox has no root directory") from None
                missing.insert(0, parts.pop())
        for name in missing:
            try:
                os.mkdir(name, 0o755, dir_fd=fd)
                sub = _openat2(fd, name, os.O_RDONLY | os.O_DIRECTORY, _CHILD)
            except OSError as e:
                os.close(fd)
                raise Unsupported(f"cannot make {path}: {e.strerror}") from None
            os.close(fd)
            fd = sub
        return fd

    def _put(
        self,
        source: Path,
        parent: int,
        name: str,
        depth: int,
        ids: _FilesystemIds,
        watch: Watch,
    ) -> None:
        """Copy host entry `source` to `name` in the sandbox directory fd `parent`. The host
        side is read as host root, the sandbox side written with the sandbox's ids."""
        if depth > MAX_DEPTH:
            raise Unsupported(f"upload deeper than {MAX_DEPTH}")
        watch.entry()
        with ids.host():
            st = os.lstat(source)
        try:
            if stat.S_ISDIR(st.st_mode):
                self._put_dir(source, st, parent, name, depth, ids, watch)
            elif stat.S_ISLNK(st.st_mode):
                with ids.host():
                    link = os.readlink(source)
                _replace_entry(parent, name)
                os.symlink(link, name, dir_fd=parent)
            elif stat.S_ISREG(st.st_mode):
                with ids.host():
                    src = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    _replace_entry(parent, name)
                    out = os.open(
                        name,
                        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                        0o600,
                        dir_fd=parent,
                    )
                    try:
                        while chunk := os.read(src, CHUNK):
                            os.write(out, chunk)
                            watch.check()
                        self._own_by_root(out)
                        os.fchmod(out, stat.S_IMODE(st.st_mode))
                        os.utime(out, ns=(st.st_mtime_ns, st.st_mtime_ns))
                    finally:
                        os.close(out)
                finally:
                    os.close(src)
            else:
                raise Unsupported(f"{source} is not a file, directory or symlink")
        except (Unsupported, FileNotFoundError):
            raise
        except OSError as e:  # EACCES, a race with the sandbox...: tar does it its own way
            raise Unsupported(f"{name}: {e.strerror}") from None

    def _put_dir(
        self,
        source: Path,
        st: os.stat_result,
        parent: int,
        name: str,
        depth: int,
        ids: _FilesystemIds,
        watch: Watch,
    ) -> None:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=parent)
        try:
            fd = _openat2(parent, name, os.O_RDONLY | os.O_DIRECTORY, _CHILD)
        except OSError as e:  # a file or a link in the way: tar's own errors then
            raise Unsupported(f"{name}: {e.strerror}") from None
        try:
            for child in _children(source, ids):
                self._put(child, fd, child.name, depth + 1, ids, watch)
            self._own_by_root(fd)
            os.fchmod(fd, stat.S_IMODE(st.st_mode))
            os.utime(fd, ns=(st.st_mtime_ns, st.st_mtime_ns))
        finally:
            os.close(fd)


def _children(source: Path, ids: _FilesystemIds) -> list[Path]:
    with ids.host():
        return sorted(source.iterdir())


def _file_member(fd: int, info: tarfile.TarInfo, watch: Watch) -> Iterator[Member]:
    """The file member, its O_PATH fd open until the member has been extracted."""
    try:
        yield info, _copier(fd, info.size, watch)
    finally:
        os.close(fd)


def _replace_entry(parent: int, name: str) -> None:
    """Remove a non-directory entry `name`, as tar does before extracting over it. Never a
    mount point (a file bound there): the host could unmount it, which sandbox root cannot."""
    try:
        fd = _openat2(parent, name, os.O_PATH | os.O_NOFOLLOW, _CHILD)  # EXDEV at a mount
    except FileNotFoundError:
        return
    except OSError as e:
        raise Unsupported(f"{name}: {e.strerror}") from None
    try:
        is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
    if is_dir:
        raise Unsupported(f"{name} is a directory in the sandbox")
    os.unlink(name, dir_fd=parent)


def _info(name: str, st: os.stat_result) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.mode = stat.S_IMODE(st.st_mode)
    info.mtime = int(st.st_mtime)
    mode = st.st_mode
    if stat.S_ISREG(mode):
        info.type, info.size = tarfile.REGTYPE, st.st_size
    elif stat.S_ISDIR(mode):
        info.type = tarfile.DIRTYPE
    elif stat.S_ISLNK(mode):
        info.type = tarfile.SYMTYPE
    else:
        info.type = tarfile.FIFOTYPE  # skipped by unpack, like devices
    return info


def _copier(path_fd: int, size: int, watch: Watch) -> Callable[[int], None]:
    """Copy `size` bytes (the size charged against the caps; later growth is not read) of
    the regular file behind the O_PATH fd `path_fd` into an fd, keeping holes as holes.
    Called while the member is being extracted, so while `path_fd` is still open."""

    def copy(out: int) -> None:
        try:
            # Non-blocking: a lease the sandbox holds on the file would make the open wait
            # for its break (45 s) in a host thread; it fails at once instead (EWOULDBLOCK).
            src = os.open(f"/proc/self/fd/{path_fd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            raise Unsupported(f"cannot open for reading: {e.strerror}") from None
        try:
            pos = 0
            while pos < size:
                try:
                    data = os.lseek(src, pos, os.SEEK_DATA)
                except OSError as e:
                    if e.errno == errno.ENXIO:  # only a hole is left
                        break
                    raise Unsupported(f"cannot read: {e.strerror}") from None
                if data >= size:
                    break
                try:
                    end = min(os.lseek(src, data, os.SEEK_HOLE), size)
                except OSError as e:
                    if e.errno == errno.ENXIO:  # it shrank under us: the rest is gone
                        break
                    raise Unsupported(f"cannot read: {e.strerror}") from None
                while data < end:
                    try:
                        chunk = os.pread(src, min(CHUNK, end - data), data)
                    except OSError as e:
                        raise Unsupported(f"cannot read: {e.strerror}") from None
                    if not chunk:  # it shrank while read: zeros past its end, as tar gives
                        end = size
                        break
                    os.pwrite(out, chunk, data)
                    data += len(chunk)
                    watch.check()
                pos = end
            os.ftruncate(out, size)
        finally:
            os.close(src)

    return copy


class _FilesystemIds:
    """Switches this thread's filesystem uid and gid between a sandbox root's and host root's.

    Changing the fsuid from 0 drops the thread's filesystem capabilities (DAC override, chown,
    fowner...); setting it back to 0 restores them. Only the calling thread is affected.
    """

    def __init__(self, uid: int, gid: int) -> None:
        self.uid, self.gid = uid, gid
        self.setfsuid, self.setfsgid = _SETFS[platform.machine()]

    def _set(self, uid: int, gid: int) -> None:
        _libc.syscall(self.setfsgid, gid)
        _libc.syscall(self.setfsuid, uid)
        # Both calls return the previous id and never fail loudly: ask (-1 changes nothing).
        if _libc.syscall(self.setfsuid, -1) != uid or _libc.syscall(self.setfsgid, -1) != gid:
            raise OSError(f"could not set the filesystem ids to {uid}:{gid}")

    @contextlib.contextmanager
    def sandbox(self) -> Iterator[None]:
        """The block runs with the sandbox root's ids (in a worker thread only)."""
        if threading.current_thread() is threading.main_thread():
            raise RuntimeError("filesystem ids are changed in worker threads only")
        self._set(self.uid, self.gid)
        try:
            yield
        finally:
            self._set(0, 0)

    @contextlib.contextmanager
    def host(self) -> Iterator[None]:
        """Inside `sandbox()`: the block runs as host root again (to read the host side)."""
        self._set(0, 0)
        try:
            yield
        finally:
            self._set(self.uid, self.gid)
