"""Sandbox cycle benchmark: LocalSandbox create -> exec `true` -> stop, against bare bwrap.

Run as root: `python tests/benchmarks/bench_sandbox.py [cycles]` (default 60). Both loops
alternate in one run so machine noise hits them alike; the ratio of p50s is the figure of
merit (target: within 3x of bare bwrap). A third loop adds a disk limit (storage_mb, as most
Harbor tasks set). Then sandboxes per second with 16 in flight.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

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


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 60))
