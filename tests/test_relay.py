"""The policy relay: real HTTP, the real openai client, traces, tokens and failure mapping."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import anyio
import openai
import pytest
from aiohttp import web
from policy_support import chat_upstream, fake_upstream

from backends.relay import CallError, Relay, RelaySettings, UnknownRolloutError
from backends.relay.scripted import ScriptedPolicy

pytestmark = pytest.mark.anyio

KEY = "sk-upstream-secret-0123456789abcdef"
PROMPT = [{"role": "user", "content": "What is 7 * 6? Answer with just the number."}]

PROMPT_IDS = [151644, 872, 198, 0, 4294967295]
SAMPLED_IDS = [19, 17, 151645]
LOGPROBS = [-0.0, -1.25e-07, -12.5]
TOKENS = ["4", "2", "<|im_end|>"]


@dataclass
class Upstream:
    """A test upstream whose behaviour each test sets: answers, failures, hangs."""

    url: str = ""
    seen: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    fail_first: int = 0  # answer 503 to this many chat calls first
    status: int = 200
    error_text: str = "overloaded"
    hang_s: float = 0.0
    stream_hang_s: float = 0.0
    version: str | None = None

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        self.headers.append(dict(request.headers))
        if self.hang_s:
            await anyio.sleep(self.hang_s)
        extra = {"x-policy-version": self.version} if self.version else {}
        if self.fail_first > 0:
            self.fail_first -= 1
            return web.json_response(
                {"error": {"message": "busy"}}, status=503, headers={"retry-after-ms": "1"}
            )
        if self.status != 200:
            return web.json_response({"error": {"message": self.error_text}}, status=self.status)
        if body.get("stream"):
            response = web.StreamResponse(headers={"content-type": "text/event-stream", **extra})
            await response.prepare(request)
            for i, token in enumerate(TOKENS):
                chunk: dict[str, Any] = {
                    "id": "c1",
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": "policy-v1",
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"content": token if i < 2 else ""}
                            | ({"role": "assistant"} if i == 0 else {}),
                            "finish_reason": "stop" if i == 2 else None,
                            "token_ids": [SAMPLED_IDS[i]],
                            "logprobs": {"content": [{"token": token, "logprob": LOGPROBS[i]}]},
                        }
                    ],
                }
                if i == 0:
                    chunk["prompt_token_ids"] = PROMPT_IDS
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                if self.stream_hang_s and i == 1:
                    await anyio.sleep(self.stream_hang_s)
            await response.write(b"data: [DONE]\n\n")
            return response
        return web.json_response(
            {
                "id": "c1",
                "object": "chat.completion",
                "created": 0,
                "model": "policy-v1",
                "prompt_token_ids": PROMPT_IDS,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "42"},
                        "finish_reason": "stop",
                        "token_ids": SAMPLED_IDS,
                        "logprobs": {
                            "content": [
                                {"token": t, "logprob": lp, "top_logprobs": []}
                                for t, lp in zip(TOKENS, LOGPROBS, strict=True)
                            ]
                        },
                    }
                ],
                "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
            },
            headers=extra,
        )

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "policy-v1"}]})


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    state = Upstream()
    routes = web.post("/v1/chat/completions", state.chat), web.get("/v1/models", state.models)
    async with fake_upstream(*routes) as state.url:
        yield state


@pytest.fixture
async def scripted() -> AsyncIterator[ScriptedPolicy]:
    async with ScriptedPolicy(api_key=KEY) as policy:
        yield policy


async def test_openai_client_sync_async_streaming_and_not(scripted: ScriptedPolicy) -> None:
    async with Relay(upstream_url=scripted.base_url, upstream_api_key=KEY) as relay:
        grant = relay.register("r1")
        assert grant.base_url == f"{relay.base_url}/rollouts/r1/v1"
        questions = [f"What is {i} * 6?" for i in range(1, 5)]

        def sync_calls() -> list[str]:
            client = openai.OpenAI(base_url=grant.base_url, api_key=grant.token)
            one = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": questions[0]}]
            )
            parts = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": questions[1]}], stream=True
            )
            two = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
            client.close()
            return [one.choices[0].message.content or "", two]

        answers = await anyio.to_thread.run_sync(sync_calls)
        client = openai.AsyncOpenAI(base_url=grant.base_url, api_key=grant.token)
        three = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": questions[2]}]
        )
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": questions[3]}], stream=True
        )
        four = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        models = await client.models.list()
        await client.close()
        answers += [three.choices[0].message.content or "", four]
        assert answers == ["6", "12", "18", "24"]
        assert [m.id for m in models.data] == ["scripted:default"]

        trace = relay.end("r1")
    assert [c.path for c in trace.calls] == ["/chat/completions"] * 4 + ["/models"]
    assert [c.stream for c in trace.calls[:4]] == [False, True, False, True]
    asked = [c.request["messages"][0]["content"] for c in trace.calls[:4] if c.request]
    assert asked == questions
    assert [c.choices[0].message for c in trace.calls[:4]] == [
        {"role": "assistant", "content": a} for a in answers
    ]
    assert all(c.status == 200 and c.upstream_status == 200 for c in trace.calls)
    assert all(c.finish_reason == "stop" and c.scripted for c in trace.calls[:4])
    assert trace.calls[0].usage is not None and trace.calls[0].usage["completion_tokens"] == 1
    assert all(c.latency_s is not None and c.ttfb_s is not None for c in trace.calls)
    assert trace.scripted and trace.policy_failure() is None
    # The relay presented its own key upstream, and the agent's token stayed here.
    assert {c.authorization for c in scripted.calls} == {f"Bearer {KEY}"}


async def test_token_ids_and_logprobs_recorded_exactly(upstream: Upstream) -> None:
    async with Relay(
        upstream_url=upstream.url, upstream_api_key=KEY, request_token_ids=True
    ) as relay:
        grant = relay.register("r1")
        client = openai.AsyncOpenAI(base_url=grant.base_url, api_key=grant.token)
        await client.chat.completions.create(model="m", messages=PROMPT)
        stream = await client.chat.completions.create(model="m", messages=PROMPT, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        await client.close()
        trace = relay.end("r1")
    assert text == "42"
    for call in trace.calls:
        assert call.prompt_token_ids == PROMPT_IDS
        assert call.completion_token_ids == SAMPLED_IDS
        assert call.logprobs == LOGPROBS
        assert call.choices[0].logprob_tokens == TOKENS
        assert call.choices[0].message == {"role": "assistant", "content": "42"}
        assert call.finish_reason == "stop"
    # The option asked the upstream for them, vLLM style.
    assert all(s["logprobs"] is True and s["return_token_ids"] is True for s in upstream.seen)


async def test_tokens_are_scoped_to_their_rollout_and_revoked_at_end(upstream: Upstream) -> None:
    async with Relay(upstream_url=upstream.url, upstream_api_key=KEY) as relay:
        a, b = relay.register("a"), relay.register("b")
        async with aiohttp.ClientSession() as http:

            async def status(grant_url: str, token: str | None) -> int:
                headers = {"authorization": f"Bearer {token}"} if token else {}
                url = grant_url + "/chat/completions"
                async with http.post(url, json={"messages": PROMPT}, headers=headers) as r:
                    body = await r.json()
                    assert "error" in body or r.status == 200
                    return r.status

            assert await status(b.base_url, a.token) == 403
            assert await status(b.base_url, None) == 401
            assert await status(b.base_url, "rlt-guess") == 403
            assert await status(relay.rollout_base_url("nobody"), a.token) == 404
            assert await status(a.base_url, a.token) == 200
            relay.end("a")
            assert await status(a.base_url, a.token) == 403
            assert await status(b.base_url, b.token) == 200
            assert len((await relay.aend("b")).calls) == 1  # parsed off the event loop
            assert await status(b.base_url, b.token) == 403
        assert len(upstream.seen) == 2  # refused calls were never forwarded
        with pytest.raises(UnknownRolloutError):
            relay.end("b")


async def test_upstream_key_never_reaches_the_client(upstream: Upstream) -> None:
    upstream.status = 500
    upstream.error_text = f"internal error while using key {KEY}"
    async with Relay(upstream_url=upstream.url, upstream_api_key=KEY) as relay:
        grant = relay.register("r1")
        seen: list[str] = [repr(grant), grant.token, grant.base_url]
        async with aiohttp.ClientSession() as http:
            url = grant.base_url + "/chat/completions"
            headers = {"authorization": f"Bearer {grant.token}"}
            for status in (500, 401, 200):
                upstream.status = status
                async with http.post(url, json={"messages": PROMPT}, headers=headers) as r:
                    seen += [str(r.headers), await r.text()]
                    assert r.status == (502 if status == 401 else status)
        relay.end("r1")
    assert not any(KEY in text for text in seen)
    assert any("***" in text for text in seen)  # the echoed key was masked, the error kept


async def test_client_retries_are_recorded_once(upstream: Upstream) -> None:
    upstream.fail_first = 2
    async with Relay(upstream_url=upstream.url, upstream_api_key=KEY) as relay:
        grant = relay.register("r1")
        client = openai.AsyncOpenAI(base_url=grant.base_url, api_key=grant.token, max_retries=2)
        reply = await client.chat.completions.create(model="m", messages=PROMPT)
        again = await client.chat.completions.create(model="m", messages=PROMPT)
        await client.close()
        trace = relay.end("r1")
    assert reply.choices[0].message.content == again.choices[0].message.content == "42"
    assert len(upstream.seen) == 4  # 2 failures + 2 answers reached the upstream
    # The SDK's two retries fold into the first call; the second, fresh call is its own.
    assert [(c.attempts, c.status) for c in trace.calls] == [(3, 200), (1, 200)]
    assert trace.policy_failure() is None


async def test_policy_version_from_header_or_registration(upstream: Upstream) -> None:
    async with Relay(upstream_url=upstream.url, upstream_api_key=KEY) as relay:
        grant = relay.register("r1", policy_version="step-7")
        client = openai.AsyncOpenAI(base_url=grant.base_url, api_key=grant.token)
        await client.chat.completions.create(model="m", messages=PROMPT)
        upstream.version = "step-8"
        await client.chat.completions.create(model="m", messages=PROMPT)
        await client.close()
        trace = relay.end("r1")
    assert [c.policy_version for c in trace.calls] == ["step-7", "step-8"]


async def test_per_rollout_upstream_override(upstream: Upstream, scripted: ScriptedPolicy) -> None:
    async with Relay() as relay:
        with pytest.raises(ValueError, match="no upstream"):
            relay.register("nowhere")
        to_script = relay.register("s", upstream_url=scripted.base_url, upstream_api_key=KEY)
        full_url = upstream.url + "/chat/completions"  # the trainer's chat_completions_url form
        to_test = relay.register("t", upstream_url=full_url, upstream_api_key=KEY)
        for grant, expected in ((to_script, "scripted:default"), (to_test, "policy-v1")):
            client = openai.AsyncOpenAI(base_url=grant.base_url, api_key=grant.token)
            reply = await client.chat.completions.create(model="m", messages=PROMPT)
            await client.close()
            assert reply.model == expected and reply.choices[0].message.content == "42"
        assert upstream.headers[0]["Authorization"] == f"Bearer {KEY}"
        assert upstream.headers[0]["x-session-id"] == "t"  # sticky routing by rollout


async def test_bad_input_gets_bounded_answers_and_others_keep_working(
    upstream: Upstream,
) -> None:
    # The timeout leaves the other rollout's call time to finish first on a loaded host.
    settings = RelaySettings(max_request_bytes=4096, response_timeout_s=3)
    async with Relay(upstream_url=upstream.url, upstream_api_key=KEY, settings=settings) as relay:
        bad, good = relay.register("bad"), relay.register("good")
        headers = {"authorization": f"Bearer {bad.token}"}
        url = bad.base_url + "/chat/completions"
        async with aiohttp.ClientSession() as http:

            async def post(data: bytes) -> tuple[int, str]:
                async with http.post(url, data=data, headers=headers) as r:
                    return r.status, (await r.json())["error"]["message"]

            status, message = await post(b'{"messages": [')
            assert status == 400 and "not valid JSON" in message
            status, message = await post(b"[1, 2]")
            assert status == 400 and "JSON object" in message
            status, message = await post(b'{"x": "' + b"y" * 5000 + b'"}')
            assert status == 413 and "4096" in message
            async with http.get(bad.base_url + "/embeddings", headers=headers) as r:
                assert r.status == 404

            # An upstream that hangs: a 504 within the timeout, while another rollout is served.
            upstream.hang_s = 30
            started = time.monotonic()
            async with anyio.create_task_group() as tg:
                result: dict[str, Any] = {}

                async def hung() -> None:
                    result["hung"] = await post(json.dumps({"messages": PROMPT}).encode())

                calls = len(upstream.seen)
                tg.start_soon(hung)
                with anyio.fail_after(10):  # the upstream has it (and hangs) before it answers
                    while len(upstream.seen) == calls:  # others: a fixed wait lost that race
                        await anyio.sleep(0.005)
                upstream.hang_s = 0
                client = openai.AsyncOpenAI(base_url=good.base_url, api_key=good.token)
                reply = await client.chat.completions.create(model="m", messages=PROMPT)
                await client.close()
                assert reply.choices[0].message.content == "42"
                assert "hung" not in result  # served while the other call was stuck
            status, message = result["hung"]
            assert status == 504 and "did not" not in message and "within 3 s" in message
            assert time.monotonic() - started < 10  # the timeout's, not the upstream's 30 s
        trace = relay.end("bad")
    assert len(trace.calls) == 1  # rejected bodies never became calls
    failure = trace.policy_failure()
    assert failure is not None and failure.error is CallError.TIMEOUT


async def test_stream_that_goes_silent_ends_with_an_error_event(upstream: Upstream) -> None:
    upstream.stream_hang_s = 5
    settings = RelaySettings(stream_idle_timeout_s=0.3)
    async with Relay(upstream_url=upstream.url, upstream_api_key=KEY, settings=settings) as relay:
        grant = relay.register("r1")
        client = openai.AsyncOpenAI(base_url=grant.base_url, api_key=grant.token, max_retries=0)
        stream = await client.chat.completions.create(model="m", messages=PROMPT, stream=True)
        received = []
        with pytest.raises(openai.APIError, match="went silent"):
            async for chunk in stream:
                received.append(chunk.choices[0].delta.content)
        await client.close()
        trace = relay.end("r1")
    assert received == ["4", "2"]
    assert trace.calls[0].error is CallError.TIMEOUT
    assert trace.calls[0].choices[0].message == {"role": "assistant", "content": "42"}
    assert trace.policy_failure() is not None


async def test_unreachable_or_failing_upstream_is_a_policy_failure(upstream: Upstream) -> None:
    async with Relay(upstream_url="http://127.0.0.1:9/v1", upstream_api_key=KEY) as relay:
        grant = relay.register("down")
        client = openai.AsyncOpenAI(base_url=grant.base_url, api_key=grant.token, max_retries=0)
        with pytest.raises(openai.InternalServerError, match="could not be reached"):
            await client.chat.completions.create(model="m", messages=PROMPT)
        await client.close()
        upstream.status = 500
        failing = relay.register("failing", upstream_url=upstream.url, upstream_api_key=KEY)
        client = openai.AsyncOpenAI(base_url=failing.base_url, api_key=failing.token, max_retries=0)
        with pytest.raises(openai.InternalServerError):
            await client.chat.completions.create(model="m", messages=PROMPT)
        upstream.status = 400  # the agent's own bad request: not the policy's fault
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="m", messages=PROMPT)
        await client.close()
        down, fail = relay.end("down"), relay.end("failing")
    down_failure = down.policy_failure()
    assert down_failure is not None and down_failure.error is CallError.CONNECTION
    assert down.calls[0].status == 502 and down.calls[0].upstream_status is None
    fail_failure = fail.policy_failure()
    assert fail_failure is not None and fail_failure.upstream_status == 500
    assert fail_failure.call_index == 0 and "HTTP 500" in fail_failure.message
    assert not fail.calls[1].is_policy_failure


async def test_unix_socket_with_a_real_client_and_socat(tmp_path: Any, upstream: Upstream) -> None:
    sock = tmp_path / "relay.sock"
    async with Relay(
        upstream_url=upstream.url, upstream_api_key=KEY, unix_socket_path=sock
    ) as relay:
        assert relay.unix_socket_path == sock and sock.is_socket()
        grant = relay.register("r1")
        # A client speaking straight to the socket, as a forwarder inside a sandbox does.
        connector = aiohttp.UnixConnector(path=str(sock))
        async with aiohttp.ClientSession(connector=connector) as http:
            async with http.post(
                "http://relay" + grant.path + "/chat/completions",
                json={"messages": PROMPT},
                headers={"authorization": f"Bearer {grant.token}"},
            ) as r:
                assert r.status == 200 and (await r.json())["choices"][0]["message"]["content"]
        # The in-sandbox shape: socat on 127.0.0.1 forwarding to the socket.
        with socket_port() as port:
            process = await anyio.open_process(
                [
                    "socat",
                    f"TCP-LISTEN:{port},bind=127.0.0.1,reuseaddr,fork",
                    f"UNIX-CONNECT:{sock}",
                ]
            )
            try:
                base = grant.url_at(f"http://127.0.0.1:{port}")
                assert base == relay.rollout_base_url("r1", f"http://127.0.0.1:{port}")
                client = openai.AsyncOpenAI(base_url=base, api_key=grant.token)
                for _ in range(50):  # until socat listens
                    try:
                        reply = await client.chat.completions.create(model="m", messages=PROMPT)
                        break
                    except openai.APIConnectionError:
                        await anyio.sleep(0.05)
                await client.close()
                assert reply.choices[0].message.content == "42"
            finally:
                process.terminate()
                await process.wait()
        assert len(relay.end("r1").calls) == 2
    assert not sock.exists()


class socket_port:
    """A free TCP port on 127.0.0.1 (closed again before use)."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        return None


async def test_admin_api_for_a_standalone_relay(upstream: Upstream) -> None:
    async with Relay(upstream_url=upstream.url, upstream_api_key=KEY, admin_token="adm") as relay:
        admin = {"authorization": "Bearer adm"}
        async with aiohttp.ClientSession(base_url=relay.base_url) as http:
            async with http.post("/admin/rollouts", json={"rollout_id": "x"}) as r:
                assert r.status == 401
            async with http.post("/admin/rollouts", json={"rollout_id": "x"}, headers=admin) as r:
                assert r.status == 201
                grant = await r.json()
            assert KEY not in json.dumps(grant)
            client = openai.AsyncOpenAI(base_url=grant["base_url"], api_key=grant["token"])
            await client.chat.completions.create(model="m", messages=PROMPT)
            await client.close()
            async with http.get("/admin/rollouts/x/trace", headers=admin) as r:
                assert len((await r.json())["calls"]) == 1
            async with http.delete("/admin/rollouts/x", headers=admin) as r:
                trace = await r.json()
                assert trace["ended_at"] and trace["calls"][0]["status"] == 200
            async with http.delete("/admin/rollouts/x", headers=admin) as r:
                assert r.status == 404
            async with http.post("/admin/rollouts", json={"rollout_id": "a/b"}, headers=admin) as r:
                assert r.status == 400


async def test_register_rejects_bad_ids_and_duplicates(upstream: Upstream) -> None:
    async with Relay(upstream_url=upstream.url) as relay:
        for bad in ("", "a/b", "a b", "x" * 300):
            with pytest.raises(ValueError):
                relay.register(bad)
        first = relay.register("r")
        with pytest.raises(ValueError, match="already registered"):
            relay.register("r")
        relay.end("r")
        second = relay.register("r")  # a retried rollout may reuse its id, with a new token
        assert second.token != first.token
        with pytest.raises(ValueError):
            Relay(upstream_url="ftp://nowhere")
        with pytest.raises(ValueError, match="control characters"):
            relay.register("k", upstream_url=upstream.url, upstream_api_key="sk\r\nX-Evil: 1")


async def test_client_hanging_up_mid_stream_abandons_the_upstream_call(upstream: Upstream) -> None:
    upstream.stream_hang_s = 5
    async with Relay(upstream_url=upstream.url, upstream_api_key=KEY) as relay:
        grant = relay.register("r1")
        async with aiohttp.ClientSession() as http:
            response = await http.post(
                grant.base_url + "/chat/completions",
                json={"messages": PROMPT, "stream": True},
                headers={"authorization": f"Bearer {grant.token}"},
            )
            assert b"data:" in await response.content.readany()
            response.close()  # the agent hangs up while the policy is still generating
        with anyio.fail_after(2):
            while relay.trace("r1").calls[0].latency_s is None:
                await anyio.sleep(0.02)
        call = relay.end("r1").calls[0]
    assert call.error is CallError.CLIENT_DISCONNECTED and not call.is_policy_failure
    assert call.latency_s is not None and call.latency_s < 2


async def test_https_upstream_is_verified(tmp_path: Any) -> None:
    import ssl

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    await anyio.run_process(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
    )  # fmt: skip
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    state = Upstream()
    async with chat_upstream(state.chat, ssl_context=server_tls) as url:
        trusted = RelaySettings(upstream_ca_file=str(cert))
        for settings, expected in ((RelaySettings(), "untrusted"), (trusted, "42")):
            async with Relay(upstream_url=url, upstream_api_key=KEY, settings=settings) as relay:
                grant = relay.register("r1")
                client = openai.AsyncOpenAI(
                    base_url=grant.base_url, api_key=grant.token, max_retries=0
                )
                try:
                    reply = await client.chat.completions.create(model="m", messages=PROMPT)
                    answer = reply.choices[0].message.content
                except openai.InternalServerError as exc:
                    assert "could not be reached" in str(exc)  # the cause is the host's to see
                    answer = "untrusted"
                await client.close()
                assert answer == expected
                trace = relay.end("r1")
                if expected == "untrusted":
                    assert "CERTIFICATE_VERIFY_FAILED" in (trace.calls[0].error_message or "")
    assert state.headers[0]["Authorization"] == f"Bearer {KEY}"


async def test_pooled_connections_the_upstream_closed_are_not_a_failure() -> None:
    async with (
        chat_upstream(Upstream().chat, keepalive_timeout=0.1) as url,
        Relay(upstream_url=url) as relay,
    ):
        grant = relay.register("r1")
        client = openai.AsyncOpenAI(base_url=grant.base_url, api_key=grant.token, max_retries=0)
        for _ in range(3):
            reply = await client.chat.completions.create(model="m", messages=PROMPT)
            assert reply.choices[0].message.content == "42"
            await anyio.sleep(0.3)  # the upstream drops the idle connection meanwhile
        await client.close()
        assert [c.attempts for c in relay.end("r1").calls] == [1, 1, 1]


async def test_a_request_on_a_connection_the_upstream_just_dropped_is_resent() -> None:
    """Each connection answers one request and drops the next unanswered (a keep-alive race)."""
    import asyncio

    body = json.dumps(
        {"object": "chat.completion", "model": "m", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "42"},
             "finish_reason": "stop"}]}
    ).encode()  # fmt: skip
    received = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal received
        for answer in (True, False):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            received += 1
            if answer:
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with Relay(upstream_url=f"http://127.0.0.1:{port}/v1") as relay:
            grant = relay.register("r1")
            client = openai.AsyncOpenAI(base_url=grant.base_url, api_key=grant.token, max_retries=0)
            for _ in range(2):
                reply = await client.chat.completions.create(model="m", messages=PROMPT)
                assert reply.choices[0].message.content == "42"
            await client.close()
            assert [c.status for c in relay.end("r1").calls] == [200, 200]
    finally:
        server.close()
    assert received == 3  # the dropped request was sent again on a fresh connection


async def test_an_upstream_echoing_its_key_inside_a_200_answer_is_scrubbed() -> None:
    """vLLM reports errors raised during generation inside a 200 stream: an echoed key is
    masked there too, even split across the upstream's writes, and in a 200 body."""
    half = len(KEY) // 2

    async def chat(request: web.Request) -> web.StreamResponse:
        if not (await request.json()).get("stream"):
            return web.json_response({"error": {"message": f"key {KEY} rejected"}})
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(f'data: {{"error": {{"message": "key {KEY[:half]}'.encode())
        await anyio.sleep(0.05)
        await response.write(f'{KEY[half:]} rejected"}}}}\n\n'.encode())
        return response

    async with (
        chat_upstream(chat) as upstream_url,
        Relay(upstream_url=upstream_url, upstream_api_key=KEY) as relay,
    ):
        grant = relay.register("r1")
        seen = []
        async with aiohttp.ClientSession() as http:
            url = grant.base_url + "/chat/completions"
            headers = {"authorization": f"Bearer {grant.token}"}
            for stream in (False, True):
                body = {"messages": PROMPT, "stream": stream}
                async with http.post(url, json=body, headers=headers) as r:
                    seen.append(await r.text())
        relay.end("r1")
    assert all("***" in text and KEY not in text for text in seen), seen


async def test_a_short_dummy_key_never_mangles_answers() -> None:
    """Masking a key like "k" in an answer would turn "completion_tokens" into garbage."""
    async with (
        ScriptedPolicy(api_key="k") as short,
        Relay(upstream_url=short.base_url, upstream_api_key="k") as relay,
    ):
        grant = relay.register("r1")
        client = openai.AsyncOpenAI(base_url=grant.base_url, api_key=grant.token)
        answer = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "What is 2 * 6?"}]
        )
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "What is 3 * 6?"}], stream=True
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        await client.close()
        relay.end("r1")
    assert answer.usage is not None and answer.usage.completion_tokens is not None
    assert answer.choices[0].message.content == "12" and "".join(parts) == "18"
