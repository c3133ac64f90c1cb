"""Anthropic's Messages API (``POST /v1/messages``) spoken over a chat-completions upstream.

Claude Code and the ``anthropic`` SDK speak it (``x-api-key`` carries the rollout token). The
request becomes a chat completions request (``system`` a system message, ``tool_use`` blocks
``tool_calls``, ``tool_result`` blocks ``tool`` messages, images data URLs); the answer becomes a
``message`` with ``thinking``, ``text`` and ``tool_use`` blocks and Anthropic's stop reasons, or
its event stream (``message_start``, ``content_block_*``, ``message_delta``, ``message_stop``).

``max_tokens`` is required, as Anthropic requires it. Server tools (web search, code execution,
...) are left out of the upstream request: a chat-completions model cannot call them. Extended
thinking settings are not forwarded (a chat-completions server has no budget for it); the
upstream's reasoning text comes back as ``thinking`` blocks with an empty signature.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from backends.relay.wire.chat import (
    Answer,
    Piece,
    WireError,
    chat_usage,
    need_dict,
    need_list,
    need_str,
    object_arguments,
    sse_event,
    sse_objects,
    usage_counts,
)
from backends.relay.wire.translated import TranslatedStream

NAME = "messages"
PATH = "/messages"

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_body(status: int, message: str, code: str, kind: str) -> bytes:
    """Anthropic's error shape: ``{"type": "error", "error": {"type": ..., "message": ...}}``."""
    error_type = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return json.dumps(
        {"type": "error", "error": {"type": error_type, "message": message, "code": code}}
    ).encode()


def upstream_error(status: int, payload: bytes) -> bytes:
    """An upstream's chat-completions error body, in Anthropic's shape (its message kept)."""
    try:
        error = json.loads(payload).get("error")
    except (ValueError, AttributeError, RecursionError):
        error = None
    message = error.get("message") if isinstance(error, dict) else error
    text = message if isinstance(message, str) else payload.decode("utf-8", "replace")[:2000]
    return error_body(status, text or f"the policy upstream answered HTTP {status}", "upstream", "")


def stream_error(message: str, code: str) -> bytes:
    return sse_event("error", json.loads(error_body(502, message, code, "")))


class Translation:
    """One Messages request as a chat completions request, and its answer back."""

    def __init__(self, request: dict[str, Any]) -> None:
        self.request = request
        self.chat_request = _chat_request(request)

    def answer(self, completion: Any) -> bytes:
        """The ``message`` object for a chat completion. Raises ``WireError``."""
        answer = Answer.of_completion(completion)
        content: list[dict[str, Any]] = []
        if answer.reasoning:
            content.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
        if answer.has_text:
            content.append({"type": "text", "text": answer.text})
        for call in answer.tool_calls:
            content.append(_tool_use(call.id, call.name, call.arguments))
        stop_reason, stop_sequence = self._stop(answer)
        body = {
            "id": _message_id(),
            "type": "message",
            "role": "assistant",
            "model": answer.model or self.request.get("model") or "",
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": _usage(answer.usage),
        }
        return json.dumps(body).encode()

    def stream(self) -> MessagesStream:
        return MessagesStream(self)

    def _stop(self, answer: Answer) -> tuple[str, str | None]:
        stops = self.request.get("stop_sequences") or []
        if answer.finish_reason == "stop" and isinstance(answer.stop_reason, str):
            if answer.stop_reason in stops:  # vLLM names the stop string that matched
                return "stop_sequence", answer.stop_reason
        reason = _STOP_REASONS.get(answer.finish_reason or "stop", "end_turn")
        if answer.tool_calls:
            reason = "tool_use"
        return reason, None


class MessagesStream(TranslatedStream[Translation]):
    """Chat-completions SSE in, the Messages event stream out (``feed`` ... ``finish``)."""

    def __init__(self, translation: Translation) -> None:
        super().__init__(translation)
        self._blocks = 0
        self._open: str | None = None  # "text" | "thinking": the block being streamed

    def _piece(self, piece: Piece) -> bytes:
        out = b""
        kind = "text" if piece.kind == "text" else "thinking"
        if self._open != kind:
            out += self._close_open()
            start = {"type": "text", "text": ""}
            if kind == "thinking":
                start = {"type": "thinking", "thinking": "", "signature": ""}
            out += self._block_start(start)
            self._open = kind
        delta = (
            {"type": "text_delta", "text": piece.text}
            if kind == "text"
            else {"type": "thinking_delta", "thinking": piece.text}
        )
        return out + _event("content_block_delta", index=self._blocks - 1, delta=delta)

    def _end(self, answer: Answer) -> bytes:
        out = self._close_open()
        for call in answer.tool_calls:
            block = _tool_use(call.id, call.name, call.arguments)
            out += self._block_start({**block, "input": {}})
            partial = json.dumps(block["input"])
            out += _event(
                "content_block_delta",
                index=self._blocks - 1,
                delta={"type": "input_json_delta", "partial_json": partial},
            )
            out += _event("content_block_stop", index=self._blocks - 1)
        stop_reason, stop_sequence = self._t._stop(answer)
        out += _event(
            "message_delta",
            delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            usage=_usage(answer.usage),
        )
        return out + _event("message_stop")

    def _error(self, message: str, code: str) -> bytes:
        return stream_error(message, code)

    def _opening(self) -> bytes:
        message: dict[str, Any] = {
            "id": _message_id(),
            "type": "message",
            "role": "assistant",
            "model": self._chat.answer.model or self._t.request.get("model") or "",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            # Known only at the end (chat streams report usage last): see message_delta.
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return _event("message_start", message=message)

    def _block_start(self, block: dict[str, Any]) -> bytes:
        self._blocks += 1
        return _event("content_block_start", index=self._blocks - 1, content_block=block)

    def _close_open(self) -> bytes:
        if self._open is None:
            return b""
        out = b""
        if self._open == "thinking":
            delta = {"type": "signature_delta", "signature": ""}
            out = _event("content_block_delta", index=self._blocks - 1, delta=delta)
        self._open = None
        return out + _event("content_block_stop", index=self._blocks - 1)


def _event(kind: str, **fields: Any) -> bytes:
    return sse_event(kind, {"type": kind, **fields})


def _message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def _tool_use(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": object_arguments(arguments)}


def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    prompt, completion, cached = usage_counts(usage)
    # Anthropic counts cache reads apart from input tokens.
    return {
        "input_tokens": prompt - cached,
        "output_tokens": completion,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _chat_request(request: dict[str, Any]) -> dict[str, Any]:
    max_tokens = request.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise WireError("max_tokens is required and must be a positive integer")
    chat: dict[str, Any] = {"messages": _messages(request), "max_tokens": max_tokens}
    if "model" in request:
        chat["model"] = need_str(request["model"], "model")
    tools = _tools(request.get("tools"))
    if tools:
        chat["tools"] = tools
        choice = request.get("tool_choice")
        if choice is not None:
            chat.update(_tool_choice(choice))
    for field in ("temperature", "top_p", "top_k"):
        if request.get(field) is not None:
            chat[field] = request[field]
    stops = request.get("stop_sequences")
    if stops:
        chat["stop"] = [need_str(s, "stop_sequences[]") for s in need_list(stops, "stop_sequences")]
    if request.get("stream") is True:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def _messages(request: dict[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    system = request.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _system_text(system)})
    given = need_list(request.get("messages"), "messages")
    if not given:
        raise WireError("messages must hold at least one message")
    for i, message in enumerate(given):
        where = f"messages[{i}]"
        message = need_dict(message, where)
        role = message.get("role")
        content = message.get("content")
        if role == "user":
            messages.extend(_user(content, f"{where}.content"))
        elif role == "assistant":
            messages.append(_assistant(content, f"{where}.content"))
        elif role == "system":  # Claude Code's mid-conversation system turns (a beta)
            messages.append(
                {"role": "system", "content": _system_text(content, f"{where}.content")}
            )
        else:
            raise WireError(f"{where}.role is {role!r}: use user, assistant or system")
    return messages


def _system_text(system: Any, where: str = "system") -> str:
    if isinstance(system, str):
        return system
    texts = []
    for i, block in enumerate(need_list(system, where)):
        block = need_dict(block, f"{where}[{i}]")
        if block.get("type") != "text":
            raise WireError(f"{where}[{i}] has type {block.get('type')!r}; use text blocks")
        texts.append(need_str(block.get("text"), f"{where}[{i}].text"))
    return "\n".join(texts)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [need_dict(b, f"{where}[{i}]") for i, b in enumerate(need_list(content, where))]


def _user(content: Any, where: str) -> list[dict[str, Any]]:
    """A user turn: its tool results first (chat wants them right after the tool calls), then
    the rest as one user message."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for i, block in enumerate(_blocks(content, where)):
        kind = block.get("type")
        at = f"{where}[{i}]"
        if kind == "tool_result":
            call_id = need_str(block.get("tool_use_id"), f"{at}.tool_use_id")
            result = block.get("content", "")
            text, images = _result_content(result, f"{at}.content")
            if block.get("is_error") is True:
                text = f"Error: {text}" if text else "Error"
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
            parts.extend(images)
        elif kind == "text":
            parts.append({"type": "text", "text": need_str(block.get("text"), f"{at}.text")})
        elif kind == "image":
            parts.append(_image(block, at))
        elif kind == "document":
            raise WireError(f"{at} is a document, which has no chat completions form")
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise WireError(f"{at} has type {kind!r}, which has no chat completions form")
    if parts:
        text_only = all(p["type"] == "text" for p in parts)
        if text_only and len(parts) == 1:
            out.append({"role": "user", "content": parts[0]["text"]})
        else:
            out.append({"role": "user", "content": parts})
    return out


def _result_content(content: Any, where: str) -> tuple[str, list[dict[str, Any]]]:
    if isinstance(content, str):
        return content, []
    texts: list[str] = []
    images: list[dict[str, Any]] = []
    for i, block in enumerate(_blocks(content, where)):
        if block.get("type") == "text":
            texts.append(need_str(block.get("text"), f"{where}[{i}].text"))
        elif block.get("type") == "image":
            images.append(_image(block, f"{where}[{i}]"))  # a tool message holds text only
        else:
            raise WireError(f"{where}[{i}] has type {block.get('type')!r}: use text or image")
    return "\n".join(texts), images


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = need_dict(block.get("source"), f"{where}.source")
    if source.get("type") == "base64":
        media = need_str(source.get("media_type"), f"{where}.source.media_type")
        data = need_str(source.get("data"), f"{where}.source.data")
        url = f"data:{media};base64,{data}"
    elif source.get("type") == "url":
        url = need_str(source.get("url"), f"{where}.source.url")
    else:
        raise WireError(f"{where}.source.type must be base64 or url")
    return {"type": "image_url", "image_url": {"url": url}}


def _assistant(content: Any, where: str) -> dict[str, Any]:
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for i, block in enumerate(_blocks(content, where)):
        kind = block.get("type")
        at = f"{where}[{i}]"
        if kind == "text":
            texts.append(need_str(block.get("text"), f"{at}.text"))
        elif kind == "tool_use":
            arguments = json.dumps(need_dict(block.get("input", {}), f"{at}.input"))
            calls.append(
                {
                    "id": need_str(block.get("id"), f"{at}.id"),
                    "type": "function",
                    "function": {
                        "name": need_str(block.get("name"), f"{at}.name"),
                        "arguments": arguments,
                    },
                }
            )
        elif kind == "thinking":
            thinking.append(need_str(block.get("thinking"), f"{at}.thinking"))
        elif kind == "redacted_thinking":
            continue
        else:
            raise WireError(f"{at} has type {kind!r}, which an assistant turn cannot hold")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _tools(tools: Any) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(need_list(tools, "tools") if tools is not None else []):
        tool = need_dict(tool, f"tools[{i}]")
        if tool.get("type") not in (None, "custom"):
            continue  # a server tool (web search, bash, editor, ...) that Anthropic runs
        function: dict[str, Any] = {
            "name": need_str(tool.get("name"), f"tools[{i}].name"),
            "parameters": need_dict(tool.get("input_schema"), f"tools[{i}].input_schema"),
        }
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> dict[str, Any]:
    choice = need_dict(choice, "tool_choice")
    kind = choice.get("type")
    out: dict[str, Any]
    if kind == "auto":
        out = {"tool_choice": "auto"}
    elif kind == "any":
        out = {"tool_choice": "required"}
    elif kind == "none":
        out = {"tool_choice": "none"}
    elif kind == "tool":
        name = need_str(choice.get("name"), "tool_choice.name")
        out = {"tool_choice": {"type": "function", "function": {"name": name}}}
    else:
        raise WireError(f"tool_choice.type is {kind!r}: use auto, any, tool or none")
    if choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    return out


# --- a native Messages upstream: its answers read as chat completions, for the trace ---------


def reassemble(body: bytes) -> dict[str, Any] | None:
    """The ``message`` a Messages event stream spelled (None if it never started)."""
    message: dict[str, Any] | None = None
    partial: dict[int, str] = {}
    for payload in sse_objects(body):
        kind = payload.get("type")
        if kind == "message_start" and isinstance(payload.get("message"), dict):
            message = payload["message"]
            message.setdefault("content", [])
        elif message is None:
            continue
        elif kind == "content_block_start" and isinstance(payload.get("content_block"), dict):
            message["content"].append(payload["content_block"])
        elif kind == "content_block_delta" and message["content"]:
            block = message["content"][-1]
            delta = payload.get("delta") or {}
            if delta.get("type") == "text_delta":
                block["text"] = block.get("text", "") + str(delta.get("text", ""))
            elif delta.get("type") == "thinking_delta":
                block["thinking"] = block.get("thinking", "") + str(delta.get("thinking", ""))
            elif delta.get("type") == "input_json_delta":
                index = len(message["content"]) - 1
                partial[index] = partial.get(index, "") + str(delta.get("partial_json", ""))
        elif kind == "message_delta":
            message.update(payload.get("delta") or {})
            usage = message.setdefault("usage", {})
            usage.update(payload.get("usage") or {})
    if message is not None:
        for index, text in partial.items():
            message["content"][index]["input"] = object_arguments(text)
    return message


def as_chat_completion(message: dict[str, Any]) -> dict[str, Any]:
    """A Messages ``message`` in chat-completion form, so its trace reads like any other."""
    texts, thinking, calls = [], [], []
    for block in message.get("content") or []:
        if not isinstance(block, dict):
            continue
        if block.get("type") == "text":
            texts.append(str(block.get("text") or ""))
        elif block.get("type") == "thinking":
            thinking.append(str(block.get("thinking") or ""))
        elif block.get("type") == "tool_use":
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {
                        "name": block.get("name"),
                        "arguments": json.dumps(block.get("input") or {}),
                    },
                }
            )
    reply: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if thinking:
        reply["reasoning_content"] = "".join(thinking)
    if calls:
        reply["tool_calls"] = calls
    finish = {"max_tokens": "length", "tool_use": "tool_calls"}.get(
        str(message.get("stop_reason")), "stop"
    )
    completion: dict[str, Any] = {
        "model": message.get("model"),
        "choices": [{"index": 0, "message": reply, "finish_reason": finish}],
    }
    usage = message.get("usage")
    if isinstance(usage, dict):
        cached = usage.get("cache_read_input_tokens") or 0
        created = usage.get("cache_creation_input_tokens") or 0
        prompt = (usage.get("input_tokens") or 0) + cached + created
        completion["usage"] = chat_usage(prompt, usage.get("output_tokens") or 0, cached)
    return completion
