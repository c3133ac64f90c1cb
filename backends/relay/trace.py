"""What the relay records about a rollout's policy calls, and how its trace is built.

The hot path only appends a ``RawCall`` (bytes and timings). Parsing, reassembling streamed
responses and extracting token ids and logprobs happen here, once, when the trace is read.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

# The models live in the rollout contract (results carry them); imported from here as before.
from backends.relay.wire import BY_NAME, CHAT
from backends.rollout.trace import CallError, CallRecord, ChoiceRecord, RolloutTrace


@dataclass(slots=True, eq=False)
class RawCall:
    """The hot path's record of a call: bytes and clock readings, parsed only when read."""

    index: int
    method: str
    path: str
    started_at: float
    t0: float  # perf_counter at arrival
    # Only the bytes are kept: a parsed copy of every long conversation would cost several
    # times the memory, for every call of every live rollout.
    request_body: bytes
    stream: bool
    policy_version: str | None
    api: str = CHAT  # what the agent spoke
    # What the upstream spoke; the request and response bytes are in this format.
    upstream_api: str = CHAT
    attempts: int = 1
    generation: int = 0  # bumped by a folded retry; a superseded attempt stops writing
    done: bool = False
    latency_s: float | None = None
    ttfb_s: float | None = None
    status: int | None = None
    upstream_status: int | None = None
    error: CallError | None = None
    error_message: str | None = None
    response_body: bytes | None = None
    chunks: list[bytes] = field(default_factory=list)


def build_trace(
    rollout_id: str, registered_at: float, calls: list[RawCall], *, ended: bool
) -> RolloutTrace:
    return RolloutTrace(
        rollout_id=rollout_id,
        registered_at=registered_at,
        ended_at=time.time() if ended else None,
        calls=[build_call(raw) for raw in calls],
    )


def build_call(raw: RawCall) -> CallRecord:
    # Fields are gathered first and the models built once: setting attributes on a built
    # pydantic model costs more than building it.
    fields: dict[str, Any] = {
        "index": raw.index,
        "method": raw.method,
        "path": raw.path,
        "started_at": raw.started_at,
        "latency_s": raw.latency_s,
        "ttfb_s": raw.ttfb_s,
        "status": raw.status,
        "upstream_status": raw.upstream_status,
        "error": raw.error,
        "error_message": raw.error_message,
        "stream": raw.stream,
        "attempts": raw.attempts,
        "api": raw.api,
        "upstream_api": raw.upstream_api,
        "request": _loads_object(raw.request_body) if raw.request_body else None,
        "policy_version": raw.policy_version,
    }
    if not raw.done:
        fields["error"] = CallError.INTERRUPTED
        fields["error_message"] = "the call was still in flight when the trace was read"
    native = BY_NAME[raw.upstream_api] if raw.upstream_api != CHAT else None
    response: dict[str, Any] | None
    if raw.chunks and native is not None and native.reassemble is not None:
        response = native.reassemble(b"".join(raw.chunks))
    elif raw.chunks:
        response = reassemble_stream(b"".join(raw.chunks))
    elif raw.response_body:
        response = _loads_object(raw.response_body)
    else:
        response = None
    if response is not None:
        fields["response"] = response
        # A native answer is read in chat form; an error body has no choices to read.
        completion = response
        if native is not None and native.as_chat_completion is not None:
            answered = raw.upstream_status is not None and raw.upstream_status < 400
            completion = native.as_chat_completion(response) if answered else {}
        if isinstance(completion.get("model"), str):
            fields["model"] = completion["model"]
        if isinstance(completion.get("usage"), dict):
            fields["usage"] = completion["usage"]
        prompt_ids = completion.get("prompt_token_ids")
        choices = completion.get("choices")
        if isinstance(choices, list):
            fields["choices"] = [_choice(c) for c in choices if isinstance(c, dict)]
            if prompt_ids is None and choices and isinstance(choices[0], dict):
                prompt_ids = choices[0].get("prompt_token_ids")  # some servers put it per choice
        if _is_int_list(prompt_ids):
            fields["prompt_token_ids"] = prompt_ids
        if native is None:
            _drop_extracted(response, fields)
    return CallRecord(**fields)


def _drop_extracted(response: dict[str, Any], fields: dict[str, Any]) -> None:
    # The parsed response is ours alone: remove from it what the record's fields now hold.
    has_prompt_ids = "prompt_token_ids" in fields
    if has_prompt_ids:
        response.pop("prompt_token_ids", None)
    choices = response.get("choices")
    raws = [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []
    for raw, choice in zip(raws, fields.get("choices", []), strict=False):
        if has_prompt_ids:
            raw.pop("prompt_token_ids", None)
        if choice.token_ids is not None and raw.get("token_ids") is not None:
            raw.pop("token_ids")
        logprobs = raw.get("logprobs")
        content = logprobs.get("content") if isinstance(logprobs, dict) else None
        if choice.logprobs is not None and choice.logprob_tokens is not None and _plain(content):
            del logprobs["content"]  # type: ignore[union-attr]  # all of it is in the record


def _choice(raw: dict[str, Any]) -> ChoiceRecord:
    message = raw.get("message")
    index = raw.get("index")
    finish = raw.get("finish_reason")
    token_ids = raw.get("token_ids")
    fields: dict[str, Any] = {
        "index": index if isinstance(index, int) else 0,
        "message": message if isinstance(message, dict) else None,
        "finish_reason": finish if isinstance(finish, str) else None,
        "token_ids": token_ids if _is_int_list(token_ids) else None,
    }
    logprobs = raw.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if isinstance(content, list) and content:
        entries = [e for e in content if isinstance(e, dict)]
        values = [e.get("logprob") for e in entries]
        tokens = [e.get("token") for e in entries]
        if all(isinstance(v, int | float) for v in values):
            fields["logprobs"] = [float(v) for v in values if isinstance(v, int | float)]
        if all(isinstance(t, str) for t in tokens):
            strings = [t for t in tokens if isinstance(t, str)]
            fields["logprob_tokens"] = strings
            if fields["token_ids"] is None:
                fields["token_ids"] = _ids_from_token_strings(strings)
    return ChoiceRecord(**fields)


def _plain(content: Any) -> bool:
    # Entries with nothing the record lacks: no alternatives beyond the sampled token.
    return isinstance(content, list) and all(
        isinstance(e, dict) and not e.get("top_logprobs") and e.keys() <= _PLAIN_LOGPROB
        for e in content
    )


_PLAIN_LOGPROB = frozenset({"token", "logprob", "bytes", "top_logprobs"})


def _ids_from_token_strings(tokens: list[str]) -> list[int] | None:
    # vLLM's --return-tokens-as-token-ids spells each logprob token "token_id:<id>".
    ids = []
    for token in tokens:
        prefix, _, number = token.partition(":")
        if prefix != "token_id" or not number.isdigit():
            return None
        ids.append(int(number))
    return ids


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(type(v) is int for v in value)


def _loads_object(body: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # a body nested deeper than the parser goes
        return None
    return value if isinstance(value, dict) else None


def reassemble_stream(body: bytes) -> dict[str, Any] | None:
    """Rebuild a ``chat.completion`` object from the SSE chunks of a streamed one.

    Text deltas are concatenated, tool-call deltas merged by index, per-token logprobs and token
    ids appended in order; the usage chunk (if any) supplies usage. Returns None if no chunk
    parses (e.g. the upstream answered an error).
    """
    merged: dict[str, Any] | None = None
    choices: dict[int, dict[str, Any]] = {}
    for event in body.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = b"\n".join(
            line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
        )
        if not data or data == b"[DONE]":
            continue
        chunk = _loads_object(data)
        if chunk is None:
            continue
        if merged is None:
            merged = {k: v for k, v in chunk.items() if k != "choices"}
            merged["object"] = "chat.completion"
        else:
            for key, value in chunk.items():
                if key not in ("choices", "object") and value is not None:
                    merged[key] = value if key != "prompt_token_ids" else merged.get(key, value)
        for delta_choice in chunk.get("choices") or []:
            if isinstance(delta_choice, dict):
                _merge_choice(choices, delta_choice)
    if merged is None:
        if body.lstrip().startswith(b"{"):
            return _loads_object(body)  # an error answered as plain JSON
        return None
    merged["choices"] = [choices[i] for i in sorted(choices)]
    return merged


def _merge_choice(choices: dict[int, dict[str, Any]], part: dict[str, Any]) -> None:
    index = part.get("index", 0)
    choice = choices.setdefault(
        index,
        {"index": index, "message": {"role": "assistant", "content": None}, "finish_reason": None},
    )
    message = choice["message"]
    delta = part.get("delta") or {}
    for key, value in delta.items():
        if key == "tool_calls" and isinstance(value, list):
            _merge_tool_calls(message.setdefault("tool_calls", []), value)
        elif isinstance(value, str) and key != "role":
            message[key] = (message.get(key) or "") + value
        elif value is not None:
            message[key] = value
    if part.get("finish_reason") is not None:
        choice["finish_reason"] = part["finish_reason"]
    token_ids = part.get("token_ids")
    if isinstance(token_ids, list):
        choice.setdefault("token_ids", []).extend(token_ids)
    if isinstance(part.get("prompt_token_ids"), list):
        choice.setdefault("prompt_token_ids", part["prompt_token_ids"])
    logprobs = part.get("logprobs")
    if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
        target = choice.setdefault("logprobs", {"content": []})
        target["content"].extend(logprobs["content"])


def _merge_tool_calls(calls: list[dict[str, Any]], deltas: list[Any]) -> None:
    for delta in deltas:
        if not isinstance(delta, dict):
            continue
        index = delta.get("index", len(calls))
        while len(calls) <= index:
            calls.append(
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
        call = calls[index]
        if delta.get("id"):
            call["id"] = delta["id"]
        if delta.get("type"):
            call["type"] = delta["type"]
        function = delta.get("function") or {}
        if function.get("name"):
            call["function"]["name"] += function["name"]
        if function.get("arguments"):
            call["function"]["arguments"] += function["arguments"]
