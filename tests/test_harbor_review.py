"""HarborBackend against what the review found an agent could do: files the host reads back."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest
from harbor.models.trial.config import EnvironmentConfig
from harbor_support import write_task

from backends import (
    HarborBackend,
    Relay,
    RelayedBackend,
    RolloutRequest,
    RolloutStatus,
    collect,
)
from backends.relay.scripted import ScriptedPolicy

pytestmark = [pytest.mark.sandbox, pytest.mark.anyio]

# A text head (Harbor's scrub sniffs the first 8 KiB for text) over a 65 MiB sparse file: a
# few KiB on the sandbox's disk, 65 MiB on the host once downloaded.
HUGE_LOG = (
    "head -c 9000 /dev/zero | tr '\\0' a > /logs/agent/huge.log; "
    "truncate -s 65M /logs/agent/huge.log; echo small > /logs/agent/small.log"
)
JUDGE_KEY = '[verifier.env]\nJUDGE_API_KEY = "sk-judge-0123456789abcdef"\n'


def request(rid: str, task_id: str) -> RolloutRequest:
    return RolloutRequest(rollout_id=rid, prompt=[], metadata={"harbor_task_id": task_id})


async def test_harbors_scrub_never_reads_a_huge_file_the_sandbox_left(tmp_path: Path) -> None:
    """With a sensitive key in [verifier.env], Harbor's own end-of-trial scrub reads every
    downloaded text file whole: a sparse file the agent made would be read in full. Such
    files are removed before it runs; without a key nothing reads them and they stay."""
    tasks = tmp_path / "tasks"
    for name, toml in (("keyed", JUDGE_KEY), ("plain", "")):
        write_task(
            tasks, name, test="echo 1 > /logs/verifier/reward.txt", solve=HUGE_LOG, toml=toml
        )
    b = HarborBackend(
        agent="oracle",
        tasks_dir=tasks,
        task_mode="dataset",
        trials_dir=tmp_path / "trials",
        artifacts=tmp_path / "out",
        cleanup_successful_trials=False,
    )
    results = await collect(b, [request("keyed", "keyed"), request("plain", "plain")])
    assert [r.reward for r in results] == [1.0, 1.0], [r.failure for r in results]
    keyed, plain = (tmp_path / "trials" / name / "agent" for name in ("keyed", "plain"))
    assert (keyed / "small.log").read_text() == "small\n"
    assert not (keyed / "huge.log").exists()
    assert (plain / "huge.log").stat().st_size == 65 << 20  # the control: nothing read it


async def test_a_stalled_transfer_costs_no_more_than_its_phases_timeout(tmp_path: Path) -> None:
    """The agent makes `tar` hang: the agent-log download and the tests' upload each stall.
    Each gives up after its phase's timeout (3 s here), not the transfers' own half hour,
    and the rollout is a timeout, not a reward and not a retried infrastructure failure.
    (Files cross by `tar` inside here: the host's own path runs nothing an agent replaces.)"""
    write_task(tmp_path / "tasks", "stall", test="echo 1 > /logs/verifier/reward.txt")
    b = HarborBackend(
        agent="harbor_support:StallsTransfers",
        environment_config=EnvironmentConfig(kwargs={"host_transfers": False}),
        tasks_dir=tmp_path / "tasks",
        task_mode="dataset",
        trials_dir=tmp_path / "trials",
        artifacts=tmp_path / "out",
    )
    await b.start()
    started = time.monotonic()
    with anyio.fail_after(120):  # the old code waits 1800 s per transfer
        [result] = await collect(
            b,
            [
                RolloutRequest(
                    rollout_id="stall",
                    prompt=[],
                    metadata={"harbor_task_id": "stall"},
                    agent_timeout_sec=3,
                    grader_timeout_sec=3,
                )
            ],
        )
    elapsed = time.monotonic() - started
    assert result.failure is not None and result.reward is None, result
    assert result.failure.category == "timeout" and not result.failure.retryable, result.failure
    assert elapsed < 30, elapsed


async def test_a_retry_after_policy_calls_gets_a_fresh_relay_registration(
    tmp_path: Path,
) -> None:
    """The agent called the policy, then its sandbox was killed from the host: the retry runs
    on a fresh registration. Its token is new, the first one is refused from then on, and
    the trace holds the retried attempt's call alone (the first one is counted)."""
    write_task(tmp_path / "tasks", "lost", test="echo 1 > /logs/verifier/reward.txt")
    record = tmp_path / "tokens.txt"
    b = HarborBackend(
        agent="harbor_support:LosesSandboxAfterPolicyCall",
        native_agent_kwargs={"record": str(record)},
        tasks_dir=tmp_path / "tasks",
        task_mode="dataset",
        trials_dir=tmp_path / "trials",
        artifacts=tmp_path / "out",
        infra_attempts=3,
    )
    async with ScriptedPolicy() as policy, Relay(upstream_url=policy.base_url) as relay:
        [result] = await collect(RelayedBackend(b, relay), [request("lost", "lost")])
    assert result.status is RolloutStatus.SUCCESS and result.reward == 1.0, result.failure
    (first, _), (second, statuses) = (
        line.split(" ", 1) for line in record.read_text().splitlines()
    )
    assert first != second
    assert statuses == "[403]"  # the first attempt's token, tried during the second attempt
    assert result.extra_fields["harbor"]["attempt"] == 2
    assert result.extra_fields["infra_retries"]["count"] == 1
    assert "killed from the host" in result.extra_fields["infra_retries"]["failures"][0]
    assert result.extra_fields["discarded_policy_calls"] == 1
    assert result.policy_trace is not None
    # The retried attempt's call alone (the refused old token made none).
    assert [c.status for c in result.policy_trace.calls] == [200]


@pytest.mark.parametrize("agent", ["EndsPid1ByPtrace", "EndsPid1ThroughItsMemory"])
async def test_an_agent_cannot_end_its_sandbox_to_escape_its_reward(
    tmp_path: Path, agent: str
) -> None:
    """An agent about to score 0 ends its sandbox's pid 1 instead, so that the rollout would
    come back as a retryable infra_error, never as its reward 0: by tracing pid 1 and
    resuming it with SIGKILL, or by writing exit_group into its code through /proc/1/mem.
    Both are refused now; the sandbox lives on and the agent keeps its 0. (What a sandbox
    ended from inside is reported as: tests/test_sandbox_ended.py.)"""
    write_task(tmp_path / "tasks", "t", test="echo 0 > /logs/verifier/reward.txt")
    b = HarborBackend(
        agent=f"harbor_support:{agent}",
        tasks_dir=tmp_path / "tasks",
        task_mode="dataset",
        trials_dir=tmp_path / "trials",
        artifacts=tmp_path / "out",
        infra_attempts=3,
    )
    [result] = await collect(b, [request("end", "t")])
    assert result.status is RolloutStatus.SUCCESS and result.reward == 0.0, result.failure
    assert result.extra_fields["harbor"]["attempt"] == 1


@pytest.mark.parametrize("agent", ["FillsVerifierDir", "BlocksTestsDir", "LinksLogsToCwd"])
async def test_what_the_agent_leaves_in_the_graders_way_gives_its_reward_not_a_retry(
    tmp_path: Path, agent: str
) -> None:
    """Grading starts from an empty /tests and /logs/verifier, whatever the agent left there:
    a file at /tests or a tree too deep to download would fail the tests' upload or the
    verifier's download, which Harbor takes for the sandbox's failure (retried)."""
    write_task(tmp_path / "tasks", "t", test="echo 0 > /logs/verifier/reward.txt")
    b = HarborBackend(
        agent=f"harbor_support:{agent}",
        tasks_dir=tmp_path / "tasks",
        task_mode="dataset",
        trials_dir=tmp_path / "trials",
        artifacts=tmp_path / "out",
    )
    await b.start()
    request = RolloutRequest(rollout_id=agent, prompt=[], metadata={"harbor_task_id": "t"})
    [result] = await collect(b, [request])
    assert result.failure is None and result.reward == 0.0, result.failure


async def test_tests_that_leave_an_undownloadable_tree_are_a_verifier_error_not_a_retry(
    tmp_path: Path,
) -> None:
    write_task(
        tmp_path / "tasks",
        "t",
        test="echo 1 > /logs/verifier/reward.txt; cd /logs/verifier && "
        "for i in $(seq 300); do mkdir d && cd d; done",
    )
    b = HarborBackend(
        agent="oracle",
        tasks_dir=tmp_path / "tasks",
        task_mode="dataset",
        trials_dir=tmp_path / "trials",
        artifacts=tmp_path / "out",
    )
    await b.start()
    request = RolloutRequest(rollout_id="deep", prompt=[], metadata={"harbor_task_id": "t"})
    [result] = await collect(b, [request])
    assert result.failure is not None and result.reward is None, result
    assert result.failure.category == "verifier_error" and not result.failure.retryable
