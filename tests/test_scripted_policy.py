"""The scripted policy: deterministic OpenAI-compatible answers, labelled as scripted."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import openai
import pytest
from pydantic import ValidationError

from backends.relay import Relay
from backends.relay.scripted import Script, ScriptedPolicy, arithmetic, fake_token_ids

pytestmark = pytest.mark.anyio

TOOL_SCRIPT = Script.model_validate(
    {
        "name": "tools",
        "rules": [
            {
                "name": "files",
                "prompt": r"(?i)list the files in (?P<dir>\S+)",
                "turns": [
                    {"tool_calls": [{"name": "ls", "arguments": {"path": "{dir}"}}]},
                    {"content": "I listed {dir}."},
                ],
            },
            {"rollout": "^broken-", "turns": [{"error_status": 503}]},
            {"rollout": "^vip-", "prompt": "hello", "turns": [{"content": "Hello, VIP."}]},
        ],
    }
)


@pytest.mark.parametrize(
    ("question", "answer"),
    [
        ("What is 7 * 6? Answer with just the number.", "42"),
        ("What is 12 + 30?", "42"),
        ("what is 50 - 8", "42"),
        ("What is 10 / 4?", "2.5"),
        ("6 * 7?", "42"),
        ("What is -3 * 4?", "-12"),
    ],
)
async def test_default_script_answers_arithmetic(question: str, answer: str) -> None:
    async with ScriptedPolicy() as policy:
        client = openai.AsyncOpenAI(base_url=policy.base_url, api_key="anything")
        reply = await client.chat.completions.create(
            model="whatever", messages=[{"role": "user", "content": question}]
        )
        await client.close()
    assert reply.choices[0].message.content == answer
    assert reply.model == "scripted:default" and reply.system_fingerprint == "scripted"


def test_arithmetic_edge_cases() -> None:
    assert arithmetic("1", "/", "0") == "undefined"
    assert arithmetic("0.1", "+", "0.2") == "0.3"
    assert arithmetic("3", "x", "4") == "12"


async def test_answers_are_labelled_scripted_everywhere() -> None:
    async with ScriptedPolicy() as policy, aiohttp.ClientSession() as http:
        async with http.post(
            policy.base_url + "/chat/completions",
            json={"messages": [{"role": "user", "content": "hello"}]},
        ) as r:
            body = await r.json()
            assert r.headers["x-scripted-policy"] == "default"
        async with http.get(policy.base_url + "/models") as r:
            assert (await r.json())["data"][0]["id"] == "scripted:default"
    assert body["model"] == "scripted:default"
    assert "scripted policy" in body["choices"][0]["message"]["content"]


async def test_tool_call_turns_follow_the_conversation_statelessly() -> None:
    async with ScriptedPolicy(TOOL_SCRIPT) as policy:
        client = openai.AsyncOpenAI(base_url=policy.base_url, api_key="k")
        messages: list[dict[str, object]] = [
            {"role": "user", "content": "Please list the files in /tmp"}
        ]
        first = await client.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
        call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
        assert first.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "ls"  # type: ignore[union-attr]
        assert json.loads(call.function.arguments) == {"path": "/tmp"}  # type: ignore[union-attr]
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "a.txt"},
        ]
        second = await client.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
        assert second.choices[0].message.content == "I listed /tmp."
        # Asking again gives the same answer: no hidden state between calls.
        again = await client.chat.completions.create(model="m", messages=messages[:1])  # type: ignore[arg-type]
        assert again.choices[0].message.tool_calls == first.choices[0].message.tool_calls
        third = await client.chat.completions.create(
            model="m",
            messages=[*messages, second.choices[0].message.model_dump(exclude_none=True)],  # type: ignore[list-item]
        )
        assert third.choices[0].message.content == "(end of script)"
        await client.close()


async def test_streaming_matches_non_streaming_with_token_ids_and_usage() -> None:
    async with ScriptedPolicy(TOOL_SCRIPT) as policy:
        async with Relay(upstream_url=policy.base_url, request_token_ids=True) as relay:
            grant = relay.register("r1")
            client = openai.AsyncOpenAI(base_url=grant.base_url, api_key=grant.token)
            for prompt in ("list the files in /srv", "nothing matches this"):
                messages = [{"role": "user", "content": prompt}]
                await client.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
                stream = await client.chat.completions.create(
                    model="m",
                    messages=messages,  # type: ignore[arg-type]
                    stream=True,
                    stream_options={"include_usage": True},
                )
                usage = [c.usage async for c in stream if c.usage]
                assert usage and usage[0].completion_tokens > 0
            await client.close()
            trace = relay.end("r1")
    plain, streamed = trace.calls[0], trace.calls[1]
    assert streamed.choices[0].message == plain.choices[0].message
    assert plain.choices[0].message and plain.choices[0].message["tool_calls"][0]["function"] == {
        "name": "ls",
        "arguments": '{"path": "/srv"}',
    }
    for call in trace.calls:
        assert call.completion_token_ids and call.logprobs and call.prompt_token_ids
        assert len(call.completion_token_ids) == len(call.logprobs)
        assert (
            call.completion_token_ids
            == trace.calls[call.index - call.index % 2].completion_token_ids
        )
    text = trace.calls[2].choices[0].message["content"]  # type: ignore[index]
    assert trace.calls[2].completion_token_ids == fake_token_ids(text)
    assert trace.calls[3].usage and trace.calls[3].usage["completion_tokens"] == len(text)


async def test_rules_by_rollout_id_through_the_relay() -> None:
    async with ScriptedPolicy(TOOL_SCRIPT) as policy, Relay(upstream_url=policy.base_url) as relay:
        answers = {}
        for rid in ("vip-1", "plain-1", "broken-1"):
            grant = relay.register(rid)
            client = openai.AsyncOpenAI(base_url=grant.base_url, api_key=grant.token, max_retries=0)
            try:
                reply = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hello"}]
                )
                answers[rid] = reply.choices[0].message.content
            except openai.InternalServerError:
                answers[rid] = "503"
            await client.close()
            trace = relay.end(rid)
            assert (trace.policy_failure() is not None) == (rid == "broken-1")
    assert answers == {
        "vip-1": "Hello, VIP.",
        "plain-1": "I have no scripted answer for that.",
        "broken-1": "503",
    }


async def test_api_key_is_enforced_when_set() -> None:
    async with ScriptedPolicy(api_key="right") as policy:
        client = openai.AsyncOpenAI(base_url=policy.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()
        await client.close()


def test_script_files_load_and_bad_scripts_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(TOOL_SCRIPT.model_dump_json())
    assert Script.load(path) == TOOL_SCRIPT
    with pytest.raises(ValidationError, match="invalid regex"):
        Script.model_validate({"rules": [{"prompt": "(", "turns": [{"content": "x"}]}]})
    with pytest.raises(ValidationError, match="needs content"):
        Script.model_validate({"default": [{}]})
    with pytest.raises(ValidationError, match="prompt or rollout"):
        Script.model_validate({"rules": [{"turns": [{"content": "x"}]}]})
    with pytest.raises(ValidationError):
        Script.model_validate({"rules": [], "surprise": 1})
