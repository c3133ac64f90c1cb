"""The rollout server with ``relay=True``: policy calls go through a rollout-scoped relay and each
result carries the policy trace (token ids, logprobs); the agent never holds the trainer's key."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from policy_support import SEEN, AskPolicy, Exact, completion, policy_server
from server_support import rollout_body, serve_in_process

from backends import (
    LocalBackend,
)
from backends.relay import Relay
from backends.server import LEASE_HEADER, create_rollout_server

pytestmark = pytest.mark.anyio

UPSTREAM_KEY = "sk-upstream-secret-0123456789"
TOKEN_IDS = [19, 17]
LOGPROBS = [-0.25, -0.5]


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[str, list[str]]]:
    """A policy answering "42" with token ids and logprobs; it records each call's
    Authorization header."""
    seen_auth: list[str] = []

    def reply(body: dict[str, Any], auth: str) -> tuple[int, dict[str, Any]]:
        seen_auth.append(auth)
        return 200, completion(body, "42", token_ids=TOKEN_IDS, logprobs=LOGPROBS)

    async with policy_server(reply) as url:
        yield url, seen_auth


def relayed_app(backend: Any, tmp_path: Path) -> Any:
    """A rollout server with its own relay, state and artifacts under tmp_path."""
    return create_rollout_server(
        backend=backend,
        relay=True,
        state_file=tmp_path / "state.sqlite3",
        artifacts_root=tmp_path / "rollouts",
    )


async def run_one(url: str, rid: str, policy_url: str) -> dict[str, Any]:
    body = rollout_body(
        rid, chat_completions_url=policy_url + "/chat/completions", llm_api_key=UPSTREAM_KEY
    )
    async with httpx.AsyncClient(base_url=url) as http:
        submitted = await http.post("/rollout", json=body)
        assert submitted.status_code == 202, submitted.text
        lease = submitted.json()["polling_lease_token"]
        response = await http.get(
            f"/rollout/{rid}/result", headers={LEASE_HEADER: lease}, params={"wait": 20}
        )
    assert response.status_code == 200, response.text
    return dict(response.json())


async def test_policy_calls_go_through_the_relay_and_the_trace_reaches_the_trainer(
    upstream: tuple[str, list[str]], tmp_path: Path
) -> None:
    policy_url, seen_auth = upstream
    backend = LocalBackend(workflow=AskPolicy, grader=Exact, artifacts_root=None)
    app = relayed_app(backend, tmp_path)
    async with serve_in_process(app) as url:
        data = await run_one(url, "relayed-1", policy_url)
        async with httpx.AsyncClient(base_url=url) as http:
            relay_url = (await http.get("/health")).json()["relay"]

    assert data["status"] == "success" and data["sample"]["reward"] == 1.0
    # The agent held only its own route on the relay and a token for it.
    assert SEEN["url"].startswith(relay_url) and "/rollouts/relayed-1/" in SEEN["url"] + "/"
    assert UPSTREAM_KEY not in json.dumps(SEEN)
    # The relay called the policy with the trainer's key.
    assert seen_auth == [f"Bearer {UPSTREAM_KEY}"]
    (call,) = data["policy_trace"]["calls"]
    assert call["upstream_status"] == 200
    (choice,) = call["choices"]
    assert choice["token_ids"] == TOKEN_IDS and choice["logprobs"] == LOGPROBS
    # The key is not echoed back either.
    assert UPSTREAM_KEY not in json.dumps(data)
    # The saved ATIF trajectory's agent step carries what the policy sampled, and no key.
    saved = (tmp_path / "rollouts" / "relayed-1" / "trajectory.json").read_text()
    assert UPSTREAM_KEY not in saved
    (agent_step,) = [s for s in json.loads(saved)["steps"] if s["source"] == "agent"]
    assert agent_step["metrics"]["completion_token_ids"] == TOKEN_IDS
    assert agent_step["metrics"]["logprobs"] == LOGPROBS


async def test_a_relay_the_caller_serves_is_used_and_left_running(
    upstream: tuple[str, list[str]], tmp_path: Path
) -> None:
    policy_url, _ = upstream
    backend = LocalBackend(workflow=AskPolicy, grader=Exact, artifacts_root=None)
    async with Relay() as relay:
        app = create_rollout_server(
            backend=backend, relay=relay, state_file=tmp_path / "s.sqlite3", artifacts_root=None
        )
        async with serve_in_process(app) as url:
            data = await run_one(url, "relayed-2", policy_url)
        assert SEEN["url"].startswith(relay.base_url)
        assert relay.base_url  # still serving after the rollout server stopped
    assert data["status"] == "success"
    assert data["policy_trace"]["calls"][0]["choices"][0]["token_ids"] == TOKEN_IDS


async def test_without_a_relay_results_carry_no_trace(
    upstream: tuple[str, list[str]], tmp_path: Path
) -> None:
    policy_url, seen_auth = upstream
    backend = LocalBackend(workflow=AskPolicy, grader=Exact, artifacts_root=None)
    app = create_rollout_server(
        backend=backend, state_file=tmp_path / "state.sqlite3", artifacts_root=None
    )
    async with serve_in_process(app) as url:
        data = await run_one(url, "direct-1", policy_url)
    assert data["status"] == "success"
    assert "policy_trace" not in data
    assert seen_auth == [f"Bearer {UPSTREAM_KEY}"] and SEEN["key"] == UPSTREAM_KEY


class AnswersWithoutThePolicy(AskPolicy):
    """Asks the policy, then adds an answer of its own, as a direct provider call would."""

    async def run(self, ctx: Any) -> Any:
        messages = await super().run(ctx)
        return [*messages, {"role": "assistant", "content": "42, I checked it myself"}]


async def test_the_trainer_sees_which_assistant_turns_bypassed_the_relay(
    upstream: tuple[str, list[str]], tmp_path: Path
) -> None:
    policy_url, _ = upstream
    backend = LocalBackend(workflow=AnswersWithoutThePolicy, grader=Exact, artifacts_root=None)
    app = relayed_app(backend, tmp_path)
    async with serve_in_process(app) as url:
        data = await run_one(url, "bypass-1", policy_url)
    # Message 1 came from the relay; message 2 did not, so it has no tokens to train on.
    assert data["sample"]["extra_fields"]["unrelayed_assistant_turns"] == [2]
