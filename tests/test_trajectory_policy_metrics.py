"""Token ids and logprobs from the relay's trace land on the right ATIF agent steps."""

from __future__ import annotations

from backends.relay.trace import CallRecord, ChoiceRecord, RolloutTrace
from backends.trajectory import to_trajectory
from backends.trajectory.policy_metrics import agent_step_metrics


def call(index: int, content: str, ids: list[int], logprobs: list[float]) -> CallRecord:
    return CallRecord(
        index=index,
        method="POST",
        path="/chat/completions",
        started_at=0.0,
        upstream_status=200,
        status=200,
        model="policy-v7",
        usage={"prompt_tokens": 11, "completion_tokens": len(ids)},
        prompt_token_ids=[1, 2, 3],
        policy_version="7",
        choices=[
            ChoiceRecord(
                index=0,
                message={"role": "assistant", "content": content},
                finish_reason="stop",
                token_ids=ids,
                logprobs=logprobs,
            )
        ],
    )


def test_each_agent_step_gets_its_own_calls_tokens() -> None:
    trace = RolloutTrace(
        rollout_id="r",
        registered_at=0.0,
        calls=[
            call(0, "discarded draft", [9], [-0.9]),
            call(1, "first answer", [5, 6], [-0.1, -0.2]),
            call(2, "second answer", [7], [-0.3]),
        ],
    ).model_dump(mode="json")
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "written by the agent itself"},
        {"role": "assistant", "content": "second answer"},
    ]
    metrics = agent_step_metrics(messages, trace)
    assert len(metrics) == 3
    first, own, second = metrics
    assert first is not None and second is not None
    assert first.completion_token_ids == [5, 6] and first.logprobs == [-0.1, -0.2]
    assert first.prompt_token_ids == [1, 2, 3] and first.prompt_tokens == 11
    assert first.extra == {
        "policy_version": "7",
        "relay_call_index": 1,
        "model": "policy-v7",
    }
    assert own is None  # no policy call produced it: no borrowed tokens
    assert second.completion_token_ids == [7]

    trajectory = to_trajectory(messages, session_id="r", agent_step_metrics=metrics)
    agent_steps = [s for s in trajectory.steps if s.source == "agent"]
    assert agent_steps[0].metrics is not None
    assert agent_steps[0].metrics.completion_token_ids == [5, 6]
    assert agent_steps[1].metrics is None
    assert agent_steps[2].metrics is not None and agent_steps[2].metrics.logprobs == [-0.3]


def test_tool_call_replies_match_on_name_and_arguments() -> None:
    record = call(0, "", [4], [-0.4])
    tool_call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
    }
    record.choices[0].message = {"role": "assistant", "content": None, "tool_calls": [tool_call]}
    trace = RolloutTrace(rollout_id="r", registered_at=0.0, calls=[record]).model_dump(mode="json")
    other = {**tool_call, "function": {"name": "add", "arguments": '{"a": 1, "b": 3}'}}
    assert agent_step_metrics([{"role": "assistant", "tool_calls": [other]}], trace) == [None]
    matched = agent_step_metrics([{"role": "assistant", "tool_calls": [tool_call]}], trace)
    assert matched[0] is not None and matched[0].completion_token_ids == [4]
