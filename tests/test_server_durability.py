"""The server as a real process: kill -9 and restart on the same state file, SIGTERM drain."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from server_support import rollout_body, server_process

from backends.server import LEASE_HEADER


def submit(http: httpx.Client, rid: str, **extra: Any) -> str:
    response = http.post("/rollout", json=rollout_body(rid, **extra))
    assert response.status_code == 202, response.text
    return str(response.json()["polling_lease_token"])


def result(http: httpx.Client, rid: str, lease: str, wait: float = 10) -> dict[str, Any]:
    response = http.get(
        f"/rollout/{rid}/result", headers={LEASE_HEADER: lease}, params={"wait": wait}
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_kill_9_mid_batch_then_restart_loses_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state.sqlite3"
    finished: dict[str, tuple[str, dict[str, Any]]] = {}
    interrupted: dict[str, str] = {}
    with server_process(tmp_path, state) as (proc, url), httpx.Client(base_url=url) as http:
        for i in range(20):
            lease = submit(http, f"fast-{i}")
            finished[f"fast-{i}"] = (lease, {})
        for i in range(5):
            interrupted[f"slow-{i}"] = submit(http, f"slow-{i}", metadata={"sleep": 60})
        for rid, (lease, _) in finished.items():
            finished[rid] = (lease, result(http, rid, lease))
        assert http.get("/health").json()["lifecycle"]["active_rollouts"] == 5
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    with server_process(tmp_path, state) as (_, url), httpx.Client(base_url=url) as http:
        for rid, (lease, before) in finished.items():
            assert before["status"] == "success"
            assert result(http, rid, lease) == before
        for rid, lease in interrupted.items():
            data = result(http, rid, lease)
            assert data["status"] == "failure", data
            assert data["failure"]["category"] == "infra_error"
            assert data["err_category"] == "internal_error"
            assert data.get("sample") is None  # no reward at all, certainly not 0
            assert "can be resubmitted under the same id" in data["err_message"]
        health = http.get("/health").json()
        assert health["lifecycle"]["active_rollouts"] == 0
        # As its message says, an interrupted rollout runs again under its id (a new lease);
        # a finished one does not.
        assert http.post("/rollout", json=rollout_body("fast-0")).status_code == 409
        again = submit(http, "slow-0")
        assert result(http, "slow-0", again)["status"] == "success"
        old_lease = http.get(
            "/rollout/slow-0/result", headers={LEASE_HEADER: interrupted["slow-0"]}
        )
        assert old_lease.status_code == 403
        assert http.post("/rollout", json=rollout_body("slow-0")).status_code == 409
    with server_process(tmp_path, state) as (_, url), httpx.Client(base_url=url) as http:
        assert result(http, "slow-0", again)["status"] == "success"  # durable as any other


def test_sigterm_drains_finishes_or_cancels_then_exits(tmp_path: Path) -> None:
    state = tmp_path / "state.sqlite3"
    # The drain leaves "quick" 2.5 s to spare on a loaded host (0.5 s was close).
    args = ("--drain-timeout-sec", "3.0")
    with server_process(tmp_path, state, *args) as (proc, url), httpx.Client(base_url=url) as http:
        quick = submit(http, "quick", metadata={"sleep": 0.5})
        stuck = submit(http, "stuck", metadata={"sleep": 60})
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        # Once the server has the signal (a loaded host may take longer than a fixed 0.1 s
        # to deliver it), it drains and refuses new rollouts.
        while http.get("/health").json()["status"] != "draining":
            assert time.monotonic() - started < 10, "the server never started draining"
            time.sleep(0.02)
        refused = http.post("/rollout", json=rollout_body("late"))
        assert refused.status_code == 503
        assert result(http, "quick", quick)["status"] == "success"
        cancelled = result(http, "stuck", stuck)
        assert cancelled["status"] == "cancelled"
        assert proc.wait(15) == 0
        assert time.monotonic() - started < 10
    with server_process(tmp_path, state) as (_, url), httpx.Client(base_url=url) as http:
        assert result(http, "quick", quick)["status"] == "success"
        assert result(http, "stuck", stuck)["status"] == "cancelled"


def test_an_open_server_beyond_loopback_is_refused_without_a_key(tmp_path: Path) -> None:
    """Sandboxes with public network reach the host's non-loopback addresses: an open server
    there would let any agent start or cancel rollouts."""
    main = tmp_path / "main.py"
    main.write_text("backend = None\n")
    script = Path(sys.executable).with_name("backends")
    env = {k: v for k, v in os.environ.items() if k != "BACKENDS_SERVER_API_KEY"}
    refused = subprocess.run(
        [str(script), "serve", f"{main}:backend", "--host", "0.0.0.0"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2
    assert "--api-key" in refused.stderr and "--no-api-key" in refused.stderr
