"""Hooks the relay and bundle features rely on: a bound relay socket, binds, host Python."""

from __future__ import annotations

import socket
import sys
import threading
from pathlib import Path

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
