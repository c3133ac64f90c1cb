"""The embedded scripted policy: an OpenAI-compatible server that answers from a script.

It speaks chat completions, and the Responses and Anthropic Messages APIs too (``/v1/responses``,
``/v1/messages``, through the relay's own translation), so it can stand in for an upstream that
speaks those natively.

It lets the main job, the demos and the tests run the real agent path (agent -> relay -> policy)
with no model. Answers are deterministic and stateless: the turn to play is the number of
assistant messages since the last user message, so retries and concurrent rollouts need no
server state. Every answer says it is scripted: ``"model": "scripted:<name>"``, the
``system_fingerprint`` ``"scripted"`` and an ``x-scripted-policy`` response header.

Script format (JSON, see ``scripts/default.json``)::

    {"name": "demo",
     "rules": [{"prompt": "(?i)hello", "turns": [{"content": "Hi!"}]},
               {"rollout": "^tool-", "turns": [
                   {"tool_calls": [{"name": "ls", "arguments": {"path": "."}}]},
                   {"content": "done"}]}],
     "default": [{"content": "I have no scripted answer for that."}]}

A rule matches when its ``prompt`` regex is found in the last user message and/or its
``rollout`` regex in the rollout id (the relay sends it as ``x-session-id``). Contents and
tool-call arguments are templates: ``{name}`` is replaced by the regex group of that name, and
``{result}`` by the value of ``a op b`` when the regex has groups ``a``, ``op`` and ``b``.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import anyio
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from backends.asgi import Receive, Scope, Send, send_json
from backends.relay.app import _reply, _reply_error
from backends.relay.serving import Served, serve_asgi
from backends.relay.wire import BY_ROUTE, CHAT_WIRE, Translation

SCRIPTED_HEADER = b"x-scripted-policy"
_ROLLOUT_HEADERS = (b"x-session-id", b"x-rollout-id")
_TEMPLATE = re.compile(r"\{(\w+)\}")


class ToolCallSpec(BaseModel):
    """A tool call the scripted assistant makes."""

    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)
    id: str | None = None


class Turn(BaseModel):
    """One assistant turn: text, tool calls, or both; or a simulated policy failure."""

    model_config = ConfigDict(extra="forbid")

    content: str | None = None
    tool_calls: list[ToolCallSpec] = Field(default_factory=list)
    # Answer this HTTP error instead (e.g. 500 or 503), to exercise policy-failure handling.
    error_status: int | None = Field(default=None, ge=400, le=599)
    delay_s: float = Field(default=0.0, ge=0.0, le=3600.0)  # wait before answering

    @model_validator(mode="after")
    def _says_something(self) -> Turn:
        if self.content is None and not self.tool_calls and self.error_status is None:
            raise ValueError("a turn needs content, tool_calls or error_status")
        return self


class Rule(BaseModel):
    """Turns to play when ``prompt`` (last user message) and/or ``rollout`` (id) match."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    prompt: str | None = None
    rollout: str | None = None
    turns: list[Turn] = Field(min_length=1)

    @field_validator("prompt", "rollout")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"invalid regex {value!r}: {exc}") from exc
        return value

    @model_validator(mode="after")
    def _matches_something(self) -> Rule:
        if self.prompt is None and self.rollout is None:
            raise ValueError("a rule needs a prompt or rollout regex (use 'default' otherwise)")
        return self


class Script(BaseModel):
    """What the scripted policy says. Load with ``Script.load(path)``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(default="script", pattern=r"^[\w.-]{1,64}$")
    rules: list[Rule] = Field(default_factory=list)
    default: list[Turn] = Field(
        default_factory=lambda: [Turn(content="I have no scripted answer for that.")],
        min_length=1,
    )
    # Played once every turn of the matched rule has been played.
    exhausted: Turn = Field(default_factory=lambda: Turn(content="(end of script)"))

    @classmethod
    def load(cls, path: str | Path) -> Script:
        """Read a script file. Raises ``OSError`` or ``pydantic.ValidationError``."""
        return cls.model_validate_json(Path(path).read_bytes())

    @classmethod
    def default_script(cls) -> Script:
        """The shipped script: greets, and computes ``What is A * B`` (and + - /) questions."""
        text = resources.files("backends.relay").joinpath("scripts/default.json").read_bytes()
        return cls.model_validate_json(text)

    def reply(self, messages: list[Any], rollout_id: str | None) -> Reply:
        """The turn to play for this conversation, rendered."""
        last_user, played = _position(messages)
        for rule in self.rules:
            groups = _match(rule, last_user, rollout_id)
            if groups is not None:
                return _render(rule.turns, played, groups, self.exhausted, rule.name)
        return _render(self.default, played, {}, self.exhausted, "default")


@dataclass(frozen=True)
class Reply:
    """A rendered turn."""

    rule: str | None
    content: str | None
    tool_calls: list[dict[str, Any]]
    error_status: int | None
    delay_s: float

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.tool_calls else "stop"

    def text_for_tokens(self) -> str:
        """What the fake tokenizer counts: the content, then the tool calls as JSON."""
        calls = json.dumps([c["function"] for c in self.tool_calls]) if self.tool_calls else ""
        return (self.content or "") + calls


def _position(messages: list[Any]) -> tuple[str, int]:
    """The last user message's text and how many assistant turns followed it."""
    played = 0
    for message in reversed(messages):
        if not isinstance(message, dict):
            continue
        if message.get("role") == "assistant":
            played += 1
        elif message.get("role") == "user":
            return _text(message.get("content")), played
    return "", played


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _match(rule: Rule, prompt: str, rollout_id: str | None) -> dict[str, str] | None:
    groups: dict[str, str] = {}
    if rule.rollout is not None:
        found = re.search(rule.rollout, rollout_id or "")
        if found is None:
            return None
        groups.update({k: v for k, v in found.groupdict().items() if v is not None})
    if rule.prompt is not None:
        found = re.search(rule.prompt, prompt)
        if found is None:
            return None
        groups.update({k: v for k, v in found.groupdict().items() if v is not None})
    if {"a", "op", "b"} <= groups.keys():
        groups["result"] = arithmetic(groups["a"], groups["op"], groups["b"])
    return groups


def arithmetic(a: str, op: str, b: str) -> str:
    """``a op b`` as the shortest exact text: "42", "2.5"; "undefined" for division by 0."""
    x, y = float(a), float(b)
    if op in ("*", "x", "X", "\u00d7"):  # times sign
        value = x * y
    elif op == "+":
        value = x + y
    elif op in ("-", "\u2212"):  # minus sign
        value = x - y
    elif op in ("/", "\u00f7"):  # division sign
        if y == 0:
            return "undefined"
        value = x / y
    else:
        raise ValueError(f"unknown operator {op!r}")
    if math.isfinite(value) and value == int(value) and abs(value) < 2**53:
        return str(int(value))
    return repr(round(value, 10))


def _render(
    turns: list[Turn], played: int, groups: dict[str, str], exhausted: Turn, rule: str | None
) -> Reply:
    turn = turns[played] if played < len(turns) else exhausted

    def fill(text: str) -> str:
        return _TEMPLATE.sub(lambda m: groups.get(m.group(1), m.group(0)), text)

    calls = []
    for i, call in enumerate(turn.tool_calls):
        if isinstance(call.arguments, str):
            arguments = fill(call.arguments)
        else:
            arguments = json.dumps(_fill_values(call.arguments, fill))
        calls.append(
            {
                "id": call.id or f"call_{played}_{i}",
                "type": "function",
                "function": {"name": call.name, "arguments": arguments},
            }
        )
    return Reply(
        rule=rule,
        content=fill(turn.content) if turn.content is not None else None,
        tool_calls=calls,
        error_status=turn.error_status,
        delay_s=turn.delay_s,
    )


def _fill_values(value: Any, fill: Any) -> Any:
    if isinstance(value, str):
        return fill(value)
    if isinstance(value, dict):
        return {k: _fill_values(v, fill) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill_values(v, fill) for v in value]
    return value


# --- the server ------------------------------------------------------------------------------


def fake_token_ids(text: str) -> list[int]:
    """The scripted policy's 'tokenizer': one token per character, its code point as the id."""
    return [ord(c) for c in text]


def fake_logprob(position: int) -> float:
    return -0.01 * (1 + position % 7)


@dataclass
class ReceivedCall:
    """A request the scripted policy answered, for tests to inspect."""

    rollout_id: str | None
    authorization: str | None
    request: dict[str, Any]  # as chat completions (translated if it came in another format)
    api: str = CHAT_WIRE.name  # the format it came in


class ScriptedPolicyApp:
    """ASGI app: ``/v1/chat/completions`` (and ``/v1/responses``, ``/v1/messages``) and
    ``/v1/models`` answered from a ``Script``."""

    def __init__(self, script: Script, *, api_key: str | None = None) -> None:
        self.script = script
        self.model = f"scripted:{script.name}"
        self.api_key = api_key
        self.calls: list[ReceivedCall] = []
        self._header = [(SCRIPTED_HEADER, script.name.encode())]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path: str = scope["path"].rstrip("/")
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization")
        if self.api_key is not None and auth != f"Bearer {self.api_key}".encode():
            return await _reply_error(
                send, 401, "wrong or missing API key", "invalid_api_key", "authentication_error"
            )
        if path.endswith("/v1/models") and scope["method"] == "GET":
            body = {
                "object": "list",
                "data": [
                    {"id": self.model, "object": "model", "created": 0, "owned_by": "scripted"}
                ],
            }
            return await self._json(send, 200, body)
        route = "v1/" + path.rpartition("/v1/")[2] if "/v1/" in path else ""
        wire = BY_ROUTE.get(route)
        if wire is None or scope["method"] != "POST":
            return await _reply_error(send, 404, f"no route {scope['method']} {path}", "not_found")
        raw = b""
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            raw += message.get("body", b"")
            more = message.get("more_body", False)
        translation: Translation | None = None
        try:
            request = json.loads(raw)
            if wire is not CHAT_WIRE and wire.translate is not None:
                translation = wire.translate(request if isinstance(request, dict) else {})
                request = translation.chat_request
            if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
                raise ValueError("expected an object with a 'messages' list")
        except (ValueError, RecursionError) as exc:  # WireError included
            refusal = wire.error_body(
                400, f"invalid request: {exc}", "invalid_request", "invalid_request_error"
            )
            return await _reply(send, 400, refusal)
        rollout_id = next((headers[h].decode() for h in _ROLLOUT_HEADERS if h in headers), None)
        self.calls.append(
            ReceivedCall(rollout_id, auth.decode() if auth else None, request, wire.name)
        )
        reply = self.script.reply(request["messages"], rollout_id)
        if reply.delay_s:
            await anyio.sleep(reply.delay_s)
        if reply.error_status is not None:
            text = f"scripted failure (rule {reply.rule!r})"
            failure = wire.error_body(reply.error_status, text, "scripted_error", "server_error")
            return await _reply(send, reply.error_status, failure)
        tokens = bool(request.get("logprobs") or request.get("return_token_ids"))
        prompt = "\n".join(
            _text(m.get("content")) for m in request["messages"] if isinstance(m, dict)
        )
        if request.get("stream") is True:
            usage = bool((request.get("stream_options") or {}).get("include_usage"))
            await self._stream(send, reply, prompt, tokens, usage, translation)
        elif translation is not None:
            answer = translation.answer(self._completion(reply, prompt, tokens))
            await send_json(send, 200, answer, self._header)
        else:
            await self._json(send, 200, self._completion(reply, prompt, tokens))

    def _completion(self, reply: Reply, prompt: str, tokens: bool) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            message["tool_calls"] = reply.tool_calls
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": reply.finish_reason,
            "logprobs": None,
        }
        text = reply.text_for_tokens()
        body = self._envelope("chat.completion")
        if tokens:
            choice["token_ids"] = fake_token_ids(text)
            choice["logprobs"] = {"content": _logprob_entries(text, 0)}
            body["prompt_token_ids"] = fake_token_ids(prompt)
        body["choices"] = [choice]
        body["usage"] = _usage(prompt, text)
        return body

    async def _stream(
        self,
        send: Send,
        reply: Reply,
        prompt: str,
        tokens: bool,
        usage: bool,
        translation: Translation | None,
    ) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream"),
                    (b"cache-control", b"no-cache"),
                    *self._header,
                ],
            }
        )
        translated = translation.stream() if translation is not None else None
        for chunk in self._chunks(reply, prompt, tokens, usage):
            if translated is not None:
                chunk = translated.feed(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        tail = translated.finish() if translated is not None else b""
        await send({"type": "http.response.body", "body": tail})

    def _chunks(self, reply: Reply, prompt: str, tokens: bool, usage: bool) -> Iterator[bytes]:
        """The answer as chat-completions SSE events."""
        position = 0
        first = True
        for delta, text in _deltas(reply):
            chunk = self._envelope("chat.completion.chunk")
            choice: dict[str, Any] = {
                "index": 0,
                "delta": delta,
                "finish_reason": None,
                "logprobs": None,
            }
            if tokens:
                choice["token_ids"] = fake_token_ids(text)
                choice["logprobs"] = {"content": _logprob_entries(text, position)}
                if first:
                    chunk["prompt_token_ids"] = fake_token_ids(prompt)
            first = False
            position += len(text)
            chunk["choices"] = [choice]
            yield _sse(chunk)
        final = self._envelope("chat.completion.chunk")
        final["choices"] = [
            {"index": 0, "delta": {}, "finish_reason": reply.finish_reason, "logprobs": None}
        ]
        yield _sse(final)
        if usage:
            tail = self._envelope("chat.completion.chunk")
            tail["choices"] = []
            tail["usage"] = _usage(prompt, reply.text_for_tokens())
            yield _sse(tail)
        yield b"data: [DONE]\n\n"

    def _envelope(self, kind: str) -> dict[str, Any]:
        return {
            "id": "chatcmpl-scripted",
            "object": kind,
            "created": int(time.time()),
            "model": self.model,
            "system_fingerprint": "scripted",
        }

    async def _json(self, send: Send, status: int, body: dict[str, Any]) -> None:
        await send_json(send, status, json.dumps(body).encode(), self._header)


def _deltas(reply: Reply) -> Iterator[tuple[dict[str, Any], str]]:
    """Stream deltas and the text each one accounts for (for token ids and logprobs)."""
    yield {"role": "assistant"} | ({"content": ""} if reply.content is not None else {}), ""
    for word in re.findall(r"\S+\s*|\s+", reply.content or ""):
        yield {"content": word}, word
    for i, call in enumerate(reply.tool_calls):
        head = {
            "index": i,
            "id": call["id"],
            "type": "function",
            "function": {"name": call["function"]["name"], "arguments": ""},
        }
        yield {"tool_calls": [head]}, ""
        arguments = call["function"]["arguments"]
        yield {"tool_calls": [{"index": i, "function": {"arguments": arguments}}]}, ""
    if reply.tool_calls:  # the tool calls' tokens, counted as text_for_tokens counts them
        yield {}, reply.text_for_tokens()[len(reply.content or "") :]


def _logprob_entries(text: str, start: int) -> list[dict[str, Any]]:
    return [
        {
            "token": c,
            "logprob": fake_logprob(start + i),
            "bytes": list(c.encode()),
            "top_logprobs": [],
        }
        for i, c in enumerate(text)
    ]


def _usage(prompt: str, completion: str) -> dict[str, int]:
    return {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(completion),
        "total_tokens": len(prompt) + len(completion),
    }


def _sse(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


class ScriptedPolicy(Served):
    """The scripted policy served from this process.

    ``async with ScriptedPolicy(script) as policy:`` serves on ``policy.base_url``
    (``http://127.0.0.1:<port>/v1``); with no script, the shipped default script.
    ``policy.calls`` lists the requests it answered.
    """

    def __init__(
        self,
        script: Script | str | Path | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        embedded: bool = True,
    ) -> None:
        if script is None:
            script = Script.default_script()
        elif not isinstance(script, Script):
            script = Script.load(script)
        self.app = ScriptedPolicyApp(script, api_key=api_key)
        self._host, self._port, self._embedded = host, port, embedded

    @property
    def script(self) -> Script:
        return self.app.script

    @property
    def model(self) -> str:
        return self.app.model

    @property
    def calls(self) -> list[ReceivedCall]:
        return self.app.calls

    @property
    def base_url(self) -> str:
        if self._listening is None:
            raise RuntimeError("the scripted policy is not serving: use `async with`")
        return self._listening.origin + "/v1"

    async def _open(self, stack: contextlib.AsyncExitStack) -> None:
        self._listening = await stack.enter_async_context(
            serve_asgi(self.app, host=self._host, port=self._port, embedded=self._embedded)
        )
