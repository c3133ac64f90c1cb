"""The state file when writing fails: odd text, a full disk, a stopped writer.

Real HTTP against a real SQLite file; a full disk is SQLite's own page limit on the server's
connection (``PRAGMA max_page_count``), which fails writes exactly as a full disk does.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from server_support import result, rollout_body, serve_in_process, server, submit

from backends import AgentWorkflow, AgentWorkflowConfig, AgentWorkflowContext, LocalBackend
from backends.server.store import Store

pytestmark = pytest.mark.anyio


class Undecodable(AgentWorkflow[AgentWorkflowConfig]):
    """Answers with text that has no UTF-8 form, as bytes decoded with surrogateescape do."""

    async def run(self, ctx: AgentWorkflowContext[AgentWorkflowConfig]) -> Any:
        text = b"caf\xe9".decode("utf-8", "surrogateescape")  # e.g. a Latin-1 file name
        return [*ctx.prompt, {"role": "assistant", "content": text}]


async def test_output_with_a_lone_surrogate_is_served_stored_and_harmless(
    tmp_path: Path,
) -> None:
    backend = LocalBackend(
        workflow=Undecodable, workflow_config=AgentWorkflowConfig(name="odd"), artifacts_root=None
    )
    app = server(tmp_path, backend)
    async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url, timeout=5) as http:
        lease = await submit(http, "odd", grade=False)
        data = await result(http, "odd", lease)
        # The writer survived: the next rollout is admitted and finishes.
        after = await submit(http, "after", grade=False)
        assert (await result(http, "after", after))["status"] == "success"
        assert (await http.get("/health")).json()["lifecycle"]["accepting_rollouts"] is True
    assert data["status"] == "success"
    assert data["sample"]["messages"][-1]["content"] == "caf\ufffd"
    async with serve_in_process(server(tmp_path, backend)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=5) as http:
            assert await result(http, "odd", lease) == data  # committed, not lost
    # Its trajectory is saved too, with the same replacement.
    saved = await anyio.Path(tmp_path / "rollouts" / "odd" / "trajectory.json").read_text()
    assert "caf\ufffd" in saved


async def test_a_write_sqlite_cannot_take_fails_alone(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.sqlite3")
    store.open(retention_sec=60, interrupted=lambda rid: ("failure", "{}"))
    try:
        with anyio.fail_after(5):  # a dead writer would leave these waiting forever
            await store.accept("a", "sha", time.time(), "{}")
            await store.accept("b", "sha", time.time(), "{}")
            # Too big for an SQLite integer: OverflowError, not an sqlite3.Error.
            bad = store.finish("a", "success", 2**70, "{}")
            good = store.finish("b", "success", time.time(), '{"ok": 1}')
            with pytest.raises(OverflowError):
                await bad
            await good
            await store.accept("c", "sha", time.time(), "{}")  # the writer still works
    finally:
        await store.aclose()
    with sqlite3.connect(tmp_path / "state.sqlite3") as db:
        rows = dict(db.execute("SELECT rollout_id, status FROM rollouts"))
    assert rows == {"a": "accepted", "b": "success", "c": "accepted"}


async def test_disk_full_error_is_reported_not_a_failed_rollback(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.sqlite3")
    store.open(retention_sec=60, interrupted=lambda rid: ("failure", "{}"))
    try:
        with anyio.fail_after(5):
            await store.accept("a", "sha", time.time(), "{}")
            assert store._conn is not None
            pages = store._conn.execute("PRAGMA page_count").fetchone()[0]
            store._conn.execute(f"PRAGMA max_page_count={pages}")
            with pytest.raises(sqlite3.OperationalError, match="full"):
                await store.finish("a", "success", time.time(), "x" * 100_000)
            # Room again: no transaction was left open, so the same write now commits.
            store._conn.execute("PRAGMA max_page_count=1073741823")
            await store.finish("a", "success", time.time(), "x" * 100_000)
    finally:
        await store.aclose()


async def test_result_that_cannot_be_committed_is_never_served(tmp_path: Path) -> None:
    big = "y" * 200_000
    app = server(tmp_path)
    async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as http:
        lease = await submit(http, "r1", metadata={"sleep": 0.3, "reply": big}, label=big)
        conn = app._store._conn
        conn.execute(f"PRAGMA max_page_count={conn.execute('PRAGMA page_count').fetchone()[0]}")
        data = await result(http, "r1", lease)
        health = (await http.get("/health")).json()
        refused = await http.post("/rollout", json=rollout_body("r2"))
    # A success the state file does not hold would be denied after a restart: a failure it is.
    assert data["status"] == "failure", data
    assert data.get("sample") is None
    assert data["err_category"] == "internal_error"
    assert data["failure"]["category"] == "internal_error"
    assert "disk is full" in data["err_message"]
    assert health["status"] == "unhealthy"
    assert health["lifecycle"]["accepting_rollouts"] is False
    assert "disk is full" in health["error"]
    assert refused.status_code == 503 and "retry-after" in refused.headers
    async with serve_in_process(server(tmp_path)) as url, httpx.AsyncClient(base_url=url) as http:
        again = await result(http, "r1", lease)
    assert again["status"] == "failure" and again.get("sample") is None


async def test_stopped_writer_fails_fast_and_reports_unhealthy(tmp_path: Path) -> None:
    app = server(tmp_path)
    async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url, timeout=5) as http:
        lease = await submit(http, "inflight", metadata={"sleep": 0.5})
        app._store._queue.put(("not", "an", "operation", "at all"))  # a writer bug, in effect
        started = time.monotonic()
        refused = await http.post("/rollout", json=rollout_body("late"))
        assert time.monotonic() - started < 1
        health = (await http.get("/health")).json()
        data = await result(http, "inflight", lease)
    assert refused.status_code == 503, refused.text
    assert "writer stopped" in refused.json()["detail"]
    assert health["status"] == "unhealthy"
    assert health["lifecycle"]["accepting_rollouts"] is False
    assert "writer stopped" in health["error"]
    # The rollout in flight gets a final answer, a failure, instead of waiting forever.
    assert data["status"] == "failure" and data["err_category"] == "internal_error"
    assert data.get("sample") is None
