"""Hooks the relay and bundle features rely on: the relay's port inside, binds, host Python."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import threading
from pathlib import Path

import anyio
import pytest

from backends.sandbox.contract import PROVIDERS

pytestmark = [pytest.mark.sandbox, pytest.mark.anyio]
LOCAL = PROVIDERS[0]


async def test_relay_socket_reachable_without_network(tmp_path: Path) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    path = private / "relay.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    path.chmod(0o666)
    server.listen()

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"HTTP/1.0 200 OK\r\n\r\nrelay:" + conn.recv(100)[:3])

    threading.Thread(target=serve, daemon=True).start()
    env = LOCAL.make(tmp_path, kwargs={"relay_socket": str(path), "relay_port": 18123})
    await env.start(force_build=False)
    try:
        res = await env.exec(
            "python3 -c \"import socket; s=socket.create_connection(('127.0.0.1', 18123));"
            "s.sendall(b'GET /'); print(s.recv(100).decode())\""
        )
        assert "relay:GET" in res.stdout, res
        assert (await env.exec("cat /proc/net/dev | grep -c :")).stdout == "1\n"
        # The socket itself is not inside: the forwarder, with its cap, is the only way in,
        # so one sandbox cannot hold thousands of the orchestrator's fds.
        mounts = await env.exec(f"grep -c {path.name} /proc/self/mountinfo; ls /run/backends")
        assert mounts.stdout.split("\n")[0] == "0", mounts
    finally:
        await env.stop(delete=True)
        server.close()


async def test_relay_port_is_served_in_a_sandbox_with_network_too(tmp_path: Path) -> None:
    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"relay:" + (await reader.read(100))[:3])
        writer.close()

    path = tmp_path / "relay.sock"
    server = await asyncio.start_unix_server(relay, path)
    path.chmod(0o666)
    kwargs = {"relay_socket": str(path), "relay_port": 18125, "network": "public"}
    env = LOCAL.make(tmp_path, kwargs=kwargs)
    await env.start(force_build=False)
    try:
        res = await env.exec(
            'grep -c : /proc/net/dev; python3 -c "import socket; '
            "s=socket.create_connection(('127.0.0.1', 18125)); s.sendall(b'GET');"
            'print(s.recv(100).decode())"'
        )
        assert res.stdout == "2\nrelay:GET\n", res  # loopback and the NAT'd interface
    finally:
        await env.stop(delete=True)
        server.close()


async def test_host_python_and_extra_binds(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "in.txt").write_text("from host")
    env = LOCAL.make(
        tmp_path,
        kwargs={
            "host_python": True,
            "extra_binds": [{"source": str(shared), "target": "/mnt/shared", "read_only": False}],
        },
    )
    await env.start(force_build=False)
    try:
        py = f"{sys.base_prefix}/bin/python3"
        res = await env.exec(f"{py} -c 'import ssl, sqlite3, ctypes, sys; print(sys.version[:4])'")
        assert res.stdout == "3.12\n", res
        res = await env.exec(
            f"cat /mnt/shared/in.txt; touch {sys.base_prefix}/x 2>&1 | grep -c Read"
        )
        assert res.stdout == "from host1\n"
    finally:
        await env.stop(delete=True)


def _socket_fds() -> int:
    """How many sockets this process holds open."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


async def test_relay_forwarder_runs_nothing_inside_and_survives_a_flood(tmp_path: Path) -> None:
    """127.0.0.1:<port> inside reaches the relay's socket with no process in the sandbox; root
    inside cannot take that port; a flood of connections costs the host a bounded number of
    fds and is served late, never refused; a large answer comes through whole; stop() ends
    it."""
    from backends.sandbox.relay_forwarder import MAX_CONNECTIONS

    big = os.urandom(1 << 20).hex().encode()  # 2 MiB of text

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await reader.read(100)
        if request.startswith(b"BIG"):
            writer.write(big)
        else:
            writer.write(b"relay:" + request[:3])
        await writer.drain()
        writer.close()

    path = tmp_path / "relay.sock"
    server = await asyncio.start_unix_server(relay, path)
    path.chmod(0o666)
    before = _socket_fds()
    env = LOCAL.make(tmp_path, kwargs={"relay_socket": str(path), "relay_port": 18123})
    await env.start(force_build=False)
    try:
        res = await env.exec(
            "for p in /proc/[0-9]*; do echo $(cat $p/comm) $(cat $p/stat | cut -d' ' -f4); done",
            user="root",
        )
        processes = res.stdout.split("\n")
        assert not any("socat" in p for p in processes), res.stdout
        assert len([p for p in processes if p.strip()]) <= 3, res.stdout  # pid 1, sh, a cat

        taken = await env.exec(
            'python3 -c "import socket\nfor opt in (socket.SO_REUSEADDR, socket.SO_REUSEPORT):\n'
            "    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, opt, 1)\n"
            "    try: s.bind(('127.0.0.1', 18123)); print('bound')\n"
            '    except OSError as e: print(e.errno)"',
            user="root",
        )
        assert taken.stdout.split() == ["98", "98"], taken  # EADDRINUSE, root or not

        # Past the cap, a connection waits (its data too) until a forwarded one ends.
        peak = before
        flood_script = (
            'python3 -c "import socket, time\n'
            f"held = [socket.create_connection(('127.0.0.1', 18123)) for _ in range({MAX_CONNECTIONS + 20})]\n"
            "late = held[-1]; late.sendall(b'GET'); late.settimeout(1)\n"
            "try: print('served past the cap:', late.recv(100))\n"
            "except TimeoutError: print('waits')\n"
            "for s in held[:20]: s.close()\n"
            "late.settimeout(30); print(late.recv(100).decode())\n"
            "for s in held[20:-1]:\n"
            "    s.settimeout(30); s.sendall(b'GET'); assert s.recv(100) == b'relay:GET'\n"
            "print('all answered')\n"
            "s = socket.create_connection(('127.0.0.1', 18123)); s.sendall(b'BIG')\n"
            "got = b''\n"
            "while chunk := s.recv(65536): got += chunk\n"
            'print(len(got))"'
        )
        async with anyio.create_task_group() as tg:

            async def sample() -> None:
                nonlocal peak
                while True:
                    peak = max(peak, _socket_fds())
                    await anyio.sleep(0.05)

            tg.start_soon(sample)
            flood = await env.exec(flood_script, timeout_sec=120)
            tg.cancel_scope.cancel()
        assert flood.return_code == 0, flood
        assert flood.stdout.split("\n")[:4] == [
            "waits", "relay:GET", "all answered", str(len(big))
        ], flood.stdout  # fmt: skip
        # Two sockets per forwarded connection, and this test's relay holds the third.
        assert before + MAX_CONNECTIONS <= peak <= before + 3 * MAX_CONNECTIONS + 8

        again = await env.exec(
            "python3 -c \"import socket; s=socket.create_connection(('127.0.0.1', 18123));"
            "s.sendall(b'GET'); print(s.recv(100).decode())\""
        )
        assert again.stdout == "relay:GET\n", again
    finally:
        await env.stop(delete=True)
        server.close()
    assert _socket_fds() <= before  # the listener and every connection are closed


async def test_relay_forwarder_closes_a_connection_when_the_relay_is_gone(
    tmp_path: Path,
) -> None:
    path = tmp_path / "relay.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.close()  # the path exists; nothing listens
    env = LOCAL.make(tmp_path, kwargs={"relay_socket": str(path), "relay_port": 18124})
    await env.start(force_build=False)
    try:
        res = await env.exec(
            "python3 -c \"import socket; s=socket.create_connection(('127.0.0.1', 18124));"
            "s.settimeout(10); s.sendall(b'GET'); print(repr(s.recv(100)))\"",
            timeout_sec=30,
        )
        assert res.stdout == "b''\n", res
    finally:
        await env.stop(delete=True)
