"""The spawner: a small, single-threaded root process that forks sandbox processes cheaply.

Why: a process must join its cgroups, and the sandbox's pid 1 must get its mount namespace,
overlay and uid-mapped user namespace, *between fork and exec*. Done with `preexec_fn` in the
owning interpreter, that costs a full fork of a large, multi-threaded process (tens of ms on
a busy VM, twice per boot because the uid map needs a helper outside the new namespace).
This process imports only the standard library's basics, so its fork is cheap, and it
writes the uid map itself, so a boot forks once.

It is run as `python -I -S zygote.py FD CONFIG` by `backends.sandbox.launcher` (CONFIG: JSON
with the compiled seccomp filter and keyctl's syscall number), talks over the SOCK_SEQPACKET
socket FD, and when the other end closes (its owner died or is done) kills every sandbox it
booted through its cgroup, then exits.

Protocol (one JSON document per message, file descriptors as SCM_RIGHTS):

- request `{"id", "argv", "env", "fds": [target fd numbers], "cgroups": [v1 `tasks` files],
  "cgroup_dir": the v2 group the child is born in, or null, "boot": null | {"options", "merged", "stages": [[source, point, read_only], ...], "disk": null |
  [image, point], "teardown": {"kill", "events", "procs"}}, "uid_map",
  "enter": null | {"uid", "gid", "groups"}}` with the fds to install at those numbers
  (every other fd is closed), and with `enter` the pidfd of the sandbox's pid 1 after them.
  `enter` runs the command inside a live sandbox: the child is forked straight into the
  sandbox's pid namespace and joins its user, mount, network, ipc and uts namespaces (what
  `nsenter` would do, without its exec and fork); the command is then looked up on the sandbox's PATH and a failed exec is an
  ordinary exit (127, or 126) with the reason on its stderr, as in a shell. A request too
  large for one message arrives as `{"spilled": true}` with a memfd holding it as the last fd;
- reply `{"id", "pid"}` with a pidfd once the child has exec'd, or `{"id", "error"}`;
- later `{"exit": pid, "code": returncode}` (negative: killed by that signal).

Nothing here may import the project: it runs with `-I -S`, standard library only.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import selectors
import signal
import socket
import struct
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWNET = 0x40000000
ENTER_NAMESPACES = CLONE_NEWUSER | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNET | CLONE_NEWNS
MS_RDONLY = 1
MS_NODEV = 4
MS_REMOUNT = 32
MS_BIND = 4096
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (newer syscalls)
SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429
OPEN_TREE_CLONE = 1
O_CLOEXEC = 0o2000000
AT_EMPTY_PATH = 0x1000
MOVE_MOUNT_F_EMPTY_PATH = 4
MOUNT_ATTR_IDMAP = 0x00100000
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 1
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MAX_FDS = 16
MAX_FD_NUMBER = 1 << 20
PR_SET_DUMPABLE = 4
LOOP_CTL_GET_FREE = 0x4C82
LOOP_CONFIGURE = 0x4C0A
LO_FLAGS_AUTOCLEAR = 4
HIGH_FD = 100  # scratch fd numbers while installing the requested ones
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
KEYCTL_JOIN_SESSION_KEYRING = 1
SYS_CLONE3 = 435  # the same number on every architecture
CLONE_INTO_CGROUP = 0x200000000

_libc = ctypes.CDLL(None, use_errno=True)
# Looked up here, once: a lookup in each forked child (dlsym plus a new function object)
# costs about 0.5 ms on every start and exec.
_prctl, _unshare, _mount, _syscall = _libc.prctl, _libc.unshare, _libc.mount, _libc.syscall


class _SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


class _Hardening:
    """What every process entering a sandbox gets: the seccomp filter, a keyring of its own."""

    program = ctypes.create_string_buffer(0)
    fprog = _SockFprog(0, None)
    keyctl = -1

    @classmethod
    def setup(cls, program: bytes, keyctl: int) -> None:
        cls.program = ctypes.create_string_buffer(program, len(program))
        cls.fprog = _SockFprog(len(program) // 8, ctypes.addressof(cls.program))
        cls.keyctl = keyctl

    @classmethod
    def own_keyring(cls) -> None:
        """Join a new anonymous session keyring: the owner's keys stay out of reach."""
        ret = _syscall(cls.keyctl, KEYCTL_JOIN_SESSION_KEYRING, None, 0, 0, 0)
        if ret < 0:
            _check(ret, "keyctl(JOIN_SESSION_KEYRING)")

    @classmethod
    def filter_syscalls(cls) -> None:
        # Allowed without no_new_privs while we hold CAP_SYS_ADMIN in the sandbox's user
        # namespace, so setuid programs inside (su, sudo) keep working, as under Docker.
        _check(
            _prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(cls.fprog), 0, 0),
            "prctl(PR_SET_SECCOMP)",
        )


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


class _CloneArgs(ctypes.Structure):
    _fields_ = tuple(
        (name, ctypes.c_uint64)
        for name in (
            "flags", "pidfd", "child_tid", "parent_tid", "exit_signal", "stack", "stack_size",
            "tls", "set_tid", "set_tid_size", "cgroup",
        )
    )  # fmt: skip


def _fork_into(cgroup_dir: str) -> int | None:
    """fork(), the child born in the v2 cgroup `cgroup_dir`; None where clone3 is refused.

    Moving a process in afterwards (writing cgroup.procs) waits for an RCU grace period, 10-15
    ms on a loaded host, on every start and exec (see `cgroups.Join`). The raw clone3 skips
    Python's and libc's after-fork bookkeeping, which this single-threaded process does not
    need: the child only makes system calls until it execs.
    """
    fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        args = _CloneArgs(flags=CLONE_INTO_CGROUP, exit_signal=signal.SIGCHLD, cgroup=fd)
        pid = _syscall(ctypes.c_long(SYS_CLONE3), ctypes.byref(args), ctypes.sizeof(args))
        if pid < 0:
            err = ctypes.get_errno()
            if err in (errno.ENOSYS, errno.EPERM):  # old kernel, or a container's filter
                return None
            raise OSError(err, f"clone3 into {cgroup_dir}: {os.strerror(err)}")
        return pid
    finally:
        os.close(fd)


def _write_file(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _child(req: dict, fds: list[int], err_w: int, go_r: int, target: int | None) -> None:
    """In the forked child: join cgroups, set up namespaces, install fds, exec. Never returns."""
    try:
        # Not dumpable until exec (which resets it; runc's fix for CVE-2016-9962): after
        # joining a sandbox's user namespace and before dropping to its user, this process
        # is host root with the host's root directory, and sandbox root could otherwise
        # ptrace it or open its /proc/PID/root and /proc/PID/fd.
        _check(_prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
        for sig in (signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        # Keep only our own fds, before going near a sandbox: the spawner's socket and the
        # other children's pipes and pidfds must never be within a sandbox's reach.
        high = [fcntl.fcntl(f, fcntl.F_DUPFD_CLOEXEC, HIGH_FD) for f in fds]
        err_w = fcntl.fcntl(err_w, fcntl.F_DUPFD_CLOEXEC, HIGH_FD + MAX_FDS)
        go_r = fcntl.fcntl(go_r, fcntl.F_DUPFD_CLOEXEC, HIGH_FD + MAX_FDS)
        if target is not None:  # received without close-on-exec: never hand it to the command
            target = fcntl.fcntl(target, fcntl.F_DUPFD_CLOEXEC, HIGH_FD + MAX_FDS)
        _close_all_but({*high, err_w, go_r, *([] if target is None else [target])})
        # First, before anything can fork: every descendant stays inside the limits.
        # ("0" is the writer itself, whichever pid namespace it was forked into; in a v1
        # `tasks` file the calling thread, which is all of this single-threaded process.)
        for f in req["cgroups"]:
            _write_file(f, b"0")
        # A session of its own: no controlling terminal (no /dev/tty, no TIOCSTI into the
        # owner's shell), and no signals from the owner's terminal. Only now, in the
        # sandbox's cpu group: in the host's root group a new session also gets a scheduler
        # autogroup of its own, and the move into it costs a reschedule (measured 4 ms on a
        # loaded host, against 0.04 ms here).
        os.setsid()
        enter = req.get("enter")
        if enter:
            assert target is not None
            _enter(enter, target)
        boot = req.get("boot")
        if boot:
            # Still host root, in a private mount namespace: mount the overlay and stage
            # the binds, so sources the sandbox uid could not traverse (e.g. /root) work.
            _check(_unshare(CLONE_NEWNS), "unshare mount namespace")
            _check(_mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
            if boot.get("disk"):
                _mount_disk(*boot["disk"])
            if boot.get("idmap"):
                assert target is not None
                _idmap_tree(boot["idmap"]["tree"], target)
            _check(
                _mount(
                    b"overlay", boot["merged"].encode(), b"overlay", MS_NODEV,
                    boot["options"].encode(),
                ),
                "mount overlay",
            )  # fmt: skip
            for source, point, read_only in boot["stages"]:
                _check(
                    _mount(source.encode(), point.encode(), None, MS_BIND | MS_REC, None),
                    f"stage bind {source}",
                )
                if read_only:
                    _make_read_only(point)
            # Created as the sandbox's own host uid, which then owns the namespace: the
            # kernel's per-user counts (inotify instances, ...) at the host level are charged
            # to it, not to host root, whose are shared by everything else.
            os.setresuid(boot["owner_uid"], boot["owner_uid"], 0)
            _check(_unshare(CLONE_NEWUSER), "unshare user namespace")
            os.write(err_w, b"U")  # the spawner, outside, writes our uid/gid map
            if os.read(go_r, 1) != b"G":
                raise OSError("could not write the sandbox uid map")
            os.setresgid(0, 0, 0)
            os.setresuid(0, 0, 0)
            os.setgroups([])
            _Hardening.own_keyring()  # owned by sandbox root; bwrap loads the filter
        # Install the requested fds at their numbers; everything else is close-on-exec.
        for number, f in zip(req["fds"], high, strict=True):
            os.dup2(f, number, inheritable=True)
        argv = req["argv"]
        if not enter:
            os.execve(argv[0], argv, req["env"])
        e = _exec_on_path(argv, req["env"])  # returns only on failure
        # Like a shell: a message and 127 (not found) or 126.
        os.write(2, f"{argv[0]}: {e.strerror}\n".encode(errors="replace"))
        os._exit(127 if isinstance(e, FileNotFoundError) else 126)
    except BaseException as e:
        try:
            os.write(err_w, b"E" + f"{type(e).__name__}: {e}".encode(errors="replace"))
        finally:
            os._exit(127)


def _idmap_tree(path: str, userns: int) -> None:
    """Show the mount tree at `path` (in our private mount namespace) through `userns`'s map."""
    fd = _syscall(
        SYS_OPEN_TREE, AT_FDCWD, path.encode(), OPEN_TREE_CLONE | O_CLOEXEC | AT_RECURSIVE
    )
    if fd < 0:
        _check(fd, f"open_tree {path}")
    try:
        attr = struct.pack("=4Q", MOUNT_ATTR_IDMAP, 0, 0, userns)  # struct mount_attr
        flags = AT_EMPTY_PATH | AT_RECURSIVE
        _check(_syscall(SYS_MOUNT_SETATTR, fd, b"", flags, attr, len(attr)), f"idmap {path}")
        _check(
            _syscall(SYS_MOVE_MOUNT, fd, b"", AT_FDCWD, path.encode(), MOVE_MOUNT_F_EMPTY_PATH),
            f"mount the idmapped {path}",
        )
    finally:
        os.close(fd)


def _kill_sandbox(teardown: dict, limit_sec: float = 5.0) -> None:
    """SIGKILL a sandbox through its cgroup and wait (a while) until it is empty.

    `teardown`: {"kill": the sandbox's cgroup.kill or null, "events": its cgroup.events or
    null, "procs": v1 cgroup.procs files}. Without cgroup.kill, members are signalled by pid.
    """
    if teardown.get("kill"):
        try:
            _write_file(teardown["kill"], b"1")
        except OSError:
            pass
    deadline = time.monotonic() + limit_sec
    while time.monotonic() < deadline:
        pids = []
        for procs in teardown.get("procs", ()):
            try:
                with open(procs) as f:
                    pids += [int(x) for x in f.read().split()]
            except OSError:
                pass
        if not pids and not _populated(teardown.get("events")):
            return
        if not teardown.get("kill"):
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        time.sleep(0.005)


def _populated(events: str | None) -> bool:
    if not events:
        return False
    try:
        with open(events) as f:
            return "populated 1" in f.read()
    except OSError:
        return False


def _make_read_only(point: str) -> None:
    """Make a staged bind (and every mount under it) read-only, from outside the sandbox.

    Set here, by host root, the flag is locked: root inside the sandbox's user namespace
    cannot remount the bind writable (bwrap's own --ro-bind, made inside, could be undone).
    """
    attr = struct.pack("=4Q", MOUNT_ATTR_RDONLY, 0, 0, 0)  # struct mount_attr
    ret = _syscall(SYS_MOUNT_SETATTR, AT_FDCWD, point.encode(), AT_RECURSIVE, attr, len(attr))
    if ret != 0 and ctypes.get_errno() == errno.ENOSYS:  # before Linux 5.12: the top mount only
        ret = _mount(None, point.encode(), None, MS_BIND | MS_REMOUNT | MS_RDONLY, None)
    _check(ret, f"make {point} read-only")


def _close_all_but(keep: set[int]) -> None:
    low = 0
    for fd in sorted(keep):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, MAX_FD_NUMBER)


def _mount_disk(image: str, point: str) -> None:
    """Mount the sandbox's ext4 disk image at `point` through a self-detaching loop device."""
    backing = os.open(image, os.O_RDWR | os.O_CLOEXEC)
    ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    # struct loop_config: fd, block_size, struct loop_info64 (lo_flags = autoclear), reserved.
    info = struct.pack("=5Q4I", 0, 0, 0, 0, 0, 0, 0, 0, LO_FLAGS_AUTOCLEAR) + bytes(176)
    config = struct.pack("=II", backing, 0) + info + bytes(64)
    try:
        for _ in range(100):  # other processes race us for free devices
            dev = f"/dev/loop{fcntl.ioctl(ctl, LOOP_CTL_GET_FREE)}"
            try:
                loop = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:  # the device node is still being created
                continue
            try:
                fcntl.ioctl(loop, LOOP_CONFIGURE, config)
            except OSError as e:
                os.close(loop)
                if e.errno == errno.EBUSY:
                    continue
                raise
            try:  # once mounted, the mount holds the device; closing ours arms autoclear
                opts = b"noinit_itable"  # a fresh sparse image: no zeroing behind our back
                _check(_mount(dev.encode(), point.encode(), b"ext4", MS_NODEV, opts),
                       f"mount disk image {image}")  # fmt: skip
            finally:
                os.close(loop)
            return
        raise OSError(errno.EBUSY, "no free loop device for the sandbox disk")
    finally:
        os.close(ctl)
        os.close(backing)


def _exec_on_path(argv: list[str], env: dict[str, str]) -> OSError:
    """execvpe without imports (os.execvpe imports modules, and we are chrooted now)."""
    name = argv[0]
    if "/" in name:
        dirs = [""]
    else:
        dirs = [d or "." for d in env.get("PATH", "/usr/bin:/bin").split(":")]
    first: OSError | None = None
    for d in dirs:
        try:
            os.execve(f"{d}/{name}" if d else name, argv, env)
        except OSError as e:
            if first is None or (isinstance(first, FileNotFoundError) and e.errno == 13):
                first = e  # EACCES wins over ENOENT, as in execvp
    return first or FileNotFoundError(2, "No such file or directory")


def _enter(enter: dict, target: int) -> None:
    """Join the namespaces of the sandbox whose pid 1 is the pidfd `target`, as its user."""
    # All at once through the pidfd: if pid 1 is gone this fails, where opening /proc/<pid>
    # could reach whichever process (perhaps a host one) reused the number.
    os.setns(target, ENTER_NAMESPACES)
    os.chdir("/")  # joining a mount namespace put us at its root: the sandbox's
    os.setresuid(0, 0, 0)  # sandbox root, with its capabilities, for the next two steps
    _Hardening.own_keyring()
    _Hardening.filter_syscalls()
    os.setgroups(enter["groups"])
    os.setresgid(enter["gid"], enter["gid"], enter["gid"])
    os.setresuid(enter["uid"], enter["uid"], enter["uid"])


class _Child:
    __slots__ = ("err_r", "error", "go_w", "hold", "pidfd", "replied", "req_id", "uid_map")

    def __init__(self, req_id: int, err_r: int, go_w: int, pidfd: int, uid_map: str) -> None:
        self.req_id = req_id
        self.err_r: int | None = err_r
        self.go_w = go_w
        self.pidfd = pidfd
        self.error = b""
        self.replied = False
        self.uid_map = uid_map
        self.hold: int | None = None  # closed once the child is reaped


class Spawner:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sel = selectors.DefaultSelector()
        self.sel.register(sock, selectors.EVENT_READ, ("ctl", 0))
        self.children: dict[int, _Child] = {}
        self.sandboxes: dict[int, dict] = {}  # bwrap pid -> how to kill that sandbox
        self.userns: dict[str, int] = {}  # uid map -> user namespace fd, for idmapped mounts
        self.own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)

    def send(self, msg: dict, fds: list[int] | None = None) -> None:
        data = json.dumps(msg).encode()
        try:
            if fds:
                socket.send_fds(self.sock, [data], fds)
            else:
                self.sock.send(data)
        except OSError:
            self.owner_gone()

    def run(self) -> None:
        while True:
            for key, _ in self.sel.select():
                kind, pid = key.data
                if kind == "ctl":
                    self.request()
                elif kind == "err":
                    self.child_said(pid)
                else:
                    self.reap(pid)

    def request(self) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(self.sock, 1 << 20, MAX_FDS)
        except OSError:
            data, fds = b"", []
        if not data:
            self.owner_gone()  # owner closed the socket or died
        req = json.loads(data)
        if req.get("spilled"):  # too large for a message: it came in a memfd, the last fd
            spill = fds.pop()
            size = os.fstat(spill).st_size
            req = json.loads(os.pread(spill, size, 0))
            os.close(spill)
        # With `enter`, the sandbox's pid 1 comes as a pidfd, the last fd; before it, the fd
        # to hold while the child lives.
        target = fds.pop() if req.get("enter") else None
        hold = fds.pop() if req.get("hold") else None
        err_r, err_w = os.pipe()
        go_r, go_w = os.pipe()
        own = [f for f in (*fds, target) if f is not None]
        boot = req.get("boot")
        try:
            if boot and boot.get("idmap"):  # the child's, for the idmapped layers
                target = os.dup(self.idmap_userns(boot["idmap"]["map"]))
                own.append(target)
            pid = self.fork(None if boot else target, req)
        except OSError as e:
            for f in (*own, err_r, err_w, go_r, go_w, *([] if hold is None else [hold])):
                os.close(f)
            where = "enter the sandbox" if req.get("enter") else "fork"
            self.send({"id": req["id"], "error": f"{where}: {e}"})
            return
        if pid == 0:
            _child(req, fds, err_w, go_r, target)
        for f in (*own, err_w, go_r):
            os.close(f)
        pidfd = os.pidfd_open(pid)
        self.children[pid] = _Child(req["id"], err_r, go_w, pidfd, req.get("uid_map", ""))
        self.children[pid].hold = hold
        if boot:
            self.sandboxes[pid] = boot["teardown"]
        self.sel.register(err_r, selectors.EVENT_READ, ("err", pid))
        self.sel.register(pidfd, selectors.EVENT_READ, ("exit", pid))

    def idmap_userns(self, uid_map: str) -> int:
        """A user namespace with this uid and gid map, to idmap mounts with (made once)."""
        fd = self.userns.get(uid_map)
        if fd is not None:
            return fd
        ready_r, ready_w = os.pipe()
        done_r, done_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # lives just long enough to have its namespace opened
            try:
                os.close(ready_r)
                os.close(done_w)  # else our own copy would keep the read below from ending
                _check(_unshare(CLONE_NEWUSER), "unshare user namespace")
                os.write(ready_w, b"1")
                os.read(done_r, 1)
            finally:
                os._exit(0)
        os.close(ready_w)
        os.close(done_r)
        try:
            if os.read(ready_r, 1) != b"1":
                raise OSError("could not create the idmap user namespace")
            for name in ("uid_map", "gid_map"):
                _write_file(f"/proc/{pid}/{name}", uid_map.encode())
            fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            os.close(ready_r)
            os.close(done_w)
            os.waitpid(pid, 0)
        if len(self.userns) >= 64:  # ranges come and go: keep the recent ones
            os.close(self.userns.pop(next(iter(self.userns))))
        self.userns[uid_map] = fd
        return fd

    def fork(self, target: int | None, req: dict) -> int:
        """fork() into the request's v2 cgroup; with `target` (a pidfd), into that process's
        pid namespace too."""
        if target is not None:
            os.setns(target, CLONE_NEWPID)  # only our future children's pid namespace changes
        try:
            pid = _fork_into(req["cgroup_dir"]) if req.get("cgroup_dir") else None
            if pid is None:
                if req.get("cgroup_dir"):  # the slow way: the child moves itself in
                    req["cgroups"].append(f"{req['cgroup_dir']}/cgroup.procs")
                pid = os.fork()
        except OSError:
            if target is not None:
                os.setns(self.own_pidns, CLONE_NEWPID)
            raise
        if pid and target is not None:
            os.setns(self.own_pidns, CLONE_NEWPID)
        return pid

    def child_said(self, pid: int) -> None:
        c = self.children[pid]
        assert c.err_r is not None
        data = os.read(c.err_r, 65536)
        if data.startswith(b"U") and not c.error:
            data = data[1:]
            answer = b"G"
            try:
                for name in ("uid_map", "gid_map"):
                    _write_file(f"/proc/{pid}/{name}", c.uid_map.encode())
            except OSError:
                answer = b"X"
            try:
                os.write(c.go_w, answer)
            except OSError:
                pass  # the child died; its exit is reported as usual
        c.error += data
        if data == b"":
            self.finish_start(pid, c)

    def finish_start(self, pid: int, c: _Child) -> None:
        """The child exec'd (or died trying): answer the request."""
        assert c.err_r is not None
        self.sel.unregister(c.err_r)
        os.close(c.err_r)
        os.close(c.go_w)
        c.err_r = None
        if c.error:
            msg = c.error[1:] if c.error.startswith(b"E") else c.error
            self.send({"id": c.req_id, "error": msg.decode(errors="replace")})
        else:
            c.replied = True
            self.send({"id": c.req_id, "pid": pid}, [c.pidfd])

    def owner_gone(self) -> None:
        """Kill every sandbox we booted that is still alive, then exit.

        Not left to the sandboxes' parent-death signals: root inside can clear pid 1's (by
        ptrace) and keep the sandbox alive past its owner. cgroup.kill reaches every process
        of a sandbox whatever it did.
        """
        for teardown in self.sandboxes.values():
            _kill_sandbox(teardown)
        os._exit(0)

    def reap(self, pid: int) -> None:
        # A booted sandbox's bwrap exits only after its pid 1, so after all of the sandbox.
        self.sandboxes.pop(pid, None)
        c = self.children.pop(pid)
        if c.err_r is not None:  # the child is dead, so its end is closed: read to EOF
            self.children[pid] = c
            while c.err_r is not None:
                self.child_said(pid)
            del self.children[pid]
        _, status = os.waitpid(pid, 0)
        self.sel.unregister(c.pidfd)
        os.close(c.pidfd)
        if c.hold is not None:
            os.close(c.hold)
        if c.replied:
            self.send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the owner decides; EOF ends us
    sock = socket.socket(fileno=int(sys.argv[1]))
    config = json.loads(sys.argv[2])
    _Hardening.setup(bytes.fromhex(config["seccomp"]), config["keyctl"])
    Spawner(sock).run()


if __name__ == "__main__":
    main()
