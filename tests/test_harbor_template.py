"""HarborBackend's template mode: dataset prompts become a template task's instruction.

terminus-2 runs for real, through the relay, against the embedded scripted policy with a
script that plays terminus-2's JSON protocol.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from harbor.utils.trajectory_validator import validate_trajectory
from harbor_support import Snoops

from backends import HarborBackend, RolloutRequest, RolloutStatus, collect
from backends.harbor import render_instruction
from backends.relay import Relay, Script, ScriptedPolicy
from backends.relayed import RelayedBackend
from backends.rollout.dataset import requests_from_dataset
from backends.rollout.loading import load_object
from backends.trajectory.save import trajectory_of

pytestmark = [pytest.mark.sandbox, pytest.mark.anyio]

ROOT = Path(__file__).parents[1]
TEMPLATES = ROOT / "tasks" / "harbor-templates"
DATASET = ROOT / "tasks" / "data" / "arithmetic.jsonl"
SCRIPT = TEMPLATES / "terminus-arithmetic.json"
ExactAnswer = load_object(f"{ROOT}/tasks/rollouts/harbor/main.py:ExactAnswer")


def wrong_for(prefix: str) -> Script:
    """The terminus script, except that rollouts whose id starts with ``prefix`` answer 7."""
    data = json.loads(SCRIPT.read_text())
    wrong = json.loads(json.dumps(data["rules"][1]))
    wrong.pop("prompt")
    wrong["name"], wrong["rollout"] = "wrong", f"^{prefix}"
    content = wrong["turns"][0]["content"].replace("{result}", "7")
    wrong["turns"][0]["content"] = content
    data["rules"].insert(1, wrong)
    return Script.model_validate(data)


@pytest.fixture
async def relay() -> AsyncIterator[Relay]:
    async with (
        ScriptedPolicy(wrong_for("row-1-")) as policy,
        Relay(upstream_url=policy.base_url, request_token_ids=True) as relay,
    ):
        yield relay


def template(tmp_path: Path, name: str, **kwargs) -> HarborBackend:
    return HarborBackend(
        tasks_dir=TEMPLATES / name,
        agent=kwargs.pop("agent", "terminus-2"),
        trials_dir=tmp_path / "trials",
        artifacts=tmp_path / "out",
        max_concurrent=4,
        **kwargs,
    )


async def test_terminus_over_the_example_dataset(tmp_path: Path, relay: Relay) -> None:
    requests = requests_from_dataset(DATASET)[:4]
    backend = RelayedBackend(template(tmp_path, "arithmetic"), relay)
    results = await collect(backend, requests, max_in_flight=4)
    for result in results:
        assert result.status is RolloutStatus.SUCCESS, result.failure
        # The template's tests reward a number; row 1's scripted answer, 7, is one too.
        assert result.reward == 1.0
        trace = result.policy_trace
        assert trace is not None and len(trace.calls) == 2  # the answer and its confirmation
        assert all(call.status == 200 for call in trace.calls)
        sample = result.sample
        assert sample is not None
        assert [m["role"] for m in sample.messages] == ["user", "assistant", "user", "assistant"]
        # Every model turn is verbatim what the policy answered through the relay.
        replies = [c.choices[0].message["content"] for c in trace.calls]
        assert [m["content"] for m in sample.messages if m["role"] == "assistant"] == replies
        trajectory = trajectory_of(result)
        assert trajectory is not None
        assert validate_trajectory(trajectory.to_json_dict())
        agent_steps = [s for s in trajectory.steps if s.source == "agent"]
        assert len(agent_steps) == 2
        for step in agent_steps:
            assert step.metrics is not None
            assert step.metrics.completion_token_ids and step.metrics.logprobs
            assert len(step.metrics.completion_token_ids) == len(step.metrics.logprobs)
    # The prompt reached the agent as text, the template's note after it.
    [row0] = [r for r in results if r.rollout_id == "row-0-0"]
    first = row0.sample.messages[0]["content"]  # type: ignore[union-attr]
    assert "What is 43 * 21?\n\nWrite just the number to `/app/answer.txt`." in first
    assert '"role"' not in first


async def test_host_grader_on_a_template_without_tests(tmp_path: Path, relay: Relay) -> None:
    requests = requests_from_dataset(DATASET)[:3]
    backend = RelayedBackend(template(tmp_path, "arithmetic-graded", grader=ExactAnswer), relay)
    rewards = {r.rollout_id: r.reward for r in await collect(backend, requests)}
    assert rewards == {"row-0-0": 1.0, "row-1-0": 0.0, "row-2-0": 1.0}
    answer = tmp_path / "out" / "row-1-0" / "artifacts" / "app" / "answer.txt"
    assert answer.read_text() == "7\n"


async def test_the_label_never_enters_the_sandbox(tmp_path: Path) -> None:
    label, planted = Snoops.canary(), Snoops.canary()
    hidden = RolloutRequest(
        rollout_id="hidden",
        prompt=[{"role": "user", "content": "What is 2 + 2?"}],
        label=label,
        metadata={"note": "metadata reaches no agent either"},
    )
    # The control: a canary the agent is given (in its prompt) is found by the same search.
    control = RolloutRequest(
        rollout_id="control", prompt=[{"role": "user", "content": f"Echo {planted}."}], label=label
    )
    backend = template(tmp_path, "arithmetic", agent=Snoops)
    results = await collect(backend, [hidden, control])
    assert all(r.status is RolloutStatus.SUCCESS for r in results), results

    def report(rid: str) -> str:
        path = tmp_path / "out" / rid / "artifacts" / "logs" / "artifacts" / "snoop.txt"
        return path.read_text()

    assert "grep:\nend" in report("hidden")  # nothing in the sandbox's files matched
    assert label not in report("hidden") and label not in report("control")
    assert "What is 2 + 2?" in report("hidden")  # the snoop did see its instruction
    assert "grep:\n/logs/artifacts/snoop.txt\nend" in report("control")


async def test_model_driven_agent_needs_a_policy_route(tmp_path: Path) -> None:
    request = RolloutRequest(rollout_id="unrouted", prompt=[{"role": "user", "content": "1+1"}])
    [result] = await collect(template(tmp_path, "arithmetic"), [request])
    assert result.failure is not None and result.failure.category == "validation_error"
    assert "policy endpoint" in result.failure.message


async def test_keys_are_scrubbed_from_kept_trial_files(tmp_path: Path) -> None:
    key = "sk-direct-key-0123456789abcdef"
    async with ScriptedPolicy(SCRIPT, api_key=key) as policy:
        request = RolloutRequest(
            rollout_id="keyed",
            prompt=[{"role": "user", "content": "What is 6 * 7?"}],
            chat_completions_url=policy.base_url,
            api_key=key,  # a direct route: terminus-2 runs on the host, the key stays there
        )
        backend = template(tmp_path, "arithmetic", cleanup_successful_trials=False)
        [result] = await collect(backend, [request])
    assert result.reward == 1.0, result.failure
    trial = tmp_path / "trials" / "keyed"
    config = (trial / "config.json").read_text()
    assert "[redacted]" in config  # Harbor wrote llm_kwargs.api_key there
    for path in trial.rglob("*"):
        if path.is_file():
            assert key.encode() not in path.read_bytes(), path


def test_prompts_render_as_readable_text() -> None:
    assert render_instruction([{"role": "user", "content": "Sum 1 and 2."}]) == "Sum 1 and 2."
    text = render_instruction(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Sum 1 and 2."}]},
        ]
    )
    assert text == "Be brief.\n\nSum 1 and 2."
    text = render_instruction(
        [
            {"role": "user", "content": "Sum 1 and 2."},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "Check again."},
        ]
    )
    assert text == "## User\n\nSum 1 and 2.\n\n## Assistant\n\n4\n\n## User\n\nCheck again."


def test_template_without_reward_source_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no grader= was given"):
        template(tmp_path, "arithmetic-graded")
    with pytest.raises(ValueError, match="pick one reward source"):
        template(tmp_path, "arithmetic", grader=ExactAnswer)
