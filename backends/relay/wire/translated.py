"""What the Responses and Messages streams share: how a chat-completions stream drives them.

``feed`` reads each chunk of the upstream's SSE bytes and passes its text and reasoning on as
they come; ``finish`` writes the closing events once the upstream ended; ``fail`` ends the
stream with an error. The opening events go out once, first (after the first chunk, which
names the model). Each format says what those events are.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from backends.relay.wire.chat import Answer, ChatStream, Piece


class TranslatedStream[T](ABC):
    """Chat-completions SSE in, a format's event stream out (``feed`` ... ``finish``), for
    one request's translation ``T``."""

    def __init__(self, translation: T) -> None:
        self._t = translation
        self._chat = ChatStream()
        self._started = False

    def feed(self, data: bytes) -> bytes:
        if self._chat.error is not None:
            return b""  # ended by the upstream's error event already
        pieces = self._chat.feed(data)
        out = self._start()  # after the first chunk: it names the model
        for piece in pieces:
            out += self._piece(piece)
        if self._chat.error is not None:
            out += self._error(self._chat.error, "upstream_error")
        return out

    def finish(self) -> bytes:
        """The closing events once the upstream stream ended."""
        out = self._start()
        if self._chat.error is not None:
            return out
        return out + self._end(self._chat.close())

    def fail(self, message: str, code: str) -> bytes:
        """Events that end the stream with an error (the upstream broke mid-way)."""
        return self._start() + self._error(message, code)

    def _start(self) -> bytes:
        if self._started:
            return b""
        self._started = True
        return self._opening()

    @abstractmethod
    def _opening(self) -> bytes:
        """The events that open the stream."""

    @abstractmethod
    def _piece(self, piece: Piece) -> bytes:
        """The events passing on one piece of answer or reasoning text."""

    @abstractmethod
    def _end(self, answer: Answer) -> bytes:
        """The closing events, given the whole answer."""

    @abstractmethod
    def _error(self, message: str, code: str) -> bytes:
        """The events that end the stream with an error."""
