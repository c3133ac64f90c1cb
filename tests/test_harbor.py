"""HarborBackend runs Harbor tasks in local sandboxes and reports Harbor's rewards."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig, TrialConfig
from harbor.trial.trial import Trial
from harbor_support import (
    CountingSandbox,
    DeepArtifacts,
    ForgesRewardLater,
    LeavesService,
    PlantsReward,
    SeizesPid1,
    Sleeps,
    Snoops,
    SwapsReward,
    write_task,
)
from host_support import marked, owned_by, running_sandboxes

from backends import AgentWorkflow, HarborBackend, RolloutRequest, RolloutStatus, collect
from backends.harbor import dataset_requests, discover_tasks
from backends.harbor.backend import build_environment_config
from backends.harbor.tasks import dataset_rows
from backends.sandbox.settings import run_dir

pytestmark = [pytest.mark.sandbox, pytest.mark.anyio]

TASKS = Path(__file__).parents[1] / "tasks" / "harbor"
LOCAL = "backends.sandbox.local:LocalSandbox"


def backend(tmp_path: Path, agent: str | type = "oracle", **kwargs) -> HarborBackend:
    kwargs.setdefault("tasks_dir", TASKS)
    kwargs.setdefault("task_mode", "dataset")
    return HarborBackend(
        agent=agent, trials_dir=tmp_path / "trials", artifacts=tmp_path / "out", **kwargs
    )


def request(rid: str, task_id: object, **kwargs) -> RolloutRequest:
    return RolloutRequest(rollout_id=rid, prompt=[], metadata={"harbor_task_id": task_id}, **kwargs)


async def harbor_reward(task: str, agent: str, trials: Path) -> float | None:
    config = TrialConfig(
        task=TaskConfig(path=TASKS / task),
        agent=AgentConfig(name=agent),
        environment=EnvironmentConfig(import_path=LOCAL),
        trials_dir=trials,
    )
    result = await (await Trial.create(config)).run()
    assert result.verifier_result is not None, result.exception_info
    return result.verifier_result.rewards["reward"]


async def test_dataset_batch_gives_harbors_own_rewards(tmp_path: Path) -> None:
    tasks = discover_tasks(TASKS)
    for shape in [
        "healthcheck",
        "artifacts",
        "named-rewards",
        "failing-tests",
        "multi-step-rewards",
    ]:
        assert shape in tasks
    expected = {("oracle", t): 0.0 if t == "failing-tests" else 1.0 for t in tasks}
    expected |= {("nop", t): 0.0 for t in tasks}

    harbor: dict[tuple[str, str], float | None] = {}

    async def direct(agent: str, task: str) -> None:
        harbor[(agent, task)] = await harbor_reward(task, agent, tmp_path / "direct")

    async with anyio.create_task_group() as group:
        for agent, task in expected:
            group.start_soon(direct, agent, task)
    assert harbor == expected

    ours = {}
    for agent in ("oracle", "nop"):
        results = await collect(
            backend(tmp_path, agent, max_concurrent=4), dataset_requests(TASKS), max_in_flight=8
        )
        for result in results:
            assert result.status is RolloutStatus.SUCCESS, result.failure
            task = result.extra_fields["harbor"]["task"]
            ours[(agent, task)] = result.reward
    assert ours == expected
    # Successful trials leave no directory behind.
    assert list((tmp_path / "trials").iterdir()) == []


async def test_named_and_step_rewards_kept_in_metrics(tmp_path: Path) -> None:
    b = backend(tmp_path)
    named, steps = await collect(
        b, [request("named", "named-rewards"), request("steps", "multi-step-rewards")]
    )
    assert named.reward == 1.0  # reward.json wins over the reward.txt of 0
    assert named.sample is not None
    assert named.sample.metrics["reward.style"] == 0.5
    assert named.sample.metrics["reward.correctness"] == 1.0
    assert steps.reward == 1.0
    assert steps.sample is not None
    assert steps.sample.metrics["step.create.reward"] == 1.0
    assert steps.sample.metrics["step.count.exists"] == 1.0
    assert steps.sample.metrics["harbor.agent_sec"] > 0


async def test_artifacts_reach_the_sink(tmp_path: Path) -> None:
    [result] = await collect(backend(tmp_path), [request("arts", "artifacts")])
    assert result.reward == 1.0
    out = tmp_path / "out" / "arts" / "artifacts"
    assert (out / "app" / "report.txt").read_text() == "done\n"
    assert (out / "logs" / "artifacts" / "notes.txt").read_text().startswith("wrote")
    assert json.loads((out / "manifest.json").read_text())


async def test_artifacts_to_a_memory_sink(tmp_path: Path) -> None:
    import fsspec

    b = HarborBackend(
        tasks_dir=TASKS,
        task_mode="dataset",
        trials_dir=tmp_path / "trials",
        artifacts="memory://harbor-test",
    )
    [result] = await collect(b, [request("arts-mem", "artifacts")])
    assert result.reward == 1.0
    fs = fsspec.filesystem("memory")
    assert fs.cat("/harbor-test/arts-mem/artifacts/app/report.txt") == b"done\n"


@pytest.mark.parametrize(
    "task_id,problem",
    [
        ("../workdir-copy", "'..'"),
        ("/etc", "relative"),
        ("escape", "outside"),
        ("no-such-task", "no Harbor task"),
        (None, "must name a task"),
        ("", "must name a task"),
    ],
)
async def test_bad_task_ids_fail_alone(tmp_path: Path, task_id: object, problem: str) -> None:
    tasks = tmp_path / "tasks"
    shutil.copytree(TASKS / "workdir-copy", tasks / "real" / "workdir-copy")
    (tasks / "alias").symlink_to(tasks / "real" / "workdir-copy")  # stays inside: allowed
    (tasks / "escape").symlink_to(TASKS / "artifacts")  # leads out of tasks_dir
    b = backend(tmp_path, tasks_dir=tasks, max_concurrent=2)
    bad, good = await collect(b, [request("bad", task_id), request("good", "alias")])
    assert bad.failure is not None and bad.failure.category == "validation_error"
    assert problem in bad.failure.message
    assert bad.reward is None
    assert good.reward == 1.0


async def test_verifier_without_a_usable_reward_is_a_verifier_error(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks"
    write_task(tasks, "no-reward", test="exit 0")
    write_task(tasks, "nan-reward", test="echo nan > /logs/verifier/reward.txt")
    write_task(tasks, "garbage", test="echo lots > /logs/verifier/reward.txt")
    write_task(
        tasks, "no-reward-key", test='echo \'{"a": 1, "b": 0}\' > /logs/verifier/reward.json'
    )
    b = backend(tmp_path, tasks_dir=tasks, max_concurrent=4)
    results = await collect(b, dataset_requests(tasks))
    for result in results:
        assert result.failure is not None, result.rollout_id
        assert result.failure.category == "verifier_error", result.failure
        assert result.failure.phase == "grading"
        assert result.reward is None
    # Failed trials are kept for diagnosis.
    assert sorted(p.name for p in (tmp_path / "trials").iterdir()) == [
        "garbage-0",
        "nan-reward-0",
        "no-reward-0",
        "no-reward-key-0",
    ]


async def test_infra_failure_retries_with_a_fresh_sandbox_and_is_never_reward_0(
    tmp_path: Path,
) -> None:
    tasks = tmp_path / "tasks"
    write_task(
        tasks,
        "sick",
        test="echo 0 > /logs/verifier/reward.txt",
        toml="[environment.healthcheck]\ncommand = 'false'\ninterval_sec = 0.05\n"
        "start_interval_sec = 0.05\nretries = 1\ntimeout_sec = 5\n",
    )
    b = backend(tmp_path, tasks_dir=tasks, infra_attempts=3)
    [result] = await collect(b, [request("sick", "sick")])
    assert result.failure is not None
    assert result.failure.category == "infra_error", result.failure
    assert result.failure.phase == "setup"
    assert "HealthcheckError" in result.failure.message
    assert result.reward is None
    assert result.extra_fields["harbor"]["attempt"] == 3
    assert result.extra_fields["infra_retries"]["count"] == 2
    trials = sorted(p.name for p in (tmp_path / "trials").iterdir())
    assert trials == ["sick", "sick~attempt-2", "sick~attempt-3"]


async def test_failed_trials_are_pruned_past_the_bound(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks"
    write_task(tasks, "broken", test="exit 0")
    b = backend(tmp_path, tasks_dir=tasks, keep_failed_trials=2, max_concurrent=1)
    reqs = [request(f"broken-{i}", "broken") for i in range(4)]
    for r in reqs:  # one after the other, so "oldest" is well defined
        [result] = await collect(b, [r])
        assert result.failure is not None
    assert sorted(p.name for p in (tmp_path / "trials").iterdir()) == ["broken-2", "broken-3"]


async def test_agent_planting_a_reward_does_not_get_it(tmp_path: Path) -> None:
    b = backend(tmp_path, PlantsReward)
    [result] = await collect(b, [request("planted", "workdir-copy")])
    assert result.status is RolloutStatus.SUCCESS
    assert result.reward == 0.0


async def test_agent_cannot_read_tests_before_verification(tmp_path: Path) -> None:
    b = backend(tmp_path, Snoops)
    [result] = await collect(b, [request("snoop", "workdir-copy")])
    assert result.reward == 0.0
    report = tmp_path / "out" / "snoop" / "artifacts" / "logs" / "artifacts" / "snoop.txt"
    text = report.read_text()
    tests_listing = text.split("tests:\n", 1)[1].split("instruction:", 1)[0]
    assert "No such file or directory" in tests_listing or not tests_listing.strip()
    assert "test.sh" not in text


def test_agents_by_name_import_path_or_refused(tmp_path: Path) -> None:
    for name in ("oracle", "nop", "terminus-2", "claude-code", "mini-swe-agent", "openhands"):
        assert backend(tmp_path, name).agent.name == name
    assert backend(tmp_path, "harbor_support:Sleeps").agent.import_path == "harbor_support:Sleeps"
    with pytest.raises(ValueError, match=r"not in Harbor's registry; known agents: .*oracle"):
        backend(tmp_path, "no-such-agent")

    class Workflow(AgentWorkflow):
        async def run(self, ctx):
            return None

    # A workflow ships as a rollout bundle: its file needs a pyproject.toml beside it.
    with pytest.raises(ValueError, match=r"Workflow lives in .*no pyproject\.toml"):
        backend(tmp_path, Workflow)
    with pytest.raises(ValueError, match="not a Harbor BaseAgent"):
        backend(tmp_path, "json:dumps")


def test_bad_configuration_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dataset mode needs a directory of tasks"):
        backend(tmp_path, tasks_dir=TASKS / "workdir-copy")
    with pytest.raises(ValueError, match="template mode needs tasks_dir to be one Harbor task"):
        backend(tmp_path, task_mode="template")
    with pytest.raises(ValueError, match="not 'local', 'skypilot'"):
        backend(tmp_path, environment="nowhere")
    tasks = tmp_path / "tasks"
    template = write_task(tasks, "no-tests", test="true")
    (template / "tests" / "test.sh").unlink()
    with pytest.raises(ValueError, match=r"no tests/test\.sh"):
        backend(tmp_path, task_mode="template", tasks_dir=template)


def test_dataset_rows_feed_backends_run(tmp_path: Path) -> None:
    rows = [json.loads(line) for line in dataset_rows(TASKS)]
    assert {r["metadata"]["harbor_task_id"] for r in rows} == set(discover_tasks(TASKS))


def leftovers() -> dict[str, list[str]]:
    """This process's sandboxes that still hold a mount or a process (other processes'
    sandboxes, of tests running beside these, are not ours to judge)."""
    ours = owned_by(os.getpid())
    with open("/proc/self/mountinfo") as mounts:
        points = [line.split()[4] for line in mounts]
    mounted = [p for p in points if any(p.startswith(f"{run_dir()}/{n}") for n in ours)]
    return {"mounts": mounted, "cgroups": running_sandboxes()}


async def test_cancel_tears_the_sandbox_down(tmp_path: Path) -> None:
    b = backend(tmp_path, Sleeps)
    before = leftovers()  # another test's sandbox may still be stopping
    results = []

    async def run() -> None:
        results.extend(await collect(b, [request("sleepy", "workdir-copy")]))

    async with anyio.create_task_group() as group:
        group.start_soon(run)
        with anyio.fail_after(30):
            while len(marked(Sleeps.marker)) < 2:
                await anyio.sleep(0.05)
        running = leftovers()
        assert running["cgroups"]  # the check sees a live sandbox (its mounts are its own)
        assert b.cancel(["sleepy"]) == {"sleepy": "cancelled_running"}
    [result] = results
    assert result.status is RolloutStatus.CANCELLED
    assert marked(Sleeps.marker) == []
    after = leftovers()
    assert not set(after["cgroups"]) - set(before["cgroups"]), after
    assert not set(after["mounts"]) - set(before["mounts"]), after


async def test_logs_are_bound_only_when_asked(tmp_path: Path) -> None:
    """auto_mounting (opt-in) binds the trial's /logs: no download or upload of them per trial."""
    CountingSandbox.transfers.clear()
    b = backend(
        tmp_path,
        environment="harbor_support:CountingSandbox",
        environment_config=EnvironmentConfig(kwargs={"auto_mounting": True}),
    )
    [result] = await collect(b, [request("bound", "workdir-copy")])
    assert result.reward == 1.0
    assert not [t for t in CountingSandbox.transfers if "/logs" in t], CountingSandbox.transfers
    assert CountingSandbox.transfers["upload /tests"] == 1  # the rest is as in Harbor


async def test_a_planted_symlink_never_makes_the_host_read_its_target(tmp_path: Path) -> None:
    """A daemon left by the agent swaps reward.txt for a link to a host file during the tests.

    With /logs bound to the host, Harbor (host root) followed the link and scored the host
    file's content (0.75 here); by default /logs is downloaded, and the link is dropped.
    """
    secret = tmp_path / "host-secret"
    secret.write_text("0.75\n")
    task = write_task(
        tmp_path / "tasks", "swap", test="echo 0 > /logs/verifier/reward.txt; sleep 1"
    )
    (task / "instruction.md").write_text(str(secret))  # the agent links reward.txt to it
    # The daemon is kept alive into verification, as if it had survived the kill.
    b = backend(
        tmp_path, agent=SwapsReward, tasks_dir=tmp_path / "tasks", end_agent_processes=False
    )
    [result] = await collect(b, [request("swap", "swap")])
    assert result.reward != 0.75
    assert result.failure is not None and result.failure.category == "verifier_error", result


async def test_logs_are_downloaded_when_the_task_limits_storage(tmp_path: Path) -> None:
    CountingSandbox.transfers.clear()
    b = backend(tmp_path, environment="harbor_support:CountingSandbox")
    [result] = await collect(b, [request("limited", "nonroot-agent")])
    assert result.reward == 1.0
    assert CountingSandbox.transfers["download /logs/verifier"] == 1


def test_an_environment_config_without_a_type_keeps_the_chosen_environment() -> None:
    # Harbor fills in type="docker" when a config names no environment; that is not a choice.
    config = build_environment_config("local", EnvironmentConfig(kwargs={"pids_limit": 64}))
    assert config.import_path == "backends.sandbox.local:LocalSandbox"
    assert config.kwargs == {"pids_limit": 64}
    assert build_environment_config("docker", None).type == "docker"
    explicit = EnvironmentConfig(type="modal")
    assert build_environment_config("local", explicit).type == "modal"


async def test_aclose_stops_every_trial_before_returning(tmp_path: Path) -> None:
    b = backend(tmp_path, Sleeps, max_concurrent=2)
    before = leftovers()
    results: list = []

    async def run() -> None:
        results.extend(await collect(b, [request("a", "workdir-copy"), request("b", "artifacts")]))

    async with anyio.create_task_group() as group:
        group.start_soon(run)
        with anyio.fail_after(60):
            while len(marked(Sleeps.marker)) < 6:
                await anyio.sleep(0.05)
        await b.aclose()
        # Returned only once both sandboxes were gone.
        assert marked(Sleeps.marker) == []
        after = leftovers()
        assert not set(after["cgroups"]) - set(before["cgroups"]), after
    assert sorted(r.status for r in results) == [RolloutStatus.CANCELLED] * 2


def test_another_suite_on_the_host_sleeps_under_a_marker_of_its_own() -> None:
    """The tests above count the marked sleeps on the whole host: a suite running beside this
    one (its own process) must not run the same, and a process this one starts must."""
    code = "from harbor_support import Sleeps; print(Sleeps.marker)"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    env.pop("SLEEPS_MARKER", None)

    def marker_of(env: dict[str, str]) -> str:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert marker_of(env) != Sleeps.marker
    assert marker_of({**env, **Sleeps.env()}) == Sleeps.marker


async def test_timeouts_follow_harbors_semantics(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks"
    write_task(tasks, "slow-tests", test="sleep 30; echo 1 > /logs/verifier/reward.txt")
    b = backend(tmp_path, tasks_dir=tasks)
    [slow] = await collect(b, [request("slow", "slow-tests", grader_timeout_sec=1)])
    assert slow.failure is not None
    assert (slow.failure.category, slow.failure.phase) == ("timeout", "grading"), slow.failure
    assert slow.reward is None
    # An agent out of time is still graded, as in Harbor: its reward is a valid measurement.
    b = backend(tmp_path, Sleeps)
    [late] = await collect(b, [request("late", "workdir-copy", agent_timeout_sec=1)])
    assert late.status is RolloutStatus.SUCCESS, late.failure
    assert late.reward == 0.0
    assert late.extra_fields["harbor"]["exception_type"] == "AgentTimeoutError"


async def test_daemons_left_by_the_agent_cannot_forge_the_reward(tmp_path: Path) -> None:
    """The agent's daemons rewrite the tests' 0 as 1 and swap the tests; both are dead first."""
    write_task(tmp_path / "tasks", "forge", test="echo 0 > /logs/verifier/reward.txt; sleep 0.5")
    b = backend(tmp_path, agent=ForgesRewardLater, tasks_dir=tmp_path / "tasks")
    results = await collect(b, [request(f"forge-{i}", "forge") for i in range(2)])
    assert [r.reward for r in results] == [0.0, 0.0], results


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the agent injects x86_64 syscalls")
async def test_an_agent_cannot_turn_pid_1_into_a_reward_forger(tmp_path: Path) -> None:
    """pid 1 is spared by the kill before grading: an agent that ptraced it into a loop
    writing 1 over the tests' 0 once turned every such rollout into reward 1."""
    write_task(tmp_path / "tasks", "forge", test="echo 0 > /logs/verifier/reward.txt; sleep 0.5")
    b = backend(tmp_path, agent=SeizesPid1, tasks_dir=tmp_path / "tasks")
    [result] = await collect(b, [request("seize", "forge")])
    assert result.reward == 0.0, result


async def test_a_survivor_of_the_kill_before_grading_voids_the_reward(tmp_path: Path) -> None:
    """A process still alive when the tests run could have written their reward: the rollout
    fails as infrastructure (retryable), never graded by what such a process left."""
    write_task(tmp_path / "tasks", "plain", test="echo 1 > /logs/verifier/reward.txt")
    b = backend(
        tmp_path, tasks_dir=tmp_path / "tasks", environment="harbor_support:SurvivorSandbox"
    )
    [result] = await collect(b, [request("survivor", "plain")])
    assert result.reward is None
    assert result.failure is not None
    assert (result.failure.category, result.failure.phase) == ("infra_error", "grading")
    assert "survived the kill" in result.failure.message


async def test_a_service_the_agent_leaves_is_kept_only_when_asked(tmp_path: Path) -> None:
    test = "if pgrep -f 'sleep 876543' >/dev/null; then echo 1; else echo 0; fi > /logs/verifier/reward.txt"
    write_task(tmp_path / "tasks", "service", test=test)
    rewards = []
    for keep in (False, True):
        b = backend(
            tmp_path,
            agent=LeavesService,
            tasks_dir=tmp_path / "tasks",
            end_agent_processes=not keep,
        )
        [result] = await collect(b, [request(f"service-{keep}", "service")])
        rewards.append(result.reward)
    assert rewards == [0.0, 1.0]


def test_rollout_ids_never_share_a_trial_directory() -> None:
    from backends.harbor.phases import _trial_name

    ids = ["x:1", "x_1", "r", "r~attempt-2", "r.attempt-2", "a" * 200 + "1", "a" * 200 + "2", ".."]
    names = [_trial_name(rid, 1) for rid in ids] + [_trial_name("r", 2), _trial_name("x:1", 2)]
    assert len(set(names)) == len(names), names
    assert _trial_name("row-1", 1) == "row-1"  # safe ids keep their own name
    assert all("/" not in n and n not in (".", "..") and len(n) < 255 for n in names)


async def test_artifacts_nested_past_path_max_are_dropped_not_fatal(tmp_path: Path) -> None:
    """Too deep a tree used to abort the file work silently: no artifacts, trial dir left."""
    write_task(tmp_path / "tasks", "deep", test="echo 1 > /logs/verifier/reward.txt")
    b = backend(tmp_path, agent=DeepArtifacts, tasks_dir=tmp_path / "tasks")
    [result] = await collect(b, [request("deep", "deep")])
    assert result.reward == 1.0
    assert "logs/artifacts/kept.txt" in result.extra_fields["harbor"]["artifacts"]
    assert list((tmp_path / "trials").iterdir()) == []  # the successful trial is removed


async def test_an_oversized_reward_file_is_a_verifier_error_not_infrastructure(
    tmp_path: Path,
) -> None:
    """The download refuses a 2 MiB reward.txt; a fresh sandbox would make it again."""
    write_task(tmp_path / "tasks", "big", test="head -c 2M /dev/zero > /logs/verifier/reward.txt")
    b = backend(tmp_path, tasks_dir=tmp_path / "tasks")
    [result] = await collect(b, [request("big", "big")])
    assert result.failure is not None, result
    assert result.failure.category == "verifier_error" and not result.failure.retryable
    assert result.reward is None
