"""Thousands of rollouts in flight through the rollout server and HarborBackend on SkyPilot.

    python tests/benchmarks/bench_scale.py [--levels 1000,5000,10000] [--baseline CHECKOUT]

One orchestrator process (a subprocess of this script) serves ``create_rollout_server`` over a
``HarborBackend`` (template mode, Harbor's ``nop`` agent, the template's tests as verifier,
``environment="skypilot"``) on the fake Sandbox SDK's latency model (``sky_sandbox.sim``:
create ~1 s, exec ~50 ms, 3% of creates failing transiently; commands are not executed, the
verifier's reward file is modelled). This process submits every rollout of a level at once
over HTTP, then collects every result, and prints per level:

- loop lag p50/p99: how late a 10 ms timer in the orchestrator's event loop fires;
- peak memory per in-flight rollout: (peak RSS - RSS before the burst) / peak in flight;
- rollouts/s from the first submission to the last result;
- lost rollouts (submitted, with no final result; must be 0), failures by category, and the
  create retries the backend counted; threads and file descriptors at the peak.

With ``--baseline`` another checkout's orchestrator runs the same levels in the same run,
interleaved, for a side-by-side ratio. With ``--batching`` this checkout runs each level twice,
interleaved: with batch creation (``create(num_sandboxes=N)``, the default) and without
(``batch_max_size=1``), and the create calls each made are printed beside the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
from bench_server import _Connection, free_port, stop  # noqa: E402

LEASE = "X-Osmosis-Rollout-Lease"

TEST_SH = """#!/bin/bash
echo 1 > /logs/verifier/reward.txt
"""


def write_template(root: Path) -> Path:
    task = root / "template"
    for sub in ("environment", "tests"):
        (task / sub).mkdir(parents=True, exist_ok=True)
    (task / "environment" / "README.md").write_text("prebuilt image\n")
    (task / "tests" / "test.sh").write_text(TEST_SH)
    (task / "instruction.md").write_text("Answer.\n")
    (task / "task.toml").write_text(
        'schema_version = "1.4"\n[agent]\ntimeout_sec = 600\n[verifier]\ntimeout_sec = 600\n'
        '[environment]\ndocker_image = "ubuntu:24.04"\n'
    )
    return task


# -- the orchestrator (a subprocess) ---------------------------------------------------------


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Probe:
    """Loop lag, peak RSS, peak in flight, threads and fds, sampled in the serving loop."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.reset()

    def reset(self) -> None:
        gc.collect()
        if os.environ.get("BENCH_GC_FREEZE"):
            gc.freeze()
        self.base_objects = len(gc.get_objects())
        self.lags: list[float] = []
        self.base_rss = rss_bytes()
        self.peak_rss = self.base_rss
        self.peak_in_flight = 0
        self.peak_threads = 0
        self.peak_fds = 0
        self.cpu = time.process_time()
        self.gc_pauses: list[float] = []  # full (generation 2) collections, seconds each
        self.gc_sec = 0.0  # every collection
        self._gc_start = 0.0
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
            return
        pause = time.perf_counter() - self._gc_start
        self.gc_sec += pause
        if info["generation"] == 2:
            self.gc_pauses.append(pause)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        tick = 0
        while True:
            t = loop.time()
            await asyncio.sleep(0.01)
            self.lags.append(loop.time() - t - 0.01)
            tick += 1
            if tick % 10 == 0:
                self.peak_rss = max(self.peak_rss, rss_bytes())
                flying = self.backend.health()["in_flight"]
                if flying >= self.peak_in_flight:
                    self.peak_in_flight = flying
                    import threading

                    self.peak_threads = max(self.peak_threads, threading.active_count())
                    self.peak_fds = max(self.peak_fds, len(os.listdir("/proc/self/fd")))

    def stats(self) -> dict[str, Any]:
        if os.environ.get("BENCH_GC_TYPES"):
            import collections

            kinds = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
            print("gc-tracked objects by type:", kinds.most_common(40), flush=True)
        lags = sorted(self.lags) or [0.0]
        return {
            "lag_p50_ms": lags[len(lags) // 2] * 1000,
            "lag_p99_ms": lags[min(len(lags) - 1, int(len(lags) * 0.99))] * 1000,
            "lag_max_ms": lags[-1] * 1000,
            "base_rss": self.base_rss,
            "peak_rss": self.peak_rss,
            "peak_in_flight": self.peak_in_flight,
            "peak_threads": self.peak_threads,
            "peak_fds": self.peak_fds,
            "cpu_sec": time.process_time() - self.cpu,
            "gc_sec": self.gc_sec,
            "objects": (len(gc.get_objects()), self.base_objects, gc.get_freeze_count()),
            "gc_full": len(self.gc_pauses),
            "gc_full_max_ms": max(self.gc_pauses, default=0.0) * 1000,
            "sim": _sim_counters(),
            "create_retries": _create_retries(),
        }


def _create_retries() -> int:
    from backends.sandbox import skyruns

    return skyruns.counters["create_retries"]


def _sim_counters() -> dict[str, int]:
    from sky_sandbox import sim

    return dict(vars(sim.engine().counters))


def serve(port: int, workdir: str, max_concurrent: int, batch_max_size: int) -> None:
    os.environ["SKYPILOT_API_SERVER_ENDPOINT"] = "sim://"
    os.environ["BACKENDS_HOME"] = workdir
    sys.path.insert(0, str(ROOT / "tests" / "skyfake"))
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    from harbor.models.trial.config import EnvironmentConfig

    from backends import HarborBackend
    from backends.server import create_rollout_server
    from backends.server.cli import serve as run

    backend = HarborBackend(
        tasks_dir=write_template(Path(workdir)),
        agent="nop",
        environment="skypilot",
        environment_config=EnvironmentConfig(
            kwargs={
                "max_concurrent_creates": 2048,
                **({"batch_max_size": batch_max_size} if batch_max_size else {}),
            }
        ),
        trials_dir=f"{workdir}/trials",
        artifacts=f"{workdir}/rollouts",
        max_concurrent=max_concurrent or None,
    )
    server = create_rollout_server(
        backend=backend,
        state_file=f"{workdir}/state.sqlite3",
        preview_root=None,
        polling_lease_timeout_sec=3600,  # results are collected one connection at a time
    )
    probe = Probe(backend)
    started: list[asyncio.Task[None]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/bench/"):
            if not started:
                started.append(asyncio.ensure_future(probe.run()))
            if scope["path"] == "/bench/reset":
                probe.reset()
            body = json.dumps(probe.stats()).encode()
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(body)),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await server(scope, receive, send)

    run(app, host="127.0.0.1", port=port, log_level="warning")


def start(
    workdir: str, tree: Path, max_concurrent: int, batch_max_size: int = 0
) -> tuple[subprocess.Popen[bytes], str]:
    import socket

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    script = ROOT / "tests" / "benchmarks" / "bench_scale.py"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(script),
            "--serve",
            "--port",
            str(port),
            "--workdir",
            workdir,
            "--max-concurrent",
            str(max_concurrent),
            *(["--batch-max-size", str(batch_max_size)] if batch_max_size else []),
        ],
        env=env,
        cwd=tree,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"http://127.0.0.1:{port}"
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the orchestrator did not start")


# -- the load generator ----------------------------------------------------------------------


async def level(url: str, n: int, window: float, connections: int = 64) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    host, port = url.removeprefix("http://").split(":")
    conns = [
        (await loop.create_connection(_Connection, host, int(port)))[1] for _ in range(connections)
    ]

    async def control(path: str, body: bytes = b"") -> Any:
        """Stats and cancel on a connection of their own (a worker's may be mid-request)."""
        conn = (await loop.create_connection(_Connection, host, int(port)))[1]
        try:
            return (await call(conn, "POST" if body else "GET", path, body))[1]
        finally:
            conn.transport.close()  # type: ignore[union-attr]

    async def call(
        conn: _Connection, method: str, path: str, body: bytes = b"", lease: str = ""
    ) -> tuple[int, Any]:
        head = f"{method} {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        if lease:
            head += f"{LEASE}: {lease}\r\n"
        status, raw = await conn.request(
            head.encode() + b"content-length: %d\r\n\r\n" % len(body) + body
        )
        return status, json.loads(raw) if raw else None

    await control("/bench/reset")
    await control("/bench/reset")  # the probe runs from the first call on
    tag = f"s{n}-{int(time.time())}"
    ids = [f"{tag}-{i}" for i in range(n)]
    leases: dict[str, str] = {}
    refused: list[str] = []
    t0 = time.perf_counter()

    async def submit(w: int) -> None:
        for rid in ids[w::connections]:
            body = json.dumps(
                {
                    "rollout_id": rid,
                    "initial_messages": [{"role": "user", "content": "Answer."}],
                    "chat_completions_url": "http://127.0.0.1:9/v1/chat/completions",
                }
            ).encode()
            status, reply = await call(conns[w], "POST", "/rollout", body)
            if status == 202:
                leases[rid] = reply["polling_lease_token"]
            elif not refused:
                refused.append(f"{status} {reply}")

    await asyncio.gather(*(submit(w) for w in range(connections)))
    submitted = time.perf_counter() - t0
    if refused:
        print(f"  {n - len(leases)} submissions refused, the first: {refused[0][:300]}")
    results: dict[str, dict[str, Any]] = {}

    async def collect(w: int) -> None:
        for rid in [r for r in ids[w::connections] if r in leases]:
            while True:
                _, reply = await call(conns[w], "GET", f"/rollout/{rid}/result", lease=leases[rid])
                if reply and reply.get("status") in ("success", "failure", "cancelled"):
                    results[rid] = reply
                    break

    # Hold them all in flight for the window (or until they are done), measure, then cancel
    # what is left and account for every rollout.
    collecting = asyncio.gather(*(collect(w) for w in range(connections)))
    done, _ = await asyncio.wait([collecting], timeout=max(0.0, window - submitted))
    elapsed = time.perf_counter() - t0
    finished = len(results)
    stats = await control("/bench/stats")
    if not done:
        await control("/rollout/cancel", b'{"all": true}')
        await collecting
    for conn in conns:
        conn.transport.close()  # type: ignore[union-attr]
    failures: dict[str, int] = {}
    for reply in results.values():
        if reply["status"] != "success":
            category = (reply.get("failure") or {}).get("category", reply["status"])
            failures[category] = failures.get(category, 0) + 1
    flying = max(stats["peak_in_flight"], 1)
    return {
        "n": n,
        "accepted": len(leases),
        "lost": n - len(results),
        "success": sum(r["status"] == "success" for r in results.values()),
        "failures": failures,
        "retries": stats["create_retries"],
        "submit_sec": submitted,
        "rate": finished / elapsed,
        "finished": finished,
        "window": elapsed,
        "kb_per_rollout": (stats["peak_rss"] - stats["base_rss"]) / flying / 1024,
        "cpu_ms": stats["cpu_sec"] / max(finished, 1) * 1000,
        **stats,
    }


def report(kind: str, r: dict[str, Any]) -> None:
    print(
        f"{kind:>9} {r['n']:>6} in flight (peak {r['peak_in_flight']:>6}): "
        f"lag p50 {r['lag_p50_ms']:6.1f} ms p99 {r['lag_p99_ms']:7.1f} ms | "
        f"{r['kb_per_rollout']:6.1f} KB/rollout | {r['rate']:6.1f} rollouts/s "
        f"({r['cpu_ms']:.0f} ms CPU each) | "
        f"lost {r['lost']} | {r['finished']} finished in {r['window']:.0f} s, ok {r['success']}, "
        f"not ok {r['failures']} | "
        f"create calls {r['sim']['creates']} for {r['sim'].get('sandboxes', '?')} sandboxes, "
        f"retries {r['retries']} (sim failures {r['sim']['create_failures']}) | "
        f"threads {r['peak_threads']} fds {r['peak_fds']} | "
        f"gc {r.get('gc_sec', 0):.1f} s, {r.get('gc_full', 0)} full (max "
        f"{r.get('gc_full_max_ms', 0):.0f} ms) objects {r.get('objects')}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="1000,5000,10000")
    parser.add_argument("--window", type=float, default=60.0, help="seconds to hold a level")
    parser.add_argument(
        "--max-concurrent",
        type=int,
        default=0,
        help="HarborBackend's running-trial bound (0: none)",
    )
    parser.add_argument("--baseline", type=Path, help="another checkout, run in the same rounds")
    parser.add_argument(
        "--batching",
        action="store_true",
        help="compare batch creation on and off (this checkout), in the same rounds",
    )
    parser.add_argument("--batch-max-size", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.port, args.workdir, args.max_concurrent, args.batch_max_size)
        return
    import uvloop

    # kind -> (checkout, batch_max_size; 0: the default)
    runs: dict[str, tuple[Path, int]] = {"this": (ROOT, 0)}
    if args.baseline:
        runs["baseline"] = (args.baseline.resolve(), 0)
    if args.batching:
        runs = {"batched": (ROOT, 0), "unbatched": (ROOT, 1)}
    print(f"scale benchmark: {os.cpu_count()} cores; fake SkyPilot latency model (sim://)")
    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in runs}
    for n in [int(x) for x in args.levels.split(",")]:
        for kind, (tree, batch_max_size) in runs.items():
            with tempfile.TemporaryDirectory(prefix="bench-scale-") as workdir:
                proc, url = start(workdir, tree, args.max_concurrent, batch_max_size)
                try:
                    r = uvloop.run(level(url, n, args.window))
                finally:
                    stop(proc)
            rows[kind].append(r)
            report(kind, r)
    if len(runs) == 2:
        first, second = rows.values()
        for this, base in zip(first, second, strict=True):
            print(
                f"ratio {'/'.join(runs)} at {this['n']}: "
                f"rollouts/s {this['rate'] / base['rate']:.2f}x, "
                f"create calls {this['sim']['creates'] / max(base['sim']['creates'], 1):.2f}x, "
                f"CPU per rollout {this['cpu_ms'] / max(base['cpu_ms'], 1e-9):.2f}x, "
                f"KB/rollout {this['kb_per_rollout'] / max(base['kb_per_rollout'], 1e-9):.2f}x, "
                f"lag p99 {this['lag_p99_ms'] / max(base['lag_p99_ms'], 1e-9):.2f}x"
            )


if __name__ == "__main__":
    main()
