"""The root launcher: turns a root filesystem plus options into a running bubblewrap sandbox.

Why a launcher and not plain `bwrap`: bubblewrap run by root leaves the sandbox as host uid 0
(measured: it reads /etc/shadow). So between fork and exec the launcher

1. joins the sandbox's cgroups (before any fork inside can escape them),
2. unshares a user namespace whose uid/gid map (written from outside by a short-lived helper,
   since a process cannot map a range into its own new namespace) sends in-sandbox root to
   host uid `UID_BASE`: host secrets become unreadable, yet `chown`, `su`, `useradd` work,
3. mounts the copy-on-write overlay inside that namespace's private mount namespace, so the
   mount vanishes with the sandbox even if this process is SIGKILLed,
4. execs bubblewrap for the pid/ipc/uts/net/mount namespaces and the bind mounts.

Commands run inside with `nsenter` into the namespaces of the sandbox's pid 1, after joining
the cgroups the same way. The pre-exec hooks run in the forked child and only make system
calls, which is what makes them safe in a multi-threaded parent.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from backends.sandbox.errors import HostPrerequisiteError, SandboxStartError
from backends.sandbox.settings import UID_BASE, UID_COUNT

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_NOSUID = 2
MS_NODEV = 4

_libc = ctypes.CDLL(None, use_errno=True)
KEEPALIVE = ["/bin/sh", "-c", "echo ready; exec sleep infinity"]


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
    cgroup_procs: Sequence[str]
    network: bool = False  # True: share the host network (network_mode = "public")
    binds: Sequence[Bind] = field(default_factory=list)
    hostname: str = "sandbox"
    stage_dir: Path = Path("/nonexistent")  # where binds are staged before entering the userns


def require_host() -> tuple[str, str]:
    """Return the paths of bwrap and nsenter, or say what to install.

    Raises:
        HostPrerequisiteError: not root, or bubblewrap / util-linux nsenter missing.
    """
    if os.geteuid() != 0:
        raise HostPrerequisiteError(
            "the local sandbox launcher must run as root (it writes uid maps, cgroups and "
            "mounts overlays); run as root or pick another environment type"
        )
    bwrap, nsenter = shutil.which("bwrap"), shutil.which("nsenter")
    if bwrap is None:
        raise HostPrerequisiteError("bubblewrap is not installed: apt-get install -y bubblewrap")
    if nsenter is None:
        raise HostPrerequisiteError("nsenter is missing: apt-get install -y util-linux")
    return bwrap, nsenter


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _join_cgroups(files: Sequence[str]) -> None:
    pid = str(os.getpid()).encode()
    for f in files:
        fd = os.open(f, os.O_WRONLY)
        try:
            os.write(fd, pid)
        finally:
            os.close(fd)


def _map_ids_of(pid: int) -> None:
    line = f"0 {UID_BASE} {UID_COUNT}\n".encode()
    for name in ("uid_map", "gid_map"):
        fd = os.open(f"/proc/{pid}/{name}", os.O_WRONLY)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


MS_BIND = 4096


def staged(spec: BootSpec, index: int) -> Path:
    return spec.stage_dir / str(index)


def prepare_stage(spec: BootSpec) -> None:
    """Create the mount points the binds are staged on (a file for a file or socket)."""
    for i, b in enumerate(spec.binds):
        point = staged(spec, i)
        point.parent.mkdir(parents=True, exist_ok=True)
        if b.source.is_dir():
            point.mkdir()
        else:
            point.touch()


def _boot_child(spec: BootSpec) -> Callable[[], None]:
    """The pre-exec hook of the bwrap process (runs in the forked child)."""
    lower = ":".join(str(p) for p in spec.lowerdirs)
    options = f"lowerdir={lower},upperdir={spec.upper},workdir={spec.work},userxattr".encode()
    merged = str(spec.merged).encode()
    stages = [
        (str(b.source).encode(), str(staged(spec, i)).encode()) for i, b in enumerate(spec.binds)
    ]

    def child() -> None:
        _join_cgroups(spec.cgroup_procs)
        # Still host root, in a private mount namespace: mount the overlay and stage the
        # binds here, so sources the sandbox uid could not traverse (e.g. under /root) work.
        _check(_libc.unshare(CLONE_NEWNS), "unshare mount namespace")
        _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
        _check(_libc.mount(b"overlay", merged, b"overlay", MS_NODEV, options), "mount overlay")
        for source, point in stages:
            _check(_libc.mount(source, point, None, MS_BIND | MS_REC, None), "stage bind")
        ready_r, ready_w = os.pipe()
        helper = os.fork()
        if helper == 0:  # still outside the new user namespace: allowed to write its map
            os.close(ready_w)
            os.read(ready_r, 1)
            try:
                _map_ids_of(os.getppid())
            except OSError:
                os._exit(1)
            os._exit(0)
        os.close(ready_r)
        _check(_libc.unshare(CLONE_NEWUSER), "unshare user namespace")
        os.close(ready_w)  # EOF tells the helper we have unshared
        _, status = os.waitpid(helper, 0)
        if status != 0:
            raise OSError("could not write the sandbox uid map")
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
        os.setgroups([])

    return child


def bwrap_argv(bwrap: str, spec: BootSpec, info_fd: int) -> list[str]:
    argv = [
        bwrap,
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
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
        "--tmpfs",
        "/dev/shm",
    ]
    if not spec.network:
        argv.append("--unshare-net")
    else:
        # The host's resolver config, read-only, so names resolve as on the host.
        for f in ("/etc/resolv.conf", "/etc/hosts"):
            if Path(f).exists():
                argv += ["--ro-bind", f, f]
    for i, b in enumerate(spec.binds):
        argv += ["--ro-bind" if b.read_only else "--bind", str(staged(spec, i)), b.target]
    return [*argv, "--", *KEEPALIVE]


@dataclass
class Booted:
    process: asyncio.subprocess.Process
    init_pid: int  # host pid of the sandbox's pid 1: nsenter's target


async def boot(spec: BootSpec) -> Booted:
    """Start the sandbox and return once its pid 1 runs inside the finished mount tree.

    Raises:
        SandboxStartError: bwrap or the namespace setup failed; the message holds its stderr.
    """
    bwrap, _ = require_host()
    info_r, info_w = os.pipe()
    try:
        proc = await asyncio.create_subprocess_exec(
            *bwrap_argv(bwrap, spec, info_w),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            pass_fds=(info_w,),
            preexec_fn=_boot_child(spec),
        )
    except (OSError, ValueError) as e:
        os.close(info_r)
        raise SandboxStartError(f"could not start bubblewrap: {e}") from e
    finally:
        os.close(info_w)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = await proc.stdout.readline()
        if line.strip() != b"ready":
            await proc.wait()
            err = (await proc.stderr.read()).decode(errors="replace").strip()
            raise SandboxStartError(
                f"sandbox failed to boot (exit {proc.returncode}): {err or 'no output'}"
            )
        info = await asyncio.to_thread(_read_info, info_r)
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await asyncio.shield(proc.wait())
        raise
    finally:
        os.close(info_r)
    return Booted(process=proc, init_pid=int(info["child-pid"]))


def _read_info(fd: int) -> dict[str, int]:
    data = b""
    while True:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
        try:
            return json.loads(data)
        except ValueError:
            continue
    return json.loads(data)


def nsenter_argv(
    nsenter: str, init_pid: int, argv: Sequence[str], *, uid: int, gid: int, cwd: str | None
) -> list[str]:
    cmd = [nsenter, "-t", str(init_pid), "-U", "-m", "-p", "-n", "-i", "-u", "-r"]
    cmd.append(f"--wd={cwd}" if cwd else "-w")
    cmd += ["-S", str(uid), "-G", str(gid), "--", *argv]
    return cmd


def join_cgroups_hook(files: Sequence[str]) -> Callable[[], None]:
    files = list(files)

    def child() -> None:
        _join_cgroups(files)

    return child


def host_id(sandbox_id: int) -> int:
    """The host uid (or gid) a sandbox-side id shows up as."""
    return UID_BASE + sandbox_id


def chown_to_sandbox(path: Path, uid: int = 0, gid: int = 0) -> None:
    os.lchown(path, host_id(uid), host_id(gid))
