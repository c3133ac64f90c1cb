"""The wire formats agents speak to the relay: chat completions, Responses, Anthropic Messages.

Trainers' inference servers speak chat completions, so that is what the relay sends upstream
and records; an agent speaking another format has its request translated on the way in and
the answer (whole, or as an event stream in its format's own grammar) translated back. An
upstream configured to speak a format natively (``RelaySettings.native_apis``) gets the
agent's bytes unchanged; its answers are read as chat completions only for the trace.

Each format is a ``Wire``: its route, its error shape, and how to translate. Translations are
plain dict work, on purpose: the SDKs' type modules cost seconds to import (the tests check the
shapes with them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from backends.relay.upstream import error_body as _openai_error
from backends.relay.wire import messages, responses
from backends.relay.wire.chat import WireError

CHAT = "chat.completions"

__all__ = ["BY_ROUTE", "CHAT", "CHAT_WIRE", "Stream", "Translation", "Wire", "WireError"]


class Stream(Protocol):
    """Chat-completions SSE bytes in (``feed``), the agent's event stream out."""

    def feed(self, data: bytes) -> bytes: ...
    def finish(self) -> bytes: ...
    def fail(self, message: str, code: str) -> bytes: ...


class Translation(Protocol):
    """One agent request as ``chat_request``, and the upstream's answer back in its format."""

    chat_request: dict[str, Any]

    def answer(self, completion: Any) -> bytes: ...
    def stream(self) -> Stream: ...


@dataclass(frozen=True, slots=True)
class Wire:
    name: str  # what traces call it: CallRecord.api
    path: str  # relative to the rollout's base URL
    # (HTTP status, message, code, OpenAI error type) -> a body in this format's error shape
    error_body: Callable[[int, str, str, str], bytes]
    # An in-band error event, for a stream whose headers are sent already.
    stream_error: Callable[[str, str], bytes]
    # An upstream's chat-completions error body, rewritten for this format's clients.
    upstream_error: Callable[[int, bytes], bytes]
    translate: Callable[[dict[str, Any]], Translation] | None = None  # None: chat itself
    # A native upstream's streamed answer as one object, and any answer as a chat completion.
    reassemble: Callable[[bytes], dict[str, Any] | None] | None = None
    as_chat_completion: Callable[[dict[str, Any]], dict[str, Any]] | None = None


def _chat_error(status: int, message: str, code: str, kind: str) -> bytes:
    return _openai_error(message, code, kind)


def _chat_stream_error(message: str, code: str) -> bytes:
    # OpenAI clients raise an SSE data event holding an ``error`` as an API error.
    return b"data: " + _openai_error(message, code) + b"\n\n"


CHAT_WIRE = Wire(CHAT, "/chat/completions", _chat_error, _chat_stream_error, lambda s, p: p)
RESPONSES_WIRE = Wire(
    responses.NAME,
    responses.PATH,
    responses.error_body,
    responses.stream_error,
    responses.upstream_error,
    responses.Translation,
    responses.reassemble,
    responses.as_chat_completion,
)
MESSAGES_WIRE = Wire(
    messages.NAME,
    messages.PATH,
    messages.error_body,
    messages.stream_error,
    messages.upstream_error,
    messages.Translation,
    messages.reassemble,
    messages.as_chat_completion,
)
# Routes under /rollouts/<id>/ that take a POST of one of these formats.
BY_ROUTE = {
    "v1/chat/completions": CHAT_WIRE,
    "v1/responses": RESPONSES_WIRE,
    "v1/messages": MESSAGES_WIRE,
}
BY_NAME = {wire.name: wire for wire in BY_ROUTE.values()}
