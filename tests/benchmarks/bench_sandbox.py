"""Sandbox cycle benchmark: LocalSandbox create -> exec `true` -> stop, against bare bwrap.

Run as root: `python tests/benchmarks/bench_sandbox.py [cycles]` (default 60). Both loops
alternate in one run so machine noise hits them alike; the ratio of p50s is the figure of
merit (target: within 3x of bare bwrap). A third loop adds a disk limit (storage_mb, as most
Harbor tasks set). Then sandboxes per second with 16 in flight, and what each hardening step
costs: the system calls of each (timed where they run, in a fresh forked child) and a file
transfer by the host against one by `tar` over the capped pipe.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from backends.sandbox import seccomp, uids
from backends.sandbox.contract import PROVIDERS

LOCAL = PROVIDERS[0]
BARE = [
    "bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--ro-bind", "/", "/",
    "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "true",
]  # fmt: skip


async def bare_cycle() -> None:
    proc = await asyncio.create_subprocess_exec(*BARE)
    assert await proc.wait() == 0


PHASES: dict[str, list[float]] = {"start": [], "exec": [], "stop": []}
DISK_PHASES: dict[str, list[float]] = {"start": [], "exec": [], "stop": []}
DISK_MB = 10240  # a typical Harbor task's storage_mb


async def sandbox_cycle(
    tmp: Path, phases: dict[str, list[float]] | None = None, storage_mb: int | None = None
) -> None:
    env = LOCAL.make(tmp, storage_mb=storage_mb)
    t0 = time.perf_counter()
    await env.start(force_build=False)
    t1 = time.perf_counter()
    try:
        res = await env.exec("true")
        assert res.return_code == 0, res
    finally:
        t2 = time.perf_counter()
        await env.stop(delete=True)
        t3 = time.perf_counter()
    if phases is not None:
        for name, a, b in (("start", t0, t1), ("exec", t1, t2), ("stop", t2, t3)):
            phases[name].append((b - a) * 1000)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def main(cycles: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        await sandbox_cycle(tmp)  # builds/loads the base rootfs and warms caches
        await sandbox_cycle(tmp, storage_mb=DISK_MB)
        bare: list[float] = []
        ours: list[float] = []
        disk: list[float] = []
        loops = (
            (bare_cycle, bare),
            (lambda: sandbox_cycle(tmp, PHASES), ours),
            (lambda: sandbox_cycle(tmp, DISK_PHASES, storage_mb=DISK_MB), disk),
        )
        for _ in range(cycles):
            for fn, sink in loops:
                t0 = time.perf_counter()
                await fn()
                sink.append((time.perf_counter() - t0) * 1000)
        print(f"cycles: {cycles} each, interleaved")
        for name, xs, phases in (
            ("bare bwrap true", bare, None),
            ("LocalSandbox create+exec+stop", ours, PHASES),
            (f"  same, storage_mb={DISK_MB}", disk, DISK_PHASES),
        ):
            print(f"  {name:32s} p50 {pct(xs, 0.5):7.2f} ms   p99 {pct(xs, 0.99):7.2f} ms")
            if phases:
                split = ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in phases.items())
                print(f"  {'':32s} p50 per phase (ms): {split}")
        ratio = statistics.median(ours) / statistics.median(bare)
        print(f"  ratio p50 LocalSandbox / bare bwrap: {ratio:.2f}x (target <= 3x)")
        ratio = statistics.median(disk) / statistics.median(bare)
        print(f"  ratio p50 with a disk limit / bare bwrap: {ratio:.2f}x")

        total, width = 96, 16
        limiter = anyio.CapacityLimiter(width)

        async def one() -> None:
            async with limiter:
                await sandbox_cycle(tmp)

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(total):
                tg.start_soon(one)
        elapsed = time.perf_counter() - t0
        print(
            f"  parallel: {total} sandboxes, {width} in flight: {total / elapsed:.1f} sandboxes/s"
        )

        hardening_steps(cycles)
        await transfer_costs(tmp, cycles)


def in_child(step: Callable[[], object], setup: Callable[[], object] | None = None) -> float:
    """Microseconds `step()` takes in a freshly forked child (one-shot calls run for real),
    after an untimed `setup()` there."""
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # threads of anyio: not touched
        pid = os.fork()
    if pid == 0:
        try:
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            step()
            os.write(w, repr(time.perf_counter() - t0).encode())
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    elapsed = float(os.read(r, 64) or b"nan")
    os.close(r)
    os.close(w)
    return elapsed * 1e6


def hardening_steps(n: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    program = seccomp.program()
    buf = ctypes.create_string_buffer(program, len(program))

    class SockFprog(ctypes.Structure):
        _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))

    fprog = SockFprog(len(program) // 8, ctypes.addressof(buf))
    keyctl = seccomp.syscall_number("keyctl")

    def seccomp_load() -> None:
        assert libc.prctl(38, 1, 0, 0, 0) == 0  # no_new_privs, as for every command
        assert libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0

    def lease() -> None:
        uids.lease().release()

    # setsid runs once the command is in its sandbox's cpu group (in the host's root group
    # it would also make a scheduler autogroup): timed in a group like that.
    cpu_group = Path(f"/sys/fs/cgroup/cpu/backends-bench-{os.getpid()}")
    join_cpu_group = None
    if cpu_group.parent.is_dir():
        cpu_group.mkdir()
        join_cpu_group = lambda: (cpu_group / "tasks").write_text("0")  # noqa: E731
    steps: dict[str, tuple[Callable[[], object], Callable[[], object] | None]] = {
        f"seccomp filter ({len(program) // 8} BPF insns), per command": (seccomp_load, None),
        "setsid (new session, no tty), per command": (os.setsid, join_cpu_group),
        "own keyring, per command": (lambda: libc.syscall(keyctl, 1, None, 0, 0, 0), None),
        "uid range lease + release, per sandbox": (lease, None),
    }
    costs: dict[str, list[float]] = {name: [] for name in steps}
    try:
        for _ in range(n):
            for name, (step, setup) in steps.items():
                costs[name].append(in_child(step, setup))
    finally:
        if join_cpu_group is not None:
            cpu_group.rmdir()
    print(f"hardening steps: median of {n}, each in a fresh forked child")
    for name, xs in costs.items():
        print(f"  {name:52s} {statistics.median(xs):7.1f} us")


async def transfer_costs(tmp: Path, n: int) -> None:
    env = LOCAL.make(tmp)
    tar = LOCAL.make(tmp, kwargs={"host_transfers": False})
    src = tmp / "upload"
    src.mkdir(exist_ok=True)
    (src / "test.sh").write_text("#!/bin/sh\necho 1 > /logs/verifier/reward.txt\n")
    ways = {"by the host": env, "by tar, capped pipe": tar}
    moves: dict[str, list[float]] = {
        f"{op} {way}": [] for op in ("upload", "download") for way in ways
    }
    for sandbox in ways.values():
        await sandbox.start(force_build=False)
    try:
        for i in range(n):
            for way, sandbox in ways.items():
                t0 = time.perf_counter()
                await sandbox.upload_dir(src, "/tests")
                t1 = time.perf_counter()
                await sandbox.download_dir("/tests", tmp / f"down-{way[:4]}-{i}")
                t2 = time.perf_counter()
                moves[f"upload {way}"].append((t1 - t0) * 1000)
                moves[f"download {way}"].append((t2 - t1) * 1000)
    finally:
        for sandbox in ways.values():
            await sandbox.stop(delete=True)
    print(f"file transfers (a one-file directory): median of {n}, interleaved")
    for name, xs in moves.items():
        print(f"  {name:52s} {statistics.median(xs):7.2f} ms")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 60))
