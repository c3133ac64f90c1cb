"""HarborBackend under the trainer-facing server: results over HTTP, back-pressure as 429."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import pytest
from harbor_support import Sleeps
from server_support import result, rollout_body, serve_in_process, server, submit

from backends import HarborBackend

pytestmark = [pytest.mark.sandbox, pytest.mark.anyio]

TASKS = Path(__file__).parents[1] / "tasks" / "harbor"


def harbor(tmp_path: Path, agent: str | type, **kwargs) -> HarborBackend:
    return HarborBackend(
        tasks_dir=TASKS,
        task_mode="dataset",
        agent=agent,
        trials_dir=tmp_path / "trials",
        artifacts=tmp_path / "rollouts",
        **kwargs,
    )


def task(name: str) -> dict:
    return {"metadata": {"harbor_task_id": name}, "label": None}


async def test_dataset_rollouts_over_http(tmp_path: Path) -> None:
    app = server(tmp_path, harbor(tmp_path, "oracle", max_concurrent=2))
    async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url, timeout=90) as http:
        leases = {
            name: await submit(http, name, **task(name))
            for name in ("workdir-copy", "failing-tests", "named-rewards")
        }
        rewards = {}
        for name, lease in leases.items():
            data = await result(http, name, lease, wait=60)
            assert data["status"] == "success", data
            rewards[name] = data["sample"]["reward"]
    assert rewards == {"workdir-copy": 1.0, "failing-tests": 0.0, "named-rewards": 1.0}
    assert (tmp_path / "rollouts" / "named-rewards" / "trajectory.json").is_file()


async def test_full_backend_answers_429_and_cancel_stops_the_trial(tmp_path: Path) -> None:
    backend = harbor(tmp_path, Sleeps, max_concurrent=1, max_queue_depth=0)
    app = server(tmp_path, backend)
    async with serve_in_process(app) as url, httpx.AsyncClient(base_url=url, timeout=90) as http:
        lease = await submit(http, "sleepy", **task("workdir-copy"))
        with anyio.fail_after(30):
            while backend.status("sleepy") is None:
                await anyio.sleep(0.05)
        refused = await http.post("/rollout", json=rollout_body("second", **task("artifacts")))
        assert refused.status_code == 429, refused.text
        assert refused.headers.get("retry-after")
        cancelled = await http.post("/rollout/cancel", json={"ids": ["sleepy"]})
        assert cancelled.status_code == 200, cancelled.text
        data = await result(http, "sleepy", lease, wait=30)
        assert data["status"] == "cancelled", data
        assert backend.has_capacity()
