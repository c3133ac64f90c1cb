"""Serve an ASGI app on a TCP port and, optionally, a Unix socket, inside the caller's task group.

uvicorn (httptools parser, no framework) does the HTTP work. We bind the sockets ourselves so
that port 0 resolves to a real port before the first request, and so one server answers on both
the TCP address and the Unix socket that sandboxes reach through a bind mount.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import resource
import socket
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Generator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import anyio
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from backends.asgi import KEEP_CONNECTION

# Sandboxes run as a mapped uid that is not the host user: the socket must be connectable by
# anyone who can reach the path. Access is still guarded by the per-rollout token.
UNIX_SOCKET_MODE = 0o666
# Connections the kernel queues for accepting; also the most one turn of the loop accepts.
LISTEN_BACKLOG = 2048

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Listening:
    """Where a started server answers."""

    host: str
    port: int
    unix_socket_path: Path | None

    @property
    def origin(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


class Served:
    """Base of objects that serve an ASGI app while inside ``async with`` (relay, policy).

    ``_open`` starts what the object serves on the given exit stack and sets ``_listening``;
    leaving the block closes the stack, stopping the server.
    """

    _listening: Listening | None = None
    _stack: contextlib.AsyncExitStack | None = None

    async def _open(self, stack: contextlib.AsyncExitStack) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        async with contextlib.AsyncExitStack() as stack:
            await self._open(stack)
            self._stack = stack.pop_all()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack, self._stack = self._stack, None
        self._listening = None
        if stack is not None:
            await stack.aclose()


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server that lives inside someone else's event loop and task group.

    It leaves signal handling to the host process (an embedded relay must not swallow Ctrl-C)
    and waits on an event instead of polling every 100 ms, so it stops as soon as asked.
    """

    def __init__(self, config: uvicorn.Config, *, embedded: bool) -> None:
        super().__init__(config)
        self._embedded = embedded
        self._exit_requested = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if self._embedded:
            yield
            return
        with super().capture_signals():
            yield

    async def main_loop(self) -> None:
        if self._embedded:
            await self._exit_requested.wait()
        else:
            await super().main_loop()

    def request_exit(self) -> None:
        self.should_exit = True
        self._exit_requested.set()


class _CoalescingTransport:
    """A transport that sends a response's head together with its first body bytes.

    uvicorn writes the status line and headers as soon as the app starts its response, then
    the body: two syscalls and two TCP segments for every answer. Held for at most one turn of
    the event loop, the head leaves with the body in one write; a head with no body yet (a
    stream waiting for its first chunk) is flushed on the next turn.
    """

    __slots__ = ("_flush_scheduled", "_held", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held: bytes | None = None
        self._flush_scheduled = False

    def write(self, data: bytes) -> None:
        if self._held is not None:
            data, self._held = self._held + data, None
            self._transport.write(data)
        elif data.startswith(b"HTTP/1.1 "):
            self._held = data
            if not self._flush_scheduled:
                self._flush_scheduled = True
                asyncio.get_running_loop().call_soon(self._flush)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._held is not None:
            data, self._held = self._held, None
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


# How long a connection may take to send a request's headers, from its first byte (or, for
# the first request, from the connect). uvicorn times only the idle wait between requests, so
# a client that connects and never sends held a connection, and its fds, for good.
HEADER_TIMEOUT_SEC = 30.0
# How long a client that shut its side down after its request still gets for the answer. A read
# cannot tell that (nc -N, some HTTP/1.0 clients) from a client that hung up, whose call must
# be abandoned soon, so the upstream stops generating for nobody.
HALF_CLOSE_GRACE_SEC = 0.5
# The most idle connections a server keeps by default, whatever the open-file limit.
MAX_IDLE_CONNECTIONS = 4096


def default_max_idle_connections() -> int:
    """A quarter of the process's open-file limit, at most ``MAX_IDLE_CONNECTIONS``."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_IDLE_CONNECTIONS
    return max(16, min(MAX_IDLE_CONNECTIONS, soft // 4))


class _IdleConnections:
    """A server's connections that serve no call an app vouched for, by source address.

    That is every connection waiting for (or sending) a request, idle between requests, or
    answering one that needs no token. Anyone who can reach the port can open those, so past
    ``most`` of them one is closed: the oldest of the source holding the most. A flood from
    one address (one pod) then closes only its own connections, and never another pod's, as
    long as it holds more than that pod. Connections the app keeps (``KEEP_CONNECTION``) are
    not here; the app bounds them per rollout.
    """

    __slots__ = ("_by_source", "_count", "_heaviest", "_told_at", "evicted", "most")

    def __init__(self, most: int) -> None:
        self.most = most
        self._by_source: dict[str, OrderedDict[_Protocol, None]] = {}
        self._count = 0
        self._heaviest = ""  # a source holding the most connections (kept up on add)
        self.evicted = 0
        self._told_at = -math.inf

    def add(self, connection: _Protocol) -> None:
        source = connection.source
        group = self._by_source.setdefault(source, OrderedDict())
        if connection in group:
            return
        group[connection] = None
        self._count += 1
        heaviest = self._by_source.get(self._heaviest)
        if heaviest is None or len(group) > len(heaviest):
            self._heaviest = source
        while self._count > self.most:
            self._evict()

    def discard(self, connection: _Protocol) -> None:
        source = connection.source
        group = self._by_source.get(source)
        if group is not None and connection in group:
            del group[connection]
            self._count -= 1
            if not group:
                del self._by_source[source]

    def _evict(self) -> None:
        group = self._by_source.get(self._heaviest)
        if group is None or len(group) * len(self._by_source) < self._count:
            # Its connections closed or were kept since: below the average, so find the
            # heaviest again (rare, and each search needs that many closes first).
            self._heaviest = max(self._by_source, key=lambda s: len(self._by_source[s]))
            group = self._by_source[self._heaviest]
        oldest, _ = group.popitem(last=False)
        self._count -= 1
        if not group:
            del self._by_source[self._heaviest]
        oldest.transport.abort()  # close() would wait for a peer that reads nothing
        self.evicted += 1
        now = time.monotonic()
        if now - self._told_at >= 60:
            self._told_at = now
            _log.warning(
                "more than %d connections serve no rollout's call: closing the oldest of %s, "
                "which holds the most (%d closed so far)",
                self.most,
                self._heaviest or "the Unix socket",
                self.evicted,
            )

    def __len__(self) -> int:
        return self._count


class _Protocol(HttpToolsProtocol):
    header_timeout_s = HEADER_TIMEOUT_SEC
    half_close_grace_s = HALF_CLOSE_GRACE_SEC
    idle: _IdleConnections  # one per server: set by _protocol_class
    source = ""  # the peer's address; "" on the Unix socket
    _header_timer: asyncio.TimerHandle | None = None
    _half_closed: asyncio.TimerHandle | None = None  # the grace's end, once the client's EOF came
    _kept = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_CoalescingTransport(transport))  # type: ignore[arg-type]
        if self.client is not None:
            self.source = self.client[0]
        self._time_headers()
        self.idle.add(self)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[KEEP_CONNECTION] = self._keep  # type: ignore[literal-required]
        if self._header_timer is None:
            self._time_headers()

    def on_headers_complete(self) -> None:
        self._stop_timing_headers()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        if self._kept:
            self._kept = False
            if not self.transport.is_closing():
                self.idle.add(self)
        super().on_response_complete()
        if self._half_closed is not None and self.cycle.response_complete:
            self._half_closed.cancel()
            self._half_closed = None
            self.transport.close()  # all it asked is answered; close() sends what is left

    def eof_received(self) -> bool | None:  # type: ignore[override]  # asyncio allows True
        if self.cycle is None or self.cycle.response_complete:
            return None  # nothing asked is unanswered: close
        # Keep the connection for the answer, for a grace (HALF_CLOSE_GRACE_SEC).
        self._half_closed = self.loop.call_later(self.half_close_grace_s, self._grace_over)
        return True

    def _grace_over(self) -> None:
        self._half_closed = None
        self.transport.abort()  # as a hang-up: the app sees the disconnect, abandons the call

    def connection_lost(self, exc: Exception | None) -> None:
        if self._half_closed is not None:
            self._half_closed.cancel()
            self._half_closed = None
        self._stop_timing_headers()
        self.idle.discard(self)
        super().connection_lost(exc)

    def handle_websocket_upgrade(self) -> None:
        self.idle.discard(self)  # another protocol object serves the connection from now on
        super().handle_websocket_upgrade()

    def _keep(self) -> None:
        if not self._kept:
            self._kept = True
            self.idle.discard(self)

    def _time_headers(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _stop_timing_headers(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def _protocol_class(header_timeout_s: float, max_idle_connections: int) -> type[_Protocol]:
    attributes = {
        "header_timeout_s": header_timeout_s,
        "idle": _IdleConnections(max_idle_connections),
    }
    return type("_Protocol", (_Protocol,), attributes)


def bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def bind_unix(path: Path) -> socket.socket:
    """Bind a Unix socket at ``path``, replacing a stale socket file left by a dead process.

    Raises ``FileExistsError`` if ``path`` exists and is not a socket (never delete user data).
    """
    if path.exists() or path.is_symlink():
        if not path.is_socket():
            raise FileExistsError(f"{path} exists and is not a Unix socket; refusing to replace it")
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(os.fspath(path))
        os.chmod(path, UNIX_SOCKET_MODE)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


@contextlib.asynccontextmanager
async def serve_asgi(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    unix_socket_path: Path | None = None,
    embedded: bool = True,
    access_log: bool = False,
    graceful_shutdown_s: int = 5,
    header_timeout_s: float = HEADER_TIMEOUT_SEC,
    max_idle_connections: int | None = None,
) -> AsyncIterator[Listening]:
    """Serve ``app`` until the block exits; yield where it listens.

    Raises ``OSError`` if the port or socket path cannot be bound. Needs the asyncio backend
    (uvicorn is asyncio-only). On exit the server stops accepting, lets in-flight requests
    finish for up to ``graceful_shutdown_s`` and then cancels them; the Unix socket file is
    removed. A connection that takes longer than ``header_timeout_s`` to send a request's
    headers is closed, and past ``max_idle_connections`` (default:
    ``default_max_idle_connections()``) connections serving no call the app keeps
    (``KEEP_CONNECTION``), the oldest of them is closed.
    """
    if max_idle_connections is None:
        max_idle_connections = default_max_idle_connections()
    sockets = [bind_tcp(host, port)]
    bound_port = sockets[0].getsockname()[1]
    try:
        if unix_socket_path is not None:
            sockets.append(bind_unix(unix_socket_path))
        config = uvicorn.Config(
            app,
            http=_protocol_class(header_timeout_s, max_idle_connections),
            lifespan="off",
            access_log=access_log,
            log_level="warning",
            server_header=False,
            date_header=False,
            timeout_graceful_shutdown=graceful_shutdown_s,
            # An agent's next policy call may come many seconds after the last one.
            timeout_keep_alive=75,
            backlog=LISTEN_BACKLOG,
            proxy_headers=False,  # the relay trusts no forwarding headers; skip the middleware
        )
        server = _EmbeddedServer(config, embedded=embedded)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_run, server, sockets)
            while not server.started:
                if server.should_exit:
                    raise RuntimeError("the relay's HTTP server stopped during startup")
                await anyio.sleep(0.001)
            try:
                yield Listening(host, bound_port, unix_socket_path)
            finally:
                server.request_exit()
    finally:
        for sock in sockets:
            sock.close()
        if unix_socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(unix_socket_path)


async def _run(server: _EmbeddedServer, sockets: list[socket.socket]) -> None:
    try:
        await server.serve(sockets=sockets)
    finally:
        # Cancelled from outside: still close the listeners and drop connections, promptly.
        if not server.should_exit:
            server.force_exit = True
            server.request_exit()
            with anyio.CancelScope(shield=True), anyio.move_on_after(1):
                await server.shutdown(sockets=sockets)
