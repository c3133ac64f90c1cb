"""OpenAI's Responses API (``POST /v1/responses``) spoken over a chat-completions upstream.

Codex and the OpenAI SDK's ``responses.create`` speak it. The request becomes a chat
completions request (``instructions`` a system message, input items messages, function-call
items ``tool_calls``, their outputs ``tool`` messages); the answer becomes a ``response`` object
with ``message``, ``reasoning`` and ``function_call`` output items, or the Responses event
stream (``response.created`` ... ``response.completed``, each event with its sequence number).

Not translatable, and refused with a 400 naming the field: ``previous_response_id`` and
``conversation`` (the relay keeps no server-side state: send the whole input), item references,
and image or file inputs given by file id. Hosted tools (web search, file search, code
interpreter, ...) are left out of the upstream request: a chat-completions model cannot call
them. ``custom`` (free-form) tools become functions taking ``{"input": string}`` and their
calls come back as ``custom_tool_call`` items.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from backends.relay.upstream import error_body as _openai_error
from backends.relay.wire.chat import (
    Answer,
    Piece,
    WireError,
    chat_usage,
    need_dict,
    need_list,
    need_str,
    sse_event,
    sse_objects,
    usage_counts,
)
from backends.relay.wire.translated import TranslatedStream

NAME = "responses"
PATH = "/responses"

# A tuple, not a set: a part's "type" may be any JSON value, and a list is not hashable.
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
_CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {"input": {"type": "string"}},
    "required": ["input"],
}
# Fields copied from the request into the response object, as OpenAI echoes them.
_ECHOED = ("instructions", "max_output_tokens", "metadata", "temperature", "top_p", "user")


def error_body(status: int, message: str, code: str, kind: str) -> bytes:
    """Responses errors have the chat completions shape: ``{"error": {message, type, code}}``."""
    return _openai_error(message, code, kind)


def upstream_error(status: int, payload: bytes) -> bytes:
    return payload  # already OpenAI-shaped


def stream_error(message: str, code: str) -> bytes:
    """An ``error`` event for a stream that broke before any Responses event was sent."""
    return sse_event(
        "error",
        {"type": "error", "code": code, "message": message, "param": None, "sequence_number": 0},
    )


class Translation:
    """One Responses request as a chat completions request, and its answer back."""

    def __init__(self, request: dict[str, Any]) -> None:
        self.request = request
        self.custom_tools: set[str] = set()
        include = request.get("include") or []
        self.want_logprobs = (
            isinstance(include, list) and "message.output_text.logprobs" in include
        ) or isinstance(request.get("top_logprobs"), int)
        self.chat_request = self._chat_request()

    # --- request ---------------------------------------------------------------------------

    def _chat_request(self) -> dict[str, Any]:
        request = self.request
        for field in ("previous_response_id", "conversation"):
            if request.get(field):
                raise WireError(
                    f"{field} is not supported: the relay keeps no responses between calls; "
                    "send the whole conversation as input"
                )
        chat: dict[str, Any] = {"messages": _messages(request)}
        if "model" in request:
            chat["model"] = need_str(request["model"], "model")
        tools = self._tools(request.get("tools"))
        if tools:
            chat["tools"] = tools
            if "tool_choice" in request:
                chat["tool_choice"] = _tool_choice(request["tool_choice"])
            if isinstance(request.get("parallel_tool_calls"), bool):
                chat["parallel_tool_calls"] = request["parallel_tool_calls"]
        for ours, theirs in (
            ("max_output_tokens", "max_tokens"),
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("top_logprobs", "top_logprobs"),
            ("user", "user"),
        ):
            if request.get(ours) is not None:
                chat[theirs] = request[ours]
        if self.want_logprobs:
            chat["logprobs"] = True
        reasoning = request.get("reasoning")
        if isinstance(reasoning, dict) and isinstance(reasoning.get("effort"), str):
            chat["reasoning_effort"] = reasoning["effort"]
        text = request.get("text")
        if isinstance(text, dict) and isinstance(text.get("format"), dict):
            response_format = _response_format(text["format"])
            if response_format is not None:
                chat["response_format"] = response_format
        if request.get("stream") is True:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
        return chat

    def _tools(self, tools: Any) -> list[dict[str, Any]]:
        out = []
        for i, tool in enumerate(need_list(tools, "tools") if tools is not None else []):
            tool = need_dict(tool, f"tools[{i}]")
            kind = tool.get("type")
            if kind == "function":
                function: dict[str, Any] = {"name": need_str(tool.get("name"), f"tools[{i}].name")}
                for key in ("description", "parameters", "strict"):
                    if tool.get(key) is not None:
                        function[key] = tool[key]
                out.append({"type": "function", "function": function})
            elif kind == "custom":
                name = need_str(tool.get("name"), f"tools[{i}].name")
                self.custom_tools.add(name)
                function = {"name": name, "parameters": _CUSTOM_PARAMETERS}
                if isinstance(tool.get("description"), str):
                    function["description"] = tool["description"]
                out.append({"type": "function", "function": function})
            # Hosted tools (web_search, file_search, ...) run at OpenAI: nothing to call here.
        return out

    # --- answer ----------------------------------------------------------------------------

    def answer(self, completion: Any) -> bytes:
        """The ``response`` object for a chat completion. Raises ``WireError``."""
        answer = Answer.of_completion(completion)
        ids = _Ids()
        output = self._items(answer, ids)
        return json.dumps(self._response(ids.response, answer, output, _status(answer))).encode()

    def stream(self) -> ResponsesStream:
        return ResponsesStream(self)

    def _items(self, answer: Answer, ids: _Ids) -> list[dict[str, Any]]:
        """The output items of an answer: reasoning, the message, the tool calls."""
        items: list[dict[str, Any]] = []
        if answer.reasoning:
            items.append(_reasoning_item(ids.new("rs"), answer.reasoning, "completed"))
        if answer.has_text or not answer.tool_calls:
            logprobs = self._logprobs(answer.logprobs)
            items.append(_message_item(ids.new("msg"), answer.text, logprobs, "completed"))
        for call in answer.tool_calls:
            items.append(self._call_item(ids.new("fc"), call.id, call.name, call.arguments))
        return items

    def _call_item(self, item_id: str, call_id: str, name: str, arguments: str) -> dict[str, Any]:
        if name in self.custom_tools:
            try:
                value = json.loads(arguments)
                text = value["input"] if isinstance(value, dict) else arguments
            except (ValueError, KeyError):
                text = arguments
            return {
                "type": "custom_tool_call",
                "id": item_id,
                "call_id": call_id,
                "name": name,
                "input": text if isinstance(text, str) else json.dumps(text),
                "status": "completed",
            }
        return {
            "type": "function_call",
            "id": item_id,
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": "completed",
        }

    def _logprobs(self, entries: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        if not self.want_logprobs or not entries:
            return []
        return [_logprob(e) for e in entries]

    def _response(
        self, response_id: str, answer: Answer | None, output: list[Any], status: str
    ) -> dict[str, Any]:
        request = self.request
        body: dict[str, Any] = {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "model": (answer.model if answer else None) or request.get("model") or "",
            "output": output,
            "parallel_tool_calls": request.get("parallel_tool_calls", True),
            "previous_response_id": None,
            "tool_choice": request.get("tool_choice", "auto"),
            "tools": request.get("tools") or [],
            "text": request.get("text") or {"format": {"type": "text"}},
            "truncation": "disabled",
            "store": False,
            "usage": _usage(answer.usage) if answer is not None else None,
        }
        for field in _ECHOED:
            body[field] = request.get(field)
        if isinstance(request.get("reasoning"), dict):
            body["reasoning"] = request["reasoning"]
        return body


class ResponsesStream(TranslatedStream[Translation]):
    """Chat-completions SSE in, the Responses event stream out (``feed`` ... ``finish``)."""

    def __init__(self, translation: Translation) -> None:
        super().__init__(translation)
        self._ids = _Ids()
        self._seq = 0
        self._output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the reasoning or message item being streamed

    def _piece(self, piece: Piece) -> bytes:
        out = b""
        kind = "message" if piece.kind == "text" else "reasoning"
        if self._open is None or self._open["type"] != kind:
            out += self._close_open()
            out += self._open_item(kind)
        item = self._open
        assert item is not None
        index = len(self._output)
        if kind == "message":
            part = item["content"][0]
            part["text"] += piece.text
            logprobs = self._t._logprobs(piece.logprobs)
            part["logprobs"] += logprobs
            return out + self._event(
                "response.output_text.delta",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                delta=piece.text,
                logprobs=logprobs,
            )
        item["content"][0]["text"] += piece.text
        return out + self._event(
            "response.reasoning_text.delta",
            item_id=item["id"],
            output_index=index,
            content_index=0,
            delta=piece.text,
        )

    def _end(self, answer: Answer) -> bytes:
        out = b""
        if not answer.has_text and not answer.tool_calls and self._open is None:
            out += self._open_item("message")  # an empty answer is still one message item
        out += self._close_open()
        for call in answer.tool_calls:
            item = self._t._call_item(self._ids.new("fc"), call.id, call.name, call.arguments)
            index = len(self._output)
            pending = {**item, "status": "in_progress"}
            custom = item["type"] == "custom_tool_call"
            pending["input" if custom else "arguments"] = ""
            out += self._event("response.output_item.added", output_index=index, item=pending)
            value = item["input"] if custom else item["arguments"]
            kind = "custom_tool_call_input" if custom else "function_call_arguments"
            out += self._event(
                f"response.{kind}.delta", item_id=item["id"], output_index=index, delta=value
            )
            done = {"input": value} if custom else {"arguments": value, "name": item["name"]}
            out += self._event(
                f"response.{kind}.done", item_id=item["id"], output_index=index, **done
            )
            out += self._event("response.output_item.done", output_index=index, item=item)
            self._output.append(item)
        status = _status(answer)
        response = self._t._response(self._ids.response, answer, self._output, status)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + self._event(kind, response=response)

    def _error(self, message: str, code: str) -> bytes:
        out = self._event("error", code=code, message=message, param=None)
        response = self._t._response(self._ids.response, None, self._output, "failed")
        response["error"] = {"code": "server_error", "message": message}
        return out + self._event("response.failed", response=response)

    def _opening(self) -> bytes:
        response = self._t._response(self._ids.response, None, [], "in_progress")
        response["model"] = self._chat.answer.model or response["model"]
        return self._event("response.created", response=response) + self._event(
            "response.in_progress", response=response
        )

    def _open_item(self, kind: str) -> bytes:
        index = len(self._output)
        if kind == "message":
            item = _message_item(self._ids.new("msg"), "", [], "in_progress")
            part = item["content"][0]
            self._open = item
            return self._event(
                "response.output_item.added", output_index=index, item={**item, "content": []}
            ) + self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part={**part, "logprobs": []},
            )
        item = _reasoning_item(self._ids.new("rs"), "", "in_progress")
        self._open = item
        return self._event(
            "response.output_item.added",
            output_index=index,
            item={**item, "content": []},
        )

    def _close_open(self) -> bytes:
        item, self._open = self._open, None
        if item is None:
            return b""
        index = len(self._output)
        item["status"] = "completed"
        part = item["content"][0]
        if item["type"] == "message":
            out = self._event(
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
                logprobs=part["logprobs"],
            ) + self._event(
                "response.content_part.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            )
        else:
            out = self._event(
                "response.reasoning_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
            )
        self._output.append(item)
        return out + self._event("response.output_item.done", output_index=index, item=item)

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse_event(kind, payload)


class _Ids:
    """Fresh item ids for one response: ``<prefix>_<response's random part><n>``."""

    def __init__(self) -> None:
        self._base = secrets.token_hex(12)
        self._n = 0
        self.response = f"resp_{self._base}"

    def new(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}_{self._base}{self._n:02d}"


def _messages(request: dict[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    instructions = request.get("instructions")
    if instructions is not None:
        messages.append({"role": "system", "content": need_str(instructions, "instructions")})
    given = request.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
        return messages
    reasoning = ""  # a reasoning item belongs to the assistant turn that follows it
    for i, item in enumerate(need_list(given, "input")):
        where = f"input[{i}]"
        item = need_dict(item, where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise WireError(
                    f"{where}.role is {role!r}: use user, assistant, system or developer"
                )
            if role == "assistant":
                text = _text(item.get("content"), f"{where}.content")
                last = _open_assistant(messages, reasoning)
                reasoning = ""
                last["content"] = (last.get("content") or "") + text
            else:
                content = _content(item.get("content"), f"{where}.content")
                messages.append(
                    {"role": "user" if role == "user" else "system", "content": content}
                )
        elif kind in ("function_call", "custom_tool_call"):
            custom = kind == "custom_tool_call"
            name = need_str(item.get("name"), f"{where}.name")
            call_id = need_str(item.get("call_id"), f"{where}.call_id")
            if custom:
                arguments = json.dumps({"input": need_str(item.get("input"), f"{where}.input")})
            else:
                arguments = need_str(item.get("arguments"), f"{where}.arguments")
            last = _open_assistant(messages, reasoning, for_tool_call=True)
            reasoning = ""
            last.setdefault("tool_calls", []).append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            )
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = need_str(item.get("call_id"), f"{where}.call_id")
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            reasoning += "".join(
                _text(item.get(key) or [], f"{where}.{key}") for key in ("summary", "content")
            )
        elif kind == "item_reference":
            raise WireError(f"{where} is an item_reference: the relay keeps no stored items")
        else:
            raise WireError(f"{where} has type {kind!r}, which has no chat completions form")
    return messages


def _open_assistant(
    messages: list[dict[str, Any]], reasoning: str, *, for_tool_call: bool = False
) -> dict[str, Any]:
    """The assistant message a turn's next output item joins: the last one if it is still open
    (only reasoning so far, or text followed by its tool calls), else a new one."""
    last = messages[-1] if messages else None
    joinable = (
        last is not None
        and last.get("role") == "assistant"
        and not reasoning
        and (for_tool_call or not (last.get("content") or last.get("tool_calls")))
    )
    if joinable:
        assert last is not None
        return last
    message: dict[str, Any] = {"role": "assistant", "content": None}
    if reasoning:
        message["reasoning_content"] = reasoning
    messages.append(message)
    return message


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for i, part in enumerate(need_list(content, where)):
        part = need_dict(part, f"{where}[{i}]")
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            parts.append(need_str(part.get("text"), f"{where}[{i}].text"))
        elif kind == "refusal":
            parts.append(need_str(part.get("refusal"), f"{where}[{i}].refusal"))
        else:
            raise WireError(f"{where}[{i}] has type {kind!r}; only text is accepted here")
    return "".join(parts)


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """User or system content: a string, or chat content parts (text, images)."""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(need_list(content, where)):
        part = need_dict(part, f"{where}[{i}]")
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": need_str(part.get("text"), f"{where}[{i}].text")})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise WireError(f"{where}[{i}] needs an image_url (file ids are not supported)")
            image: dict[str, Any] = {"url": url}
            if isinstance(part.get("detail"), str):
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        elif kind == "input_file":
            data = part.get("file_data")
            if not isinstance(data, str):
                raise WireError(f"{where}[{i}] needs file_data (file ids are not supported)")
            file = {"file_data": data, "filename": part.get("filename") or "file"}
            parts.append({"type": "file", "file": file})
        else:
            raise WireError(f"{where}[{i}] has type {kind!r}, which has no chat completions form")
    if len(parts) == 1 and parts[0]["type"] == "text":
        return str(parts[0]["text"])
    return parts


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise WireError(f"tool_choice {choice!r}: use auto, none or required")
        return choice
    choice = need_dict(choice, "tool_choice")
    kind = choice.get("type")
    if kind in ("function", "custom"):
        return {
            "type": "function",
            "function": {"name": need_str(choice.get("name"), "tool_choice.name")},
        }
    if kind == "allowed_tools":
        return "required" if choice.get("mode") == "required" else "auto"
    return "auto"  # a hosted tool: the model may call any


def _response_format(format_: dict[str, Any]) -> dict[str, Any] | None:
    kind = format_.get("type")
    if kind == "json_schema":
        schema = {k: v for k, v in format_.items() if k != "type"}
        return {"type": "json_schema", "json_schema": schema}
    if kind == "json_object":
        return {"type": "json_object"}
    return None


def _status(answer: Answer) -> str:
    return "incomplete" if answer.finish_reason == "length" else "completed"


def _message_item(
    item_id: str, text: str, logprobs: list[dict[str, Any]], status: str
) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}],
    }


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "status": status,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _logprob(entry: dict[str, Any]) -> dict[str, Any]:
    top = [
        {"token": t.get("token"), "logprob": t.get("logprob"), "bytes": t.get("bytes") or []}
        for t in entry.get("top_logprobs") or []
        if isinstance(t, dict)
    ]
    return {
        "token": entry.get("token"),
        "logprob": entry.get("logprob"),
        "bytes": entry.get("bytes") or [],
        "top_logprobs": top,
    }


def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    prompt, completion, cached = usage_counts(usage)
    details = (usage or {}).get("completion_tokens_details")
    reasoning = details.get("reasoning_tokens") if isinstance(details, dict) else None
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning or 0},
        "total_tokens": prompt + completion,
    }


# --- a native Responses upstream: its answers read as chat completions, for the trace --------


def reassemble(body: bytes) -> dict[str, Any] | None:
    """The final ``response`` of a Responses event stream (None if it never finished)."""
    final = None
    for payload in sse_objects(body):
        if payload.get("type") in (
            "response.completed",
            "response.incomplete",
            "response.failed",
        ):
            final = payload.get("response")
    return final if isinstance(final, dict) else None


def as_chat_completion(response: dict[str, Any]) -> dict[str, Any]:
    """A Responses ``response`` in chat-completion form, so its trace reads like any other."""
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    logprobs: list[dict[str, Any]] = []
    for item in response.get("output") or []:
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "message":
            for part in item.get("content") or []:
                if isinstance(part, dict) and part.get("type") == "output_text":
                    text.append(str(part.get("text") or ""))
                    logprobs.extend(p for p in part.get("logprobs") or [] if isinstance(p, dict))
        elif kind == "reasoning":
            for key in ("content", "summary"):
                reasoning.extend(
                    str(p.get("text") or "") for p in item.get(key) or [] if isinstance(p, dict)
                )
        elif kind in ("function_call", "custom_tool_call"):
            arguments = item.get("arguments")
            if kind == "custom_tool_call":
                arguments = json.dumps({"input": item.get("input")})
            calls.append(
                {
                    "id": item.get("call_id"),
                    "type": "function",
                    "function": {"name": item.get("name"), "arguments": arguments},
                }
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    status = response.get("status")
    finish = "length" if status == "incomplete" else "tool_calls" if calls else "stop"
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
    if logprobs:
        choice["logprobs"] = {"content": logprobs}
    usage = response.get("usage") if isinstance(response.get("usage"), dict) else {}
    assert isinstance(usage, dict)
    details = usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    completion: dict[str, Any] = {"model": response.get("model"), "choices": [choice]}
    if usage:
        completion["usage"] = chat_usage(
            usage.get("input_tokens") or 0, usage.get("output_tokens") or 0, cached or 0
        )
    return completion
