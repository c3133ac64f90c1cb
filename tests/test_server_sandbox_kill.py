"""Kill -9 a rollout server whose rollouts hold live local sandboxes: nothing survives it.

The workflow starts a real LocalSandbox and leaves a process running inside it, plus a
daemonized one. After SIGKILL of the server, every process inside is gone (the sandbox dies
with its owner), the restarted server reports the rollout as an infrastructure failure, and
the leak collector leaves no scratch directory or cgroup behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from host_support import marked, owned_by, unique_marker
from server_support import free_port, rollout_body

from backends.sandbox import cgroups
from backends.sandbox.runtime import reap_orphans
from backends.sandbox.settings import run_dir
from backends.server import LEASE_HEADER

pytestmark = pytest.mark.sandbox
ROOT = Path(__file__).resolve().parents[1]

MAIN = """
import uuid
from pathlib import Path

import anyio

from backends import AgentWorkflow, LocalBackend
from backends.sandbox.contract import PROVIDERS


class HoldsASandbox(AgentWorkflow):
    async def run(self, ctx):
        env = PROVIDERS[0].make(Path({scratch!r}) / uuid.uuid4().hex[:8])
        await env.start(force_build=False)
        try:
            await env.exec("nohup sleep {marker} >/dev/null 2>&1 &")
            await env.exec("sleep {marker}")
        finally:
            await env.stop(delete=True)
        return [*ctx.prompt, {{"role": "assistant", "content": "never"}}]


backend = LocalBackend(workflow=HoldsASandbox, artifacts_root=None)
"""


def start_server(tmp_path: Path, state: Path, port: int) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "backends.server", str(tmp_path / "main.py") + ":backend",
        "--port", str(port), "--state-file", str(state), "--log-level", "warning",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 120  # a loaded host imports slowly; a failed start exits
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("server did not start")
        time.sleep(0.1)


def test_kill_9_leaves_no_sandbox_running(tmp_path: Path) -> None:
    marker = unique_marker()
    (tmp_path / "main.py").write_text(MAIN.format(scratch=str(tmp_path / "s"), marker=marker))
    state = tmp_path / "state.sqlite3"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(tmp_path, state, port)
    try:
        body = rollout_body("sandboxed", grade=False)
        lease = httpx.post(url + "/rollout", json=body).json()["polling_lease_token"]
        deadline = time.monotonic() + 60
        while len(marked(marker)) < 2:  # the daemon and the foreground sleep
            assert time.monotonic() < deadline, "the sandboxed processes never started"
            time.sleep(0.1)
        ours = owned_by(proc.pid)
        assert ours, "the rollout's sandbox has no scratch directory"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    deadline = time.monotonic() + 30  # the spawner's kill is prompt; a loaded host, not always
    while marked(marker):
        assert time.monotonic() < deadline, (
            f"sandboxed processes outlived the server: {marked(marker)}"
        )
        time.sleep(0.1)

    proc = start_server(tmp_path, state, port)
    try:
        response = httpx.get(
            f"{url}/rollout/sandboxed/result", headers={LEASE_HEADER: lease}, params={"wait": 5}
        )
        data = response.json()
        assert data["status"] == "failure" and data["failure"]["category"] == "infra_error"
        assert data.get("sample") is None
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)

    reap_orphans()
    leftovers = {p.name for p in run_dir().iterdir()}
    assert not (leftovers & ours)
    assert not (set(cgroups.stale_groups()) & ours)
