"""The OpenAI Agents SDK on LocalBackend, through the relay, against the scripted policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from agents import ModelSettings, Runner, function_tool
from integration_support import TOOL_SCRIPT, relayed_local, request, valid_trajectory

from backends import RolloutContext, RolloutStatus
from backends.graders import ExactMatchGrader
from backends.integrations.openai_agents import (
    ITEMS_FIELD,
    OsmosisAgent,
    OsmosisMemorySession,
    OsmosisRolloutModel,
)
from backends.relayed import UNRELAYED_FIELD
from backends.rollout import AgentWorkflow, AgentWorkflowContext

pytestmark = pytest.mark.anyio


# -- the seed's example as given; only the imports changed (osmosis_ai.rollout -> backends) ----


class SimpleOpenAIWorkflow(AgentWorkflow):
    async def run(self, ctx: AgentWorkflowContext) -> None:
        agent = OsmosisAgent(
            name="simple-openai-agent",
            instructions="Answer the user's request clearly.",
            model=OsmosisRolloutModel(),
            model_settings=ModelSettings(temperature=1.0, max_tokens=4096),
        )
        session = OsmosisMemorySession()
        await Runner.run(
            agent,
            ctx.prompt,
            session=session,
        )


# -- a tool-calling agent ------------------------------------------------------------------------


@function_tool
def multiply(a: float, b: float) -> str:
    """Multiply two numbers."""
    product = a * b
    return str(int(product)) if product.is_integer() else str(product)


class ToolWorkflow(AgentWorkflow[Any]):
    async def run(self, ctx: AgentWorkflowContext[Any]) -> None:
        agent = OsmosisAgent(name="calculator", instructions="Use your tools.", tools=[multiply])
        await Runner.run(agent, ctx.prompt, session=OsmosisMemorySession())


async def test_the_seeds_openai_agents_example_runs_as_given(tmp_path: Path) -> None:
    async with relayed_local(SimpleOpenAIWorkflow, ExactMatchGrader, tmp_path) as backend:
        result = await backend.execute(request("o1", "What is 6 * 7?", "42"))
    assert result.status is RolloutStatus.SUCCESS, result.failure
    assert result.reward == 1.0
    trace = result.policy_trace
    assert trace is not None and len(trace.calls) == 1
    sent = trace.calls[0].request or {}
    assert sent["messages"][0] == {
        "role": "system",
        "content": "Answer the user's request clearly.",
    }
    assert sent["temperature"] == 1.0 and sent["max_tokens"] == 4096
    assert result.sample is not None and UNRELAYED_FIELD not in result.sample.extra_fields
    valid_trajectory(tmp_path, result)


async def test_a_tool_calling_agent_records_tool_turns_and_every_call(tmp_path: Path) -> None:
    async with relayed_local(ToolWorkflow, ExactMatchGrader, tmp_path, TOOL_SCRIPT) as backend:
        result = await backend.execute(request("o2", "Please multiply 6 * 7", "42"))
    assert result.status is RolloutStatus.SUCCESS, result.failure
    assert result.reward == 1.0
    trace = result.policy_trace
    assert trace is not None and [c.finish_reason for c in trace.calls] == ["tool_calls", "stop"]
    # The session holds the tool call and its output, for grading and previews.
    assert result.sample is not None
    roles = [m["role"] for m in result.sample.messages]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert result.sample.messages[1]["tool_calls"][0]["function"]["name"] == "multiply"
    assert result.sample.messages[2]["content"] == "42"
    items = result.sample.extra_fields[ITEMS_FIELD]
    assert [i.get("type") for i in items if i.get("type")][:2] == [
        "function_call",
        "function_call_output",
    ]
    assert UNRELAYED_FIELD not in result.sample.extra_fields
    trajectory = valid_trajectory(tmp_path, result)
    agent_steps = [s for s in trajectory["steps"] if s["source"] == "agent"]
    assert [bool(s.get("tool_calls")) for s in agent_steps] == [True, False]
    assert all(s["metrics"]["completion_token_ids"] for s in agent_steps)


def test_tracing_to_openai_is_off() -> None:
    from agents.tracing import get_trace_provider

    provider: Any = get_trace_provider()
    assert provider._disabled is True


async def test_constructing_outside_a_rollout_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match=r"inside AgentWorkflow\.run\(\)"):
        OsmosisMemorySession()


async def test_the_session_is_the_sample_source_with_a_bounded_preview() -> None:
    with RolloutContext(chat_completions_url="http://127.0.0.1:9/v1", api_key="rlt-x") as rollout:
        session = OsmosisMemorySession()
        await session.add_items(
            [
                {"role": "user", "content": "one"},
                {"role": "assistant", "content": "two"},
                {"role": "user", "content": "three"},
            ]
        )
        assert rollout.sample_source is not None
        preview = await rollout.sample_source.get_preview(2)
        assert len(await session.get_items(limit=1)) == 1
        sample = await rollout.get_sample()
    assert session.session_id == "rollout"  # no rollout id in this bare context
    assert preview is not None and [m["content"] for m in preview.messages] == ["two", "three"]
    assert [m["role"] for m in sample.messages] == ["user", "assistant", "user"]
