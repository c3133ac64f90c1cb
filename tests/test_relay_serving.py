"""The relay's HTTP server bounds what one client can hold: a connection that never finishes
its request's headers is closed, so a sandbox cannot pile up idle connections (each an fd of
the orchestrator process, shared by every rollout) until nothing else can open a file."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from backends.relay.serving import serve_asgi

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _slow_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers after `?sleep` seconds (the path), like a long policy call."""
    await anyio.sleep(float(scope["path"].strip("/") or 0))
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def _closed_within(stream: Any, seconds: float) -> bool:
    with anyio.move_on_after(seconds):
        try:
            while await stream.receive():
                pass
        except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
            return True
    return False


async def test_idle_and_trickling_connections_are_closed_and_others_served(
    tmp_path: Path,
) -> None:
    socket_path = tmp_path / "relay.sock"
    async with serve_asgi(_slow_app, unix_socket_path=socket_path, header_timeout_s=0.5) as at:
        started = time.monotonic()  # before the connections, whose timeouts start with them
        silent = await anyio.connect_unix(socket_path)
        trickling = await anyio.connect_tcp(at.host, at.port)
        await trickling.send(b"GET /0 HTTP/1.1\r\nHost: x\r\n")  # headers never end

        assert await _closed_within(silent, 5)
        assert await _closed_within(trickling, 5)
        assert 0.4 < time.monotonic() - started < 4

        # A request whose answer takes longer than the header timeout is not cut short, and
        # its connection stays open for the next request past the timeout (keep-alive).
        async with await anyio.connect_unix(socket_path) as client:
            await client.send(b"GET /1.2 HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await client.receive()).startswith(b"HTTP/1.1 200")
            await anyio.sleep(0.8)
            await client.send(b"GET /0 HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await client.receive()).startswith(b"HTTP/1.1 200")


def test_the_open_file_limit_is_raised_to_the_hard_limit() -> None:
    """A soft limit of 1,024 under a larger hard one (common at login) is lifted at start."""
    script = (
        "import resource\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (min(64, hard), hard))\n"
        "from backends.fdlimit import raise_open_file_limit\n"
        "print(raise_open_file_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    now, soft, hard = (int(v) for v in out.stdout.split())
    assert now == soft == hard
