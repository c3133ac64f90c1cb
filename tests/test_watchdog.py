"""The event-loop watchdog: the rollout that blocks the loop is named, the others keep time."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import anyio
import pytest
from watchdog_support import is_block_of, reported_block

from backends import (
    AgentWorkflow,
    AgentWorkflowContext,
    Grader,
    GraderContext,
    LocalBackend,
    RolloutRequest,
    collect,
)
from backends.rollout.watchdog import BLOCKED_FIELD, _dogs

pytestmark = pytest.mark.anyio


class Sometimes(AgentWorkflow[Any]):
    async def run(self, ctx: AgentWorkflowContext[Any]) -> Any:
        if ctx.metadata and ctx.metadata.get("block"):
            time.sleep(ctx.metadata["block"])  # the mistake: a blocking call on the loop
        else:
            await anyio.sleep(0.3)
        return [*ctx.prompt, {"role": "assistant", "content": "42"}]


class BlockingGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        if ctx.metadata and ctx.metadata.get("block_grader"):
            time.sleep(1.2)
        else:
            await anyio.sleep(0.3)
        ctx.set_reward(1.0)


def request(rid: str, **metadata: Any) -> RolloutRequest:
    return RolloutRequest(
        rollout_id=rid, prompt=[{"role": "user", "content": "q"}], label="42",
        metadata=metadata, agent_timeout_sec=1.0, grader_timeout_sec=1.0,
    )  # fmt: skip


async def test_the_culprit_is_charged_and_the_others_get_their_time_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = LocalBackend(workflow=Sometimes, grader=BlockingGrader, artifacts_root=None)
    requests = [request(f"ok-{i}") for i in range(3)] + [request("bad", block=1.5)]
    with caplog.at_level(logging.WARNING, logger="backends.rollout.watchdog"):
        results = {r.rollout_id: r for r in await collect(backend, requests, max_in_flight=4)}
    bad = results.pop("bad")
    assert {r.status.value for r in results.values()} == {"success"}
    assert all(BLOCKED_FIELD not in r.extra_fields for r in results.values())
    assert bad.failure is not None and bad.failure.category.value == "timeout"
    charged = reported_block(bad.failure.message, "its own code blocked the event loop for ")
    assert is_block_of(charged, 1.5), bad.failure.message
    assert bad.extra_fields[BLOCKED_FIELD]["at"] == ["test_watchdog.py:31 in run"]
    logged = reported_block(
        caplog.text, "blocked for ", " by rollout bad at test_watchdog.py:31 in run"
    )
    assert is_block_of(logged, 1.5), caplog.text


async def test_a_grader_blocking_the_loop_spares_the_other_graders() -> None:
    backend = LocalBackend(workflow=Sometimes, grader=BlockingGrader, artifacts_root=None)
    requests = [request(f"ok-{i}") for i in range(3)] + [request("bad", block_grader=True)]
    results = {r.rollout_id: r for r in await collect(backend, requests, max_in_flight=4)}
    bad = results.pop("bad")
    assert {r.status.value for r in results.values()} == {"success"}
    assert bad.failure is not None and bad.failure.phase.value == "grading"
    assert "blocked the event loop" in bad.failure.message


async def test_the_heartbeat_stops_when_nothing_is_watched() -> None:
    backend = LocalBackend(workflow=Sometimes, grader=BlockingGrader, artifacts_root=None)
    await collect(backend, [request("one")])
    dog = _dogs[asyncio.get_running_loop()]
    await anyio.sleep(0.1)
    assert dog._timer is None
