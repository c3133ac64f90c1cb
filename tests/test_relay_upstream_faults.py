"""The relay against upstreams that misbehave: huge answers, dropped connections, credentials in
the URL, concurrent identical calls, and agents that hang up. Real servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web

from backends.relay import CallError, Relay, RelaySettings
from backends.relay.upstream import Upstream
from tests.policy_support import chat_upstream, completion, policy_server

pytestmark = pytest.mark.anyio

MESSAGES = [{"role": "user", "content": "What is 7 * 6?"}]
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def raw_upstream(handler: Handler) -> AsyncIterator[str]:
    """A hand-written HTTP/1.1 upstream, for behaviour no framework would produce."""
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return await reader.readexactly(length)


def answer(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


async def post(
    url: str, token: str, body: dict[str, Any], give_up_s: float = 30, **headers: str
) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=give_up_s)) as http,
        http.post(
            url + "/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {token}", **headers},
        ) as response,
    ):
        return response.status, await response.text()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_large_non_streamed_answer_arrives_whole_and_quickly() -> None:
    content = "x" * (6 << 20)  # e.g. a long completion with logprobs
    payload = json.dumps(completion({}, content)).encode()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer(payload))
        await writer.drain()
        await reader.read()  # keep the connection until the relay closes it

    # The upstream keeps the connection open: a relay reading to EOF would wait out the
    # 30 s timeout. Well within it is "quickly" (0.3-0.6 s measured at load 10).
    settings = RelaySettings(response_timeout_s=30)
    async with raw_upstream(serve) as url, Relay(upstream_url=url, settings=settings) as relay:
        grant = relay.register("r1")
        started = time.monotonic()
        status, text = await post(grant.base_url, grant.token, {"messages": MESSAGES})
        elapsed = time.monotonic() - started
        trace = relay.end("r1")
    assert status == 200 and elapsed < 10
    assert json.loads(text)["choices"][0]["message"]["content"] == content
    assert trace.calls[0].choices[0].message["content"] == content


async def test_credentials_in_the_upstream_url_are_basic_auth_and_never_shown() -> None:
    password = "hunter2-password"
    down = f"http://svc:{password}@127.0.0.1:{closed_port()}/v1"
    parsed = Upstream.parse(down, None)
    assert password not in parsed.base_url and password not in repr(parsed)
    async with Relay(upstream_url=down) as relay:
        grant = relay.register("down")
        status, text = await post(grant.base_url, grant.token, {"messages": MESSAGES})
        trace = relay.end("down")
    assert status == 502 and "could not be reached" in text
    # The trace (host side) names the URL, without its credentials; the agent learns neither.
    assert parsed.base_url in (trace.calls[0].error_message or "")
    assert "127.0.0.1" not in text and password not in text
    assert password not in trace.model_dump_json()

    # Reachable, the URL's credentials are the upstream's Basic auth; an explicit key wins.
    seen: list[str] = []

    def reply(body: dict[str, Any], authorization: str) -> tuple[int, dict[str, Any]]:
        seen.append(authorization)
        return 200, completion(body)

    async with policy_server(reply) as url:
        with_auth = url.replace("http://", f"http://svc:{password}@")
        async with Relay(upstream_url=with_auth) as relay:
            for rollout, key in (("url-only", None), ("keyed", "sk-explicit")):
                grant = relay.register(rollout, upstream_api_key=key)
                status, _ = await post(grant.base_url, grant.token, {"messages": MESSAGES})
                assert status == 200
    assert seen == [
        f"Basic {base64.b64encode(f'svc:{password}'.encode()).decode()}",
        "Bearer sk-explicit",
    ]


async def test_an_sdk_retry_is_not_folded_into_a_concurrent_call_that_succeeded() -> None:
    """A's first attempt fails with 503 while B, an identical request, succeeds; A retries."""
    arrived = 0
    b_answered = asyncio.Event()

    async def chat(request: web.Request) -> web.Response:
        nonlocal arrived
        body = await request.json()
        arrived += 1
        me = arrived
        if me == 1:
            await b_answered.wait()
            return web.json_response({"error": {"message": "busy"}}, status=503)
        reply = completion(body, f"answer {me}", token_ids=[me])
        if me == 2:
            b_answered.set()
        return web.json_response(reply | {"id": f"resp-{me}"})

    body = {"model": "m", "messages": MESSAGES, "temperature": 1.0}
    async with chat_upstream(chat) as url, Relay(upstream_url=url) as relay:
        grant = relay.register("r1")

        async def call(retry: int) -> dict[str, Any]:
            status, text = await post(
                grant.base_url, grant.token, body, **{"x-stainless-retry-count": str(retry)}
            )
            return {"status": status} | json.loads(text)

        async def sample_b() -> dict[str, Any]:
            while arrived < 1:  # A's first attempt is at the upstream
                await asyncio.sleep(0.005)
            return await call(0)

        b_task = asyncio.create_task(sample_b())
        first = await call(0)
        b = await b_task
        a = await call(1)  # the SDK's retry of A, after B's call has finished
        trace = relay.end("r1")
    assert first["status"] == 503 and (a["id"], b["id"]) == ("resp-3", "resp-2")
    recorded = {(c.response or {}).get("id", ""): c for c in trace.calls}
    assert sorted(recorded) == ["resp-2", "resp-3"]  # both completions the agent used
    assert recorded["resp-2"].completion_token_ids == [2] and recorded["resp-2"].attempts == 1
    assert recorded["resp-3"].completion_token_ids == [3] and recorded["resp-3"].attempts == 2
    assert len(trace.calls) == 2 and trace.policy_failure() is None


async def test_a_request_the_upstream_worked_on_before_dropping_it_is_not_resent() -> None:
    received: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError):
            while True:
                received.append(await read_request(reader))
                if len(received) == 1:
                    writer.write(answer(json.dumps(completion({})).encode()))
                    await writer.drain()
                else:
                    await asyncio.sleep(1.0)  # generating, then the upstream worker dies
                    writer.transport.abort()
                    return

    async with raw_upstream(serve) as url, Relay(upstream_url=url) as relay:
        grant = relay.register("r1")
        assert (await post(grant.base_url, grant.token, {"messages": MESSAGES}))[0] == 200
        expensive = {"messages": [{"role": "user", "content": "expensive"}]}
        status, text = await post(grant.base_url, grant.token, expensive)
        trace = relay.end("r1")
    assert status == 502 and "dropped the connection" in text
    assert "closed the connection before answering" in (trace.calls[1].error_message or "")
    assert len(received) == 2  # the expensive request reached the upstream once
    assert trace.calls[1].error is CallError.CONNECTION and trace.calls[1].attempts == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_an_agent_hanging_up_closes_the_upstream_call(stream: bool) -> None:
    """Before any answer byte: a non-streamed call, or a stream still waiting to start."""
    hung_up_after: list[float] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        started = time.monotonic()
        with contextlib.suppress(TimeoutError):
            # Generating; b"" means the relay closed the connection.
            if await asyncio.wait_for(reader.read(1), 5) == b"":
                hung_up_after.append(time.monotonic() - started)
        writer.transport.abort()

    async with raw_upstream(serve) as url, Relay(upstream_url=url) as relay:
        grant = relay.register("r1")
        body = {"messages": MESSAGES, "stream": stream}
        with pytest.raises(TimeoutError):  # the agent gives up (or its sandbox goes) at 0.3 s
            await post(grant.base_url, grant.token, body, give_up_s=0.3)
        with anyio.fail_after(2):
            while not hung_up_after:
                await anyio.sleep(0.02)
        call = relay.end("r1").calls[0]
    assert hung_up_after[0] < 1
    assert call.error is CallError.CLIENT_DISCONNECTED and not call.is_policy_failure


async def test_the_agent_never_learns_the_upstreams_address_from_an_error() -> None:
    """Connect failure, a dropped call and a stream broken mid-way: the agent's error body or
    SSE event says what failed, the trace (host side) says where; the sandbox must not learn
    the upstream's URL (it could aim at the trainer's endpoint, which holds no rollout token)."""
    secret_host = "127.0.0.1"

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await read_request(reader)
        if b'"stream": true' in request or b'"stream":true' in request:
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )
            chunk = b"data: " + json.dumps(completion({})).encode() + b"\n\n"
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
        writer.transport.abort()  # mid-stream, or before any answer

    down = f"http://{secret_host}:{closed_port()}/v1"
    async with raw_upstream(serve) as url, Relay(upstream_url=url) as relay:
        port = url.split(":")[2].split("/")[0]
        seen: list[str] = []
        for rollout, upstream, stream in (
            ("refused", down, False),
            ("dropped", url, False),
            ("broken-stream", url, True),
        ):
            grant = relay.register(rollout, upstream_url=upstream)
            body = {"messages": MESSAGES, "stream": stream}
            status, text = await post(grant.base_url, grant.token, body)
            trace = relay.end(rollout)
            seen.append(text)
            assert status in (200, 502), text
            assert "upstream" in text and "error" in text
            recorded = trace.calls[0].error_message or ""
            assert upstream.rsplit("/", 1)[0] in recorded  # the operator still sees where
    for text in seen:
        assert secret_host not in text and port not in text and "/v1" not in text, text
