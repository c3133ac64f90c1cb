"""The rollout server against loose types, repeated cancels and a state file that refuses."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx
import pytest
from server_support import make_backend, result, rollout_body, serve_in_process, server, submit
from watchdog_support import is_block_of, reported_block

from backends import LocalBackend
from backends.rollout.backend import CancelDisposition
from backends.server import RolloutClient
from backends.server.client import WAIT_MARGIN_SEC, RolloutHandle

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("selector", [{"all": "yes"}, {"all": 1}, {"all": "true"}])
async def test_a_cancel_selector_must_be_the_real_type(
    tmp_path: Path, selector: dict[str, Any]
) -> None:
    async with (
        serve_in_process(server(tmp_path)) as url,
        httpx.AsyncClient(base_url=url, timeout=10) as http,
    ):
        lease = await submit(http, "r1", metadata={"sleep": 0.5})
        refused = await http.post("/rollout/cancel", json=selector)
        assert refused.status_code == 422, refused.text
        assert refused.json()["detail"][0]["loc"][0] == "body"
        # Nothing was cancelled by a selector that was not a boolean true.
        assert (await result(http, "r1", lease))["status"] == "success"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("grade", "no"),
        ("grade", 0),
        ("agent_timeout_sec", "5"),
        ("agent_timeout_sec", True),
        ("grader_timeout_sec", "1e3"),
    ],
)
async def test_booleans_and_numbers_are_not_coerced(tmp_path: Path, field: str, value: Any) -> None:
    async with (
        serve_in_process(server(tmp_path)) as url,
        httpx.AsyncClient(base_url=url, timeout=10) as http,
    ):
        response = await http.post("/rollout", json=rollout_body("r1", **{field: value}))
        assert response.status_code == 422, response.text
        assert response.json()["detail"][0]["loc"] == ["body", field]
        # An integer is still a number of seconds.
        assert (
            await http.post("/rollout", json=rollout_body("r2", agent_timeout_sec=5))
        ).is_success


class ForgetsOnCancel(LocalBackend):
    """A backend that stops tracking a rollout the moment it is cancelled (as one whose
    rollout finished between two cancels does): a repeat gets ``not_found`` from it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.forgotten: set[str] = set()

    def status(self, rollout_id: str) -> Any:
        return None if rollout_id in self.forgotten else super().status(rollout_id)

    def cancel(self, ids: Any = None, prefix: Any = None, all: bool = False) -> Any:
        out = {}
        for rid in ids or []:
            if rid in self.forgotten:
                out[rid] = CancelDisposition.NOT_FOUND
            else:
                out.update(super().cancel(ids=[rid]))
                self.forgotten.add(rid)
        return out


async def test_a_repeat_cancel_tells_running_from_queued_truthfully(tmp_path: Path) -> None:
    base = make_backend(max_concurrent=1)
    backend = ForgetsOnCancel(
        workflow=base.workflow_cls, workflow_config=base.workflow_config,
        grader=base.grader_cls, artifacts_root=None,
    )  # fmt: skip
    app = server(tmp_path, backend)
    async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as http:
        running = await submit(http, "running", metadata={"sleep": 30})
        queued = await submit(http, "queued", metadata={"sleep": 30})
        while backend.status("running") is None:
            await anyio.sleep(0.01)
        first = app.cancel(ids=["running", "queued"])
        again = app.cancel(ids=["running", "queued"])
        assert first == {"running": "cancelled_running", "queued": "cancelled_queued"}
        assert again == first
        assert (await result(http, "running", running))["status"] == "cancelled"
        assert (await result(http, "queued", queued))["status"] == "cancelled"
        # Once finished, it is no longer in flight.
        assert app.cancel(ids=["running"]) == {"running": "not_found"}


async def test_a_state_file_that_refuses_an_admission_is_a_503_with_the_cause(
    tmp_path: Path,
) -> None:
    app = server(tmp_path)
    big = "z" * 300_000
    async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as http:
        conn = app._store._conn
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count={pages}")  # the disk is full
        refused = await http.post(
            "/rollout", json=rollout_body("r1", initial_messages=[{"role": "user", "content": big}])
        )
        health = (await http.get("/health")).json()
        conn.execute("PRAGMA max_page_count=1073741823")  # room again
        lease = await submit(http, "r1")  # the id was not taken by the refused attempt
        data = await result(http, "r1", lease)
        healthy = (await http.get("/health")).json()
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "5"
    assert "full" in refused.json()["detail"]
    assert health["status"] == "degraded" and "full" in health["error"]
    assert data["status"] == "success"
    assert healthy["status"] == "ok" and "error" not in healthy


@contextlib.asynccontextmanager
async def silent_server() -> AsyncIterator[str]:
    """Accepts connections, reads what comes, never answers."""

    async def hold(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                while True:
                    await stream.receive()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, hold)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            tg.cancel_scope.cancel()


async def test_every_client_call_has_a_deadline() -> None:
    async with silent_server() as url, RolloutClient(url, timeout_sec=1.0) as client:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="did not answer in 1s"):
            await client.submit(rollout_body("r1"))
        assert time.monotonic() - started < 2
        handle = RolloutHandle(
            "r1", "lease", result_wait_timeout_sec=30, polling_lease_timeout_sec=120
        )
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="did not finish in 2s"):
            await client.wait(handle, timeout_sec=2)
        assert time.monotonic() - started < 2 + WAIT_MARGIN_SEC + 0.5
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await client.health()  # retried, still within its deadline
        assert time.monotonic() - started < 2


async def test_a_rollout_blocking_the_loop_is_named_and_innocent_ones_keep_their_time(
    tmp_path: Path,
) -> None:
    async with (
        serve_in_process(server(tmp_path)) as url,
        httpx.AsyncClient(base_url=url, timeout=20) as http,
    ):
        leases = {
            f"innocent-{i}": await submit(http, f"innocent-{i}", metadata={"sleep": 0.5},
                                          agent_timeout_sec=1.5)
            for i in range(4)
        }  # fmt: skip
        await anyio.sleep(0.1)  # they are all running
        culprit = await submit(http, "culprit", metadata={"block": 2.0}, agent_timeout_sec=1.5)
        blamed = await result(http, "culprit", culprit)
        finished = [await result(http, rid, lease) for rid, lease in leases.items()]
    assert [r["status"] for r in finished] == ["success"] * 4, finished
    assert blamed["status"] == "failure" and blamed["failure"]["category"] == "timeout"
    charged = reported_block(blamed["err_message"], "its own code blocked the event loop for ")
    assert is_block_of(charged, 2.0), blamed["err_message"]
    assert "server_support.py:" in blamed["err_message"]
