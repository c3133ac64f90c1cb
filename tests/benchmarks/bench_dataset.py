"""Peak memory of reading a dataset as ``backends run`` does: streamed, against all at once.

    python tests/benchmarks/bench_dataset.py [--rows 10000,1000000] [--repeat 3]
                                             [--all-at-once-up-to 100000]

Each measurement is a fresh process that reads a JSONL file of arithmetic-style rows and
reports its peak RSS (``ru_maxrss``) and wall time:

- ``streamed``: what the run does, ``count_rows`` (every row checked, none kept) and then
  ``iter_requests``, each request dropped once taken (as ``run_batch`` does when it finishes);
- ``all at once``: ``requests_from_dataset``, every request built before the first rollout
  (what ``backends run`` did before), for sizes up to ``--all-at-once-up-to``.

Rounds are interleaved; medians and the ratio all-at-once / streamed are printed, with the
interpreter's own baseline (a process that imports the package and reads nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def measure(mode: str, path: str) -> None:
    """In the child: read ``path`` as ``mode``; print peak RSS (MiB) and seconds as JSON."""
    from backends.rollout.dataset import count_rows, iter_requests, requests_from_dataset

    started = time.perf_counter()
    rows = 0
    if mode == "streamed":
        rows = count_rows(Path(path))
        for _ in iter_requests(Path(path)):
            pass
    elif mode == "all-at-once":
        rows = len(requests_from_dataset(Path(path)))
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"rows": rows, "peak_mib": peak, "seconds": seconds}))


def child(mode: str, path: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, path],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return dict(json.loads(out.stdout))


def write_rows(path: Path, rows: int) -> None:
    with path.open("w") as f:
        for i in range(rows):
            a, b = i % 997, i % 89
            row = {
                "system_prompt": "You are a careful calculator. Reply with just the number.",
                "user_prompt": f"What is {a} * {b}?",
                "ground_truth": str(a * b),
                "metadata": {"source": "bench", "index": i},
            }
            f.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="10000,1000000")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--all-at-once-up-to", type=int, default=100_000)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        measure(*args.child)
        return
    sizes = [int(n) for n in args.rows.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-dataset-") as tmp:
        files = {}
        for n in sizes:
            files[n] = Path(tmp) / f"rows-{n}.jsonl"
            write_rows(files[n], n)
        print(
            f"dataset benchmark: {os.cpu_count()} cores, {args.repeat} interleaved rounds, "
            f"row size ~{files[sizes[0]].stat().st_size // sizes[0]} bytes"
        )
        results: dict[tuple[str, int], list[dict[str, float]]] = {}
        for round_ in range(args.repeat):
            results.setdefault(("import only", 0), []).append(child("none", str(files[sizes[0]])))
            for n in sizes:
                modes = ["streamed"] + (["all-at-once"] if n <= args.all_at_once_up_to else [])
                for mode in modes:
                    stats = child(mode, str(files[n]))
                    results.setdefault((mode, n), []).append(stats)
                    print(
                        f"  round {round_ + 1} {mode:12s} {n:9d} rows: peak {stats['peak_mib']:7.1f}"
                        f" MiB  {stats['seconds']:6.2f} s",
                        flush=True,
                    )
    med = {
        key: {k: statistics.median(r[k] for r in rs) for k in ("peak_mib", "seconds")}
        for key, rs in results.items()
    }
    base = med[("import only", 0)]["peak_mib"]
    print(f"\nmedians (interpreter + package, reading nothing: {base:.1f} MiB)")
    for n in sizes:
        streamed = med[("streamed", n)]
        line = (
            f"  {n:9d} rows: streamed peak {streamed['peak_mib']:7.1f} MiB "
            f"(+{streamed['peak_mib'] - base:.1f}) in {streamed['seconds']:.2f} s"
        )
        if ("all-at-once", n) in med:
            whole = med[("all-at-once", n)]
            line += (
                f"; all at once {whole['peak_mib']:7.1f} MiB (+{whole['peak_mib'] - base:.1f}) in "
                f"{whole['seconds']:.2f} s; growth ratio "
                f"{(whole['peak_mib'] - base) / max(streamed['peak_mib'] - base, 0.1):.0f}x"
            )
        print(line)


if __name__ == "__main__":
    main()
