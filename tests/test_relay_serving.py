"""The relay's HTTP server bounds what one client can hold, so a sandbox cannot pile up
connections (each an fd of the orchestrator process, shared by every rollout) until nothing
else can open a file: a connection that never finishes its request's headers is closed, past a
cap the oldest connection serving no rollout's call is closed, and one rollout has at most
``max_calls_in_flight`` calls open."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import httpx2
import openai
import pytest
from aiohttp import web
from anyio.streams.buffered import BufferedByteReceiveStream
from openai.types.chat import ChatCompletionMessageParam
from policy_support import chat_upstream, completion

from backends.relay import CallError, Grant, Relay, RelaySettings
from backends.relay.serving import HALF_CLOSE_GRACE_SEC, LISTEN_BACKLOG, serve_asgi

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _slow_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers after `?sleep` seconds (the path), like a long policy call."""
    await anyio.sleep(float(scope["path"].strip("/") or 0))
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def _closed_within(stream: Any, seconds: float) -> bool:
    with anyio.move_on_after(seconds):
        try:
            while await stream.receive():
                pass
        except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
            return True
    return False


async def test_idle_and_trickling_connections_are_closed_and_others_served(
    tmp_path: Path,
) -> None:
    socket_path = tmp_path / "relay.sock"
    async with serve_asgi(_slow_app, unix_socket_path=socket_path, header_timeout_s=0.5) as at:
        started = time.monotonic()  # before the connections, whose timeouts start with them
        silent = await anyio.connect_unix(socket_path)
        trickling = await anyio.connect_tcp(at.host, at.port)
        await trickling.send(b"GET /0 HTTP/1.1\r\nHost: x\r\n")  # headers never end

        assert await _closed_within(silent, 5)
        assert await _closed_within(trickling, 5)
        assert 0.4 < time.monotonic() - started < 4

        # A request whose answer takes longer than the header timeout is not cut short, and
        # its connection stays open for the next request past the timeout (keep-alive).
        async with await anyio.connect_unix(socket_path) as client:
            await client.send(b"GET /1.2 HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await client.receive()).startswith(b"HTTP/1.1 200")
            await anyio.sleep(0.8)
            await client.send(b"GET /0 HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await client.receive()).startswith(b"HTTP/1.1 200")


def test_the_open_file_limit_is_raised_to_the_hard_limit() -> None:
    """A soft limit of 1,024 under a larger hard one (common at login) is lifted at start."""
    script = (
        "import resource\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (min(64, hard), hard))\n"
        "from backends.fdlimit import raise_open_file_limit\n"
        "print(raise_open_file_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    now, soft, hard = (int(v) for v in out.stdout.split())
    assert now == soft == hard


PROMPT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is 7 * 6?"}]


class _Policy:
    """Answers at once, except to the rollout named `attacker`: not until `release` is set."""

    def __init__(self) -> None:
        self.release = anyio.Event()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if request.headers.get("x-session-id") == "attacker":
            await self.release.wait()
        return web.json_response(completion(body))


def _client(
    relay: Relay, rollout_id: str, token: str, http: httpx2.AsyncClient | None = None
) -> openai.AsyncOpenAI:
    base_url = relay.rollout_base_url(rollout_id)
    return openai.AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0, http_client=http)


async def _ask(client: openai.AsyncOpenAI) -> str | None:
    reply = await client.chat.completions.create(model="m", messages=PROMPT)
    return reply.choices[0].message.content


async def test_a_rollouts_calls_past_its_limit_are_refused_naming_it_and_others_served() -> None:
    policy = _Policy()
    settings = RelaySettings(max_calls_in_flight=2)
    async with (
        chat_upstream(policy.chat) as url,
        Relay(upstream_url=url, settings=settings) as relay,
    ):
        attacker, victim = relay.register("attacker"), relay.register("victim")
        own = _client(relay, "attacker", attacker.token)
        served = _client(relay, "victim", victim.token)
        wrong = _client(relay, "victim", attacker.token)
        async with own, served, wrong, anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(_ask, own)
            with anyio.fail_after(10):
                while relay.core.registry.get("attacker").in_flight < 2:
                    await anyio.sleep(0.01)
            with pytest.raises(openai.RateLimitError) as refused:
                await _ask(own)
            assert refused.value.status_code == 429
            assert refused.value.code == "too_many_calls_in_flight"
            assert "'attacker' already has 2 calls in flight" in refused.value.message
            assert "max_calls_in_flight" in refused.value.message
            assert len(relay.trace("attacker").calls) == 2  # a refusal is no policy call

            # The other rollout is served meanwhile, and a wrong token on its route counts
            # against nobody's limit.
            with pytest.raises(openai.PermissionDeniedError):
                await _ask(wrong)
            with anyio.fail_after(5):
                for _ in range(3):
                    assert await _ask(served) == "42"
            policy.release.set()
        # Its calls answered, the rollout has its whole limit back.
        assert relay.core.registry.get("attacker").in_flight == 0
        async with _client(relay, "attacker", attacker.token) as again:
            async with anyio.create_task_group() as tg:
                for _ in range(2):
                    tg.start_soon(_ask, again)
        assert [c.status for c in relay.end("attacker").calls] == [200] * 4
        relay.end("victim")


FLOOD = 6000  # connections the flooder keeps open


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_connection_flood_from_one_sandbox_keeps_fds_bounded_and_others_served() -> None:
    """One sandbox, from its own address, keeps 6,000 connections of every kind open, reopening
    each one the relay closes. The relay holds its idle cap plus the flooder's few admitted
    calls, and another rollout's calls are answered promptly all along, none of its connections
    closed (the client does not retry)."""
    policy = _Policy()
    most_idle, most_calls = 200, 4
    settings = RelaySettings(max_calls_in_flight=most_calls, max_idle_connections=most_idle)
    async with (
        chat_upstream(policy.chat) as url,
        Relay(upstream_url=url, settings=settings) as relay,
    ):
        attacker, victim = relay.register("attacker"), relay.register("victim")
        baseline = _open_fds()
        flood_script = Path(__file__).with_name("relay_flood.py")
        command = [sys.executable, str(flood_script), relay.base_url]
        command += [attacker.base_url, attacker.token, str(FLOOD), "127.0.0.2"]
        fds: list[int] = []

        async def count_fds() -> None:
            while True:
                fds.append(_open_fds())
                await anyio.sleep(0.01)

        # Its connection is open before the flood and kept (httpx drops an idle one after 5 s):
        # a new connection's SYN waits while the flood keeps the kernel's accept queue full.
        keep = httpx2.AsyncClient(limits=httpx2.Limits(keepalive_expiry=None))
        client = _client(relay, "victim", victim.token, keep)
        async with keep, client, await anyio.open_process(command) as flood:
            assert await _ask(client) == "42"
            assert flood.stdin is not None and flood.stdout is not None
            lines = BufferedByteReceiveStream(flood.stdout)
            counts: dict[str, int] = {}
            async with anyio.create_task_group() as tg:
                tg.start_soon(count_fds)
                with anyio.fail_after(120):
                    while counts.get("closed by the relay", 0) < 1000 or not counts.get("429"):
                        counts = json.loads(await lines.receive_until(b"\n", 1 << 16))
                latencies = []
                for _ in range(20):
                    started = time.monotonic()
                    with anyio.fail_after(30):
                        assert await _ask(client) == "42"
                    latencies.append(time.monotonic() - started)
                tg.cancel_scope.cancel()
            await flood.stdin.aclose()
            final = json.loads(await lines.receive_until(b"\n", 1 << 16))
        policy.release.set()
        victim_calls = relay.end("victim").calls
        relay.end("attacker")
    fds.sort()
    typical, peak = fds[len(fds) // 2] - baseline, fds[-1] - baseline
    print(f"flood {final}; fds {baseline} + {typical} typically, + {peak} at most")
    print(f"victim's calls {max(latencies):.3f} s at most")

    assert final["opened"] > FLOOD and final["closed by the relay"] >= 1000
    assert final["429"] > 0  # its calls past the limit were refused
    assert [c.status for c in victim_calls] == [200] * 21
    assert max(latencies) < 10, latencies  # 0.01-0.06 s at load 5, up to 3.3 s at load 10
    # The idle cap, plus per admitted call its connection, the relay's upstream connection and
    # the test upstream's side of it, plus the victim's, plus a little slack; plus what the loop
    # accepted in its last turn (up to the listen backlog), which it closes a few turns later.
    held = most_idle + 3 * (most_calls + 1) + 30 + LISTEN_BACKLOG
    assert typical <= held < FLOOD, fds  # typically 217 at load 5, 396 at load 10


def _raw_call(grant: Grant) -> bytes:
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    head = (
        f"POST {grant.path}/chat/completions HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {grant.token}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _answer_after_half_close(stream: Any, request: bytes) -> bytes:
    await stream.send(request)
    await stream.send_eof()  # shutdown(SHUT_WR), as nc -N does
    answer = b""
    with anyio.fail_after(10):
        try:
            while chunk := await stream.receive():
                answer += chunk
        except anyio.EndOfStream:
            pass
    return answer


async def test_a_client_that_half_closes_after_its_request_still_gets_the_answer(
    tmp_path: Path,
) -> None:
    """A client may shut down its sending side once its request is out (nc -N, some HTTP/1.0
    clients) and wait for the answer; the relay's local sandboxes reach it through a forwarder
    that passes the EOF on at once."""
    socket_path = tmp_path / "relay.sock"
    async with serve_asgi(_slow_app, unix_socket_path=socket_path) as at:
        for connect in (
            lambda: anyio.connect_unix(socket_path),
            lambda: anyio.connect_tcp(at.host, at.port),
        ):
            for version in (b"1.1", b"1.0"):
                async with await connect() as stream:
                    request = b"GET /0.3 HTTP/" + version + b"\r\nHost: x\r\n\r\n"
                    answer = await _answer_after_half_close(stream, request)
                assert answer.startswith(b"HTTP/1.1 200") and b"\r\nok" in answer, answer

    # Through the relay, a policy call, answered and recorded.
    async with (
        chat_upstream(_Policy().chat) as url,
        Relay(upstream_url=url, unix_socket_path=tmp_path / "r.sock") as relay,
    ):
        grant = relay.register("r1")
        request = _raw_call(grant)
        async with await anyio.connect_unix(tmp_path / "r.sock") as stream:
            answer = await _answer_after_half_close(stream, request)
        assert answer.startswith(b"HTTP/1.1 200") and b'"content": "42"' in answer, answer
        assert [c.status for c in relay.end("r1").calls] == [200]


async def test_a_half_closed_clients_call_is_abandoned_after_a_grace(tmp_path: Path) -> None:
    """A read cannot tell a half-close from a hang-up: past the grace, the call is given up."""
    policy = _Policy()  # never answers the rollout named attacker
    async with (
        chat_upstream(policy.chat) as url,
        Relay(upstream_url=url, unix_socket_path=tmp_path / "r.sock") as relay,
    ):
        grant = relay.register("attacker")
        request = _raw_call(grant)
        started = time.monotonic()
        async with await anyio.connect_unix(tmp_path / "r.sock") as stream:
            assert await _answer_after_half_close(stream, request) == b""
        assert time.monotonic() - started < 5
        with anyio.fail_after(5):
            while relay.trace("attacker").calls[0].latency_s is None:
                await anyio.sleep(0.02)
        call = relay.end("attacker").calls[0]
        policy.release.set()
    assert call.error is CallError.CLIENT_DISCONNECTED
    assert call.latency_s is not None and HALF_CLOSE_GRACE_SEC <= call.latency_s < 5
