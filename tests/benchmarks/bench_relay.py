"""Added latency and throughput of the policy relay, side by side with direct calls.

    python tests/benchmarks/bench_relay.py [--quick]

Three processes, so the relay does not share an event loop with the load: a trivial
OpenAI-compatible upstream (raw asyncio + httptools), the relay (``backends.relay.Relay``, tokens
checked, traces recorded), and this process as the aiohttp load generator. Each measurement runs
direct (load -> upstream) and relayed (load -> relay -> upstream) in alternating blocks in the
same run, so both see the same machine. Reports p50/p99 latency added at 1 in flight
(non-streaming: full response; streaming: time to first body byte) and requests/s at 64 in
flight, checks the targets, and checks that the relay recorded exactly the calls made.

The same question asked in the OpenAI Responses and Anthropic Messages formats (translated to
chat completions by the relay, the answers translated back) is measured in the same
interleaved blocks, so the added latency of each format reads side by side with chat's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve()
UPSTREAM_KEY = "sk-upstream-secret-never-in-a-sandbox"
ROLLOUTS = 64

TARGET_P50_ADDED_MS = 0.5
TARGET_P99_ADDED_MS = 2.0
TARGET_RPS = 2000.0
TARGET_RATIO = 0.60

CHAT_BODY = json.dumps(
    {
        "model": "policy",
        "messages": [{"role": "user", "content": "What is 7 * 6? Answer with just the number."}],
        "max_tokens": 16,
    }
).encode()
STREAM_BODY = json.dumps(
    {
        "model": "policy",
        "messages": [{"role": "user", "content": "What is 7 * 6? Answer with just the number."}],
        "stream": True,
    }
).encode()


QUESTION = "What is 7 * 6? Answer with just the number."
# (format, route, non-streaming body, streaming body): the same call in each format.
WIRES = [
    ("chat", "/chat/completions", CHAT_BODY, STREAM_BODY),
    (
        "responses",
        "/responses",
        json.dumps({"model": "policy", "input": QUESTION, "max_output_tokens": 16}).encode(),
        json.dumps({"model": "policy", "input": QUESTION, "stream": True}).encode(),
    ),
    (
        "messages",
        "/messages",
        json.dumps(
            {
                "model": "policy",
                "max_tokens": 16,
                "messages": [{"role": "user", "content": QUESTION}],
            }
        ).encode(),
        json.dumps(
            {
                "model": "policy",
                "max_tokens": 16,
                "stream": True,
                "messages": [{"role": "user", "content": QUESTION}],
            }
        ).encode(),
    ),
]


# --- the upstream: a trivial OpenAI-compatible responder ------------------------------------


def _completion() -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 0,
            "model": "bench",
            "prompt_token_ids": [1, 2, 3, 4, 5],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "42"},
                    "finish_reason": "stop",
                    "token_ids": [19, 17],
                    "logprobs": {
                        "content": [
                            {"token": "4", "logprob": -0.01, "top_logprobs": []},
                            {"token": "2", "logprob": -0.02, "top_logprobs": []},
                        ]
                    },
                }
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
        }
    ).encode()


def _sse() -> bytes:
    chunks = []
    for delta, finish in (
        ({"role": "assistant"}, None),
        ({"content": "4"}, None),
        ({"content": "2"}, "stop"),
    ):
        chunk = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "bench",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        chunks.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    chunks.append(b"data: [DONE]\n\n")
    # One HTTP chunk per SSE event, as real servers send them.
    return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"


def _http(status: str, content_type: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 "
        + status.encode()
        + b"\r\ncontent-type: "
        + content_type
        + b"\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


COMPLETION_RESPONSE = _http("200 OK", b"application/json", _completion())
MODELS_RESPONSE = _http("200 OK", b"application/json", b'{"object":"list","data":[{"id":"bench"}]}')
STREAM_RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    + _sse()
)


class _Upstream(asyncio.Protocol):
    def __init__(self) -> None:
        import httptools

        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except Exception:
            assert self.transport is not None
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.body)
        self.body = []
        assert self.transport is not None
        if self.url.endswith(b"/models"):
            self.transport.write(MODELS_RESPONSE)
        elif b'"stream": true' in body or b'"stream":true' in body:
            self.transport.write(STREAM_RESPONSE)
        else:
            self.transport.write(COMPLETION_RESPONSE)


async def _upstream_main() -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Upstream, "127.0.0.1", 0, backlog=2048)
    port = server.sockets[0].getsockname()[1]
    print(json.dumps({"port": port}), flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)  # until the parent says stop
    server.close()


# --- the relay process -----------------------------------------------------------------------


async def _relay_main(upstream: str) -> None:
    from backends.relay import Relay

    async with Relay(upstream_url=upstream, upstream_api_key=UPSTREAM_KEY) as relay:
        grants = [relay.register(f"rollout-{i}") for i in range(ROLLOUTS)]
        print(
            json.dumps({"grants": [{"base_url": g.base_url, "token": g.token} for g in grants]}),
            flush=True,
        )
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.readline)
        started = time.perf_counter()
        traces = [relay.end(g.rollout_id) for g in grants]
        build_s = time.perf_counter() - started
        calls = sum(len(t.calls) for t in traces)
        attempts = sum(c.attempts for t in traces for c in t.calls)
        failed = sum(1 for t in traces for c in t.calls if c.status != 200)
        with_ids = sum(1 for t in traces for c in t.calls if c.completion_token_ids)
        print(
            json.dumps(
                {
                    "calls": calls,
                    "attempts": attempts,
                    "failed": failed,
                    "with_token_ids": with_ids,
                    "trace_build_s": build_s,
                }
            ),
            flush=True,
        )


# --- the load generator ----------------------------------------------------------------------


class Target:
    def __init__(
        self,
        name: str,
        urls: list[str],
        tokens: list[str],
        bodies: tuple[bytes, bytes] = (CHAT_BODY, STREAM_BODY),
        end: bytes = b"[DONE]",
    ) -> None:
        self.name = name
        self.urls = urls
        self.bodies = bodies  # non-streaming, streaming
        self.end = end  # what the last streamed event holds
        self.headers = [
            {"authorization": f"Bearer {t}", "content-type": "application/json"} for t in tokens
        ]


async def _one(session: aiohttp.ClientSession, target: Target, i: int, stream: bool) -> float:
    """One call; returns seconds to the full body (or, streaming, to the first body bytes)."""
    k = i % len(target.urls)
    body = target.bodies[1 if stream else 0]
    started = time.perf_counter()
    async with session.post(target.urls[k], data=body, headers=target.headers[k]) as response:
        if stream:
            first = await response.content.readany()
            elapsed = time.perf_counter() - started
            rest = await response.read()
            assert first and target.end in first + rest, first + rest
        else:
            await response.read()
            elapsed = time.perf_counter() - started
        if response.status != 200:
            raise RuntimeError(f"{target.name}: HTTP {response.status}")
        return elapsed


async def _latency(
    session: aiohttp.ClientSession, targets: list[Target], n: int, stream: bool
) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {t.name: [] for t in targets}
    block = 100
    for start in range(0, n, block):
        for target in targets:
            for i in range(start, start + block):
                samples[target.name].append(await _one(session, target, i, stream))
    return samples


async def _throughput(
    session: aiohttp.ClientSession, target: Target, concurrency: int, seconds: float
) -> tuple[float, int]:
    deadline = time.perf_counter() + seconds
    done = 0

    async def worker(w: int) -> None:
        nonlocal done
        i = w
        while time.perf_counter() < deadline:
            await _one(session, target, i, False)
            done += 1
            i += concurrency

    started = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for w in range(concurrency):
            tg.create_task(worker(w))
    return done / (time.perf_counter() - started), done


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def _measure(
    direct: Target, relayed: list[Target], n: int, seconds: float, rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, list[float]], int]:
    chat = relayed[0]
    relay_calls = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        # The relay refuses a token on another rollout's route, and nothing is recorded.
        for target in relayed:
            async with session.post(
                target.urls[0], data=target.bodies[0], headers=target.headers[1]
            ) as response:
                assert response.status == 403, response.status
        for target in (direct, *relayed):  # warm up connections and code paths
            for i in range(300):
                await _one(session, target, i, i % 2 == 1)
        relay_calls += 300 * len(relayed)

        plain = await _latency(session, [direct, *relayed], n, False)
        streamed = await _latency(session, [direct, *relayed], n, True)
        relay_calls += 2 * n * len(relayed)

        rates: dict[str, list[float]] = {"direct": [], "relay": []}
        # Paired rounds (direct, then relay straight after) so a burst of other load on the
        # machine hits one pair, not one side; the median pair is reported.
        for _ in range(rounds):
            for target in (direct, chat):
                rate, count = await _throughput(session, target, 64, seconds)
                rates[target.name].append(rate)
                if target is chat:
                    relay_calls += count
    return plain, streamed, rates, relay_calls


def _bench(quick: bool) -> int:
    import uvloop

    env = {**os.environ, "PYTHONPATH": str(HERE.parents[2])}
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "env": env}
    upstream = subprocess.Popen([sys.executable, str(HERE), "_upstream"], **pipes)  # type: ignore[call-overload]
    relay = None
    n = 1000 if quick else 4000
    seconds = 2.0 if quick else 3.0
    rounds = 3 if quick else 5
    try:
        port = json.loads(upstream.stdout.readline())["port"]
        upstream_url = f"http://127.0.0.1:{port}/v1"
        relay = subprocess.Popen([sys.executable, str(HERE), "_relay", upstream_url], **pipes)  # type: ignore[call-overload]
        grants = json.loads(relay.stdout.readline())["grants"]
        direct = Target("direct", [upstream_url + "/chat/completions"], ["unused"])
        ends = {"chat": b"[DONE]", "responses": b"response.completed", "messages": b"message_stop"}
        relayed = [
            Target(
                "relay" if name == "chat" else f"relay {name}",
                [g["base_url"] + route for g in grants],
                [g["token"] for g in grants],
                (body, stream_body),
                ends[name],
            )
            for name, route, body, stream_body in WIRES
        ]
        plain, streamed, rates, relay_calls = uvloop.run(
            _measure(direct, relayed, n, seconds, rounds)
        )
        relay.stdin.write(b"end\n")
        relay.stdin.flush()
        summary = json.loads(relay.stdout.readline())
    finally:
        for proc in (relay, upstream):
            if proc is not None:
                proc.stdin.close()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()

    failures: list[str] = []
    print(
        f"relay benchmark: {n} sequential calls per mode; 64 in flight, "
        f"{len(rates['relay'])} paired rounds of {seconds:g} s"
    )
    for label, samples in (("non-streaming", plain), ("streaming TTFB", streamed)):
        d50, d99 = _pct(samples["direct"], 0.5), _pct(samples["direct"], 0.99)
        r50, r99 = _pct(samples["relay"], 0.5), _pct(samples["relay"], 0.99)
        print(
            f"  {label:15} direct p50 {d50:.3f} ms p99 {d99:.3f} ms | relay p50 {r50:.3f} ms "
            f"p99 {r99:.3f} ms | added p50 {r50 - d50:.3f} ms p99 {r99 - d99:.3f} ms"
        )
        for name in [k for k in samples if k.startswith("relay ")]:
            w50, w99 = _pct(samples[name], 0.5), _pct(samples[name], 0.99)
            print(
                f"  {'':15} {name:15} p50 {w50:.3f} ms p99 {w99:.3f} ms | added p50 "
                f"{w50 - d50:.3f} ms p99 {w99 - d99:.3f} ms (chat's +{r50 - d50:.3f} ms)"
            )
        if label == "non-streaming":
            if r50 - d50 > TARGET_P50_ADDED_MS:
                failures.append(f"p50 added {r50 - d50:.3f} ms > {TARGET_P50_ADDED_MS} ms")
            if r99 - d99 > TARGET_P99_ADDED_MS:
                failures.append(f"p99 added {r99 - d99:.3f} ms > {TARGET_P99_ADDED_MS} ms")
    pairs = sorted(zip(rates["relay"], rates["direct"], strict=True), key=lambda p: p[0] / p[1])
    relay_rps, direct_rps = pairs[len(pairs) // 2]
    ratio = relay_rps / direct_rps
    print(
        f"  64 in flight    direct {direct_rps:,.0f} req/s | relay {relay_rps:,.0f} req/s "
        f"| ratio {ratio:.0%} (median pair; rounds: direct {[round(r) for r in rates['direct']]}, "
        f"relay {[round(r) for r in rates['relay']]})"
    )
    if relay_rps < TARGET_RPS:
        failures.append(f"relay {relay_rps:,.0f} req/s < {TARGET_RPS:,.0f}")
    if ratio < TARGET_RATIO:
        failures.append(f"relay/direct {ratio:.0%} < {TARGET_RATIO:.0%}")
    print(
        f"  trace: {summary['calls']} calls recorded for {relay_calls} made, "
        f"{summary['with_token_ids']} with token ids, {summary['failed']} failed; "
        f"trace build {summary['trace_build_s'] * 1000:.0f} ms"
    )
    if summary["calls"] != relay_calls or summary["failed"]:
        failures.append("the trace does not hold exactly the calls made")
    for failure in failures:
        print(f"  MISSED: {failure}")
    print("  all targets met" if not failures else f"  {len(failures)} target(s) missed")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "role", nargs="?", default="bench", choices=["bench", "_upstream", "_relay"]
    )
    parser.add_argument("upstream", nargs="?")
    parser.add_argument("--quick", action="store_true", help="fewer samples, shorter runs")
    args = parser.parse_args()
    import uvloop

    if args.role == "_upstream":
        uvloop.run(_upstream_main())
        return 0
    if args.role == "_relay":
        import anyio

        anyio.run(_relay_main, args.upstream, backend_options={"use_uvloop": True})
        return 0
    return _bench(args.quick)


if __name__ == "__main__":
    sys.exit(main())
