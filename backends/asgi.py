"""The few ASGI pieces the relay, the scripted policy and the rollout server share.

They are raw ASGI apps on purpose: on their hot paths a framework's routing and request
objects cost more than the work itself (see the benchmarks in tests/benchmarks/).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_JSON = (b"content-type", b"application/json")

# Scope key of a callable our server (``backends.relay.serving``) adds to each request: called
# by an app that vouches for the request (a rollout's token checked), it keeps the connection
# from being closed to make room for others until the response ends.
KEEP_CONNECTION = "backends.keep_connection"


async def send_json(
    send: Send,
    status: int,
    body: bytes,
    headers: Iterable[tuple[bytes, bytes]] = (),
    *,
    close: bool = False,
) -> None:
    """Send a complete JSON response; ``close`` asks the client to drop the connection."""
    head = [_JSON, (b"content-length", str(len(body)).encode()), *headers]
    if close:
        head.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})
