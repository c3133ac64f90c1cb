"""The main job's wall time, as a user meets it: `backends run` with no options.

Run as root: `python tests/benchmarks/bench_main_job.py [rounds] [--cold]` (default 3 rounds).
Each round runs, interleaved, the command line as a subprocess:

* `backends run` (the main job: the example workflow inside local sandboxes, HarborBackend
  template mode, from a rollout bundle, behind the relay and the scripted policy), warm: the
  bundle and its installed environment already in the cache;
* `backends run --backend local` (the same rollouts in process): the baseline.

`--cold` first runs the main job once on an empty cache (a new `BACKENDS_CACHE` holding only
hard links to the base rootfs, which `make setup` builds): the bundle is resolved, its wheels
downloaded, and installed in a sandbox before the first rollout. Prints each wall time, the
medians, the warm ratio against the baseline, and where the main job's time went (backend
start, then the rollouts).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = [sys.executable, "-m", "backends.cli", "run"]


def run_once(args: list[str], home: Path, cache: Path | None = None) -> dict[str, float]:
    env = {**os.environ, "BACKENDS_HOME": str(home)}
    if cache is not None:
        env["BACKENDS_CACHE"] = str(cache)
    run_dir = home / f"run-{time.monotonic_ns()}"
    started = time.monotonic()
    proc = subprocess.run(
        [*BACKENDS, *args, "-o", str(run_dir)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"{args} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    manifest = json.loads((run_dir / "run.json").read_text())
    records = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]
    session = manifest["sessions"][0]
    first = min(r["started_at"] for r in records)
    return {
        "wall": wall,
        "start": first - session["started_at"],
        "rollouts": max(r["finished_at"] for r in records) - first,
    }


def show(name: str, runs: list[dict[str, float]]) -> float:
    walls = [r["wall"] for r in runs]
    median = statistics.median(walls)
    print(
        f"{name:<28} wall p50 {median:7.1f} s  (each {', '.join(f'{w:.1f}' for w in walls)}); "
        f"backend start p50 {statistics.median(r['start'] for r in runs):.1f} s, "
        f"rollouts p50 {statistics.median(r['rollouts'] for r in runs):.1f} s"
    )
    return median


def main() -> None:
    rounds = int(next((a for a in sys.argv[1:] if a.isdigit()), "3"))
    with tempfile.TemporaryDirectory(prefix="bench-main-job-") as scratch:
        home = Path(scratch)
        if "--cold" in sys.argv:
            cache = home / "cache"
            cache.mkdir()
            rootfs = Path(os.environ.get("BACKENDS_CACHE", "/var/cache/backends")) / "rootfs"
            subprocess.run(["cp", "-al", str(rootfs), str(cache / "rootfs")], check=True)
            show("main job, cold cache", [run_once([], home, cache)])
            shutil.rmtree(cache, ignore_errors=True)
        run_once([], home)  # warm the default cache once (bundle, environment)
        harbor, local = [], []
        for _ in range(rounds):
            harbor.append(run_once([], home))
            local.append(run_once(["--backend", "local"], home))
        warm = show("main job, warm cache", harbor)
        base = show("--backend local (baseline)", local)
        print(f"ratio main job / local: {warm / base:.2f}x (load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
