"""What both translations read from a chat completion: the answer of choice 0, whole or streamed.

A trainer's inference server (vLLM, SGLang) speaks chat completions; an agent speaking the
Responses or Messages API gets that answer rewritten in its own format. ``Answer`` is the
format-neutral middle: text (with per-token logprobs when the upstream sent them), reasoning,
tool calls, why it stopped, usage. ``ChatStream`` builds it incrementally from SSE bytes as they
arrive, handing out the text as it comes so the agent still sees a live stream.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


class WireError(ValueError):
    """A request or answer that cannot be translated; the message says what is wrong."""


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class Answer:
    """Choice 0 of a chat completion, in the terms both translations need."""

    model: str | None = None
    text: str = ""
    has_text: bool = False
    reasoning: str = ""
    logprobs: list[dict[str, Any]] | None = None  # chat ``logprobs.content`` entries
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Any = None  # vLLM: the stop string (or token id) that ended the answer
    usage: dict[str, Any] | None = None

    @classmethod
    def of_completion(cls, completion: Any) -> Answer:
        """Read a non-streamed chat completion. Raises ``WireError`` if it is not one."""
        choices = completion.get("choices") if isinstance(completion, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise WireError("the policy upstream's answer is not a chat completion with a choice")
        choice = choices[0]
        message = choice.get("message")
        if not isinstance(message, dict):
            raise WireError("the policy upstream's chat completion has no message")
        answer = cls(model=_str(completion.get("model")), usage=_dict(completion.get("usage")))
        content = message.get("content")
        if isinstance(content, str):
            answer.text, answer.has_text = content, bool(content)
        answer.reasoning = _reasoning(message)
        calls = message.get("tool_calls")
        for i, call in enumerate(calls if isinstance(calls, list) else []):
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                answer.tool_calls.append(
                    ToolCall(
                        id=_str(call.get("id")) or f"call_{i}",
                        name=_str(function.get("name")) or "",
                        arguments=_arguments(function.get("arguments")),
                    )
                )
        answer.finish_reason = _str(choice.get("finish_reason"))
        answer.stop_reason = choice.get("stop_reason")
        answer.logprobs = _logprob_entries(choice)
        return answer


@dataclass(slots=True)
class Piece:
    """A bit of streamed output to pass on at once: answer text or reasoning text."""

    kind: str  # "text" | "reasoning"
    text: str
    logprobs: list[dict[str, Any]] | None = None


class ChatStream:
    """Reads a chat-completions SSE stream as it arrives (choice 0).

    ``feed`` returns the text and reasoning pieces in the bytes given so far; tool calls,
    the finish reason and usage accumulate in ``answer`` (tool calls are passed on whole, once
    complete: that is when an agent can act on them, and it keeps parallel calls whose deltas
    interleave apart). ``error`` is set when the upstream sent an error event.
    """

    def __init__(self) -> None:
        self.answer = Answer()
        self.error: str | None = None
        self.done = False
        self._buffer = b""
        self._calls: dict[int, ToolCall] = {}

    def feed(self, data: bytes) -> list[Piece]:
        self._buffer += data
        pieces: list[Piece] = []
        while True:
            end, sep = _event_end(self._buffer)
            if end < 0:
                return pieces
            event, self._buffer = self._buffer[:end], self._buffer[end + sep :]
            self._event(event, pieces)

    def close(self) -> Answer:
        """The whole answer, once the stream has ended."""
        if self._buffer.strip():
            self._event(self._buffer, [])
            self._buffer = b""
        self.answer.tool_calls = [self._calls[i] for i in sorted(self._calls)]
        return self.answer

    def _event(self, event: bytes, pieces: list[Piece]) -> None:
        data = b"\n".join(
            line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:")
        )
        if not data:
            return
        if data == b"[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except (ValueError, RecursionError):
            return
        if not isinstance(chunk, dict):
            return
        if "error" in chunk and not chunk.get("choices"):
            error = chunk["error"]
            message = error.get("message") if isinstance(error, dict) else error
            self.error = str(message or "the policy upstream failed mid-stream")
            return
        answer = self.answer
        if answer.model is None:
            answer.model = _str(chunk.get("model"))
        if isinstance(chunk.get("usage"), dict):
            answer.usage = chunk["usage"]
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                self._choice(choice, pieces)

    def _choice(self, choice: dict[str, Any], pieces: list[Piece]) -> None:
        answer = self.answer
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            delta = {}
        reasoning = _reasoning(delta)
        if reasoning:
            answer.reasoning += reasoning
            pieces.append(Piece("reasoning", reasoning))
        content = delta.get("content")
        logprobs = _logprob_entries(choice)
        if logprobs:
            answer.logprobs = (answer.logprobs or []) + logprobs
        if isinstance(content, str) and content:
            answer.text += content
            answer.has_text = True
            pieces.append(Piece("text", content, logprobs))
        parts = delta.get("tool_calls")
        for part in parts if isinstance(parts, list) else []:
            if not isinstance(part, dict):
                continue
            index = part.get("index", len(self._calls))
            if not isinstance(index, int) or isinstance(index, bool):
                continue
            call = self._calls.get(index)
            if call is None:
                call = self._calls[index] = ToolCall(id=f"call_{index}", name="", arguments="")
            if part.get("id"):
                call.id = str(part["id"])
            function = part.get("function")
            if not isinstance(function, dict):
                function = {}
            if function.get("name"):
                call.name += str(function["name"])
            if function.get("arguments"):
                call.arguments += str(function["arguments"])
        if choice.get("finish_reason") is not None:
            answer.finish_reason = str(choice["finish_reason"])
        if choice.get("stop_reason") is not None:
            answer.stop_reason = choice["stop_reason"]


def _event_end(buffer: bytes) -> tuple[int, int]:
    # SSE events end with a blank line; servers use \n or \r\n.
    lf, crlf = buffer.find(b"\n\n"), buffer.find(b"\r\n\r\n")
    if crlf >= 0 and (lf < 0 or crlf < lf):
        return crlf, 4
    return lf, 2


def sse_objects(body: bytes) -> Iterator[dict[str, Any]]:
    """The JSON objects in a whole SSE body's data lines (others skipped)."""
    for event in body.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = b"\n".join(
            line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
        )
        try:
            payload = json.loads(data) if data else None
        except (ValueError, RecursionError):
            continue
        if isinstance(payload, dict):
            yield payload


def sse_event(kind: str, payload: dict[str, Any]) -> bytes:
    """One server-sent event with a name, as the Responses and Messages streams send them."""
    return b"event: %s\ndata: %s\n\n" % (kind.encode(), json.dumps(payload).encode())


def _reasoning(message: dict[str, Any]) -> str:
    # vLLM and SGLang call it reasoning_content; newer vLLM also ``reasoning``.
    value = message.get("reasoning_content") or message.get("reasoning")
    return value if isinstance(value, str) else ""


def _logprob_entries(choice: dict[str, Any]) -> list[dict[str, Any]] | None:
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if isinstance(content, list):
        return [e for e in content if isinstance(e, dict)]
    return None


def _arguments(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value) if value is not None else ""


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _dict(value: Any) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None


def usage_counts(usage: dict[str, Any] | None) -> tuple[int, int, int]:
    """(prompt tokens, completion tokens, cached prompt tokens) of a chat usage object."""
    if not usage:
        return 0, 0, 0
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return (
        _int(usage.get("prompt_tokens")),
        _int(usage.get("completion_tokens")),
        _int(cached),
    )


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def chat_usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    """A chat-completions usage object (what traces hold, whatever the agent spoke)."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def object_arguments(arguments: str) -> dict[str, Any]:
    """Tool-call arguments as the object Messages' ``tool_use.input`` must be.

    A model that wrote invalid JSON keeps its text, under ``_raw``, rather than losing it.
    """
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {"_raw": arguments}
    return value if isinstance(value, dict) else {"_value": value}


def need_dict(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise WireError(f"{where} must be a JSON object")
    return value


def need_list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise WireError(f"{where} must be a list")
    return value


def need_str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise WireError(f"{where} must be a string")
    return value
