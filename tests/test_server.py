"""The rollout server's wire protocol, driven over real HTTP against a real SQLite file."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from server_support import make_backend, result, rollout_body, serve_in_process, server, submit

from backends.rollout.backend import CancelDisposition
from backends.server import LEASE_HEADER, RolloutClient, RolloutServerError

pytestmark = pytest.mark.anyio

KEY = "sk-test-key-0123456789abcdef"


async def test_health_reports_backend_and_lifecycle(tmp_path: Path) -> None:
    async with serve_in_process(server(tmp_path)) as url, httpx.AsyncClient(base_url=url) as http:
        data = (await http.get("/health")).json()
    assert data["status"] == "ok"
    assert data["backend"] == "local"
    assert data["lifecycle"] == {"accepting_rollouts": True, "active_rollouts": 0}
    assert data["process_id"] and data["instance_id"]


async def test_submit_then_long_poll_returns_graded_result(tmp_path: Path) -> None:
    async with serve_in_process(server(tmp_path)) as url, httpx.AsyncClient(base_url=url) as http:
        lease = await submit(http, "ok-1", metadata={"sleep": 0.2})
        data = await result(http, "ok-1", lease)
    assert data["status"] == "success"
    assert data["sample"]["reward"] == 1.0
    assert data["sample"]["messages"][-1] == {"role": "assistant", "content": "42"}
    assert "trajectory_messages" not in data["sample"]
    assert "err_category" not in data and "failure" not in data


async def test_failed_rollout_has_no_reward_and_names_category_and_phase(tmp_path: Path) -> None:
    async with serve_in_process(server(tmp_path)) as url, httpx.AsyncClient(base_url=url) as http:
        lease = await submit(http, "bad-1", metadata={"fail": True})
        data = await result(http, "bad-1", lease)
        wrong = await submit(http, "wrong-1", metadata={"reply": "41"})
        graded_zero = await result(http, "wrong-1", wrong)
    assert data["status"] == "failure"
    assert data.get("sample") is None or data["sample"]["reward"] is None
    assert data["err_category"] == "agent_error"
    assert data["failure"]["category"] == "agent_error" and data["failure"]["phase"] == "agent"
    assert "failed on purpose" in data["err_message"]
    # A wrong answer is a real 0 from the grader, unlike the failure above.
    assert graded_zero["status"] == "success" and graded_zero["sample"]["reward"] == 0.0


async def test_duplicate_id_is_409(tmp_path: Path) -> None:
    async with serve_in_process(server(tmp_path)) as url, httpx.AsyncClient(base_url=url) as http:
        await submit(http, "dup")
        again = await http.post("/rollout", json=rollout_body("dup"))
    assert again.status_code == 409
    assert "dup" in again.json()["detail"]


class _Full:
    """A backend that is full for its first ``full_for`` admissions."""

    def __init__(self, full_for: int) -> None:
        self.inner = make_backend()
        self.full_for = full_for

    def has_capacity(self) -> bool:
        self.full_for -= 1
        return self.full_for < 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_full_backend_is_429_with_retry_after(tmp_path: Path) -> None:
    async with serve_in_process(server(tmp_path, _Full(10))) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            response = await http.post("/rollout", json=rollout_body("full"))
    assert response.status_code == 429
    assert response.headers["retry-after"] == "5"


async def test_draining_server_is_503(tmp_path: Path) -> None:
    app = server(tmp_path)
    async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url) as http:
        app.request_drain()
        response = await http.post("/rollout", json=rollout_body("late"))
        health = (await http.get("/health")).json()
    assert response.status_code == 503
    assert "retry-after" in response.headers
    assert health["lifecycle"]["accepting_rollouts"] is False


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (rollout_body("a/b"), "rollout_id"),
        (rollout_body("x", initial_messages="hello"), "initial_messages"),
        (rollout_body("x", initial_messages=["hello"]), "initial_messages"),
        (rollout_body("x", agent_timeout_sec=-1), "agent_timeout_sec"),
        (rollout_body("x", grader_timeout_sec=-0.5), "grader_timeout_sec"),
        (rollout_body("x", llm_api_key=""), "llm_api_key"),
        ({"rollout_id": "x", "initial_messages": []}, "chat_completions_url"),
    ],
)
async def test_invalid_input_is_422_naming_the_field(
    tmp_path: Path, body: dict[str, Any], field: str
) -> None:
    async with serve_in_process(server(tmp_path)) as url, httpx.AsyncClient(base_url=url) as http:
        response = await http.post("/rollout", json=body)
        assert response.status_code == 422, response.text
        locs = [err["loc"] for err in response.json()["detail"]]
        assert ["body", field] in [loc[:2] for loc in locs], locs
        # The server keeps serving.
        lease = await submit(http, "after-422")
        assert (await result(http, "after-422", lease))["status"] == "success"


async def test_huge_body_and_broken_json_are_422(tmp_path: Path) -> None:
    app = server(tmp_path, max_body_bytes=64 * 1024)
    async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url) as http:
        big = rollout_body("big", initial_messages=[{"role": "user", "content": "x" * 100_000}])
        response = await http.post("/rollout", json=big)
        assert response.status_code == 422
        assert response.json()["detail"][0]["loc"] == ["body"]
        assert "limit" in response.json()["detail"][0]["msg"]
        broken = await http.post("/rollout", content=b"{not json")
        assert broken.status_code == 422
        assert (await http.get("/health")).status_code == 200


async def test_unknown_id_is_404_and_wrong_or_missing_lease_is_403(tmp_path: Path) -> None:
    async with serve_in_process(server(tmp_path)) as url, httpx.AsyncClient(base_url=url) as http:
        assert (await http.get("/rollout/nope/result")).status_code == 404
        await submit(http, "leased")
        wrong = await http.get("/rollout/leased/result", headers={LEASE_HEADER: "not-it"})
        missing = await http.get("/rollout/leased/result")
        assert (await http.get("/nowhere")).status_code == 404
        assert (await http.get("/rollout")).status_code == 405
    assert wrong.status_code == 403
    assert missing.status_code == 403


async def test_long_poll_returns_live_status_when_the_wait_ends(tmp_path: Path) -> None:
    async with serve_in_process(server(tmp_path)) as url, httpx.AsyncClient(base_url=url) as http:
        lease = await submit(http, "slow", metadata={"sleep": 1.0})
        started = time.monotonic()
        data = await result(http, "slow", lease, wait=0.2)
        elapsed = time.monotonic() - started
        final = await result(http, "slow", lease)
    assert data == {"rollout_id": "slow", "status": "running"}
    assert 0.15 < elapsed < 0.9
    assert final["status"] == "success"


async def test_wait_that_is_not_a_finite_duration_is_422(tmp_path: Path) -> None:
    async with serve_in_process(server(tmp_path)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=5) as http:
            lease = await submit(http, "waits", metadata={"sleep": 30})
            for wait in ["nan", "inf", "-1", "soon"]:
                response = await http.get(
                    "/rollout/waits/result", headers={LEASE_HEADER: lease}, params={"wait": wait}
                )
                assert response.status_code == 422, (wait, response.text)
                assert response.json()["detail"][0]["loc"] == ["query", "wait"]
            assert (await result(http, "waits", lease, wait=0))["status"] == "running"
            await http.post("/rollout/cancel", json={"all": True})


async def test_cancel_by_ids_prefix_and_all(tmp_path: Path) -> None:
    async with serve_in_process(server(tmp_path)) as url, httpx.AsyncClient(base_url=url) as http:
        leases = {rid: await submit(http, rid, metadata={"sleep": 30}) for rid in
                  ["one", "batch-a", "batch-b", "other"]}  # fmt: skip
        await anyio.sleep(0.1)
        by_id = (await http.post("/rollout/cancel", json={"ids": ["one", "ghost"]})).json()
        by_prefix = (await http.post("/rollout/cancel", json={"prefix": "batch-"})).json()
        everything = (await http.post("/rollout/cancel", json={"all": True})).json()
        two_ways = await http.post("/rollout/cancel", json={"ids": ["x"], "all": True})
        results = {rid: await result(http, rid, lease) for rid, lease in leases.items()}
    assert by_id["dispositions"] == {
        "one": CancelDisposition.CANCELLED_RUNNING,
        "ghost": CancelDisposition.NOT_FOUND,
    }
    assert set(by_prefix["dispositions"]) == {"batch-a", "batch-b"}
    assert set(everything["dispositions"]) == {"other"}
    assert two_ways.status_code == 422
    for data in results.values():
        assert data["status"] == "cancelled"
        assert data["failure"]["category"] == "cancelled"
        assert data.get("sample") is None


async def test_bearer_auth_guards_every_route(tmp_path: Path) -> None:
    app = server(tmp_path, api_key="server-secret")
    async with serve_in_process(app) as url:
        async with httpx.AsyncClient(base_url=url) as anonymous:
            assert (await anonymous.get("/health")).status_code == 401
            assert (await anonymous.post("/rollout", json=rollout_body("a"))).status_code == 401
            wrong = await anonymous.get("/health", headers={"authorization": "Bearer nope"})
            assert wrong.status_code == 401
        headers = {"authorization": "Bearer server-secret"}
        async with httpx.AsyncClient(base_url=url, headers=headers) as http:
            assert (await http.get("/health")).status_code == 200
            lease = await submit(http, "authed")
            assert (await result(http, "authed", lease))["status"] == "success"


async def test_expired_lease_fails_and_cancels_the_rollout(tmp_path: Path) -> None:
    app = server(tmp_path, result_wait_timeout_sec=0.2, polling_lease_timeout_sec=0.6)
    async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url) as http:
        lease = await submit(http, "forgotten", metadata={"sleep": 30})
        await anyio.sleep(1.8)  # nobody polls
        data = await result(http, "forgotten", lease)
        assert app.backend.status("forgotten") is None  # the work was stopped
    assert data["status"] == "failure"
    assert data["err_category"] == "lease_expired"
    assert data["failure"]["category"] == "lease_expired"


async def test_results_expire_after_retention(tmp_path: Path) -> None:
    app = server(tmp_path, result_retention_sec=0.3)
    async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url) as http:
        lease = await submit(http, "brief")
        assert (await result(http, "brief", lease))["status"] == "success"
        await anyio.sleep(1.5)
        gone = await http.get("/rollout/brief/result", headers={LEASE_HEADER: lease})
    assert gone.status_code == 404
    with sqlite3.connect(tmp_path / "state.sqlite3") as db:
        assert db.execute("SELECT count(*) FROM rollouts").fetchone() == (0,)


async def test_restart_serves_finished_results_from_the_state_file(tmp_path: Path) -> None:
    async with serve_in_process(server(tmp_path)) as url, httpx.AsyncClient(base_url=url) as http:
        lease = await submit(http, "kept")
        before = await result(http, "kept", lease)
    async with serve_in_process(server(tmp_path)) as url, httpx.AsyncClient(base_url=url) as http:
        after = await result(http, "kept", lease)
        wrong = await http.get("/rollout/kept/result", headers={LEASE_HEADER: "x"})
        dup = await http.post("/rollout", json=rollout_body("kept"))
    assert after == before
    assert wrong.status_code == 403
    assert dup.status_code == 409


async def test_llm_api_key_is_never_stored(tmp_path: Path) -> None:
    async with serve_in_process(server(tmp_path)) as url, httpx.AsyncClient(base_url=url) as http:
        lease = await submit(http, "secret", metadata={"reply": f"my key is {KEY}"})
        data = await result(http, "secret", lease)
        lease2 = await submit(
            http, "secret-url", chat_completions_url="http://user:hunter2pass@127.0.0.1:9/v1"
        )
        await result(http, "secret-url", lease2)
    assert KEY not in json.dumps(data)
    stored = _state_bytes(tmp_path)
    assert stored, "the state file exists"
    assert KEY.encode() not in stored
    assert b"hunter2pass" not in stored
    for saved in (tmp_path / "rollouts").rglob("*.json"):
        assert KEY not in saved.read_text()


def _state_bytes(tmp_path: Path) -> bytes:
    # The database, its WAL and shared-memory files: the key must be in none of them.
    return b"".join(p.read_bytes() for p in tmp_path.glob("state.sqlite3*") if p.is_file())


async def test_second_server_on_the_same_state_file_refuses_to_start(tmp_path: Path) -> None:
    messages: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "lifespan.startup"}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    async with serve_in_process(server(tmp_path)):
        await server(tmp_path)({"type": "lifespan"}, receive, send)
    assert messages[0]["type"] == "lifespan.startup.failed"
    assert "in use by another rollout server" in messages[0]["message"]


async def test_client_submit_wait_cancel_health(tmp_path: Path) -> None:
    app = server(tmp_path, api_key="s3cret-token")
    async with serve_in_process(app) as url, RolloutClient(url, api_key="s3cret-token") as client:
        assert (await client.health())["status"] == "ok"
        done = await client.run(rollout_body("c1"), timeout_sec=10)
        assert done.status == "success" and done.sample and done.sample["reward"] == 1.0
        handle = await client.submit(rollout_body("c2", metadata={"sleep": 30}))
        await anyio.sleep(0.05)
        assert await client.cancel(["c2"]) == {"c2": "cancelled_running"}
        assert (await client.wait(handle, timeout_sec=10)).status == "cancelled"
        with pytest.raises(RolloutServerError) as conflict:
            await client.submit(rollout_body("c1"))
        assert conflict.value.status == 409
        with pytest.raises(RolloutServerError) as bad:
            await client.submit(rollout_body("c/3"))
        assert bad.value.status == 422


async def test_client_retries_429_honouring_retry_after(tmp_path: Path) -> None:
    backend = _Full(2)
    app = server(tmp_path, backend)
    async with serve_in_process(app) as url:
        async with RolloutClient(url) as client:
            client_module = __import__("backends.server.client", fromlist=["x"])
            client_module.MAX_RETRY_AFTER_SEC, saved = 0.2, client_module.MAX_RETRY_AFTER_SEC
            try:
                started = time.monotonic()
                done = await client.run(rollout_body("patient"), timeout_sec=10)
            finally:
                client_module.MAX_RETRY_AFTER_SEC = saved
    assert done.status == "success"
    assert time.monotonic() - started >= 0.35  # two waits, clamped to 0.2 s each
    async with serve_in_process(server(tmp_path / "b", _Full(100))) as url:
        async with RolloutClient(url, max_attempts=2) as client:
            with pytest.raises(RolloutServerError) as full:
                client_module.MAX_RETRY_AFTER_SEC = 0.1
                try:
                    await client.submit(rollout_body("never"))
                finally:
                    client_module.MAX_RETRY_AFTER_SEC = saved
    assert full.value.status == 429
