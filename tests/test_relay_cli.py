"""The standalone relay and scripted policy processes, driven over HTTP like a deployment."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import anyio
import pytest

pytestmark = pytest.mark.anyio

RUN = (
    "import typer, sys\n"
    "from backends.relay.cli import relay_command, scripted_policy_command\n"
    "app = typer.Typer()\n"
    "app.command('relay')(relay_command)\n"
    "app.command('scripted-policy')(scripted_policy_command)\n"
    "app()\n"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_healthy(http: aiohttp.ClientSession, url: str) -> None:
    with anyio.fail_after(15):
        while True:
            try:
                async with http.get(url) as r:
                    if r.status in (200, 404):
                        return
            except aiohttp.ClientConnectionError:
                await anyio.sleep(0.05)


async def test_standalone_relay_and_scripted_policy(tmp_path: Path) -> None:
    policy_port, relay_port = free_port(), free_port()
    sock = tmp_path / "relay.sock"
    env = {
        **os.environ,
        "BACKENDS_UPSTREAM_API_KEY": "sk-cli-upstream-key",
        "BACKENDS_RELAY_ADMIN_TOKEN": "admin-secret",
    }
    log = (tmp_path / "relay.log").open("wb")
    policy = await anyio.open_process(
        [sys.executable, "-c", RUN, "scripted-policy", "--port", str(policy_port)],
        env=env,
        stdout=subprocess.DEVNULL,
    )
    relay = await anyio.open_process(
        [
            sys.executable, "-c", RUN, "relay",
            "--upstream", f"http://127.0.0.1:{policy_port}/v1",
            "--port", str(relay_port),
            "--unix-socket", str(sock),
            "--upstream-speaks", "messages",
        ],
        env=env,
        stdout=log,
    )  # fmt: skip
    try:
        admin = {"authorization": "Bearer admin-secret"}
        async with aiohttp.ClientSession() as http:
            await wait_healthy(http, f"http://127.0.0.1:{policy_port}/v1/models")
            await wait_healthy(http, f"http://127.0.0.1:{relay_port}/health")
            url = f"http://127.0.0.1:{relay_port}/admin/rollouts"
            async with http.post(url, json={"rollout_id": "demo"}, headers=admin) as r:
                grant = await r.json()
        question = {"messages": [{"role": "user", "content": "What is 7 * 6?"}]}
        unix = aiohttp.UnixConnector(path=str(sock))
        async with aiohttp.ClientSession(connector=unix) as http:
            async with http.post(
                "http://sandbox" + grant["path"] + "/chat/completions",
                json=question,
                headers={"authorization": f"Bearer {grant['token']}"},
            ) as r:
                answer = await r.json()
                assert "sk-cli-upstream-key" not in str(r.headers) + str(answer)
            # The upstream speaks Messages itself (--upstream-speaks): forwarded as is.
            async with http.post(
                "http://sandbox" + grant["path"] + "/messages",
                json={"max_tokens": 9, **question},
                headers={"x-api-key": grant["token"], "anthropic-version": "2023-06-01"},
            ) as r:
                message = await r.json()
        assert answer["choices"][0]["message"]["content"] == "42"
        assert answer["model"] == "scripted:default"
        assert message["content"] == [{"type": "text", "text": "42"}]
        async with aiohttp.ClientSession() as http:
            async with http.delete(url + "/demo", headers=admin) as r:
                trace = await r.json()
        assert [(c["status"], c["upstream_api"]) for c in trace["calls"]] == [
            (200, "chat.completions"),
            (200, "messages"),
        ]
    finally:
        for process in (relay, policy):
            process.send_signal(signal.SIGINT)
        with anyio.fail_after(10):
            assert [await p.wait() for p in (relay, policy)] == [0, 0]
        log.close()
    assert b"relay listening on" in (tmp_path / "relay.log").read_bytes()
    assert not sock.exists()


def test_an_unknown_upstream_format_is_a_usage_error() -> None:
    run = subprocess.run(
        [sys.executable, "-c", RUN, "relay", "--upstream", "http://127.0.0.1:9/v1",
         "--upstream-speaks", "telepathy"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2
    assert "'responses' or 'messages'" in run.stderr
