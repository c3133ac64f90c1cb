"""The report of a 10,000-rollout run: how long it takes to write, how large it is, and how
long headless Chromium takes to show it.

    python tests/benchmarks/bench_report.py [--rollouts 10000] [--rounds 3]

One run directory of ``--rollouts`` rollouts (each with a tool-calling trajectory, one in ten
failed, one in five with an artifact) is written once. Then, in interleaved rounds:

- ``write``: ``write_report(run_dir)`` from scratch (the main page and one page per rollout),
  and ``rewrite``: again with nothing changed (only the main page is written), seconds;
- ``load ours``: Chromium opening report.html until its script has put the first page of rows
  on screen (``performance.now()`` at the script's end, from navigation start);
- ``load naive``: the baseline, the same rows as one static table of every row (what a report
  without paging would be), until a script at the end of its body runs.

Medians are printed, with the page sizes and the ratio naive / ours.
"""

from __future__ import annotations

import argparse
import html
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from backends.report import write_report  # noqa: E402
from backends.rollout.errors import ErrorCategory, Phase  # noqa: E402
from tests.report_support import CHROMIUM, Rollout, make_run  # noqa: E402


def build(run_dir: Path, n: int) -> None:
    rollouts = []
    for i in range(n):
        failure = (ErrorCategory.AGENT_ERROR, Phase.AGENT, f"agent crashed on row {i}")
        rollouts.append(
            Rollout(
                row=i // 4,
                attempt=i % 4,
                reward=float(i % 3 != 0),
                failure=failure if i % 10 == 9 else None,
                prompt=f"What is {i} * 7?",
                artifacts={"reply.txt": f"{i * 7}\n"} if i % 5 == 0 else {},
            )
        )
    make_run(run_dir, rollouts, rows=(n + 3) // 4, attempts=4)


def naive_page(run_dir: Path) -> Path:
    records = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]
    cells = "".join(
        "<tr>"
        + "".join(
            f"<td>{html.escape(str(r.get(k)))}</td>"
            for k in ("rollout_id", "prompt", "status", "reward", "failure", "answer")
        )
        + "</tr>"
        for r in records
    )
    page = run_dir / "naive.html"
    page.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>naive</title></head><body>"
        f"<table>{cells}</table><script>document.body.setAttribute('data-render-ms', "
        "String(Math.round(performance.now())))</script></body></html>"
    )
    return page


def load_ms(page: Path) -> float:
    done = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--virtual-time-budget=30000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    marker = 'data-render-ms="'
    start = done.stdout.index(marker) + len(marker)
    return float(done.stdout[start : done.stdout.index('"', start)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rollouts", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-report-"))
    try:
        run_dir = scratch / "run"
        started = time.perf_counter()
        build(run_dir, args.rollouts)
        print(f"built a run of {args.rollouts} rollouts in {time.perf_counter() - started:.1f} s")
        naive = naive_page(run_dir)
        write, rewrite, ours, base = [], [], [], []
        summary = None
        for _ in range(args.rounds):
            shutil.rmtree(run_dir / "report", ignore_errors=True)
            started = time.perf_counter()
            summary = write_report(run_dir)
            write.append(time.perf_counter() - started)
            started = time.perf_counter()
            write_report(run_dir)
            rewrite.append(time.perf_counter() - started)
            ours.append(load_ms(run_dir / "report.html"))
            base.append(load_ms(naive))
        assert summary is not None
        pages = sum(p.stat().st_size for p in (run_dir / "report").iterdir())
        print(
            f"write_report: from scratch median {statistics.median(write):.2f} s "
            f"({summary.pages} rollout pages, {pages / 1024 / 1024:.1f} MiB in all), "
            f"unchanged rewrite median {statistics.median(rewrite):.2f} s"
        )
        print(
            f"report.html: {summary.bytes / 1024:.0f} KiB; naive table: {naive.stat().st_size / 1024:.0f} KiB"
        )
        print(
            f"Chromium load to first rows: ours median {statistics.median(ours):.0f} ms "
            f"{sorted(ours)}, naive median {statistics.median(base):.0f} ms {sorted(base)}, "
            f"naive/ours {statistics.median(base) / statistics.median(ours):.2f}x"
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
