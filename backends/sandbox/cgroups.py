"""Per-sandbox cgroups on pure cgroup v2 hosts and on v1/v2 hybrids.

Hosts differ: a pure v2 host has every controller plus `cgroup.kill` in one tree under
/sys/fs/cgroup; a hybrid (like the Firecracker VMs this project is measured on) mounts v1
`memory`, `pids` and `cpu` hierarchies separately while the v2 tree at
/sys/fs/cgroup/unified has no useful controller but does offer `cgroup.kill`. We detect which
files exist instead of assuming a layout, and use `cgroup.kill` wherever a v2 tree exists
because it kills a whole tree atomically, daemons and re-parented children included.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from backends.sandbox.errors import HostPrerequisiteError

CGROUP_ROOT = Path("/sys/fs/cgroup")
GROUP = "backends"  # parent group holding every sandbox, so leftovers are easy to find
CPU_PERIOD_US = 100_000
KILL_WAIT_SEC = 5.0  # how long killed processes may take to leave their cgroup


@dataclass(frozen=True)
class Limits:
    """Resource ceilings for one sandbox; None means no limit."""

    cpus: float | None = None
    memory_mb: int | None = None
    pids: int | None = None


@dataclass(frozen=True)
class Layout:
    """Which cgroup files this host offers."""

    v2_root: Path | None  # a cgroup2 mount (for cgroup.kill, and limits when pure v2)
    v2_controllers: frozenset[str]
    v1: dict[str, Path] = field(default_factory=dict)  # controller -> v1 hierarchy mount

    @property
    def can_kill_tree(self) -> bool:
        return self.v2_root is not None and (self.v2_root / "cgroup.procs").exists()

    def limit_supported(self, controller: str) -> bool:
        return controller in self.v2_controllers or controller in self.v1


def detect(mounts: Path = Path("/proc/self/mounts")) -> Layout:
    """Read the mount table and report the cgroup layout of this host."""
    v2_root: Path | None = None
    v1: dict[str, Path] = {}
    for line in mounts.read_text().splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        mountpoint, fstype, options = Path(parts[1]), parts[2], parts[3].split(",")
        if fstype == "cgroup2" and v2_root is None:
            v2_root = mountpoint
        elif fstype == "cgroup":
            for controller in ("memory", "pids", "cpu"):
                if controller in options:
                    v1.setdefault(controller, mountpoint)
    controllers: frozenset[str] = frozenset()
    if v2_root is not None and (v2_root / "cgroup.controllers").exists():
        controllers = frozenset((v2_root / "cgroup.controllers").read_text().split())
    # A controller bound to a v1 hierarchy cannot be used through v2 at the same time.
    controllers = controllers - set(v1)
    return Layout(v2_root=v2_root, v2_controllers=controllers, v1=v1)


_layout: Layout | None = None


def layout() -> Layout:
    global _layout
    if _layout is None:
        _layout = detect()
    return _layout


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _removed(e: OSError) -> bool:
    """The cgroup this file belongs to is gone (ENOENT) or being removed right now: the
    kernel refuses its files with ENODEV until the directory disappears."""
    return e.errno in (errno.ENOENT, errno.ENODEV)


def _kill_group(group: Path) -> None:
    """Write the group's `cgroup.kill`; a group removed meanwhile has nothing to kill."""
    try:
        _write(group / "cgroup.kill", "1")
    except OSError as e:
        if not _removed(e):
            raise


def _enable_v2_controllers(root: Path, controllers: set[str]) -> None:
    """Delegate the v2 controllers we need down to the `backends` group."""
    wanted = " ".join(f"+{c}" for c in sorted(controllers))
    if not wanted:
        return
    for parent in (root, root / GROUP):
        with contextlib.suppress(OSError):
            _write(parent / "cgroup.subtree_control", wanted)


@dataclass(frozen=True)
class Join:
    """Where a new process goes: born into the v2 group `v2_dir`, then into each v1 group.

    Never by writing `cgroup.procs`: moving a process that way takes a host-wide lock whose
    write side waits for an RCU grace period (measured 10-15 ms a move on a loaded host, on
    every start and exec). The spawner forks the process straight into `v2_dir` (clone3's
    CLONE_INTO_CGROUP), and the still single-threaded child moves itself into each v1 group
    through `tasks` ("0": the calling thread, which the kernel moves without that lock).
    """

    v1_tasks: tuple[str, ...] = ()
    v2_dir: str | None = None


class SandboxCgroup:
    """The cgroups of one sandbox: limits on every hierarchy, one kill switch.

    Processes join as `join()` says (the spawner does it between fork and exec, so nothing
    escapes by forking early). Each `exec` gets a child group in the v2 tree so a timeout
    kills that command's tree and leaves the rest of the sandbox alone.
    """

    def __init__(self, name: str, lay: Layout | None = None) -> None:
        self.name = name
        self.layout = lay or layout()
        self._path = f"/{GROUP}/{name}"  # as /proc/PID/cgroup shows its groups
        self._dirs: list[Path] = []
        self.v2_dir: Path | None = None
        # Plain strings: these run on every start and exec, where pathlib's cost shows.
        self._v2_str: str | None = None
        seen: set[str] = set()
        if self.layout.v2_root is not None:
            self._v2_str = f"{self.layout.v2_root}/{GROUP}/{name}"
            self.v2_dir = Path(self._v2_str)
            self._dirs.append(self.v2_dir)
            seen.add(self._v2_str)
        v1_dirs: list[str] = []
        for mount in self.layout.v1.values():
            d = f"{mount}/{GROUP}/{name}"
            if d not in seen:
                seen.add(d)
                self._dirs.append(Path(d))
            v1_dirs.append(d)
        v1_dirs = list(dict.fromkeys(v1_dirs))
        self._v1_procs = [f"{d}/cgroup.procs" for d in v1_dirs]
        self._v1_tasks = tuple(f"{d}/tasks" for d in v1_dirs)

    def create(self, limits: Limits) -> None:
        """Make the groups and write the limits.

        Raises:
            HostPrerequisiteError: a limit was requested whose controller this host lacks,
                or cgroups cannot be created (not root, read-only cgroupfs).
        """
        lay = self.layout
        for controller, value in (
            ("cpu", limits.cpus),
            ("memory", limits.memory_mb),
            ("pids", limits.pids),
        ):
            if value is not None and not lay.limit_supported(controller):
                raise HostPrerequisiteError(
                    f"the task sets a {controller} limit but this host has no {controller} "
                    "cgroup controller (neither v1 nor v2); refusing to run it unlimited"
                )
        try:
            if lay.v2_root is not None and lay.v2_controllers:
                # The parent group must exist, with the controllers delegated to it, before
                # the sandbox's group is made: only then does the kernel give the new group
                # its limit files (memory.max, cpu.max, pids.max).
                (lay.v2_root / GROUP).mkdir(exist_ok=True)
                _enable_v2_controllers(lay.v2_root, {"cpu", "memory", "pids"} & lay.v2_controllers)
            for d in self._dirs:
                d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise HostPrerequisiteError(f"cannot create cgroup {e.filename}: {e.strerror}") from e
        self._write_limits(limits)
        if self.v2_dir is not None:
            (self.v2_dir / "init").mkdir(exist_ok=True)

    def _controller_dir(self, controller: str) -> Path:
        if controller in self.layout.v1:
            return self.layout.v1[controller] / GROUP / self.name
        assert self.v2_dir is not None
        return self.v2_dir

    def _write_limits(self, limits: Limits) -> None:
        v1 = self.layout.v1
        if limits.memory_mb is not None:
            d, nbytes = self._controller_dir("memory"), limits.memory_mb * 1024 * 1024
            if "memory" in v1:
                _write(d / "memory.limit_in_bytes", str(nbytes))
                # Without swap accounting the file is absent; with it, cap swap too.
                if (d / "memory.memsw.limit_in_bytes").exists():
                    _write(d / "memory.memsw.limit_in_bytes", str(nbytes))
            else:
                _write(d / "memory.max", str(nbytes))
                with contextlib.suppress(OSError):
                    _write(d / "memory.swap.max", "0")
        if limits.pids is not None:
            _write(self._controller_dir("pids") / "pids.max", str(limits.pids))
        if limits.cpus is not None:
            d, quota = self._controller_dir("cpu"), max(1000, int(limits.cpus * CPU_PERIOD_US))
            if "cpu" in v1:
                _write(d / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                _write(d / "cpu.cfs_quota_us", str(quota))
            else:
                _write(d / "cpu.max", f"{quota} {CPU_PERIOD_US}")

    def join(self, sub: str = "init") -> Join:
        """How a new process joins the sandbox: its v1 groups and the v2 child group `sub`."""
        v2 = f"{self._v2_str}/{sub}" if self._v2_str is not None else None
        return Join(self._v1_tasks, v2)

    def teardown_request(self) -> dict[str, object]:
        """How the spawner kills this sandbox if its owner dies (see zygote._kill_sandbox)."""
        v2 = self._v2_str
        return {
            "kill": f"{v2}/cgroup.kill" if v2 is not None and self.layout.can_kill_tree else None,
            "events": f"{v2}/cgroup.events" if v2 is not None else None,
            "procs": list(self._v1_procs),
        }

    def new_exec_group(self, sub: str) -> None:
        if self.v2_dir is not None:
            (self.v2_dir / sub).mkdir(exist_ok=True)

    def drop_exec_group(self, sub: str) -> None:
        """Remove an exec's child group if nothing lives in it any more (daemons may)."""
        if self.v2_dir is not None:
            with contextlib.suppress(OSError):
                (self.v2_dir / sub).rmdir()

    def kill(self, sub: str | None = None, timeout: float = 5.0) -> None:
        """SIGKILL every process of the sandbox (or of one exec group) and wait till gone."""
        target = self.v2_dir / sub if (self.v2_dir is not None and sub) else self.v2_dir
        if target is not None and (target / "cgroup.kill").exists():
            _kill_group(target)
            _wait_empty(target, timeout)
            return
        # No cgroup.kill: signal members until none is left (they cannot fork past pids.max
        # forever, and each round kills everything that exists).
        groups = [target] if target is not None else []
        if sub is None:
            groups += [mount / GROUP / self.name for mount in self.layout.v1.values()]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pids = [p for g in groups for p in _members(g)]
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)

    def start_kill(self) -> bool:
        """SIGKILL the whole sandbox through `cgroup.kill`, without waiting; False: no such file."""
        if self.v2_dir is None or not self.layout.can_kill_tree:
            return False
        _kill_group(self.v2_dir)  # never created: nothing runs in it
        return True

    async def wait_empty(self, limit_sec: float = KILL_WAIT_SEC) -> None:
        """Wait (on the event loop) until no process is left in the sandbox's v2 group."""
        if self.v2_dir is None:
            return
        deadline = time.monotonic() + limit_sec
        delay = 0.0002
        while time.monotonic() < deadline:
            if _empty(self.v2_dir):
                return
            await anyio.sleep(delay)
            delay = min(delay * 2, 0.005)

    def members(self) -> list[int]:
        return [p for d in self._dirs for p in _members(d)]

    def oom_kills(self) -> int:
        """How many of the sandbox's processes the out-of-memory killer has killed (0 when
        the host keeps no count)."""
        if "memory" in self.layout.v1:
            events = self._controller_dir("memory") / "memory.oom_control"
        elif self.v2_dir is not None:
            events = self.v2_dir / "memory.events"  # counts its exec subgroups too
        else:
            return 0
        try:
            lines = events.read_text().splitlines()
        except OSError:
            return 0
        for line in lines:
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
        return 0

    async def kill_all_but(self, keep: Collection[int], limit_sec: float = KILL_WAIT_SEC) -> bool:
        """SIGKILL every process of the sandbox but the pids `keep`; True once they are gone.

        Every v2 exec group goes whole (cgroup.kill: a fork loop cannot outrun it); any other
        member (where there is no cgroup.kill, or one forked by a hijacked pid 1 into its
        group) is signalled through a pidfd, only after checking that the pid it holds is
        still a member, so a number reused by a host process is never hit.
        """
        home = self.v2_dir / "init" if self.v2_dir is not None else None
        deadline = time.monotonic() + limit_sec
        while True:
            left = False
            if self.v2_dir is not None and self.layout.can_kill_tree:
                for group in self.v2_dir.iterdir():
                    if group.is_dir() and group != home and not _empty(group):
                        left = True
                        _kill_group(group)
            for pid in set(self.members()) - set(keep):
                left = True
                self._kill_member(pid)
            if not left:
                return True
            if time.monotonic() > deadline:
                return False
            await anyio.sleep(0.001)

    def _kill_member(self, pid: int) -> None:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return
        try:
            with open(f"/proc/{pid}/cgroup") as f:  # read after the pidfd pinned the process
                ours = any(
                    line.split(":", 2)[-1].rstrip("/") == self._path
                    or line.split(":", 2)[-1].startswith(self._path + "/")
                    for line in f.read().splitlines()
                )
            if ours:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass  # gone meanwhile
        finally:
            os.close(pidfd)

    def remove(self) -> None:
        """Kill what is left, then remove the groups (children first)."""
        self.kill()
        for d in self._dirs:
            _rmtree_cgroup(d)


def _members(group: Path) -> list[int]:
    pids: list[int] = []
    for procs in [group / "cgroup.procs", *group.glob("*/cgroup.procs")]:
        try:  # an exec's group may be removed while we list (it had no member then)
            pids.extend(int(x) for x in procs.read_text().split())
        except OSError as e:
            if not _removed(e):
                raise
    return pids


def _empty(group: Path) -> bool:
    """No process left in the v2 group or below it (a removed group counts as empty)."""
    try:
        return "populated 0" in (group / "cgroup.events").read_text()
    except OSError as e:
        if _removed(e):
            return True
        raise


def _wait_empty(group: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not _empty(group):
        time.sleep(0.001)


def _rmtree_cgroup(d: Path, attempts: int = 200) -> None:
    try:
        children = [c for c in d.iterdir() if c.is_dir()]
    except FileNotFoundError:  # gone already: another process reaping the same orphan
        return
    for child in children:
        _rmtree_cgroup(child, attempts)
    for _ in range(attempts):
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.005)  # killed processes are still being reaped


def stale_groups() -> list[str]:
    """Names of sandbox groups present on this host (for the leak collector)."""
    lay = layout()
    names: set[str] = set()
    roots = [m / GROUP for m in lay.v1.values()]
    if lay.v2_root is not None:
        roots.append(lay.v2_root / GROUP)
    for r in roots:
        if r.is_dir():
            names.update(c.name for c in r.iterdir() if c.is_dir())
    return sorted(names)
