"""RelayedBackend: the agent sees only its rollout's relay route; traces and blame come back."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI
from policy_support import SEEN, AskPolicy, Exact, completion, policy_server

from backends import (
    ErrorCategory,
    LocalBackend,
    RolloutRequest,
    RolloutResult,
    RolloutSample,
    RolloutStatus,
)
from backends.relay import Relay
from backends.relayed import UNRELAYED_FIELD, RelayedBackend, attach_trace
from backends.rollout import CallRecord, RolloutTrace
from backends.rollout.trace import ChoiceRecord

pytestmark = pytest.mark.anyio

UPSTREAM_KEY = "sk-upstream-secret-0123456789"


@pytest.fixture
async def upstream() -> AsyncIterator[str]:
    """A policy that answers "42", or 502 when asked to fail; it insists on the upstream key."""

    def reply(body: dict[str, Any], auth: str) -> tuple[int, dict[str, Any]]:
        assert auth == f"Bearer {UPSTREAM_KEY}"
        if "fail" in body["messages"][-1]["content"]:
            return 502, {"error": {"message": "overloaded"}}
        return 200, completion(body, "42")

    async with policy_server(reply) as url:
        yield url


def request(rid: str, question: str, upstream: str) -> RolloutRequest:
    return RolloutRequest(
        rollout_id=rid,
        prompt=[{"role": "user", "content": question}],
        label="42",
        chat_completions_url=upstream + "/chat/completions",
        api_key=UPSTREAM_KEY,
    )


async def test_agent_sees_only_its_route_and_the_trace_comes_back(
    upstream: str, tmp_path: Path
) -> None:
    backend = LocalBackend(workflow=AskPolicy, grader=Exact, artifacts_root=tmp_path)
    async with Relay() as relay:
        relayed = RelayedBackend(backend, relay)
        result = await relayed.execute(request("r1", "6 * 7?", upstream))
        assert result.status is RolloutStatus.SUCCESS and result.reward == 1.0
        assert SEEN["url"].startswith(relay.base_url) and "/rollouts/r1/" in SEEN["url"] + "/"
        assert UPSTREAM_KEY not in json.dumps(SEEN)
        assert result.policy_trace is not None
        trace = result.policy_trace.model_dump(mode="json")
        assert [c["upstream_status"] for c in trace["calls"]] == [200]
        assert trace["calls"][0]["usage"]["completion_tokens"] == 1
        # The token died with the rollout.
        async with aiohttp.ClientSession() as http:
            async with http.post(
                SEEN["url"] + "/chat/completions",
                headers={"Authorization": f"Bearer {SEEN['key']}"},
                json={"model": "policy", "messages": [{"role": "user", "content": "again"}]},
            ) as response:
                assert response.status in (401, 403)


async def test_a_failing_policy_is_blamed_not_the_agent(upstream: str, tmp_path: Path) -> None:
    backend = LocalBackend(workflow=AskPolicy, grader=Exact, artifacts_root=tmp_path)
    async with Relay() as relay:
        result = await RelayedBackend(backend, relay).execute(request("r2", "fail", upstream))
    assert result.failure is not None
    assert result.failure.category is ErrorCategory.POLICY_ERROR
    assert (
        "502" in result.failure.message and "my agent could not continue" in result.failure.message
    )
    assert result.reward is None


async def test_no_upstream_anywhere_is_a_clear_error(tmp_path: Path) -> None:
    backend = LocalBackend(workflow=AskPolicy, grader=Exact, artifacts_root=tmp_path)
    async with Relay() as relay:
        bare = RolloutRequest(rollout_id="r3", prompt=[{"role": "user", "content": "q"}], label="1")
        result = await RelayedBackend(backend, relay).execute(bare)
    assert result.failure is not None
    assert result.failure.category is ErrorCategory.VALIDATION_ERROR
    assert "upstream" in result.failure.message


class SwallowsPolicyErrors(AskPolicy):
    """Asks once per user turn; a failed call becomes a canned reply, as sloppy agents do."""

    async def run(self, ctx: Any) -> Any:
        messages = list(ctx.prompt)
        for question in ctx.metadata["questions"]:
            messages.append({"role": "user", "content": question})
            try:
                messages = await super().run(dataclasses.replace(ctx, prompt=messages))
            except RuntimeError:
                messages.append({"role": "assistant", "content": "I could not reach the model"})
        return messages


@pytest.mark.parametrize(
    ("questions", "withheld"),
    [
        (["6 * 7?", "fail"], True),  # the last call failed: nothing the policy said ends it
        (["fail", "6 * 7?"], False),  # the policy failed once, then answered: a real result
    ],
)
async def test_a_swallowed_policy_failure_withholds_the_reward(
    upstream: str, tmp_path: Path, questions: list[str], withheld: bool
) -> None:
    backend = LocalBackend(workflow=SwallowsPolicyErrors, grader=Exact, artifacts_root=tmp_path)
    req = request("r4", "start", upstream).model_copy(update={"metadata": {"questions": questions}})
    async with Relay() as relay:
        result = await RelayedBackend(backend, relay).execute(req)
    assert result.policy_trace is not None
    trace = result.policy_trace.model_dump(mode="json")
    assert trace["calls"], result.failure
    assert [c["upstream_status"] for c in trace["calls"]] == [
        502 if q == "fail" else 200 for q in questions
    ]
    if withheld:
        # The grader would have scored the canned reply 0: a dead endpoint must not train
        # as reward 0. The sample stays for diagnosis, without a reward.
        assert result.status is RolloutStatus.FAILURE and result.reward is None
        assert result.failure is not None
        assert result.failure.category is ErrorCategory.POLICY_ERROR
        assert "502" in result.failure.message and "withheld" in result.failure.message
        assert result.sample is not None and result.sample.reward is None
        assert result.sample.messages[-1]["content"] == "I could not reach the model"
    else:
        assert result.status is RolloutStatus.SUCCESS and result.reward == 1.0


class AlsoAsksAProviderDirectly(AskPolicy):
    """Asks through the rollout context, then calls a provider at a fixed URL, as the seeds warn
    against: the second answer never passes the relay."""

    async def run(self, ctx: Any) -> Any:
        messages = await super().run(ctx)
        direct = AsyncOpenAI(base_url=ctx.metadata["direct_url"], api_key=UPSTREAM_KEY)
        async with direct:
            reply = await direct.chat.completions.create(model="gpt", messages=messages)
        return [*messages, reply.choices[0].message.model_dump(exclude_none=True)]


async def test_assistant_turns_the_relay_never_saw_are_flagged(
    upstream: str, tmp_path: Path
) -> None:
    backend = LocalBackend(workflow=AlsoAsksAProviderDirectly, artifacts_root=tmp_path)
    req = request("r5", "6 * 7?", upstream).model_copy(
        update={"metadata": {"direct_url": upstream}, "grade": False}
    )
    async with Relay() as relay:
        result = await RelayedBackend(backend, relay).execute(req)
        clean = await RelayedBackend(
            LocalBackend(workflow=AskPolicy, artifacts_root=tmp_path), relay
        ).execute(request("r6", "6 * 7?", upstream).model_copy(update={"grade": False}))
    assert result.status is RolloutStatus.SUCCESS and result.sample is not None
    # Both answers read "42"; only the first was sampled through the relay (message 1), the
    # direct one (message 2) was not, so the trainer has no policy tokens for it.
    assert [m["role"] for m in result.sample.messages] == ["user", "assistant", "assistant"]
    assert result.sample.extra_fields[UNRELAYED_FIELD] == [2]
    assert clean.sample is not None and UNRELAYED_FIELD not in clean.sample.extra_fields


def test_only_the_relay_flags_turns_a_workflow_cannot_forge_the_flag() -> None:
    call = CallRecord(
        index=0,
        method="POST",
        path="/chat/completions",
        started_at=0.0,
        choices=[ChoiceRecord(index=0, message={"role": "assistant", "content": "42"})],
    )
    trace = RolloutTrace(rollout_id="r", registered_at=0.0, calls=[call])
    sample = RolloutSample(
        messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "42"}],
        extra_fields={UNRELAYED_FIELD: [1], "mine": 1},
    )
    result = RolloutResult(rollout_id="r", status=RolloutStatus.SUCCESS, sample=sample)
    flagged = attach_trace(result, trace)
    assert flagged.sample is not None and flagged.sample.extra_fields == {"mine": 1}
