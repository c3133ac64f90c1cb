"""Throughput and latency of the rollout server over real HTTP, at 1, 64 and 256 in flight.

    python tests/benchmarks/bench_server.py [--seconds 3] [--levels 1,64,256] [--repeat 3]
                                            [--baseline PATH-TO-ANOTHER-CHECKOUT]

This process is the load generator: a raw keep-alive HTTP/1.1 client on uvloop (one
connection per worker); each worker submits a rollout (``POST /rollout``) and long-polls its
result until it is final, then starts the next. Two
servers run as subprocesses, each under uvicorn (uvloop + httptools):

- ``trivial``: speaks the protocol and nothing else (no work, no state). Its rate is the
  ceiling of this generator on this machine; our server cannot be measured above it.
- ``backends``: ``create_rollout_server`` over a LocalBackend with a trivial workflow and
  grader, with durable SQLite state (WAL, synchronous=NORMAL, group commit: 202 only after
  acceptance is committed, a result served only after it is committed). The targets apply here.
- ``backends+files``: the same plus the per-rollout files of the default configuration: an
  artifacts directory (LocalBackend) and a saved ``trajectory.json`` for every rollout.
- ``no-watchdog``: ``backends`` with the event-loop watchdog off (``BACKENDS_LOOP_WATCHDOG=off``):
  the difference in server CPU per rollout is what the watchdog costs.

Prints rollouts/s and p50/p99 latency (submit to final result) per level, CPU time per rollout
of the server process and of the generator (steadier than rates on a shared machine), and the
ratios against the generator's ceiling and against the reference SDK's measured rates.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
LEASE = "X-Osmosis-Rollout-Lease"
KINDS = ("trivial", "backends", "backends+files", "no-watchdog")
REFERENCE = {1: 373.0, 64: 396.0, 256: 353.0}  # osmosis-ai 0.3.8, same exchange (DESIGN.md)


# -- the servers (run as subprocesses of this script) ---------------------------------------


async def trivial_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The protocol and nothing else: accept anything, answer success at once."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    if scope["method"] == "POST":
        while (await receive()).get("more_body"):
            pass
        body = (
            b'{"rollout_id": "x", "status": "queued", "polling_lease_token": "t", '
            b'"result_wait_timeout_sec": 30, "polling_lease_timeout_sec": 120}'
        )
        status = 202
    else:
        body = b'{"rollout_id": "x", "status": "success", "sample": {"reward": 1.0}}'
        status = 200
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def backends_app(state: str, artifacts: str | None) -> Any:
    from backends import AgentWorkflow, Grader, LocalBackend
    from backends.rollout.config import AgentWorkflowConfig, ConcurrencyConfig
    from backends.server import create_rollout_server

    class Echo(AgentWorkflow[Any]):
        async def run(self, ctx: Any) -> Any:
            return [*ctx.prompt, {"role": "assistant", "content": "42"}]

    class Exact(Grader):
        async def grade(self, ctx: Any) -> None:
            ctx.set_reward(1.0 if ctx.sample.messages[-1]["content"] == ctx.label else 0.0)

    backend = LocalBackend(
        workflow=Echo,
        workflow_config=AgentWorkflowConfig(
            name="echo", concurrency=ConcurrencyConfig(max_concurrent=None)
        ),
        grader=Exact,
        artifacts_root=artifacts,
    )
    return create_rollout_server(
        backend=backend, state_file=state, artifacts_root=artifacts, preview_root=None
    )


def serve(kind: str, port: int, workdir: str) -> None:
    from backends.server.cli import serve as run

    if kind == "trivial":
        app: Any = trivial_app
    elif kind == "backends":
        app = backends_app(f"{workdir}/state.sqlite3", None)
    elif kind == "no-watchdog":
        os.environ["BACKENDS_LOOP_WATCHDOG"] = "off"  # read when backends is imported
        app = backends_app(f"{workdir}/no-watchdog-state.sqlite3", None)
    else:
        app = backends_app(f"{workdir}/files-state.sqlite3", f"{workdir}/rollouts")
    run(app, host="127.0.0.1", port=port, log_level="warning")


# -- the load generator --------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux), to compare costs under a noisy machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection, one request at a time: all a load generator needs.

    A general client (aiohttp) spends about 250 us of CPU per request here, which capped the
    generator near the rates it was meant to measure; this one writes pre-built requests and
    reads responses framed by ``content-length`` (every server here sends it).
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.start = 0
        self.end = -1  # where the response being read ends, once its head is parsed
        self.status = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.waiter is not None:
            self._parse()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc or ConnectionError("the server closed the connection"))

    def _parse(self) -> None:
        buf = self.buf
        if self.end < 0:
            head_end = buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = bytes(buf[:head_end]).lower()
            self.status = int(head[9:12])
            at = head.find(b"content-length:") + 15
            if at < 15:
                raise RuntimeError("a response without content-length")
            stop = head.find(b"\r\n", at)
            self.start = head_end + 4
            self.end = self.start + int(head[at : stop if stop >= 0 else None])
        if len(buf) >= self.end:
            body = bytes(buf[self.start : self.end])
            del buf[: self.end]
            self.end = -1
            waiter, self.waiter = self.waiter, None
            assert waiter is not None
            waiter.set_result((self.status, body))

    def request(self, raw: bytes) -> asyncio.Future[tuple[int, bytes]]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        if self.buf:
            self._parse()
        return self.waiter


async def drive(url: str, in_flight: int, seconds: float, tag: str, pid: int) -> dict[str, float]:
    """Run ``in_flight`` workers, each on its own keep-alive connection, for ``seconds``."""
    loop = asyncio.get_running_loop()
    host, port = url.removeprefix("http://").split(":")
    latencies: list[float] = []
    errors = 0
    body_head = (
        b'{"initial_messages": [{"role": "user", "content": "What is 6 * 7?"}], "label": "42", '
        b'"chat_completions_url": "http://127.0.0.1:9/v1/chat/completions", "rollout_id": "'
    )
    post_head = b"POST /rollout HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n" % (
        host.encode()
    )
    get_head = f"\r\nhost: {host}\r\n{LEASE}: ".encode()
    stop_at = 0.0
    counting = False
    loads = json.loads
    perf = time.perf_counter
    connections = [
        (await loop.create_connection(_Connection, host, int(port)))[1] for _ in range(in_flight)
    ]

    async def worker(conn: _Connection, w: int) -> None:
        nonlocal errors
        n = 0
        while perf() < stop_at:
            n += 1
            rid = f"{tag}-{w}-{n}".encode()
            started = perf()
            body = body_head + rid + b'"}'
            status, raw = await conn.request(
                post_head + b"content-length: %d\r\n\r\n" % len(body) + body
            )
            if status != 202:
                errors += 1
                continue
            poll = (
                b"GET /rollout/" + rid + b"/result HTTP/1.1" + get_head
                + loads(raw)["polling_lease_token"].encode() + b"\r\n\r\n"
            )  # fmt: skip
            while True:
                status, raw = await conn.request(poll)
                state = loads(raw)["status"]
                if state in ("success", "failure", "cancelled"):
                    break
            if state != "success":
                errors += 1
            if counting:
                latencies.append(perf() - started)

    try:
        # Warm up (connections, code paths), then measure a fixed window.
        stop_at = perf() + 0.5
        await asyncio.gather(*(worker(c, w) for w, c in enumerate(connections)))
        counting = True
        server_cpu, own_cpu = cpu_seconds(pid), time.process_time()
        started = perf()
        stop_at = started + seconds
        await asyncio.gather(*(worker(c, w + 10_000) for w, c in enumerate(connections)))
        elapsed = perf() - started
        server_cpu, own_cpu = cpu_seconds(pid) - server_cpu, time.process_time() - own_cpu
    finally:
        for conn in connections:
            if conn.transport is not None:
                conn.transport.close()
    latencies.sort()
    return {
        "rate": len(latencies) / elapsed,
        "p50": _pct(latencies, 0.50) * 1000,
        "p99": _pct(latencies, 0.99) * 1000,
        "errors": errors,
        "server_us": server_cpu / max(len(latencies), 1) * 1e6,
        "client_us": own_cpu / max(len(latencies), 1) * 1e6,
    }


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(kind: str, workdir: str, tree: Path = ROOT) -> tuple[subprocess.Popen[bytes], str]:
    """Serve ``kind`` from a subprocess running the code of ``tree`` (this checkout by default)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    script = tree / "tests" / "benchmarks" / "bench_server.py"
    proc = subprocess.Popen(
        [sys.executable, str(script), "--serve", kind, "--port", str(port), "--workdir", workdir],
        env=env,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"http://127.0.0.1:{port}"
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{kind} server did not start")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--levels", default="1,64,256")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; medians are reported")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="another checkout (e.g. a git worktree of an older commit): its backends server "
        "is measured in the same rounds, as 'baseline'",
    )
    parser.add_argument("--serve", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port, args.workdir)
        return

    import uvloop

    levels = [int(x) for x in args.levels.split(",")]
    kinds = [*KINDS, *(["baseline"] if args.baseline else [])]
    print(
        f"rollout server benchmark: {os.cpu_count()} cores, {args.seconds:g} s per level, "
        f"{args.repeat} interleaved rounds (medians below)"
    )
    runs: dict[str, dict[int, list[dict[str, float]]]] = {k: {n: [] for n in levels} for k in kinds}
    with tempfile.TemporaryDirectory(prefix="bench-server-") as workdir:
        servers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
        try:
            for kind in kinds:
                if kind == "baseline":
                    servers[kind] = start("backends", f"{workdir}/baseline", args.baseline)
                else:
                    servers[kind] = start(kind, workdir)
            # Every kind at every level in each round, so a burst of load elsewhere on the
            # machine lands on all of them rather than on one.
            for round_ in range(args.repeat):
                for level in levels:
                    for kind in kinds:
                        proc, url = servers[kind]
                        tag = f"{kind.replace('+', '-')}{level}r{round_}"
                        stats = uvloop.run(drive(url, level, args.seconds, tag, proc.pid))
                        runs[kind][level].append(stats)
                        print(
                            f"  round {round_ + 1} {kind:14s} {level:4d} in flight: "
                            f"{stats['rate']:7.0f} rollouts/s  p50 {stats['p50']:6.2f} ms  "
                            f"p99 {stats['p99']:7.2f} ms  errors {stats['errors']:.0f}  "
                            f"CPU/rollout: server {stats['server_us']:.0f} us, "
                            f"generator {stats['client_us']:.0f} us",
                            flush=True,
                        )
        finally:
            for proc, _ in servers.values():
                stop(proc)
    med = {
        kind: {n: {key: median([r[key] for r in rs]) for key in rs[0]} for n, rs in by.items()}
        for kind, by in runs.items()
    }
    print("\nmedians per kind and level")
    for kind in kinds:
        for level in levels:
            m = med[kind][level]
            print(
                f"  {kind:14s} {level:4d} in flight: {m['rate']:7.0f} rollouts/s  "
                f"p50 {m['p50']:6.2f} ms  p99 {m['p99']:7.2f} ms  CPU/rollout: server "
                f"{m['server_us']:.0f} us, generator {m['client_us']:.0f} us"
            )
    ours, ceiling, files = med["backends"], med["trivial"], med["backends+files"]
    best = max(s["rate"] for s in ours.values())
    print("\nsummary (median rollouts/s)")
    extra = f" {'baseline':>9s} {'ours/base':>9s}" if args.baseline else ""
    print(
        f"  {'in flight':>9s} {'backends':>9s} {'+files':>9s} {'ceiling':>9s} "
        f"{'of ceiling':>10s} {'vs reference':>12s}{extra}"
    )
    for level in levels:
        rate = ours[level]["rate"]
        ref = REFERENCE.get(level)
        vs_ref = f"{rate / ref:11.1f}x" if ref else f"{'-':>12s}"
        row = (
            f"  {level:9d} {rate:9.0f} {files[level]['rate']:9.0f} {ceiling[level]['rate']:9.0f} "
            f"{rate / ceiling[level]['rate']:9.0%} {vs_ref}"
        )
        if args.baseline:
            base = med["baseline"][level]["rate"]
            row += f" {base:9.0f} {rate / base:8.2f}x"
        print(row)
    bare = med["no-watchdog"]
    print("\nevent-loop watchdog cost (backends against no-watchdog, medians)")
    for level in levels:
        cost = ours[level]["server_us"] - bare[level]["server_us"]
        print(
            f"  {level:4d} in flight: server CPU/rollout {ours[level]['server_us']:.0f} vs "
            f"{bare[level]['server_us']:.0f} us ({cost:+.0f} us), rate ratio "
            f"{ours[level]['rate'] / bare[level]['rate']:.2f}x"
        )
    if 64 in ours:
        print(
            f"  target at 64 in flight: >= 1200/s -> {'met' if ours[64]['rate'] >= 1200 else 'MISSED'}"
        )
    if 256 in ours:
        share = ours[256]["rate"] / best
        print(
            f"  256 in flight vs best level: {share:.0%} (target >= 90%) -> "
            f"{'met' if share >= 0.9 else 'MISSED'}"
        )


if __name__ == "__main__":
    main()
