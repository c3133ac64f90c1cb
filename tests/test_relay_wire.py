"""The relay speaks Responses and Anthropic Messages to agents, chat completions upstream.

Real HTTP throughout: the official ``openai`` and ``anthropic`` clients, as agents use them, call
the real relay, which calls the real scripted policy. Every answer and event is checked against
the SDKs' own type definitions, every call against the trace.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.responses import Response, ResponseStreamEvent
from policy_support import chat_upstream
from pydantic import TypeAdapter

from backends.relay import Relay, RelaySettings
from backends.relay.scripted import Script, ScriptedPolicy
from backends.rollout.trace import CallError, RolloutTrace
from backends.trajectory import to_trajectory
from backends.trajectory.policy_metrics import agent_step_metrics

pytestmark = pytest.mark.anyio

KEY = "sk-upstream-secret-0123456789abcdef"
QUESTION = "Use the calculator: what is 6 * 7?"
CALCULATOR = {
    "type": "object",
    "properties": {"a": {"type": "string"}, "op": {"type": "string"}, "b": {"type": "string"}},
}
RESPONSE_EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
MESSAGE_EVENTS: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)


_CLIENTS: list[openai.AsyncOpenAI | anthropic.AsyncAnthropic] = []


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    while _CLIENTS:
        await _CLIENTS.pop().close()


@pytest.fixture
async def scripted() -> AsyncIterator[ScriptedPolicy]:
    async with ScriptedPolicy(api_key=KEY) as policy:
        yield policy


@pytest.fixture
async def relay(scripted: ScriptedPolicy) -> AsyncIterator[Relay]:
    async with Relay(
        upstream_url=scripted.base_url, upstream_api_key=KEY, request_token_ids=True
    ) as relay:
        yield relay


def _openai(relay: Relay, rollout_id: str, token: str | None = None) -> openai.AsyncOpenAI:
    grant_url = relay.rollout_base_url(rollout_id)
    client = openai.AsyncOpenAI(base_url=grant_url, api_key=token or "", max_retries=0)
    _CLIENTS.append(client)
    return client


def _anthropic(relay: Relay, rollout_id: str, token: str) -> anthropic.AsyncAnthropic:
    # Anthropic clients add /v1/messages themselves.
    base = relay.rollout_base_url(rollout_id).removesuffix("/v1")
    client = anthropic.AsyncAnthropic(base_url=base, api_key=token, max_retries=0)
    _CLIENTS.append(client)
    return client


async def _responses_turn(
    client: openai.AsyncOpenAI, items: list[dict[str, Any]], stream: bool
) -> Response:
    tools: Any = [{"type": "function", "name": "calculator", "parameters": CALCULATOR}]
    if not stream:
        return await client.responses.create(
            model="policy",
            instructions="You are terse.",
            input=items,
            tools=tools,  # type: ignore[arg-type]
        )
    async with client.responses.stream(
        model="policy",
        instructions="You are terse.",
        input=items,
        tools=tools,  # type: ignore[arg-type]
    ) as events:
        async for _ in events:
            pass
        return await events.get_final_response()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_responses_tool_call_round_trip_with_the_openai_client(
    relay: Relay, scripted: ScriptedPolicy, stream: bool
) -> None:
    grant = relay.register("resp-1")
    client = _openai(relay, "resp-1", grant.token)
    items: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]

    first = await _responses_turn(client, items, stream)
    assert first.status == "completed"
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "calculator"
    assert json.loads(call.arguments) == {"a": "6", "op": "*", "b": "7"}

    items += [
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "42"},
    ]  # fmt: skip
    second = await _responses_turn(client, items, stream)
    assert second.output_text == "42"
    assert second.usage is not None and second.usage.output_tokens == 2

    # Upstream, the policy saw chat completions: instructions as the system message, the call
    # and its output as an assistant tool call and a tool message.
    seen = scripted.calls[-1]
    assert seen.api == "chat.completions" and seen.rollout_id == "resp-1"
    assert [m["role"] for m in seen.request["messages"]] == ["system", "user", "assistant", "tool"]
    assert seen.request["messages"][2]["tool_calls"][0]["id"] == call.call_id
    assert seen.request["tools"][0]["function"]["name"] == "calculator"

    trace = relay.end("resp-1")
    assert [(c.api, c.upstream_api, c.path, c.status, c.stream) for c in trace.calls] == [
        ("responses", "chat.completions", "/responses", 200, stream)
    ] * 2
    tool_turn, answer_turn = trace.calls
    assert tool_turn.choices[0].message["tool_calls"][0]["function"]["name"] == "calculator"  # type: ignore[index]
    assert tool_turn.finish_reason == "tool_calls"
    assert answer_turn.choices[0].message == {"role": "assistant", "content": "42"}
    # The scripted policy's tokenizer: one id per character.
    assert answer_turn.completion_token_ids == [ord("4"), ord("2")]
    assert answer_turn.logprobs == [-0.01, -0.02]
    assert answer_turn.prompt_token_ids and answer_turn.usage == {
        "prompt_tokens": len(answer_turn.prompt_token_ids),
        "completion_tokens": 2,
        "total_tokens": len(answer_turn.prompt_token_ids) + 2,
    }
    assert answer_turn.request and answer_turn.request["messages"][0] == {
        "role": "system",
        "content": "You are terse.",
    }


async def _messages_turn(
    client: anthropic.AsyncAnthropic, messages: list[dict[str, Any]], stream: bool
) -> Message:
    tools: Any = [{"name": "calculator", "description": "computes", "input_schema": CALCULATOR}]
    if not stream:
        return await client.messages.create(
            model="policy",
            max_tokens=256,
            system="You are terse.",
            messages=messages,
            tools=tools,  # type: ignore[arg-type]
        )
    async with client.messages.stream(
        model="policy",
        max_tokens=256,
        system="You are terse.",
        messages=messages,
        tools=tools,  # type: ignore[arg-type]
    ) as events:
        return await events.get_final_message()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_messages_tool_use_round_trip_with_the_anthropic_client(
    relay: Relay, scripted: ScriptedPolicy, stream: bool
) -> None:
    grant = relay.register("msg-1")
    client = _anthropic(relay, "msg-1", grant.token)
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]

    first = await _messages_turn(client, messages, stream)
    assert first.stop_reason == "tool_use"
    (use,) = [block for block in first.content if block.type == "tool_use"]
    assert use.name == "calculator" and use.input == {"a": "6", "op": "*", "b": "7"}

    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": "42"}]},
    ]  # fmt: skip
    second = await _messages_turn(client, messages, stream)
    assert second.stop_reason == "end_turn"
    assert [(b.type, getattr(b, "text", None)) for b in second.content] == [("text", "42")]
    assert second.usage.output_tokens == 2 and second.usage.input_tokens > 0

    seen = scripted.calls[-1]
    assert [m["role"] for m in seen.request["messages"]] == ["system", "user", "assistant", "tool"]
    assert seen.request["messages"][3] == {"role": "tool", "tool_call_id": use.id, "content": "42"}
    assert seen.authorization == f"Bearer {KEY}"  # the relay's key upstream, not the token

    trace = relay.end("msg-1")
    assert [(c.api, c.path, c.status) for c in trace.calls] == [("messages", "/messages", 200)] * 2
    assert trace.calls[1].completion_token_ids == [ord("4"), ord("2")]
    assert trace.calls[1].logprobs == [-0.01, -0.02]


async def test_every_format_gives_the_same_trajectory_and_training_data(relay: Relay) -> None:
    """One conversation spoken three ways: the ATIF trajectories, with the token ids and
    logprobs the trainer reads, are the same."""
    trajectories = []
    for api in ("chat", "responses", "messages"):
        grant = relay.register(f"same-{api}")
        if api == "chat":
            client = _openai(relay, grant.rollout_id, grant.token)
            tools: Any = [{"type": "function", "function": {"name": "calculator",
                                                            "parameters": CALCULATOR}}]  # fmt: skip
            history: list[dict[str, Any]] = [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": QUESTION},
            ]
            one = await client.chat.completions.create(
                model="policy",
                messages=history,
                tools=tools,  # type: ignore[arg-type]
            )
            call = one.choices[0].message.tool_calls[0]  # type: ignore[index]
            history += [
                one.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "42"},
            ]
            await client.chat.completions.create(model="policy", messages=history, tools=tools)  # type: ignore[arg-type]
        elif api == "responses":
            client = _openai(relay, grant.rollout_id, grant.token)
            items: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
            out = await _responses_turn(client, items, stream=True)
            fc = out.output[0]
            assert fc.type == "function_call"
            items += [
                {"type": "function_call", "call_id": fc.call_id, "name": fc.name,
                 "arguments": fc.arguments},
                {"type": "function_call_output", "call_id": fc.call_id, "output": "42"},
            ]  # fmt: skip
            await _responses_turn(client, items, stream=False)
        else:
            claude = _anthropic(relay, grant.rollout_id, grant.token)
            messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
            msg = await _messages_turn(claude, messages, stream=False)
            use = msg.content[0]
            assert use.type == "tool_use"
            messages += [
                {"role": "assistant", "content": [use.model_dump()]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": "42"}]},
            ]  # fmt: skip
            await _messages_turn(claude, messages, stream=True)
        trace = relay.end(grant.rollout_id)
        # The sample as an agent's trajectory gives it: what the policy saw, then its answer.
        last = trace.calls[-1]
        assert last.request is not None and last.choices[0].message is not None
        sample = [*last.request["messages"], last.choices[0].message]
        metrics = agent_step_metrics(sample, trace.model_dump(mode="json"))
        assert all(m is not None and m.completion_token_ids for m in metrics)
        doc = to_trajectory(sample, agent_step_metrics=metrics).to_json_dict()
        for step in doc["steps"]:
            ((step.get("metrics") or {}).get("extra") or {}).pop("latency_s", None)
        trajectories.append(doc)
    assert trajectories[0] == trajectories[1] == trajectories[2]
    agent_steps = [s for s in trajectories[0]["steps"] if s["source"] == "agent"]
    assert agent_steps[-1]["metrics"]["completion_token_ids"] == [ord("4"), ord("2")]
    assert agent_steps[-1]["metrics"]["logprobs"] == [-0.01, -0.02]


async def _raw(
    url: str, body: bytes | dict[str, Any], headers: dict[str, str]
) -> tuple[int, bytes, str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            url, data=data, headers={"content-type": "application/json", **headers}
        ) as response,
    ):
        return response.status, await response.read(), response.headers.get("content-type", "")


async def test_raw_events_follow_each_formats_grammar(relay: Relay) -> None:
    """Every event parses as the SDK's event type; sequence numbers and block indexes hold."""
    grant = relay.register("grammar")
    base = grant.base_url
    auth = {"authorization": f"Bearer {grant.token}"}
    tools = [{"type": "function", "name": "calculator", "parameters": CALCULATOR}]
    for question in ("What is 6 * 7?", QUESTION):
        status, body, kind = await _raw(
            base + "/responses",
            {"model": "p", "input": question, "stream": True, "tools": tools,
             "include": ["message.output_text.logprobs"]},
            auth,
        )  # fmt: skip
        assert status == 200 and kind.startswith("text/event-stream")
        events = _sse(body)
        assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
        for name, event in events:
            assert name == event["type"]
            RESPONSE_EVENTS.validate_python(event)
        assert events[0][0] == "response.created" and events[-1][0] == "response.completed"
        final = Response.model_validate(events[-1][1]["response"])
        if question == QUESTION:
            assert [o.type for o in final.output] == ["function_call"]
        else:
            (text,) = [e for n, e in events if n == "response.output_text.done"]
            assert text["text"] == "42" and [p["logprob"] for p in text["logprobs"]] == [
                -0.01,
                -0.02,
            ]

        status, body, _ = await _raw(
            base.removesuffix("/v1") + "/v1/messages",
            {"model": "p", "max_tokens": 64, "stream": True,
             "messages": [{"role": "user", "content": question}],
             "tools": [{"name": "calculator", "input_schema": CALCULATOR}]},
            {"x-api-key": grant.token, "anthropic-version": "2023-06-01"},
        )  # fmt: skip
        assert status == 200
        events = _sse(body)
        open_block = None
        for name, event in events:
            assert name == event["type"]
            MESSAGE_EVENTS.validate_python(event)
            if name == "content_block_start":
                assert open_block is None
                open_block = event["index"]
            elif name in ("content_block_delta", "content_block_stop"):
                assert event["index"] == open_block
                if name == "content_block_stop":
                    open_block = None
        assert [n for n, _ in events][:1] == ["message_start"]
        assert [n for n, _ in events][-2:] == ["message_delta", "message_stop"]
    relay.end("grammar")


def _sse(body: bytes) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in body.decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in lines:
            events.append((lines.get("event", ""), json.loads(lines["data"])))
    return events


async def test_tokens_are_scoped_per_rollout_in_each_format(
    relay: Relay, scripted: ScriptedPolicy
) -> None:
    mine, other = relay.register("mine"), relay.register("other")
    before = len(scripted.calls)

    # Responses: OpenAI's error shape, as the openai client raises it.
    with pytest.raises(openai.PermissionDeniedError) as refused:
        await _openai(relay, "mine", other.token).responses.create(model="p", input="hi")
    assert "not valid for rollout 'mine'" in refused.value.message
    status, body, _ = await _raw(mine.base_url + "/responses", {"model": "p", "input": "hi"}, {})
    assert status == 401
    assert json.loads(body)["error"]["message"] == (
        "missing token: send 'Authorization: Bearer <rollout token>'"
    )

    # Messages: Anthropic's error shape, as the anthropic client raises it.
    with pytest.raises(anthropic.PermissionDeniedError) as denied:
        await _anthropic(relay, "mine", other.token).messages.create(
            model="p", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert denied.value.body == {
        "type": "error",
        "error": {
            "type": "permission_error",
            "message": "this token is not valid for rollout 'mine'",
            "code": "invalid_token",
        },
    }
    status, body, _ = await _raw(
        mine.base_url + "/messages",
        {"model": "p", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
        {"anthropic-version": "2023-06-01"},
    )
    assert status == 401
    assert json.loads(body)["error"] == {
        "type": "authentication_error",
        "message": "missing token: send 'x-api-key <rollout token>'",
        "code": "missing_token",
    }

    # Routes the relay does not serve (count_tokens) are refused in the client's shape too.
    with pytest.raises(anthropic.NotFoundError, match="is not relayed"):
        await _anthropic(relay, "mine", mine.token).messages.count_tokens(
            model="p", messages=[{"role": "user", "content": "hi"}]
        )

    # An ended rollout's token is refused in its format too.
    relay.end("other")
    with pytest.raises(anthropic.PermissionDeniedError, match="has ended"):
        await _anthropic(relay, "other", other.token).messages.create(
            model="p", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert len(scripted.calls) == before  # nothing reached the policy
    assert relay.end("mine").calls == []


# A parser's recursion limit is no excuse for a 500 (the chat route gave one before).
NESTED = b'{"input": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
BAD_RESPONSES = [
    (b"{not json", "request body is not valid JSON"),
    (NESTED, "nested too deeply"),
    (b"[1, 2]", "request body must be a JSON object"),
    ({"model": "p"}, "input must be a list"),
    ({"model": "p", "input": [{"role": "robot", "content": "x"}]}, "input[0].role is 'robot'"),
    ({"model": "p", "input": [{"type": "teleport"}]}, "input[0] has type 'teleport'"),
    ({"model": "p", "input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    (
        {"model": "p", "input": [{"type": "function_call_output", "output": "x"}]},
        "input[0].call_id must be a string",
    ),
    ({"model": "p", "input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
]
BAD_MESSAGES = [
    (b"{not json", "request body is not valid JSON"),
    (NESTED, "nested too deeply"),
    ({"model": "p", "messages": [{"role": "user", "content": "x"}]}, "max_tokens is required"),
    ({"model": "p", "max_tokens": 5, "messages": []}, "at least one message"),
    (
        {"model": "p", "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]},
        "messages[0].role is 'robot'",
    ),
    (
        {
            "model": "p",
            "max_tokens": 5,
            "messages": [{"role": "user", "content": [{"type": "tool_result"}]}],
        },
        "messages[0].content[0].tool_use_id must be a string",
    ),
    (
        {
            "model": "p",
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "x"}],
            "tool_choice": {"type": "maybe"},
            "tools": [{"name": "t", "input_schema": {}}],
        },
        "tool_choice.type is 'maybe'",
    ),
]


async def test_malformed_bodies_get_a_4xx_naming_the_problem_and_never_reach_upstream(
    relay: Relay, scripted: ScriptedPolicy
) -> None:
    grant = relay.register("bad")
    before = len(scripted.calls)
    for body, problem in BAD_RESPONSES:
        status, answer, _ = await _raw(
            grant.base_url + "/responses", body, {"authorization": f"Bearer {grant.token}"}
        )
        error = json.loads(answer)["error"]
        assert status == 400 and problem in error["message"], (body, error)
        assert error["type"] == "invalid_request_error"
    for body, problem in BAD_MESSAGES:
        status, answer, _ = await _raw(
            grant.base_url + "/messages", body, {"x-api-key": grant.token}
        )
        parsed = json.loads(answer)
        assert status == 400 and parsed["type"] == "error", (body, parsed)
        assert parsed["error"]["type"] == "invalid_request_error"
        assert problem in parsed["error"]["message"], (body, parsed)
    status, answer, _ = await _raw(
        grant.base_url + "/chat/completions", NESTED, {"authorization": f"Bearer {grant.token}"}
    )
    assert status == 400 and "nested too deeply" in json.loads(answer)["error"]["message"]
    assert len(scripted.calls) == before
    # The rollout is unharmed: a good call still works, and only it is in the trace.
    answer = await _openai(relay, "bad", grant.token).responses.create(model="p", input="2 + 2")
    assert answer.output_text == "4"
    assert [c.path for c in relay.end("bad").calls] == ["/responses"]


async def test_oversized_bodies_are_refused_in_each_format(scripted: ScriptedPolicy) -> None:
    settings = RelaySettings(max_request_bytes=4096)
    async with Relay(upstream_url=scripted.base_url, upstream_api_key=KEY, settings=settings) as r:
        grant = r.register("big")
        huge = "x" * 5000
        with pytest.raises(openai.APIStatusError) as responses_refusal:
            await _openai(r, "big", grant.token).responses.create(model="p", input=huge)
        assert responses_refusal.value.status_code == 413
        assert "exceeds the relay's limit of 4096 bytes" in responses_refusal.value.message
        with pytest.raises(anthropic.APIStatusError) as messages_refusal:
            await _anthropic(r, "big", grant.token).messages.create(
                model="p", max_tokens=8, messages=[{"role": "user", "content": huge}]
            )
        assert messages_refusal.value.status_code == 413
        body: Any = messages_refusal.value.body
        assert body["error"]["type"] == "request_too_large"
        assert r.end("big").calls == [] and scripted.calls == []


async def test_policy_failures_reach_the_agent_in_its_format_and_the_trace() -> None:
    script = Script.model_validate(
        {"rules": [{"prompt": "fail", "turns": [{"error_status": 503}]}]}
    )
    async with (
        ScriptedPolicy(script) as policy,
        Relay(upstream_url=policy.base_url) as relay,
    ):
        grant = relay.register("down")
        with pytest.raises(anthropic.InternalServerError) as failed:
            await _anthropic(relay, "down", grant.token).messages.create(
                model="p", max_tokens=8, messages=[{"role": "user", "content": "fail"}]
            )
        assert failed.value.status_code == 503
        body: Any = failed.value.body
        assert body["error"]["type"] == "api_error"
        assert "scripted failure" in body["error"]["message"]
        with pytest.raises(openai.InternalServerError):
            await _openai(relay, "down", grant.token).responses.create(
                model="p", input="fail", stream=True
            )
        trace = relay.end("down")
        assert [(c.api, c.upstream_status) for c in trace.calls] == [
            ("messages", 503),
            ("responses", 503),
        ]
        failure = trace.policy_failure()
        assert failure is not None and failure.upstream_status == 503


@pytest.fixture
async def odd_upstream() -> AsyncIterator[str]:
    """An upstream that breaks mid-stream, or answers 200 with something that is no completion."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("model") == "echo":  # an error that quotes the request's credentials
            seen = request.headers.get("authorization", "")
            return web.json_response({"error": {"message": f"bad key {seen}"}}, status=400)
        if not body.get("stream"):
            return web.json_response({"id": "x", "object": "chat.completion", "choices": []})
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"model": "m", "choices": [{"index": 0, "delta": {"content": "thinking"}}]}
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        assert request.transport is not None
        request.transport.abort()  # the server dies mid-answer
        return response

    async with chat_upstream(chat) as url:
        yield url


async def test_the_upstream_key_never_reaches_the_agent_in_a_translated_error(
    odd_upstream: str,
) -> None:
    async with Relay(upstream_url=odd_upstream, upstream_api_key=KEY) as relay:
        grant = relay.register("echo")
        for stream in (False, True):
            with pytest.raises(anthropic.BadRequestError) as refused:
                await _anthropic(relay, "echo", grant.token).messages.create(
                    model="echo",
                    max_tokens=8,
                    messages=[{"role": "user", "content": "x"}],
                    stream=stream,
                )
            body: Any = refused.value.body
            assert body["error"]["message"] == "bad key Bearer ***"
            with pytest.raises(openai.BadRequestError) as told:
                await _openai(relay, "echo", grant.token).responses.create(
                    model="echo", input="x", stream=stream
                )
            assert KEY not in str(told.value.body) and "***" in str(told.value.body)
        relay.end("echo")


async def test_broken_upstreams_end_each_stream_in_its_own_grammar(odd_upstream: str) -> None:
    async with Relay(upstream_url=odd_upstream) as relay:
        grant = relay.register("odd")
        auth = {"authorization": f"Bearer {grant.token}"}
        status, body, _ = await _raw(
            grant.base_url + "/responses", {"model": "p", "input": "x", "stream": True}, auth
        )
        events = _sse(body)
        assert status == 200 and [n for n, _ in events][-2:] == ["error", "response.failed"]
        for _, event in events:
            RESPONSE_EVENTS.validate_python(event)
        assert "could not be reached or dropped the connection" in events[-2][1]["message"]

        status, body, _ = await _raw(
            grant.base_url + "/messages",
            {"model": "p", "max_tokens": 9, "stream": True,
             "messages": [{"role": "user", "content": "x"}]},
            auth,
        )  # fmt: skip
        events = _sse(body)
        assert [n for n, _ in events][-1] == "error"
        assert events[-1][1]["error"]["type"] == "api_error"

        # A 200 that is no chat completion: a 502 saying so, a policy failure in the trace.
        with pytest.raises(anthropic.APIStatusError) as bad:
            await _anthropic(relay, "odd", grant.token).messages.create(
                model="p", max_tokens=8, messages=[{"role": "user", "content": "x"}]
            )
        assert bad.value.status_code == 502 and "cannot be given as messages" in str(bad.value)
        trace = relay.end("odd")
        assert [c.error for c in trace.calls] == [
            CallError.CONNECTION,
            CallError.CONNECTION,
            CallError.UNTRANSLATABLE,
        ]
        assert trace.calls[0].choices[0].message == {"role": "assistant", "content": "thinking"}
        assert trace.policy_failure() is not None


async def test_custom_tools_round_trip_as_custom_tool_calls() -> None:
    """Codex's free-form tools (apply_patch) are functions taking {"input"} upstream."""
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
    script = Script.model_validate(
        {"rules": [{"prompt": "patch", "turns": [
            {"tool_calls": [{"name": "apply_patch", "arguments": {"input": patch}}]},
            {"content": "patched"}]}]}
    )  # fmt: skip
    async with ScriptedPolicy(script) as policy, Relay(upstream_url=policy.base_url) as relay:
        grant = relay.register("codex-like")
        client = _openai(relay, "codex-like", grant.token)
        tools: Any = [{"type": "custom", "name": "apply_patch", "description": "edit files"},
                      {"type": "web_search"}]  # fmt: skip
        for stream in (False, True):
            items: list[Any] = [{"role": "user", "content": "patch it"}]
            if stream:
                async with client.responses.stream(model="p", input=items, tools=tools) as s:
                    first = await s.get_final_response()
            else:
                first = await client.responses.create(model="p", input=items, tools=tools)
            (call,) = first.output
            assert call.type == "custom_tool_call" and call.input == patch
            items += [
                {"type": "custom_tool_call", "call_id": call.call_id, "name": call.name,
                 "input": call.input},
                {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done"},
            ]  # fmt: skip
            second = await client.responses.create(model="p", input=items, tools=tools)
            assert second.output_text == "patched"
        upstream_tools = policy.calls[-1].request["tools"]
        # The hosted web search has no chat-completions form: left out, not refused.
        assert [t["function"]["name"] for t in upstream_tools] == ["apply_patch"]
        trace: RolloutTrace = relay.end("codex-like")
        assert trace.calls[0].choices[0].message["tool_calls"][0]["function"] == {  # type: ignore[index]
            "name": "apply_patch",
            "arguments": json.dumps({"input": patch}),
        }


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_native_upstream_gets_the_agents_bytes_and_the_trace_reads_them(
    stream: bool,
) -> None:
    """With native_apis the relay forwards Responses/Messages as they came (here to the scripted
    policy, which speaks both) and still traces each call in chat form."""
    settings = RelaySettings(native_apis=frozenset({"responses", "messages"}))
    async with (
        ScriptedPolicy(api_key=KEY) as policy,
        Relay(upstream_url=policy.base_url, upstream_api_key=KEY, settings=settings) as relay,
    ):
        grant = relay.register("native")
        answer = await _responses_turn(
            _openai(relay, "native", grant.token),
            [{"role": "user", "content": QUESTION}],
            stream,
        )
        assert answer.output[0].type == "function_call"
        message = await _messages_turn(
            _anthropic(relay, "native", grant.token),
            [{"role": "user", "content": "What is 6 * 7?"}],
            stream,
        )
        assert message.content[0].type == "text" and message.content[0].text == "42"
        assert [c.api for c in policy.calls] == ["responses", "messages"]
        trace = relay.end("native")
        assert [(c.api, c.upstream_api, c.status) for c in trace.calls] == [
            ("responses", "responses", 200),
            ("messages", "messages", 200),
        ]
        responses_call, messages_call = trace.calls
        assert responses_call.request and responses_call.request["input"][0]["content"] == QUESTION
        assert responses_call.finish_reason == "tool_calls"
        assert responses_call.choices[0].message["tool_calls"][0]["function"]["name"] == (  # type: ignore[index]
            "calculator"
        )
        assert messages_call.choices[0].message == {"role": "assistant", "content": "42"}
        assert messages_call.usage and messages_call.usage["completion_tokens"] == 2
        assert messages_call.model == "scripted:default"


def _vllm_like(request: dict[str, Any]) -> list[dict[str, Any]]:
    """Chunks as vLLM streams them: reasoning, then text, and a finish by model name:
    ``thinker`` stops normally, ``long`` runs out of tokens, ``stopper`` hits a stop string."""
    model = request["model"]
    finish = {"long": "length"}.get(model, "stop")
    chunks: list[dict[str, Any]] = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "reasoning_content": "Six "}}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "sevens."}}]},
        {"choices": [{"index": 0, "delta": {"content": "4"}}]},
        {"choices": [{"index": 0, "delta": {"content": "2"}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": finish,
                      "stop_reason": "END" if model == "stopper" else None}]},
        {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13,
                                  "prompt_tokens_details": {"cached_tokens": 3}}},
    ]  # fmt: skip
    for chunk in chunks:
        chunk.update({"id": "c", "object": "chat.completion.chunk", "model": model})
    return chunks


@pytest.fixture
async def vllm_like() -> AsyncIterator[str]:
    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chunks = _vllm_like(body)
        if not body.get("stream"):
            message = {
                "role": "assistant",
                "reasoning_content": "Six sevens.",
                "content": "42",
            }
            last = chunks[-2]["choices"][0]
            choice = {"index": 0, "message": message, "finish_reason": last["finish_reason"],
                      "stop_reason": last["stop_reason"]}  # fmt: skip
            return web.json_response(
                {"model": body["model"], "choices": [choice], "usage": chunks[-1]["usage"]}
            )
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for chunk in chunks:
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    async with chat_upstream(chat) as url:
        yield url


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_reasoning_stops_and_usage_translate_both_ways(vllm_like: str, stream: bool) -> None:
    async with Relay(upstream_url=vllm_like) as relay:
        grant = relay.register("think")
        client = _openai(relay, "think", grant.token)
        claude = _anthropic(relay, "think", grant.token)
        for model in ("thinker", "long", "stopper"):
            if stream:
                # The SDK's typed events; the last one holds the response (the stream helper
                # only finishes on response.completed, not on an incomplete answer's event).
                events = [e async for e in await client.responses.create(
                    model=model, input="6*7?", stream=True)]  # fmt: skip
                assert events[-1].type == (
                    "response.incomplete" if model == "long" else "response.completed"
                )
                answer = events[-1].response  # type: ignore[union-attr]
            else:
                answer = await client.responses.create(model=model, input="6*7?")
            assert [o.type for o in answer.output] == ["reasoning", "message"]
            reasoning = answer.output[0]
            assert reasoning.type == "reasoning" and reasoning.content is not None
            assert reasoning.content[0].text == "Six sevens."
            assert answer.output_text == "42" and answer.model == model
            assert answer.status == ("incomplete" if model == "long" else "completed")
            assert answer.usage is not None
            assert (answer.usage.input_tokens, answer.usage.output_tokens) == (9, 4)
            assert answer.usage.input_tokens_details.cached_tokens == 3

            ask: Any = {
                "model": model,
                "max_tokens": 64,
                "messages": [{"role": "user", "content": "6*7?"}],
                "stop_sequences": ["END"],
            }
            if stream:
                async with claude.messages.stream(**ask) as message_events:
                    message = await message_events.get_final_message()
            else:
                message = await claude.messages.create(**ask)
            assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
                    for b in message.content] == [("thinking", "Six sevens."), ("text", "42")]  # fmt: skip
            stop = {"thinker": "end_turn", "long": "max_tokens", "stopper": "stop_sequence"}
            assert message.stop_reason == stop[model]
            assert message.stop_sequence == ("END" if model == "stopper" else None)
            # Anthropic counts cache reads apart from the other input tokens.
            assert (message.usage.input_tokens, message.usage.cache_read_input_tokens) == (6, 3)
            assert message.usage.output_tokens == 4
        trace = relay.end("think")
        assert {c.choices[0].message["reasoning_content"] for c in trace.calls} == {"Six sevens."}  # type: ignore[index]
        assert trace.calls[-1].request and trace.calls[-1].request["stop"] == ["END"]


async def test_request_translation_keeps_images_turns_and_tool_history() -> None:
    """What the policy sees of multimodal and multi-turn requests in each format."""
    from backends.relay.wire.messages import Translation as MessagesTranslation
    from backends.relay.wire.responses import Translation as ResponsesTranslation

    image = "data:image/png;base64,iVBORw0KGgo="
    responses = ResponsesTranslation(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": "Use tools."},
                {"role": "user", "content": [
                    {"type": "input_text", "text": "What is this?"},
                    {"type": "input_image", "image_url": image, "detail": "low"}]},
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Look."}]},
                {"type": "message", "role": "assistant",
                 "content": [{"type": "output_text", "text": "Let me check."}]},
                {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "zoom", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "a cat"},
                {"type": "function_call_output", "call_id": "c2",
                 "output": [{"type": "input_text", "text": "a big cat"}]},
            ],
            "tools": [{"type": "function", "name": "look", "parameters": {}},
                      {"type": "function", "name": "zoom", "parameters": {}}],
            "tool_choice": {"type": "function", "name": "look"},
            "max_output_tokens": 50,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}},
        }
    ).chat_request  # fmt: skip
    assert responses["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": image, "detail": "low"}}]},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Look.",
         "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}},
             {"id": "c2", "type": "function", "function": {"name": "zoom", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a cat"},
        {"role": "tool", "tool_call_id": "c2", "content": "a big cat"},
    ]  # fmt: skip
    assert responses["tool_choice"] == {"type": "function", "function": {"name": "look"}}
    assert responses["max_tokens"] == 50
    assert responses["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {}},
    }

    messages = MessagesTranslation(
        {
            "model": "m",
            "max_tokens": 10,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": "iVBORw0KGgo="}}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Look.", "signature": "s"},
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "t1", "name": "look", "input": {"q": 1}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                     "content": [{"type": "text", "text": "blurry"}]},
                    {"type": "text", "text": "Try again."}]},
            ],
            "tools": [{"name": "look", "input_schema": {"type": "object"}},
                      {"type": "web_search_20250305", "name": "web_search"}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        }
    ).chat_request  # fmt: skip
    assert messages["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": image}}]},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Look.",
         "tool_calls": [{"id": "t1", "type": "function",
                         "function": {"name": "look", "arguments": '{"q": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "Error: blurry"},
        {"role": "user", "content": "Try again."},
    ]  # fmt: skip
    assert [t["function"]["name"] for t in messages["tools"]] == ["look"]  # server tool left out
    assert (messages["tool_choice"], messages["parallel_tool_calls"]) == ("required", False)


_ODD: list[Any] = [None, 0, -1, 1.5, True, "", "x", [], [1], {}, {"type": "text"}, {"type": 5}]


def _mutated(base: Any, rng: random.Random) -> Any:
    """``base`` with one to three values anywhere in it replaced by odd JSON, or removed."""
    value = copy.deepcopy(base)
    places: list[tuple[Any, Any]] = []

    def walk(node: Any) -> None:
        keys = node.keys() if isinstance(node, dict) else range(len(node))
        for key in keys:
            places.append((node, key))
            if isinstance(node[key], dict | list):
                walk(node[key])

    walk(value)
    for _ in range(rng.randint(1, 3)):
        node, key = rng.choice(places)
        try:
            if isinstance(node, dict) and rng.random() < 0.2:
                del node[key]
            else:
                node[key] = copy.deepcopy(rng.choice(_ODD))
        except (KeyError, IndexError):
            pass  # a place an earlier mutation removed
    return value


async def test_any_json_is_translated_or_refused_never_a_crash() -> None:
    """Seeded fuzz of both translations, requests and answers: anything else than a
    ``WireError`` (a 400 naming the field) would be a 500 for the agent."""
    from backends.relay.wire import MESSAGES_WIRE, RESPONSES_WIRE, WireError

    responses_request = {
        "model": "m", "instructions": "i", "stream": True, "include": ["message.output_text.logprobs"],
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "q"},
                                         {"type": "input_image", "image_url": "data:,"}]},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]},
            {"type": "function_call", "call_id": "c", "name": "n", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "o"},
            {"type": "custom_tool_call", "call_id": "d", "name": "p", "input": "x"}],
        "tools": [{"type": "function", "name": "n", "parameters": {}}, {"type": "custom", "name": "p"}],
        "tool_choice": {"type": "function", "name": "n"}, "reasoning": {"effort": "low"},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}},
    }  # fmt: skip
    messages_request = {
        "model": "m", "max_tokens": 5, "stream": True, "stop_sequences": ["x"],
        "system": [{"type": "text", "text": "s"}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "q"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "t"}, {"type": "text", "text": "a"},
                {"type": "tool_use", "id": "t", "name": "n", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
                {"type": "text", "text": "r"}, {"type": "image", "source": {"type": "url", "url": "u"}}]}]}],
        "tools": [{"name": "n", "input_schema": {}}], "tool_choice": {"type": "tool", "name": "n"},
    }  # fmt: skip
    completion = {
        "model": "m",
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
        "choices": [{"index": 0, "finish_reason": "tool_calls",
                     "logprobs": {"content": [{"token": "a", "logprob": -1.0}]},
                     "message": {"role": "assistant", "content": "a", "reasoning_content": "r",
                                 "tool_calls": [{"id": "x", "type": "function",
                                                 "function": {"name": "p", "arguments": "{}"}}]}}],
    }  # fmt: skip
    rng = random.Random(12)
    translated = refused = 0
    for wire, request in ((RESPONSES_WIRE, responses_request), (MESSAGES_WIRE, messages_request)):
        assert wire.translate is not None
        for _ in range(1500):
            try:
                translation = wire.translate(_mutated(request, rng))
                json.dumps(translation.chat_request)
            except WireError:
                refused += 1
                continue
            translated += 1
            odd = _mutated(completion, rng)
            with contextlib.suppress(WireError):
                json.loads(translation.answer(odd))
            stream = translation.stream()
            choice = (
                odd["choices"][0] if isinstance(odd.get("choices"), list) and odd["choices"] else {}
            )
            delta = choice.get("message") if isinstance(choice, dict) else None
            chunk = {
                "model": "m",
                "choices": [{"index": 0, "delta": delta, "finish_reason": "stop"}],
            }
            noise = bytes(rng.randrange(256) for _ in range(rng.randint(0, 30)))
            events = stream.feed(b"data: " + json.dumps(chunk).encode() + b"\n\n" + noise)
            events += stream.finish()
            assert events.endswith(b"\n\n")
    assert translated > 200 and refused > 1000  # both outcomes were exercised
