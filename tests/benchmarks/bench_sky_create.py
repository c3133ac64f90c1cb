"""A lone SkyPilot sandbox create with batch creation on and off: how much longer it waits.

    python tests/benchmarks/bench_sky_create.py [--rounds 15]

Over the fake SDK's latency model (``sim://``, in process; create 0.2 s, no jitter, no
failures), one ``SkyPilotSandbox.start`` at a time, alternating batching on (the default
window) and off (``batch_max_size=1``), interleaved rounds; prints the median start time of
each and the difference. Admission jitter is off in both, to see the window alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


async def one(tmp: Path, batching: bool) -> float:
    from backends.sandbox.contract import PROVIDERS

    sky = next(p for p in PROVIDERS if p.name == "skypilot")
    kwargs = {"admission_jitter_sec": 0, **({} if batching else {"batch_max_size": 1})}
    env = sky.make(tmp, kwargs=kwargs)
    t0 = time.perf_counter()
    await env.start(force_build=False)
    took = time.perf_counter() - t0
    await env.stop(delete=True)
    return took


async def main(rounds: int) -> None:
    from sky_sandbox import sim

    sim.configure(sim.LatencyModel(create_sec=0.2, exec_sec=0.01, jitter=0, create_failure_rate=0))
    times: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            for batching in (True, False):
                times[batching].append(await one(Path(tmp) / f"{i}-{batching}", batching))
    on, off = (statistics.median(times[b]) * 1000 for b in (True, False))
    print(
        f"lone create+start, median of {rounds}: batching on {on:.1f} ms, off {off:.1f} ms, "
        f"difference {on - off:+.1f} ms ({on / off:.3f}x)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    os.environ["SKYPILOT_API_SERVER_ENDPOINT"] = "sim://"
    os.environ.setdefault("BACKENDS_HOME", tempfile.mkdtemp(prefix="bench-sky-create-"))
    sys.path.insert(0, str(ROOT / "tests" / "skyfake"))
    import anyio

    anyio.run(main, args.rounds)
