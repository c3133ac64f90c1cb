"""Harbor's own Trial runs the example tasks in LocalSandbox: oracle gets 1, nop gets 0."""

from __future__ import annotations

from pathlib import Path

import pytest
from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig, TrialConfig
from harbor.trial.trial import Trial

pytestmark = [pytest.mark.sandbox, pytest.mark.anyio]

TASKS = Path(__file__).parents[1] / "tasks" / "harbor"
NAMES = ["workdir-copy", "workdir-override", "nonroot-agent", "multi-step", "separate-verifier"]


@pytest.mark.parametrize("agent,reward", [("oracle", 1.0), ("nop", 0.0)])
@pytest.mark.parametrize("task", NAMES)
async def test_trial_reward(task: str, agent: str, reward: float, tmp_path: Path) -> None:
    config = TrialConfig(
        task=TaskConfig(path=TASKS / task),
        agent=AgentConfig(name=agent),
        environment=EnvironmentConfig(import_path="backends.sandbox.local:LocalSandbox"),
        trials_dir=tmp_path,
    )
    result = await (await Trial.create(config)).run()
    assert result.exception_info is None, result.exception_info.exception_message
    assert result.verifier_result is not None
    assert result.verifier_result.rewards == {"reward": reward}
    for step in result.step_results or []:
        assert step.verifier_result is not None
        assert step.verifier_result.rewards == {"reward": reward}
