"""The relay's TCP endpoint inside a local sandbox, served from the host: no process inside.

A sandbox without network reaches the policy relay at `127.0.0.1:<port>`, the URL any client
takes (`OPENAI_BASE_URL`, a workflow's own `AsyncOpenAI(base_url=...)`). `RelayForwarder`
makes that port exist without starting anything in the sandbox: host root opens a listening
socket *in the sandbox's network namespace* (a socket belongs to the namespace it was created
in, wherever its fd lives), and the owning process forwards each connection to the relay's
Unix socket. Against an in-sandbox `socat`, this saves an exec and a readiness poll per
sandbox start and a fork per connection, and needs no socat in the image; root inside can
neither kill it nor take its port (that port is held by a host socket).

Its serving task spans `LocalSandbox.start()` and `stop()`, which Harbor calls from different
tasks, so it is one task of the event loop that `aclose()` cancels and awaits; everything it
runs lives in its own task group. It forwards at most `MAX_CONNECTIONS` connections at once
(each costs this process two fds); more wait in the listening socket's backlog, and past
that in the sandbox's own connect, until one ends: a burst is served late, never refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from pathlib import Path

import anyio
from anyio.abc import ByteStream, SocketListener

from backends.sandbox.namespaces import listen_in_namespace

MAX_CONNECTIONS = 64
CHUNK = 65536


class RelayForwarder:
    """Forwards connections to `port` on a sandbox's loopback to the relay's Unix socket."""

    def __init__(self, listener: socket.socket, relay_socket: Path) -> None:
        self.relay_socket = relay_socket
        listener.setblocking(False)
        self._socket = listener
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, pidfd: int, port: int, relay_socket: Path) -> RelayForwarder:
        """Listen on `127.0.0.1:port` in the network namespace of `pidfd` (a sandbox's pid 1)
        and start forwarding; it listens when this returns.

        Raises:
            ProcessLookupError: the sandbox is gone.
            OSError: the port cannot be bound.
        """
        listener = listen_in_namespace(pidfd, "127.0.0.1", port, backlog=MAX_CONNECTIONS)
        forwarder = cls(listener, relay_socket)
        forwarder._task = asyncio.get_running_loop().create_task(forwarder._serve())
        return forwarder

    async def aclose(self) -> None:
        """Stop listening and end every connection (idempotent; completes when cancelled)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait([task])
        self._socket.close()  # if the task never ran

    async def _serve(self) -> None:
        listener = await SocketListener.from_socket(self._socket)
        slots = anyio.Semaphore(MAX_CONNECTIONS)
        async with listener, anyio.create_task_group() as tg:
            while True:
                await slots.acquire()  # at the cap, new connections wait in the backlog
                try:
                    client = await listener.accept()
                except BaseException:
                    slots.release()
                    raise
                tg.start_soon(self._forward, client, slots)

    async def _forward(self, client: ByteStream, slots: anyio.Semaphore) -> None:
        try:
            async with client:
                try:
                    upstream = await anyio.connect_unix(self.relay_socket)
                except OSError:
                    return  # the relay is gone: the client sees its connection closed
                async with upstream, anyio.create_task_group() as tg:
                    tg.start_soon(_pipe, client, upstream)
                    await _pipe(upstream, client)
                    tg.cancel_scope.cancel()  # the relay closed: the exchange is over
        finally:
            slots.release()


async def _pipe(source: ByteStream, sink: ByteStream) -> None:
    """Copy `source` to `sink` until `source` ends, then half-close `sink`."""
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        while True:
            try:
                chunk = await source.receive(CHUNK)
            except anyio.EndOfStream:
                break
            await sink.send(chunk)
        await sink.send_eof()
