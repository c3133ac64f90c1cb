"""The example rollouts run inside local sandboxes, from their bundles, as users write them.

HarborBackend template mode with ``agent="tasks/rollouts/<example>/main.py:<Workflow>"``,
behind a real relay over the embedded scripted policy (which plays a tool call, then the
answer): the sample (the framework's history and its chat-completions copy) comes back from
inside the sandbox, the host grades it, and every model call is in the relay's trace.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from policy_support import completion, policy_server

from backends import HarborBackend, Relay, RelayedBackend, RolloutRequest, RolloutStatus, collect
from backends.graders import ModelInfo, Rubric, RubricGraderConfig
from backends.relay.scripted import ScriptedPolicy
from backends.rollout.dataset import requests_from_dataset
from backends.trajectory.save import trajectory_of

# The first run of a new bundle installs it in a sandbox: minutes on a loaded machine.
pytestmark = [pytest.mark.sandbox, pytest.mark.anyio, pytest.mark.timeout(1800)]

ROOT = Path(__file__).parents[1]
TEMPLATE = ROOT / "tasks" / "templates" / "workflow"
CALCULATOR = ROOT / "tasks" / "data" / "calculator.jsonl"
ARITHMETIC = ROOT / "tasks" / "data" / "arithmetic.jsonl"
BUNDLE_PROJECT = Path(__file__).parent / "bundle_project"


@pytest.fixture
async def relay(tmp_path: Path) -> AsyncIterator[Relay]:
    async with (
        ScriptedPolicy() as policy,
        Relay(
            upstream_url=policy.base_url,
            upstream_api_key="upstream-key-never-in-a-sandbox",
            request_token_ids=True,
            unix_socket_path=tmp_path / "relay.sock",
        ) as relay,
    ):
        yield relay


@pytest.fixture
async def sandboxed(tmp_path: Path) -> AsyncIterator[Callable[..., HarborBackend]]:
    """Makes HarborBackends over the workflow template; closes each after the test (its warm
    runner's sandbox would otherwise run, holding a uid range, until the process ends)."""
    made: list[HarborBackend] = []

    def make(agent: str, grader: str, **kwargs: Any) -> HarborBackend:
        made.append(
            HarborBackend(
                tasks_dir=TEMPLATE,
                agent=agent,
                grader=grader,
                trials_dir=tmp_path / "trials",
                artifacts=tmp_path / "out",
                **{"max_concurrent": 4, **kwargs},
            )
        )
        return made[-1]

    yield make
    for backend in made:
        await backend.aclose()


def valid_atif(path: Path) -> None:
    check = subprocess.run(
        [sys.executable, "-m", "harbor.utils.trajectory_validator", str(path)],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("example", ["strands-calculator", "openai-agents-calculator"])
async def test_each_integration_example_runs_in_a_sandbox(
    tmp_path: Path, relay: Relay, example: str, sandboxed: Callable[..., HarborBackend]
) -> None:
    backend = sandboxed(
        f"{ROOT}/tasks/rollouts/{example}/main.py:CalculatorWorkflow",
        "backends.graders:ExactMatchGrader",
    )
    requests = requests_from_dataset(CALCULATOR)
    results = await collect(RelayedBackend(backend, relay), requests)
    assert len(results) == len(requests)
    for result in results:
        assert result.status is RolloutStatus.SUCCESS, result.failure
        assert result.reward == 1.0, (result.rollout_id, result.sample)
        sample = result.sample
        assert sample is not None and result.policy_trace is not None
        # Both model calls (the tool call, then the answer) went through the relay.
        calls = result.policy_trace.calls
        assert [c.choices[0].finish_reason for c in calls] == ["tool_calls", "stop"]
        assert "unrelayed_assistant_turns" not in sample.extra_fields
        # The framework's own history and its chat-completions copy came back from inside:
        # the tool call, the tool's result, the answer.
        assert sample.messages and sample.trajectory_messages
        roles = [m["role"] for m in sample.trajectory_messages]
        assert roles[-3:] == ["assistant", "tool", "assistant"], roles
        assert sample.trajectory_messages[-3]["tool_calls"][0]["function"]["name"] == "calculator"
        assert sample.label is not None  # graded on the host, where the label is
        trajectory = trajectory_of(result)
        assert trajectory is not None
        path = tmp_path / f"{result.rollout_id}.json"
        path.write_text(trajectory.model_dump_json(exclude_none=True))
        valid_atif(path)
        agent_steps = [s for s in trajectory.steps if s.source == "agent"]
        assert len(agent_steps) == 2
        assert all(s.metrics and s.metrics.completion_token_ids for s in agent_steps)


async def test_the_arithmetic_example_runs_in_a_sandbox(
    tmp_path: Path, relay: Relay, sandboxed: Callable[..., HarborBackend]
) -> None:
    example = ROOT / "tasks" / "rollouts" / "arithmetic" / "main.py"
    backend = sandboxed(f"{example}:ArithmeticWorkflow", f"{example}:ExactAnswerGrader")
    results = await collect(RelayedBackend(backend, relay), requests_from_dataset(ARITHMETIC))
    assert {r.status for r in results} == {RolloutStatus.SUCCESS}, [r.failure for r in results]
    assert [r.reward for r in results] == [1.0] * len(results)  # the script's answers
    for result in results:
        assert result.policy_trace is not None and len(result.policy_trace.calls) == 1
        assert result.sample is not None and result.sample.messages[-1]["role"] == "assistant"


async def test_a_rubric_judge_is_called_from_the_host_and_its_key_never_enters(
    tmp_path: Path,
    relay: Relay,
    monkeypatch: pytest.MonkeyPatch,
    sandboxed: Callable[..., HarborBackend],
) -> None:
    """The workflow runs in the sandbox; the rubric grader grades its sample on the host,
    calling the configured judge endpoint with the key from the host's environment. The
    sandbox searches itself (files and environment) for the key and finds only the canary
    planted in the metadata, which proves the search works."""
    key = "CANARY-" + uuid.uuid4().hex  # shaped so that the sandbox's search would find it
    planted = "CANARY-" + uuid.uuid4().hex  # in the metadata, which does enter the sandbox
    monkeypatch.setenv("JUDGE_KEY", key)
    judged: list[tuple[dict[str, Any], str]] = []

    def reply(body: dict[str, Any], auth: str) -> tuple[int, dict[str, Any]]:
        judged.append((body, auth))
        return 200, completion(body, '{"score": 0.75, "explanation": "close"}')

    async with policy_server(reply) as url:
        model = ModelInfo(provider="local", model="judge", api_key_env="JUDGE_KEY", base_url=url)
        config = RubricGraderConfig(
            rubric=Rubric(id="answer", rubric="Award 1 for 42.", model_info=model)
        )
        backend = sandboxed(
            f"{BUNDLE_PROJECT}/main.py:Snoops",
            "backends.graders:RubricGrader",
            grader_config=config,
            max_concurrent=None,
        )
        request = RolloutRequest(
            rollout_id="judged",
            prompt=[{"role": "user", "content": "What is 6 * 7?"}],
            label="42",
            metadata={"note": planted},
        )
        [result] = await collect(RelayedBackend(backend, relay), [request])
    assert result.status is RolloutStatus.SUCCESS and result.reward == 0.75, result.failure
    assert result.sample is not None
    report = result.sample.messages[-1]["content"]
    assert planted in report and key not in report, report
    ((body, auth),) = judged
    assert auth == f"Bearer {key}" and body["model"] == "judge"
    assert report in body["messages"][-1]["content"]  # it judged what the sandbox answered
