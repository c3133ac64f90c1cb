"""Strands Agents on LocalBackend, through the relay, against the scripted policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from integration_support import TOOL_SCRIPT, relayed_local, request, valid_trajectory
from strands import tool

from backends import RolloutContext, RolloutStatus, get_rollout_context
from backends.graders import ExactMatchGrader
from backends.integrations.strands import OsmosisRolloutModel, OsmosisStrandsAgent
from backends.relayed import UNRELAYED_FIELD
from backends.rollout import AgentWorkflow, AgentWorkflowContext

pytestmark = pytest.mark.anyio


# -- the seed's examples as given; only the imports changed (osmosis_ai.rollout -> backends) ---


class SimpleStrandsWorkflow(AgentWorkflow):
    async def run(self, ctx: AgentWorkflowContext) -> None:
        agent = OsmosisStrandsAgent(
            name="simple-strands-agent",
            model=OsmosisRolloutModel(params={"temperature": 1.0}),
            messages=ctx.prompt,
            callback_handler=None,
        )
        await agent.invoke_async()


class PrivateStrandsWorkflow(AgentWorkflow):
    async def run(self, ctx: AgentWorkflowContext) -> None:
        rollout_context = get_rollout_context()
        if rollout_context is not None:
            rollout_context.preview_enabled = False
        agent = OsmosisStrandsAgent(
            model=OsmosisRolloutModel(),
            messages=ctx.prompt,
            callback_handler=None,
        )
        await agent.invoke_async()


# -- a tool-calling agent ------------------------------------------------------------------------


@tool
def multiply(a: float, b: float) -> str:
    """Multiply two numbers."""
    product = a * b
    return str(int(product)) if product.is_integer() else str(product)


class ToolWorkflow(AgentWorkflow[Any]):
    async def run(self, ctx: AgentWorkflowContext[Any]) -> None:
        agent = OsmosisStrandsAgent(
            model=OsmosisRolloutModel(),
            messages=[{"role": "system", "content": "Use your tools."}, *ctx.prompt],
            tools=[multiply],
            callback_handler=None,
        )
        await agent.invoke_async()


@pytest.mark.parametrize("workflow", [SimpleStrandsWorkflow, PrivateStrandsWorkflow])
async def test_the_seeds_strands_examples_run_as_given(workflow: Any, tmp_path: Path) -> None:
    async with relayed_local(workflow, ExactMatchGrader, tmp_path) as backend:
        result = await backend.execute(request("s1", "What is 6 * 7?", "42"))
    assert result.status is RolloutStatus.SUCCESS, result.failure
    assert result.reward == 1.0
    assert result.policy_trace is not None and len(result.policy_trace.calls) == 1
    assert result.sample is not None and UNRELAYED_FIELD not in result.sample.extra_fields
    # The native Strands history is the sample; its chat-completions copy the trajectory.
    last = result.sample.messages[-1]
    assert (last["role"], last["content"]) == ("assistant", [{"text": "42"}])
    valid_trajectory(tmp_path, result)


async def test_a_tool_calling_strands_agent_is_traced_call_by_call(tmp_path: Path) -> None:
    async with relayed_local(ToolWorkflow, ExactMatchGrader, tmp_path, TOOL_SCRIPT) as backend:
        result = await backend.execute(request("t1", "Please multiply 6 * 7", "42"))
    assert result.status is RolloutStatus.SUCCESS, result.failure
    assert result.reward == 1.0
    trace = result.policy_trace
    assert trace is not None and [c.finish_reason for c in trace.calls] == ["tool_calls", "stop"]
    # The model saw the system prompt, and the tool really ran: its result went back.
    second = trace.calls[1].request or {}
    assert second["messages"][0] == {"role": "system", "content": "Use your tools."}
    assert {"role": "tool", "content": "42"}.items() <= second["messages"][-1].items()
    assert result.sample is not None and UNRELAYED_FIELD not in result.sample.extra_fields
    trajectory = valid_trajectory(tmp_path, result)
    agent_steps = [s for s in trajectory["steps"] if s["source"] == "agent"]
    assert [bool(s.get("tool_calls")) for s in agent_steps] == [True, False]
    # Token ids and logprobs of each call landed on its step.
    assert all(s["metrics"]["completion_token_ids"] for s in agent_steps)


async def test_constructing_outside_a_rollout_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match=r"inside AgentWorkflow\.run\(\)"):
        OsmosisRolloutModel()


async def test_the_agent_is_the_sample_source_with_a_bounded_preview() -> None:
    prompt = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"},
    ]
    with RolloutContext(chat_completions_url="http://127.0.0.1:9/v1", api_key="rlt-x") as rollout:
        agent = OsmosisStrandsAgent(messages=prompt, callback_handler=None)
        assert rollout.sample_source is not None
        preview = await rollout.sample_source.get_preview(2)
        sample = await rollout.get_sample()
    assert agent.system_prompt == "Be brief."
    assert preview is not None and len(preview.messages) == 2
    assert preview.messages[-1] == {"role": "user", "content": [{"text": "three"}]}
    # The chat-completions copy keeps the system turn and plain text.
    assert sample.trajectory_messages is not None
    assert sample.trajectory_messages[0] == {"role": "system", "content": "Be brief."}
    assert len(sample.messages) == 3 and await rollout.sample_source.get_preview(0) is None
