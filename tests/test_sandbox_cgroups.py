"""Cgroup layout detection and limits on both kinds of host.

This machine is a v1/v2 hybrid, so the pure cgroup-v2 path (the default on current Debian
and Ubuntu) cannot run against a real kernel here; it is exercised on a directory standing
in for /sys/fs/cgroup, which checks what is written where and in which order. The hybrid
path runs for real in the contract suite.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import uuid
from pathlib import Path

import pytest

from backends.sandbox.cgroups import GROUP, Join, Limits, SandboxCgroup, detect
from backends.sandbox.errors import HostPrerequisiteError

HYBRID = """\
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup /sys/fs/cgroup/pids cgroup rw,relatime,pids 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""


def _pure_v2(tmp_path: Path) -> Path:
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma misc\n")
    (root / "cgroup.procs").write_text("")
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda1 / ext4 rw 0 0\ncgroup2 {root} cgroup2 rw,nsdelegate 0 0\n")
    return mounts


def test_hybrid_layout_uses_v1_controllers_and_v2_for_kill(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(HYBRID)
    lay = detect(mounts)
    assert lay.v2_root == Path("/sys/fs/cgroup/unified")
    assert lay.v1 == {c: Path(f"/sys/fs/cgroup/{c}") for c in ("cpu", "memory", "pids")}
    assert all(lay.limit_supported(c) for c in ("cpu", "memory", "pids"))


def test_pure_v2_delegates_controllers_before_making_the_group(tmp_path: Path) -> None:
    lay = detect(_pure_v2(tmp_path))
    assert lay.v1 == {}
    assert {"cpu", "memory", "pids"} <= lay.v2_controllers
    assert lay.can_kill_tree
    root = lay.v2_root
    assert root is not None

    group = SandboxCgroup("sbx-test", lay)
    group.create(Limits(cpus=1.5, memory_mb=512, pids=64))  # a fresh host: no GROUP dir yet
    # Without +memory etc. in the parent's subtree_control the kernel would not create the
    # limit files in the sandbox group, and the first sandbox on a fresh host would fail.
    for parent in (root, root / GROUP):
        assert (parent / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    box = root / GROUP / "sbx-test"
    assert (box / "memory.max").read_text() == str(512 * 1024 * 1024)
    assert (box / "memory.swap.max").read_text() == "0"
    assert (box / "cpu.max").read_text() == "150000 100000"
    assert (box / "pids.max").read_text() == "64"
    # Processes live in leaf groups only (v2's no-internal-processes rule).
    assert group.join() == Join((), str(box / "init"))
    assert group.join("x0") == Join((), str(box / "x0"))


def test_pure_v2_without_a_controller_refuses_the_limit(tmp_path: Path) -> None:
    mounts = _pure_v2(tmp_path)
    (tmp_path / "cgroup" / "cgroup.controllers").write_text("cpu pids\n")
    group = SandboxCgroup("sbx-nomem", detect(mounts))
    with pytest.raises(HostPrerequisiteError, match=r"memory limit.*refusing to run it unlimited"):
        group.create(Limits(memory_mb=256))


def test_removing_a_group_another_reaper_removed_first_is_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from backends.sandbox import cgroups

    group = tmp_path / "sbx-gone"
    group.mkdir()
    listdir = Path.iterdir

    def raced(self: Path):  # the other reaper wins between our look and our listing
        if self == group:
            self.rmdir()
        return listdir(self)

    monkeypatch.setattr(Path, "iterdir", raced)
    cgroups._rmtree_cgroup(group)
    assert not group.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="real cgroups need root")
def test_reading_a_sandbox_while_its_exec_groups_come_and_go_never_fails() -> None:
    """Every exec makes and removes a child group; reading the sandbox's members meanwhile
    meets groups the kernel is removing, whose files answer ENODEV (CI once failed a module's
    leak check on it). Such a group counts as empty, as one already gone does."""
    group = SandboxCgroup(f"sbx-churn-{uuid.uuid4().hex[:8]}")
    group.create(Limits())
    stop = threading.Event()

    def churn() -> None:
        for i in itertools.count():
            if stop.is_set():
                return
            group.new_exec_group(f"exec-{i}")
            group.drop_exec_group(f"exec-{i}")

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            assert group.members() == []
            group.kill(timeout=0.1)
    finally:
        stop.set()
        worker.join()
        group.remove()
