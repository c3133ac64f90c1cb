"""The root launcher: turns a root filesystem plus options into a running bubblewrap sandbox.

Why a launcher and not plain `bwrap`: bubblewrap run by root leaves the sandbox as host uid 0
(measured: it reads /etc/shadow). So between fork and exec the launcher

1. joins the sandbox's cgroups (before any fork inside can escape them),
2. unshares a user namespace whose uid/gid map (written from outside by the spawner, since
   a process cannot map a range into its own new namespace) sends in-sandbox root to the
   first host uid of the sandbox's leased range (`backends.sandbox.uids`): host secrets
   become unreadable, yet `chown`, `su`, `useradd` work; the layers, owned on disk by the
   range from `UID_BASE`, are shown shifted to the sandbox's range by an idmapped mount,
3. mounts the copy-on-write overlay inside that namespace's private mount namespace, so the
   mount vanishes with the sandbox even if this process is SIGKILLed,
4. execs bubblewrap for the pid/ipc/uts/net/mount namespaces and the bind mounts.

Commands run inside by the spawner: its child is forked into the sandbox's pid namespace,
joins the cgroups the same way, then the namespaces, root and cwd of the sandbox's pid 1
(what `nsenter` does, minus an exec and a fork), drops to the user and execs the command.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import anyio

from backends.sandbox import seccomp
from backends.sandbox.cgroups import Join
from backends.sandbox.errors import HostPrerequisiteError, SandboxStartError
from backends.sandbox.namespaces import open_namespaces
from backends.sandbox.pidfds import has_exited
from backends.sandbox.settings import UID_BASE, UID_COUNT, cache_dir

_ZYGOTE = Path(__file__).with_name("zygote.py")
# The sandbox's pid 1 (init.c): says it runs inside the finished mount tree, then waits on
# its stdin, a pipe only the owner can write to; it ends when the owner closes the pipe
# (stop, or the owner's death). As pid 1 with no handlers it is immune to signals from
# inside (`kill -9 -1` as sandbox root does not end the sandbox), and the kernel reaps the
# orphans it inherits.
#
# It is the one process the sandbox keeps when the agent's are killed before grading, so
# sandbox root must not be able to take it over (ptrace, /proc/1/mem): it runs from a
# host-root-owned, execute-only file. Exec of a file the caller cannot read makes the
# process non-dumpable and ties its memory to the host's user namespace, where sandbox root
# holds no CAP_SYS_PTRACE.
INIT_PATH = "/dev/.init"
KEEPALIVE = [INIT_PATH]
_INIT_SOURCE = Path(__file__).with_name("init.c")
COMPILER_HINT = "apt-get install -y gcc libc6-dev"


@dataclass(frozen=True)
class Bind:
    """A host path made visible inside the sandbox."""

    source: Path
    target: str
    read_only: bool = True


@dataclass
class BootSpec:
    """Everything the launcher needs to boot one sandbox."""

    lowerdirs: Sequence[Path]  # top-most layer first, base rootfs last
    upper: Path
    work: Path
    merged: Path
    cgroup: Join
    network: bool = False  # True: a NAT'd uplink will be attached (network_mode = "public")
    resolv_conf: str = "/etc/resolv.conf"  # bound at /etc/resolv.conf when `network`
    binds: Sequence[Bind] = field(default_factory=list)
    hostname: str = "sandbox"
    stage_dir: Path = Path("/nonexistent")  # where binds are staged before entering the userns
    # A scratch upper layer (deleted at stop) needs no durability: a volatile overlay skips
    # syncing the whole upper filesystem at unmount, about 1 ms off every stop here.
    volatile: bool = False
    disk: Path | None = None  # ext4 image holding upper and work, mounted on their parent
    shm_bytes: int = 64 * 1024 * 1024  # size of /dev/shm (docker's default)
    # How the spawner kills the whole sandbox when the owner dies (cgroups.teardown_request).
    teardown: dict[str, object] = field(default_factory=dict)
    uid_base: int = UID_BASE  # host uid of sandbox root (the sandbox's leased range)
    uid_lease: int = -1  # the range's locked fd: the spawner holds a copy while bwrap lives
    idmap_tree: Path | None = None  # shown shifted from the layers' range to the sandbox's


@functools.cache
def _which(name: str) -> str | None:
    return shutil.which(name)


def require_host() -> str:
    """Return the path of bwrap, or say what to install.

    Raises:
        HostPrerequisiteError: not root, or bubblewrap missing.
    """
    if os.geteuid() != 0:
        raise HostPrerequisiteError(
            "the local sandbox launcher must run as root (it writes uid maps, cgroups and "
            "mounts overlays); run as root or pick another environment type"
        )
    bwrap = _which("bwrap")
    if bwrap is None:
        raise HostPrerequisiteError("bubblewrap is not installed: apt-get install -y bubblewrap")
    return bwrap


@functools.cache
def init_binary() -> Path:
    """The sandbox's pid 1 program: init.c built static, execute-only (0111) and owned by
    host root, in the cache (built once per source, atomically).

    Raises:
        HostPrerequisiteError: no C compiler or static C library to build it with.
    """
    source = _INIT_SOURCE.read_bytes()
    target = cache_dir() / "init" / f"init-{hashlib.sha256(source).hexdigest()[:16]}"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    cc = _which("cc") or _which("gcc")
    try:
        if cc is None:
            raise OSError("no C compiler")
        subprocess.run(
            [cc, "-static", "-Os", "-o", str(tmp), str(_INIT_SOURCE)],
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", b"") or str(e).encode()
        raise HostPrerequisiteError(
            f"could not build the local sandbox's pid 1 ({detail.decode(errors='replace').strip()}):"
            f" {COMPILER_HINT}"
        ) from e
    os.chown(tmp, 0, 0)
    tmp.chmod(0o111)
    tmp.replace(target)
    return target


def all_binds(spec: BootSpec) -> list[Bind]:
    """The sandbox's binds: the caller's, then pid 1's program."""
    return [*spec.binds, Bind(init_binary(), INIT_PATH)]


def staged(spec: BootSpec, index: int) -> Path:
    return spec.stage_dir / str(index)


def prepare_stage(spec: BootSpec) -> None:
    """Create the mount points the binds are staged on (a file for a file or socket)."""
    for i, b in enumerate(all_binds(spec)):
        point = staged(spec, i)
        point.parent.mkdir(parents=True, exist_ok=True)
        if b.source.is_dir():
            point.mkdir()
        else:
            point.touch()


def _boot_request(spec: BootSpec) -> dict[str, object]:
    lower = ":".join(str(p) for p in spec.lowerdirs)
    options = f"lowerdir={lower},upperdir={spec.upper},workdir={spec.work},userxattr"
    return {
        "options": f"{options},volatile" if spec.volatile else options,
        "merged": str(spec.merged),
        "disk": [str(spec.disk), str(spec.upper.parent)] if spec.disk else None,
        "stages": [
            [str(b.source), str(staged(spec, i)), b.read_only]
            for i, b in enumerate(all_binds(spec))
        ],
        "teardown": spec.teardown,
        "owner_uid": spec.uid_base,
        "idmap": None
        if spec.idmap_tree is None
        else {
            "tree": str(spec.idmap_tree),
            # Root's own files stay root's (else host root could not reach the layers).
            "map": f"0 0 1\n{UID_BASE} {spec.uid_base} {UID_COUNT}\n",
        },
    }


def bwrap_argv(bwrap: str, spec: BootSpec, info_fd: int, seccomp_fd: int) -> list[str]:
    argv = [
        bwrap,
        "--seccomp",  # loaded into pid 1 last, after bwrap's own mounts
        str(seccomp_fd),
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--as-pid-1",
        "--hostname",
        spec.hostname,
        "--info-fd",
        str(info_fd),
        "--bind",
        str(spec.merged),
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        # pid 1's program, bound while /dev is still writable (its mount point is there).
        "--ro-bind",
        str(staged(spec, len(spec.binds))),
        INIT_PATH,
        # /dev/shm is a tmpfs outside the disk limit: sized (its pages also count against the
        # memory limit), and /dev itself read-only once set up, so neither is spare storage.
        "--size",
        str(spec.shm_bytes),
        "--tmpfs",
        "/dev/shm",
        "--remount-ro",
        "/dev",
        # Always a network namespace of its own; with public network, slirp4netns gives it
        # an uplink once it runs (backends.sandbox.network).
        "--unshare-net",
    ]
    if spec.network:
        argv += ["--ro-bind", spec.resolv_conf, "/etc/resolv.conf"]
        if Path("/etc/hosts").exists():
            argv += ["--ro-bind", "/etc/hosts", "/etc/hosts"]
    for i, b in enumerate(spec.binds):
        # The folders a bind's mount point needs are made open to every user (bwrap's own are
        # 0700, which kept a task's non-root agent user from a runtime under
        # /var/cache/backends); folders the image has keep their own mode.
        for folder in reversed(PurePosixPath(b.target).parents[:-1]):
            argv += ["--perms", "0755", "--dir", str(folder)]
        argv += ["--ro-bind" if b.read_only else "--bind", str(staged(spec, i)), b.target]
    return [*argv, "--", *KEEPALIVE]


class SandboxProcess:
    """A process the spawner started for us: pid, exit code, kill and wait.

    Its state changes only on the event loop that started it, so `kill()` never signals
    through a closed pidfd (and never hits a recycled pid: it signals via the pidfd).
    """

    def __init__(self, pid: int, pidfd: int, loop: asyncio.AbstractEventLoop) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._pidfd: int | None = pidfd
        self._done: asyncio.Future[int] = loop.create_future()

    def kill(self) -> None:
        if self.returncode is None and self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    async def wait(self) -> int:
        return await asyncio.shield(self._done)

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._close()
        if not self._done.done():
            self._done.set_result(code)

    def _close(self) -> None:
        fd, self._pidfd = self._pidfd, None
        if fd is not None:
            os.close(fd)


def _on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., object], *args: object) -> bool:
    """Run fn on `loop`: now if that is the loop we are on, else soon (False: loop closed)."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        fn(*args)
        return True
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that loop is closed
        return False
    return True


NO_CGROUP = Join()  # host infrastructure (the network uplink): stays in the spawner's cgroups


class Spawner:
    """Client of the spawner process (`backends/sandbox/zygote.py`); one per owner process."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            config = {
                "seccomp": seccomp.program().hex(),
                "keyctl": seccomp.syscall_number("keyctl"),
            }
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    "-S",
                    str(_ZYGOTE),
                    str(theirs.fileno()),
                    json.dumps(config),
                ],
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                # Not in the owner's session or process group: no controlling terminal to
                # pass on, and a kill of the owner's group leaves it to clean up after it.
                start_new_session=True,
            )
        self.sock = ours
        self.sock.setblocking(False)
        self.owner = os.getpid()
        self.dead = False
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[SandboxProcess]]]
        self._pending = {}
        self._procs: dict[int, tuple[asyncio.AbstractEventLoop, SandboxProcess]] = {}
        # Replies are read on the event loops themselves (a reader thread would wait for
        # the GIL, up to the 5 ms switch interval, on every message).
        self._loops: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()

    async def spawn(
        self,
        argv: Sequence[str],
        *,
        env: dict[str, str],
        fds: Sequence[int],
        cgroup: Join = NO_CGROUP,
        boot: dict[str, object] | None = None,
        enter: dict[str, object] | None = None,
        enter_pidfd: int = -1,
        uid_base: int = UID_BASE,
        hold: int = -1,
    ) -> SandboxProcess:
        """Start argv with `fds` as its fds 0, 1, 2, ..., in the cgroups `cgroup` names.

        With `enter` ({"uid", "gid", "groups"}) argv runs inside the live sandbox whose pid 1
        is the pidfd `enter_pidfd`, as that user, found on `env`'s PATH. With `boot`, a new
        user namespace maps sandbox root to host `uid_base`. The spawner keeps a copy of the
        fd `hold` (if any) until the child has exited.

        Raises:
            OSError: the spawner is gone, or the child failed before exec (message says why).
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[SandboxProcess] = loop.create_future()
        rid = next(self._ids)
        req = {
            "id": rid,
            "argv": list(argv),
            "env": env,
            "fds": list(range(len(fds))),
            "cgroups": list(cgroup.v1_tasks),
            "cgroup_dir": cgroup.v2_dir,
            "boot": boot,
            "uid_map": f"0 {uid_base} {UID_COUNT}\n",
            "enter": enter,
            "hold": hold >= 0,
        }
        data = json.dumps(req).encode()
        send_fds = list(fds)
        if hold >= 0:
            send_fds.append(hold)
        if enter is not None:
            if enter_pidfd < 0:
                raise OSError("no pidfd of the sandbox's pid 1 to enter it by")
            send_fds.append(enter_pidfd)
        spill: int | None = None
        if len(data) > INLINE_REQUEST_BYTES:
            # A socket message has a size limit a long command (up to execve's ~2 MB) would
            # exceed: large requests travel in a memfd passed along with the other fds.
            spill = os.memfd_create("sandbox-spawn-request", os.MFD_CLOEXEC)
            os.write(spill, data)
            data, send_fds = b'{"spilled": true}', [*send_fds, spill]
        with self._lock:
            if self.dead:
                raise OSError("the sandbox spawner process is gone")
            if loop not in self._loops:
                self._loops.add(loop)
                loop.add_reader(self.sock.fileno(), self._readable)
            self._pending[rid] = (loop, fut)
        try:
            while True:
                try:
                    socket.send_fds(self.sock, [data], send_fds)
                    break
                except BlockingIOError:
                    await asyncio.sleep(0.001)
                except OSError:
                    self._pending.pop(rid, None)
                    raise
        finally:
            if spill is not None:
                os.close(spill)
        return await fut

    def _readable(self) -> None:
        while True:
            # Several event loops may read this socket (a layer build runs its own): receive
            # and dispatch under one lock, so a process's reply is always handled before its
            # exit message, whichever loop reads which.
            with self._recv_lock:
                try:
                    data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 4)
                except BlockingIOError:
                    return
                except OSError:
                    data, fds = b"", []
                if data:
                    self._dispatch(json.loads(data), fds)
                    continue
            self._died()
            return

    def _dispatch(self, msg: dict[str, Any], fds: list[int]) -> None:
        if "id" in msg:
            loop, fut = self._pending.pop(msg["id"])
            if "pid" in msg:
                proc = SandboxProcess(msg["pid"], fds[0], loop)
                self._procs[proc.pid] = (loop, proc)
                if not _on_loop(loop, _deliver, fut, proc):
                    os.close(fds[0])
            else:
                _on_loop(loop, _fail, fut, OSError(msg["error"]))
        else:
            loop, proc = self._procs.pop(msg["exit"])
            if not _on_loop(loop, proc._exited, msg["code"]):
                proc._close()

    def _died(self) -> None:
        with self._lock:
            if self.dead:
                return
            self.dead = True
            loops = list(self._loops)
        for loop in loops:
            with contextlib.suppress(RuntimeError, ValueError, OSError):
                _on_loop(loop, loop.remove_reader, self.sock.fileno())
        for loop, fut in self._pending.values():
            _on_loop(loop, _fail, fut, OSError("the sandbox spawner process died"))
        for loop, proc in self._procs.values():
            _on_loop(loop, proc._exited, -signal.SIGKILL)
        self._pending.clear()
        self._procs.clear()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(1)


def _deliver(fut: asyncio.Future[SandboxProcess], proc: SandboxProcess) -> None:
    if fut.done():  # the caller gave up (cancelled): do not leave the process running
        proc.kill()
    else:
        fut.set_result(proc)


def _fail(fut: asyncio.Future[SandboxProcess], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


_spawner: Spawner | None = None
_spawner_lock = threading.Lock()


def spawner() -> Spawner:
    """The spawner of this process, started on first use (and again if it died)."""
    global _spawner
    with _spawner_lock:
        if _spawner is None or _spawner.dead or _spawner.owner != os.getpid():
            _spawner = Spawner()
        return _spawner


async def read_fd(
    fd: int, until: Callable[[bytes], bool] | None = None, sink: bytearray | None = None
) -> bytes:
    """Read a pipe on the event loop until EOF (or until `until(data)`).

    What arrived is also in `sink` (when given), so a cancelled read keeps its data.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    buf = bytearray() if sink is None else sink
    os.set_blocking(fd, False)

    def readable() -> None:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        buf.extend(chunk)
        if not chunk or (until is not None and until(bytes(buf))):
            loop.remove_reader(fd)
            if not done.done():
                done.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await done
    finally:
        loop.remove_reader(fd)
    return bytes(buf)


async def write_fd(fd: int, data: bytes) -> None:
    """Write all of data to a non-blocking pipe (stops quietly if the reader went away)."""
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:
            n = 0
        except (BrokenPipeError, ConnectionResetError):
            return
        view = view[n:]
        if view:
            ready: asyncio.Future[None] = loop.create_future()
            loop.add_writer(fd, _set_done, ready)
            try:
                await ready
            finally:
                loop.remove_writer(fd)


def _set_done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


@dataclass
class Booted:
    process: SandboxProcess
    init_pid: int  # host pid of the sandbox's pid 1: commands join its namespaces
    keepalive: int  # write end of the first process's stdin: closing it ends that process
    init_fd: int = -1  # pidfd of pid 1: readable once it, and so its whole pid namespace, is gone

    def alive(self) -> bool:
        """Is the sandbox's pid 1 still running (asked through its pidfd, never its number)?"""
        if self.init_fd < 0:
            return False
        # Readable once it exited, even while still a zombie (a signal would reach that).
        return not has_exited(self.init_fd)

    def open_namespace(self, name: str) -> int:
        """An fd of one of the sandbox's namespaces, checked to belong to its live pid 1.

        Raises:
            ProcessLookupError: pid 1 is gone (its number may already be someone else's).
        """
        if self.init_fd < 0:
            raise ProcessLookupError(f"the sandbox's pid 1 ({self.init_pid}) is gone")
        (fd,) = open_namespaces(self.init_fd, (name,))
        return fd

    async def init_exited(self) -> None:
        """Wait until the sandbox's pid 1 has exited (after everything else in it)."""
        if self.init_fd >= 0:
            await anyio.wait_readable(self.init_fd)

    def close(self) -> None:
        for name in ("keepalive", "init_fd"):
            fd = getattr(self, name)
            setattr(self, name, -1)
            if fd >= 0:
                os.close(fd)


def _parses(data: bytes) -> bool:
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


INFO_FD = 3
SECCOMP_FD = 4
INLINE_REQUEST_BYTES = 64 * 1024
BOOT_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}


async def boot(spec: BootSpec) -> Booted:
    """Start the sandbox and return once its pid 1 runs inside the finished mount tree.

    Raises:
        SandboxStartError: bwrap or the namespace setup failed; the message holds its stderr.
    """
    bwrap = require_host()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    info_r, info_w = os.pipe()
    keep_r, keep_w = os.pipe()
    filter_r, filter_w = os.pipe()  # a fresh read position per boot; fits the pipe's buffer
    os.write(filter_w, seccomp.program())
    os.close(filter_w)
    try:
        try:
            proc = await spawner().spawn(
                bwrap_argv(bwrap, spec, INFO_FD, SECCOMP_FD),
                # bwrap and the keepalive need nothing from the owner's environment (and
                # the host's variables have no business in the sandbox's /proc/1/environ).
                env=BOOT_ENV,
                fds=(keep_r, out_w, err_w, info_w, filter_r),
                cgroup=spec.cgroup,
                boot=_boot_request(spec),
                uid_base=spec.uid_base,
                hold=spec.uid_lease,
            )
        except OSError as e:
            raise SandboxStartError(f"could not start bubblewrap: {e}") from e
        finally:
            for fd in (keep_r, out_w, err_w, info_w, filter_r):
                os.close(fd)
        try:
            line = await read_fd(out_r, lambda b: b"\n" in b)
            if line.strip() != b"ready":
                await proc.wait()
                err = (await read_fd(err_r)).decode(errors="replace").strip()
                raise SandboxStartError(
                    f"sandbox failed to boot (exit {proc.returncode}): {err or 'no output'}"
                )
            info = json.loads(await read_fd(info_r, _parses))
        except BaseException:
            proc.kill()
            await proc.wait()
            raise
    except BaseException:
        os.close(keep_w)
        raise
    finally:
        for fd in (out_r, err_r, info_r):
            os.close(fd)
    init_pid = int(info["child-pid"])
    try:
        init_fd = os.pidfd_open(init_pid)
    except ProcessLookupError:
        init_fd = -1  # already gone: nothing to wait for
    return Booted(process=proc, init_pid=init_pid, keepalive=keep_w, init_fd=init_fd)


def host_id(sandbox_id: int) -> int:
    """The host uid (or gid) a sandbox-side id shows up as."""
    return UID_BASE + sandbox_id


def chown_to_sandbox(path: Path, uid: int = 0, gid: int = 0) -> None:
    os.lchown(path, host_id(uid), host_id(gid))
