"""HarborBackend against what the review found an agent could do: files the host reads back."""

from __future__ import annotations

from pathlib import Path

import pytest
from harbor_support import write_task

from backends import HarborBackend, RolloutRequest, collect

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
        write_task(tasks, name, test="echo 1 > /logs/verifier/reward.txt", solve=HUGE_LOG, toml=toml)
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
