"""One bubblewrap sandbox: boot, run commands, move files, tear down. No Harbor here.

`LocalSandbox` (the Harbor environment) and the layer builder both drive this class. It
owns four things that must not leak: the bwrap process tree, its cgroups, its overlay upper
directory and an owner record. `stop()` removes all four; if the owning process dies first,
the spawner (which outlives it in a session of its own) kills every process through the
sandbox's cgroup, whatever root inside did to pid 1, the mount lives only in the sandbox's
own mount namespace, and `reap_orphans()` removes the rest on the next start.
"""

from __future__ import annotations

import atexit
import hashlib
import itertools
import logging
import os
import shlex
import shutil
import signal
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol, SupportsIndex

import anyio

from backends.sandbox import cgroups, direct, disk, launcher, network, owners, uids
from backends.sandbox.errors import (
    ExecTimeoutError,
    SandboxEndedError,
    SandboxNotRunningError,
)
from backends.sandbox.settings import UID_BASE, UID_COUNT, cache_dir, private_dir, run_dir

log = logging.getLogger(__name__)

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Output still arriving after the command exited is collected this long; a daemon that keeps
# the pipe open must not hold the caller forever.
DRAIN_GRACE_SEC = 0.2
# Output kept per stream of one command; a command printing gigabytes must not take the
# owner's memory (and with it every other sandbox) down.
OUTPUT_LIMIT = 64 * 1024 * 1024


@dataclass(frozen=True)
class User:
    uid: int
    gid: int
    home: str
    groups: tuple[int, ...] = ()  # supplementary groups (from the sandbox's /etc/group)


@dataclass
class RunResult:
    return_code: int
    stdout: bytes
    stderr: bytes
    # Bytes dropped past the output limit: the command ran to its end, its output did not fit.
    stdout_dropped: int = 0
    stderr_dropped: int = 0


@dataclass
class SandboxSpec:
    """What to boot: the layer stack and the run-time options."""

    lowerdirs: Sequence[Path]  # top-most first
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    network: bool = False
    binds: Sequence[launcher.Bind] = ()
    limits: cgroups.Limits = field(default_factory=cgroups.Limits)
    # Directories created (mode 0777) in the upper layer before boot, e.g. Harbor's /logs/*.
    precreate_dirs: Sequence[str] = ()
    upper: Path | None = None  # keep the writable layer here (layer builds); else scratch
    # Cap on what the sandbox may write (its scratch layer lives in an image this size).
    storage_mb: int | None = None
    shm_mb: int = 64  # size of /dev/shm


class ExecSpawner(Protocol):
    """What starts a command in a sandbox: `launcher.Spawner`'s `spawn` for `enter` requests."""

    async def spawn(
        self,
        argv: Sequence[str],
        *,
        env: dict[str, str],
        fds: Sequence[int],
        cgroup: cgroups.Join,
        enter: dict[str, Any],
        enter_pidfd: int,
    ) -> launcher.SandboxProcess: ...


class BwrapSandbox:
    def __init__(self, spec: SandboxSpec, name: str | None = None) -> None:
        self.spec = spec
        self.name = name or new_sandbox_name()
        self.label = self.name  # for messages: a pooled entry's name replaces `name` at start
        self._dir: Path | None = None
        self._cgroup: cgroups.SandboxCgroup | None = None
        self._booted: launcher.Booted | None = None
        self._uplink: network.Uplink | None = None
        self._users: dict[str | int, User] = {}
        self._exec_ids = itertools.count()
        self._lease: uids.Lease | None = None
        self._root: direct.SandboxRoot | None = None
        self._root_refused = False

    # Built on first use: a sandbox that takes a pooled entry takes that entry's name, so
    # computing them for the constructor's name would be wasted work on every start.
    @property
    def dir(self) -> Path:
        if self._dir is None:
            self._dir = run_dir() / self.name
        return self._dir

    @property
    def cgroup(self) -> cgroups.SandboxCgroup:
        if self._cgroup is None:
            self._cgroup = cgroups.SandboxCgroup(self.name)
        return self._cgroup

    @property
    def running(self) -> bool:
        return self._booted is not None and self._booted.process.returncode is None

    @property
    def init_pidfd(self) -> int:
        """A pidfd of the sandbox's pid 1 (owned by the sandbox; -1 when not running)."""
        return self._booted.init_fd if self._booted is not None else -1

    @property
    def upper(self) -> Path:
        """The writable layer (with a disk limit: a path inside the sandbox's mount namespace)."""
        return self.spec.upper or self._scratch() / "upper"

    def _scratch(self) -> Path:
        """Parent of the scratch upper and work dirs: host root only (they hold setuid files)."""
        return self.dir / (disk.MOUNT_POINT if self._disk_limited() else PRIVATE)

    def _disk_limited(self) -> bool:
        return self.spec.upper is None and self.spec.storage_mb is not None

    async def start(self) -> None:
        """Boot the sandbox.

        Raises:
            HostPrerequisiteError: not root, bwrap missing, a needed cgroup controller missing.
            SandboxStartError: the namespaces, overlay or bwrap failed (message says why).
        """
        launcher.require_host()
        if self.spec.network:
            network.require_slirp()
        if self._disk_limited():
            assert self.spec.storage_mb is not None
            disk.require_support(self.spec.storage_mb)
        try:
            taken = _pool.take(self._pool_key()) if self.spec.upper is None else None
            if taken is not None:
                # Run dir, owner record, cgroups, limits and precreated dirs were made ahead
                # of time: the sandbox takes that entry's name.
                self.name, self._dir, self._cgroup = taken, None, None
                spec = self._boot_spec()
            else:
                spec = self._boot_spec()
                prepare = (self.dir, self.cgroup, self._pool_key(), self.spec.upper)
                if self._disk_limited():  # mkfs: not on the event loop
                    await anyio.to_thread.run_sync(_prepare_dir, *prepare)
                else:  # a few mkdirs and cgroup writes: cheaper inline than a thread hop
                    _prepare_dir(*prepare)
            launcher.prepare_stage(spec)
            self._lease = uids.lease()
            spec.uid_base, spec.uid_lease = self._lease.base, self._lease.fd
            self._booted = await launcher.boot(spec)
            if self.spec.network:
                self._uplink = await network.connect(self._booted)
        except BaseException:
            with anyio.CancelScope(shield=True):
                booted, self._booted = self._booted, None  # booted, then failed after it
                await self._teardown(booted)
            raise

    def _boot_spec(self) -> launcher.BootSpec:
        return launcher.BootSpec(
            lowerdirs=self.spec.lowerdirs,
            upper=self.upper,
            work=self._scratch() / "work",
            disk=self.dir / disk.IMAGE if self._disk_limited() else None,
            # Every sandbox mounts its overlay here, each in its own private mount namespace.
            merged=_shared_mount_point(),
            cgroup=self.cgroup.join(),
            teardown=self.cgroup.teardown_request(),
            network=self.spec.network,
            resolv_conf=network.resolv_conf() if self.spec.network else "/etc/resolv.conf",
            binds=self.spec.binds,
            stage_dir=self.dir / "binds",
            volatile=self.spec.upper is None,
            shm_bytes=self.spec.shm_mb * 1024 * 1024,
            idmap_tree=cache_dir(),  # the layers, the writable layer and its disk image
        )

    def _pool_key(self) -> _PoolKey:
        storage = self.spec.storage_mb if self._disk_limited() else None
        return (self.spec.limits, tuple(self.spec.precreate_dirs), storage)

    async def stop(self) -> None:
        """Kill every process of the sandbox (daemons included) and remove all its state.

        Idempotent and safe under cancellation: the teardown runs shielded.
        """
        with anyio.CancelScope(shield=True):
            booted, self._booted = self._booted, None
            await self._teardown(booted)

    async def _teardown(self, booted: launcher.Booted | None) -> None:
        """Kill everything, confirm it is dead, then hand the removals to a worker thread.

        By the time this returns no process of the sandbox is alive (cgroup.kill plus an
        empty cgroup, or every process signalled and reaped); the cgroup directories and the
        run dir go in the background (rmdir is slow here) and at the latest at interpreter
        exit. Names are never reused, so no later sandbox can see that state.
        """
        if booted is not None:
            booted.process.kill()
        if self.cgroup.start_kill():
            if booted is not None:
                # An event rather than polling: the cgroup empties right after pid 1 exits.
                with anyio.move_on_after(cgroups.KILL_WAIT_SEC):
                    await booted.init_exited()
            await self.cgroup.wait_empty()
        else:  # no cgroup.kill on this host
            await anyio.to_thread.run_sync(self.cgroup.kill)
            if booted is not None:
                await booted.process.wait()
            await self.cgroup.wait_empty()
        self._release(booted)
        self._close_uplink()
        _later(self._cleanup)

    def stop_nowait(self, then: Callable[[], None] | None = None) -> None:
        """`stop()` for code that cannot await (a finalizer); call it on the sandbox's loop.

        Every process gets SIGKILL now; confirming they are dead, freeing the uid range,
        the removals and then `then` follow on the cleanup thread.
        """
        booted, self._booted = self._booted, None
        if booted is not None:
            booted.process.kill()
        self.cgroup.start_kill()
        self._close_uplink()

        def finish() -> None:
            self.cgroup.kill()  # waits until the group is empty (or signals it empty)
            self._release(booted)
            self._cleanup()
            if then is not None:
                then()

        _later(finish)

    def _close_uplink(self) -> None:
        if self._uplink is not None:
            # Host-side infrastructure, not sandbox code: killed, but not waited for (its
            # network device's teardown takes tens of ms); the spawner reaps it.
            self._uplink.close()
            self._uplink = None

    def _release(self, booted: launcher.Booted | None) -> None:
        """Close what the host held of a sandbox whose processes are all dead."""
        root, self._root = self._root, None
        if root is not None:
            root.close()
        if booted is not None:
            booted.close()
        if self._lease is not None:  # nothing of the sandbox runs as its uids any more
            self._lease.release()
            self._lease = None

    def _cleanup(self) -> None:
        self.cgroup.remove()
        _discard(self.dir)

    async def end_processes(self) -> bool:
        """SIGKILL every process of the sandbox but its pid 1, as `kill -KILL -1` by root
        inside would, daemons included; True once they are gone (False: some survived).

        Done from the host: it costs no command in the sandbox.

        Raises:
            SandboxNotRunningError: not started, stopped, or the sandbox died.
        """
        booted = self._booted
        if booted is None:
            raise SandboxNotRunningError(f"sandbox {self.label} is not running")
        if not booted.alive():
            raise await self._gone(booted)
        return await self.cgroup.kill_all_but({booted.process.pid, booted.init_pid})

    async def resolve_user(self, user: str | int | None) -> User:
        """uid, gid and home of a user of this sandbox (looked up inside, then cached)."""
        key: str | int = 0 if user is None else user
        if key in self._users:
            return self._users[key]
        if key in (0, "root", "0"):
            found = User(0, 0, "/root")
        else:
            script = 'getent passwd "$0" || exit 2; id -G "$0"'
            res = await self.run(["/bin/sh", "-c", script, str(key)], user=User(0, 0, "/root"))
            lines = res.stdout.decode().splitlines()
            fields = lines[0].split(":") if lines else []
            if res.return_code in (0, 1) and len(fields) >= 6:
                gid = int(fields[3])
                extra = lines[1].split() if res.return_code == 0 and len(lines) > 1 else []
                groups = tuple(g for g in dict.fromkeys(int(x) for x in extra) if g != gid)
                found = User(int(fields[2]), gid, fields[5] or "/", groups)
            elif isinstance(key, int) or str(key).isdigit():
                found = User(int(key), int(key), "/")  # like docker: numeric ids need no entry
            else:
                raise ValueError(f"user {key!r} does not exist in the sandbox")
            if max(found.uid, found.gid) >= UID_COUNT:
                raise ValueError(
                    f"user {key!r} (uid {found.uid}, gid {found.gid}) is outside the "
                    f"{UID_COUNT} ids a sandbox maps"
                )
        self._users[key] = found
        return found

    def forget_users(self) -> None:
        self._users.clear()

    def host_root(self) -> direct.SandboxRoot | None:
        """The sandbox's root as the host reaches it (opened once), or None where this host
        cannot (then files cross by `tar` inside)."""
        booted = self._booted
        if self._root is None and not self._root_refused and booted is not None:
            assert self._lease is not None
            try:
                self._root = direct.SandboxRoot(
                    booted.init_pid, booted.alive, self._lease.base, self._lease.base
                )
            except (direct.Unsupported, OSError) as e:
                log.info("sandbox %s: files cross by tar inside (%s)", self.label, e)
                self._root_refused = True
        return self._root

    async def run(
        self,
        argv: Sequence[str],
        *,
        user: User,
        env: dict[str, str] | None = None,
        stdin: bytes | BinaryIO | None = None,
        stdout: BinaryIO | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - mirrors Harbor's exec(timeout_sec)
        output_limit: int = OUTPUT_LIMIT,
        spawner: ExecSpawner | None = None,
    ) -> RunResult:
        """Run argv inside the sandbox and collect its exit code and output.

        `stdin` may be a real file (with a descriptor): the command reads it from its start
        through a read-only descriptor of its own, so nothing inside can write to it. With a
        `stdout` file, the host copies the command's output from a pipe into it, at most
        `output_limit` bytes: past that the command is killed and `stdout_dropped` is set;
        once the call returns the pipe is closed, so nothing inside (a daemon handed the
        pipe) can write into the file. Collected output keeps at most `output_limit` bytes
        per stream; the rest is drained and counted as dropped.
        A non-zero exit is an ordinary result. On timeout or cancellation the command's whole
        process tree (including anything it daemonized) is killed. `spawner` starts the
        command instead of the sandbox spawner (a fork server: `backends.sandbox.forkserver`).

        Raises:
            SandboxNotRunningError: the sandbox was not started, was stopped, or died.
            ExecTimeoutError: `timeout` seconds passed.
        """
        booted = self._booted
        if booted is None:
            raise SandboxNotRunningError(f"sandbox {self.label} is not running")
        if booted.process.returncode is not None:
            raise await self._gone(booted)
        group = f"x{next(self._exec_ids)}"
        self.cgroup.new_exec_group(group)
        full_env = {"PATH": DEFAULT_PATH, **self.spec.env, "HOME": user.home, **(env or {})}
        # The spawner gets copies of the child's ends, so ours are always closed after spawn.
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        feed: bytes | None = None
        if isinstance(stdin, bytes):
            in_r, in_w = os.pipe()
            feed = stdin
        elif stdin is not None:
            # A description of its own, read-only: a dup would let a daemon grow the file.
            in_r = os.open(f"/proc/self/fd/{stdin.fileno()}", os.O_RDONLY | os.O_CLOEXEC)
            in_w = None
        else:
            in_r, in_w = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC), None
        ours = _Fds(out_r, err_r, in_w)
        try:
            try:
                proc = await (spawner or launcher.spawner()).spawn(
                    argv,
                    env=full_env,
                    fds=(in_r, out_w, err_w),
                    cgroup=self.cgroup.join(group),
                    enter={"uid": user.uid, "gid": user.gid, "groups": [user.gid, *user.groups]},
                    enter_pidfd=booted.init_fd,
                )
            except OSError as e:
                if booted.alive():
                    # Entering fails as soon as pid 1 starts exiting; its pidfd turns
                    # readable a moment later. (A live sandbox: a short wait, then the error.)
                    with anyio.move_on_after(0.5):
                        await booted.init_exited()
                if booted.process.returncode is not None or not booted.alive():
                    raise await self._gone(booted) from e
                raise
            finally:
                for fd in (in_r, out_w, err_w):
                    os.close(fd)
            try:
                with anyio.fail_after(timeout):
                    result = await _collect(proc, ours, feed, output_limit, stdout)
            except TimeoutError:
                raise ExecTimeoutError(
                    f"command timed out after {timeout} seconds and was killed: {shlex.join(argv)}"
                ) from None
            finally:
                with anyio.CancelScope(shield=True):
                    if proc.returncode is None:
                        proc.kill()  # enough on its own where no cgroup can kill a subtree
                        await anyio.to_thread.run_sync(self.cgroup.kill, group)
                        await proc.wait()
            if self._booted is not booted:  # stop() killed it: not the command's own exit
                raise SandboxNotRunningError(
                    f"sandbox {self.label} was stopped while running: {shlex.join(argv)}"
                )
            return result
        finally:
            ours.close_all()
            self.cgroup.drop_exec_group(group)

    async def _gone(self, booted: launcher.Booted) -> SandboxNotRunningError:
        """The error for a sandbox that died though nothing here stopped it: who ended it.

        Root inside cannot SIGKILL its pid 1 (the kernel ignores that from inside) nor trace
        it (seccomp), so pid 1 killed by SIGKILL with no OOM kill is the host's doing (an
        operator, a machine in trouble); pid 1 exiting, any other signal, or the OOM killer
        (within the sandbox's memory) is what ran inside.
        """
        with anyio.move_on_after(1):
            await booted.process.wait()  # pid 1 is gone; bwrap follows within moments
        code = booted.process.returncode
        oom_kills = self.cgroup.oom_kills()
        if code is None or (code in (-signal.SIGKILL, 128 + signal.SIGKILL) and not oom_kills):
            return SandboxNotRunningError(
                f"sandbox {self.label} is not running: it was killed from the host"
            )
        how = "the out-of-memory killer ended it" if oom_kills else f"its pid 1 ended ({code})"
        return SandboxEndedError(
            f"sandbox {self.label} ended from inside: {how} while nothing on the host stopped it"
        )


PRIVATE = "private"  # in a run dir: mode 0700, holding the scratch upper and work dirs
_PoolKey = tuple[cgroups.Limits, tuple[str, ...], int | None]  # limits, precreated, storage_mb


def _prepare_dir(
    directory: Path, cgroup: cgroups.SandboxCgroup, key: _PoolKey, upper: Path | None = None
) -> None:
    """Run dir (owner record first), overlay dirs, precreated dirs, disk, cgroups with limits."""
    directory.mkdir(parents=True)
    # Atomically: a concurrent reap_orphans (another process) must never read a
    # half-written record and take this live sandbox for an orphan.
    owners.write(directory)
    limits, precreate, storage_mb = key
    # With a disk limit the layer's directories are laid out here, then copied into the image
    # (mounted only inside the sandbox's mount namespace, out of host users' reach).
    base = directory / ("disk.tpl" if storage_mb is not None else PRIVATE)
    private_dir(base)
    if upper is None or storage_mb is not None:
        upper = base / "upper"
    work = base / "work"
    work.mkdir()
    upper.mkdir(parents=True, exist_ok=True)
    for d in (upper, work):
        os.chown(d, UID_BASE, UID_BASE)
    for path in precreate:
        _precreate(upper, path)
    if storage_mb is not None:
        disk.format_image(directory / disk.IMAGE, storage_mb, contents=base)
        shutil.rmtree(base)
        (directory / disk.MOUNT_POINT).mkdir()
    cgroup.create(limits)


def _precreate(upper: Path, path: str) -> None:
    # Written straight into the fresh (still empty, sandbox-free) upper layer: cheaper
    # than an exec, and nothing inside can race us yet.
    current = upper
    for part in Path(path.lstrip("/")).parts:
        current = current / part
        try:
            os.mkdir(current, 0o755)
        except FileExistsError:
            continue
        os.chown(current, UID_BASE, UID_BASE)
        os.chmod(current, 0o755)  # not narrowed by the umask
    os.chmod(current, 0o777)


POOL_SIZE = 4  # prepared entries kept per kind of sandbox (limits + precreated dirs)


class _Pool:
    """Sandbox run dirs and cgroups prepared ahead of time, off the critical path of start.

    `take` hands out a ready entry (or None) and asks the cleanup thread to top the pool
    up for that kind. Entries carry our owner record, so `reap_orphans` leaves them alone
    while we live and removes them once we are gone; `close` (at interpreter exit) removes
    them at once. A forked child never takes its parent's entries.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready: dict[_PoolKey, list[str]] = {}
        self._filling: set[_PoolKey] = set()
        self._pid = os.getpid()
        self._closed = False

    def take(self, key: _PoolKey) -> str | None:
        with self._lock:
            if self._pid != os.getpid():  # forked: those entries are the parent's
                self._ready, self._filling, self._pid = {}, set(), os.getpid()
            if self._closed:
                return None
            names = self._ready.get(key)
            name = names.pop() if names else None
            fill = key not in self._filling
            if fill:
                self._filling.add(key)
        if fill:
            _later(lambda: self._fill(key))
        return name

    def _fill(self, key: _PoolKey) -> None:
        try:
            while True:
                with self._lock:
                    if self._closed or len(self._ready.get(key, ())) >= POOL_SIZE:
                        return
                name = new_sandbox_name()
                directory, cgroup = run_dir() / name, cgroups.SandboxCgroup(name)
                try:
                    _prepare_dir(directory, cgroup, key)
                except Exception as e:  # start() will prepare inline and report it
                    log.debug("could not prepare a pooled sandbox: %s", e)
                    _remove_entry(name)
                    return
                with self._lock:
                    keep = not self._closed and self._pid == os.getpid()
                    if keep:
                        self._ready.setdefault(key, []).append(name)
                if not keep:
                    _remove_entry(name)
                    return
        finally:
            with self._lock:
                self._filling.discard(key)

    def close(self) -> None:
        """Remove every unused entry; no more are made or handed out."""
        with self._lock:
            self._closed = True
            names = [n for ns in self._ready.values() for n in ns]
            self._ready.clear()
            ours = self._pid == os.getpid()
        if ours:
            for name in names:
                _remove_entry(name)


def _remove_entry(name: str) -> None:
    cgroups.SandboxCgroup(name).remove()
    shutil.rmtree(run_dir() / name, ignore_errors=True)


_pool = _Pool()


class _Fds:
    """Our ends of an exec's pipes; each is closed exactly once."""

    def __init__(self, out_r: int | None, err_r: int, in_w: int | None) -> None:
        self.out_r, self.err_r, self.in_w = out_r, err_r, in_w
        self._open = {fd for fd in (out_r, err_r, in_w) if fd is not None}

    def close(self, fd: int) -> None:
        if fd in self._open:
            self._open.discard(fd)
            os.close(fd)

    def close_all(self) -> None:
        for fd in list(self._open):
            self.close(fd)


class _Sink(bytearray):
    """Collected output: the first `limit` bytes are kept, the rest only counted."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.dropped = 0

    def extend(self, chunk: Iterable[SupportsIndex], /) -> None:
        data = bytes(chunk)
        room = max(0, self.limit - len(self))
        super().extend(data[:room])
        self.dropped += max(0, len(data) - room)


class _FileSink(_Sink):
    """Output copied into a host file, at most `limit` bytes; past it the command is killed."""

    def __init__(self, file: BinaryIO, limit: int, proc: launcher.SandboxProcess) -> None:
        super().__init__(limit)
        self.fd, self.proc, self.written = file.fileno(), proc, 0

    def extend(self, chunk: Iterable[SupportsIndex], /) -> None:
        data = memoryview(bytes(chunk))
        room = max(0, self.limit - self.written)
        kept = data[:room]
        while kept:
            n = os.write(self.fd, kept)
            kept, self.written = kept[n:], self.written + n
        if len(data) > room:
            self.dropped += len(data) - room
            self.proc.kill()


async def _collect(
    proc: launcher.SandboxProcess,
    fds: _Fds,
    stdin: bytes | None,
    limit: int,
    stdout: BinaryIO | None = None,
) -> RunResult:
    out = _Sink(limit) if stdout is None else _FileSink(stdout, limit, proc)
    err = _Sink(limit)
    streams_done = [anyio.Event(), anyio.Event()]

    async def pump(fd: int | None, sink: _Sink, done: anyio.Event) -> None:
        try:
            if fd is not None:
                # A file's copy stops at its cap: reading on would only feed whoever writes.
                full = (lambda _: sink.dropped > 0) if isinstance(sink, _FileSink) else None
                await launcher.read_fd(fd, full, sink=sink)
        finally:
            done.set()

    async def feed(fd: int) -> None:
        try:
            await launcher.write_fd(fd, stdin or b"")
        finally:
            fds.close(fd)

    async with anyio.create_task_group() as tg:
        if fds.in_w is not None:
            tg.start_soon(feed, fds.in_w)
        tg.start_soon(pump, fds.out_r, out, streams_done[0])
        tg.start_soon(pump, fds.err_r, err, streams_done[1])
        code = await proc.wait()
        # Background children may hold the pipes open; take what comes quickly, then go.
        if not (streams_done[0].is_set() and streams_done[1].is_set()):
            with anyio.move_on_after(DRAIN_GRACE_SEC):
                for done in streams_done:
                    await done.wait()
        tg.cancel_scope.cancel()
    # Killed by a signal (e.g. by the OOM killer): report it the way
    # shells and docker do, 128 + signal number.
    return RunResult(
        code if code >= 0 else 128 - code,
        bytes(out),
        bytes(err),
        stdout_dropped=out.dropped,
        stderr_dropped=err.dropped,
    )


MOUNT_POINT = ".mnt"


_mount_points: dict[Path, tuple[str, Path]] = {}


def _shared_mount_point() -> Path:
    """The (empty) directory every sandbox mounts its overlay on, made when missing."""
    base = run_dir()
    hit = _mount_points.get(base)
    if hit is None:
        point = base / MOUNT_POINT
        hit = _mount_points[base] = (str(point), point)
    if not os.path.isdir(hit[0]):  # a plain stat: the run dir may have been wiped
        hit[1].mkdir(parents=True, exist_ok=True)
    return hit[1]


TRASH = ".trash"  # run-dir entry holding stopped sandboxes' directories until deleted
_trash_lock = threading.Lock()
_trash: list[Path] = []


def _discard(path: Path) -> None:
    """Remove a stopped sandbox's directory: renamed away now, deleted by a worker thread.

    The rename is atomic and cheap; deleting an upper layer full of files is not, and
    nothing needs to wait for it. What a crash leaves in the trash `reap_orphans` removes.
    """
    trash = path.parent / TRASH
    try:
        trash.mkdir(exist_ok=True)
        target = trash / f"{path.name}-{uuid.uuid4().hex[:8]}"
        path.rename(target)
    except FileNotFoundError:
        return
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
        return
    with _trash_lock:
        _trash.append(target)
        start = len(_trash) == 1
    if start:
        try:
            threading.Thread(target=_empty_trash, name="sandbox-trash", daemon=True).start()
        except RuntimeError:  # interpreter shutdown: no new threads, so delete it here
            _empty_trash()


def _empty_trash() -> None:
    while True:
        with _trash_lock:
            if not _trash:
                return
            target = _trash[0]
        shutil.rmtree(target, ignore_errors=True)
        with _trash_lock:
            _trash.pop(0)


def flush_trash() -> None:
    """Delete discarded sandbox directories now (also run at interpreter exit)."""
    with _trash_lock:
        pending = list(_trash)
    for target in pending:
        shutil.rmtree(target, ignore_errors=True)


_later_lock = threading.Lock()
_later_queue: list[Callable[[], None]] = []
_later_worker: threading.Thread | None = None


def _later(fn: Callable[[], None]) -> None:
    """Run fn soon on the cleanup thread (sequentially; and at interpreter exit at the latest)."""
    global _later_worker
    with _later_lock:
        _later_queue.append(fn)
        if _later_worker is None:
            _later_worker = threading.Thread(target=_run_later, name="sandbox-cleanup", daemon=True)
            _later_worker.start()


def _run_later() -> None:
    global _later_worker
    while True:
        with _later_lock:
            if not _later_queue:
                _later_worker = None
                return
            fn = _later_queue.pop(0)
        try:
            fn()
        except Exception:
            log.exception("sandbox cleanup failed")


def flush_cleanup(timeout: float = 30.0) -> None:
    """Finish every pending cleanup of stopped sandboxes now (also run at interpreter exit)."""
    while True:
        with _later_lock:
            worker = _later_worker
            fn = _later_queue.pop(0) if _later_queue else None
        if fn is not None:
            try:
                fn()
            except Exception:
                log.exception("sandbox cleanup failed")
        elif worker is not None and worker is not threading.current_thread():
            worker.join(timeout)
            if worker.is_alive():
                return
        else:
            return


atexit.register(flush_trash)
atexit.register(flush_cleanup)
atexit.register(_pool.close)  # registered last, so it runs first: no refill after it


def _owner_alive(directory: Path) -> bool:
    """Alive, or recorded in another host or pid namespace (not ours to judge).

    Raises:
        FileNotFoundError: no owner record (yet).
    """
    return owners.state_of(directory) != "dead"


def new_sandbox_name() -> str:
    """A fresh sandbox name, tagged with this cache (see `sandbox_prefix`)."""
    return f"{sandbox_prefix()}{uuid.uuid4().hex[:12]}"


def sandbox_prefix() -> str:
    """What names of sandboxes owned through this cache start with.

    Cgroups are host-wide but owner records live in the cache: a collector must never take
    another cache's sandboxes (CI beside a developer, two users) for orphans.
    """
    tag = hashlib.sha256(str(cache_dir().resolve()).encode()).hexdigest()[:6]
    return f"sbx-{tag}-"


def reap_orphans() -> list[str]:
    """Remove sandboxes whose owning process died: processes, cgroups, scratch dirs.

    Returns the names removed. Cheap when there is nothing to do.
    """
    removed: list[str] = []
    base = run_dir()
    names = {n for n in cgroups.stale_groups() if n.startswith(sandbox_prefix())}
    if base.is_dir():
        names.update(p.name for p in base.iterdir() if p.is_dir() and not p.name.startswith("."))
        trash = base / TRASH
        if trash.is_dir():
            with _trash_lock:
                busy = set(_trash)
            for p in trash.iterdir():
                if p not in busy:  # ours being deleted, or left by a dead process
                    shutil.rmtree(p, ignore_errors=True)
    for name in sorted(names):
        try:
            if _owner_alive(base / name):
                continue
        except FileNotFoundError:
            # A run dir without an owner record is being created right now (the record is
            # written first); a cgroup without a run dir is abandoned.
            if (base / name).exists():
                continue
        cgroups.SandboxCgroup(name).remove()
        shutil.rmtree(base / name, ignore_errors=True)
        removed.append(name)
    if removed:
        log.warning("removed %d orphaned sandbox(es): %s", len(removed), ", ".join(removed))
    return removed


def list_sandboxes() -> list[tuple[str, bool]]:
    """This cache's sandboxes on the host as (name, whether its owning process is alive)."""
    base = run_dir()
    found = []
    for path in sorted(base.iterdir()) if base.is_dir() else []:
        if path.is_dir() and path.name.startswith(sandbox_prefix()):
            try:
                alive = _owner_alive(path)
            except FileNotFoundError:
                alive = True  # being created right now (its owner record comes first)
            found.append((path.name, alive))
    return found
