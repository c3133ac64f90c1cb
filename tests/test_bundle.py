"""Rollout bundles: built once per content, installed offline once, run inside local sandboxes.

The end-to-end tests run workflows through HarborBackend template mode behind a real relay
with the embedded scripted policy, and compare with LocalBackend on the same dataset.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from host_support import running_sandboxes

from backends import (
    ErrorCategory,
    LocalBackend,
    Relay,
    RelayedBackend,
    RolloutRequest,
    RolloutResult,
    RolloutStatus,
    collect,
)
from backends.bundle import Bundle, BundleError, build_bundle
from backends.bundle import environment as environment_module
from backends.bundle.agent import WorkflowPlan
from backends.bundle.build import bundle_key
from backends.bundle.environment import image_platform, platform_of
from backends.bundle.models import RunnerInput, RunnerOutput
from backends.harbor import HarborBackend
from backends.relay.scripted import ScriptedPolicy
from backends.rollout.dataset import requests_from_dataset
from backends.rollout.sample import RolloutSample
from backends.runtimes import runtimes_dir

# A test may be the first to build and install a bundle: a minute, and up to 15 measured on
# a host loaded with other suites.
pytestmark = pytest.mark.timeout(1800)

ROOT = Path(__file__).parents[1]
ARITHMETIC = ROOT / "tasks" / "rollouts" / "arithmetic"
PROJECT = Path(__file__).parent / "bundle_project"
TEMPLATE = ROOT / "tasks" / "templates" / "workflow"
PROMPT = [{"role": "user", "content": "What is 6 * 7?"}]
GRADER = f"{PROJECT}/main.py:NonEmptyAnswer"


def copy_project(tmp_path: Path, source: Path = PROJECT) -> Path:
    target = tmp_path / "project"
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target


# -- building, on the host --------------------------------------------------------------------


def test_same_inputs_same_key_any_change_a_new_one(tmp_path: Path) -> None:
    project = copy_project(tmp_path)
    key = bundle_key(project, python="3.12", platform="manylinux_2_36_x86_64")
    assert key == bundle_key(project, python="3.12", platform="manylinux_2_36_x86_64")
    assert key != bundle_key(project, python="3.13", platform="manylinux_2_36_x86_64")
    assert key != bundle_key(project, python="3.12", platform="manylinux_2_28_aarch64")
    (project / "__pycache__").mkdir()
    (project / "__pycache__" / "main.cpython-312.pyc").write_bytes(b"not shipped")
    assert key == bundle_key(project, python="3.12", platform="manylinux_2_36_x86_64")
    (project / "helper.py").write_text("X = 1\n")
    assert key != bundle_key(project, python="3.12", platform="manylinux_2_36_x86_64")


def test_a_built_bundle_is_found_again_not_rebuilt() -> None:
    first = build_bundle(ARITHMETIC, entrypoint="main.py:ArithmeticWorkflow")
    stamp = (first.path / "manifest.json").stat().st_mtime_ns
    again = build_bundle(ARITHMETIC, entrypoint="main.py:ArithmeticWorkflow")
    assert again.path == first.path
    assert (again.path / "manifest.json").stat().st_mtime_ns == stamp
    manifest = again.manifest
    assert manifest.python == "3.12" and manifest.platform == "manylinux_2_36_x86_64"
    assert manifest.files == ["main.py", "pyproject.toml"]
    names = {d.split("==")[0] for d in manifest.dependencies}
    assert {"openai", "pydantic", "harbor"} <= names
    wheels = sorted(p.name for p in again.wheels_dir.iterdir())
    assert len(wheels) == len(manifest.dependencies)
    # Native extensions are built for the sandbox's platform, not whatever the host is.
    core = next(w for w in wheels if w.startswith("pydantic_core-"))
    assert "cp312" in core and "manylinux" in core and "x86_64" in core


def test_projects_that_cannot_ship_fail_before_any_sandbox(tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "main.py").write_text("X = 1\n")
    with pytest.raises(BundleError, match=r"has no pyproject\.toml"):
        build_bundle(bare)

    broken = copy_project(tmp_path)
    (broken / "main.py").write_text("import definitely_missing_module_xyz\n")
    with pytest.raises(BundleError, match=r"does not import.*definitely_missing_module_xyz"):
        build_bundle(broken, entrypoint="main.py:Workflow")
    (broken / "main.py").write_text("X = 1\n")
    with pytest.raises(BundleError, match=r"does not import.*no attribute 'Workflow'"):
        build_bundle(broken, entrypoint="main.py:Workflow")

    impossible = copy_project(tmp_path / "x")
    text = (impossible / "pyproject.toml").read_text()
    (impossible / "pyproject.toml").write_text(text.replace('"openai>=1.50"', '"openai>=999"'))
    root = tmp_path / "bundles"
    with pytest.raises(BundleError, match=r"resolving the project's dependencies failed"):
        build_bundle(impossible, root=root)
    # Nothing half-built (a lock file is no bundle: pruning removes it).
    assert [p for p in root.iterdir() if p.name != "wheelhouse" and p.suffix != ".lock"] == []


def test_the_platform_is_read_from_the_image_and_an_image_without_glibc_is_refused() -> None:
    assert platform_of("glibc 2.36\nx86_64\n") == "manylinux_2_36_x86_64"
    assert platform_of("glibc 2.28\naarch64\n") == "manylinux_2_28_aarch64"
    with pytest.raises(BundleError, match="no glibc"):
        platform_of("none\nx86_64\n")


@pytest.mark.sandbox
@pytest.mark.anyio
async def test_the_image_is_asked_for_its_platform_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(environment_module, "platforms_dir", lambda: tmp_path / "platforms")
    assert await image_platform(TEMPLATE / "environment", "debian:12") == "manylinux_2_36_x86_64"
    (recorded,) = (tmp_path / "platforms").iterdir()
    recorded.write_text("manylinux_2_99_x86_64")  # later asks read what the first one found
    assert await image_platform(TEMPLATE / "environment", "debian:12") == "manylinux_2_99_x86_64"


def test_harbor_backend_refuses_a_workflow_it_cannot_ship(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir()
    (loose / "flow.py").write_text(
        "from backends import AgentWorkflow\n"
        "class Flow(AgentWorkflow):\n    async def run(self, ctx):\n        return []\n"
    )
    with pytest.raises(ValueError, match=r"no pyproject\.toml"):
        HarborBackend(tasks_dir=TEMPLATE, agent=f"{loose}/flow.py:Flow", grader=GRADER)
    with pytest.raises(ValueError, match="template mode"):
        HarborBackend(
            tasks_dir=ROOT / "tasks" / "harbor",
            task_mode="dataset",
            agent=f"{PROJECT}/main.py:ReturnsList",
        )


# -- what crosses the sandbox wall ------------------------------------------------------------


def test_the_runner_input_has_no_place_for_the_label() -> None:
    fields = {
        "rollout_id": "r",
        "project_dir": "/p",
        "entrypoint": "main.py:W",
        "prompt": PROMPT,
    }
    RunnerInput.model_validate(fields)
    with pytest.raises(ValueError, match="label"):
        RunnerInput.model_validate({**fields, "label": "42"})


PRELOAD_PROBE = """
import sys, threading
connected = []
sys.addaudithook(lambda event, args: event == "socket.connect" and connected.append(args[1]))
from backends.bundle.preload import preload
preload(sys.argv[1], "main.py:ArithmeticWorkflow", None)
print(sorted({address[0] for address in connected}), threading.active_count())
"""


def test_the_preload_warms_openai_on_its_own_loopback_and_leaves_no_thread() -> None:
    """A workflow importing openai gets its request path warmed in the fork server: one call
    to a stub on loopback (nothing else is reached), and no thread left (forks need none)."""
    probe = subprocess.run(
        [sys.executable, "-c", PRELOAD_PROBE, str(ARITHMETIC)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split("\n")[0] == "['127.0.0.1'] 1"
    assert "failed" not in probe.stderr


def _plan_with_output(tmp_path: Path, output: str | None) -> tuple[WorkflowPlan, Path]:
    plan = WorkflowPlan(PROJECT, "main.py:ReturnsList", None)
    trial = tmp_path / "trial"
    (trial / "agent").mkdir(parents=True)
    if output is not None:
        (trial / "agent" / "runner_output.json").write_text(output)
    return plan, trial


def test_the_host_reads_back_only_what_it_should(tmp_path: Path) -> None:
    sample = RolloutSample(messages=PROMPT, reward=1.0, label="planted")
    good = RunnerOutput(status="success", sample=sample).model_dump_json()
    plan, trial = _plan_with_output(tmp_path / "a", good)
    collected = plan.collect(trial)
    assert isinstance(collected, RolloutSample)
    assert collected.reward is None and collected.label is None  # the host grades

    plan, trial = _plan_with_output(tmp_path / "b", None)
    failure = plan.collect(trial)
    assert not isinstance(failure, RolloutSample)
    assert failure.category is ErrorCategory.AGENT_ERROR and "no sample" in failure.message

    # A symlink planted in the output's place is never followed to a host file.
    secret = tmp_path / "host-secret.json"
    secret.write_text(good)
    plan, trial = _plan_with_output(tmp_path / "c", None)
    (trial / "agent" / "runner_output.json").symlink_to(secret)
    failure = plan.collect(trial)
    assert not isinstance(failure, RolloutSample) and "unusable" in failure.message

    plan, trial = _plan_with_output(tmp_path / "d", '{"status": "success", "reward": 1}')
    failure = plan.collect(trial)
    assert not isinstance(failure, RolloutSample) and "unusable" in failure.message


# -- inside local sandboxes -------------------------------------------------------------------


@pytest.fixture
async def relay(tmp_path: Path) -> AsyncIterator[Relay]:
    async with (
        ScriptedPolicy() as policy,
        Relay(
            upstream_url=policy.base_url,
            upstream_api_key="upstream-key-never-in-a-sandbox",
            unix_socket_path=tmp_path / "relay.sock",
        ) as relay,
    ):
        yield relay


@pytest.fixture
async def in_sandbox(tmp_path: Path) -> AsyncIterator[Callable[..., HarborBackend]]:
    """Makes HarborBackends running a workflow in sandboxes; closes each after the test (its
    warm runner's sandbox would otherwise run, holding a uid range, until the process ends)."""
    made: list[HarborBackend] = []

    def make(
        workflow: str, project: Path = PROJECT, *, where: Path = tmp_path, **kwargs: Any
    ) -> HarborBackend:
        kwargs.setdefault("grader", f"{project}/main.py:NonEmptyAnswer")
        kwargs.setdefault("tasks_dir", TEMPLATE)
        made.append(
            HarborBackend(
                agent=f"{project}/main.py:{workflow}",
                trials_dir=where / "trials",
                artifacts=where / "out",
                **kwargs,
            )
        )
        return made[-1]

    yield make
    for backend in made:
        await backend.aclose()


async def run_one(relay: Relay, backend: HarborBackend, **kwargs: Any) -> RolloutResult:
    kwargs.setdefault("label", "expected")
    request = RolloutRequest(rollout_id=f"b-{uuid.uuid4().hex[:8]}", prompt=PROMPT, **kwargs)
    return await RelayedBackend(backend, relay).execute(request)


@pytest.mark.sandbox
@pytest.mark.anyio
@pytest.mark.parametrize("workflow", ["ReturnsOutput", "ReturnsList", "RegistersSource"])
async def test_each_return_shape_gives_the_sample_inside(
    tmp_path: Path, relay: Relay, workflow: str, in_sandbox: Callable[..., HarborBackend]
) -> None:
    result = await run_one(relay, in_sandbox(workflow))
    assert result.status is RolloutStatus.SUCCESS, result.failure
    assert result.sample is not None
    assert result.sample.messages[:1] == PROMPT
    assert result.sample.messages[-1]["role"] == "assistant"
    assert "42" in result.sample.messages[-1]["content"]
    # The host's grader decided, not the reward the sample source claimed inside.
    assert result.reward == 0.5 and result.sample.label == "expected"
    assert result.policy_trace is not None and len(result.policy_trace.calls) == 1
    if workflow == "ReturnsOutput":
        assert result.sample.metrics["shape"] == 1.0
        stored = result.extra_fields["harbor"]["artifacts"]
        assert "logs/artifacts/note.txt" in stored
        assert (tmp_path / "out" / result.rollout_id / "artifacts" / "logs" / "artifacts" /
                "note.txt").read_text() == "written inside\n"  # fmt: skip


@pytest.mark.sandbox
@pytest.mark.anyio
async def test_a_raising_workflow_is_an_agent_error_with_its_traceback(
    relay: Relay, in_sandbox: Callable[..., HarborBackend]
) -> None:
    result = await run_one(relay, in_sandbox("Raises"))
    assert result.status is RolloutStatus.FAILURE and result.reward is None
    assert result.failure is not None
    assert result.failure.category is ErrorCategory.AGENT_ERROR
    assert "ValueError: the workflow broke on purpose" in result.failure.message
    assert "Traceback (most recent call last)" in result.failure.message
    assert 'main.py", line' in result.failure.message


@pytest.mark.sandbox
@pytest.mark.anyio
async def test_a_missing_sample_is_a_failure_never_reward_0(
    relay: Relay, in_sandbox: Callable[..., HarborBackend]
) -> None:
    result = await run_one(relay, in_sandbox("DiesWithoutOutput"))
    assert result.status is RolloutStatus.FAILURE and result.reward is None
    assert result.failure is not None
    assert result.failure.category is ErrorCategory.AGENT_ERROR
    assert "no sample" in result.failure.message


@pytest.mark.sandbox
@pytest.mark.anyio
async def test_the_label_is_nowhere_in_the_sandbox_and_there_is_no_network(
    relay: Relay, in_sandbox: Callable[..., HarborBackend]
) -> None:
    label = "CANARY-" + uuid.uuid4().hex
    planted = "CANARY-" + uuid.uuid4().hex  # in the metadata, which does enter: proves the search
    backend = in_sandbox("Snoops")
    result = await run_one(relay, backend, label=label, metadata={"note": planted})
    assert _warm_servers(backend)  # forked from a warm runner, which never saw the label
    await backend.aclose()
    assert result.status is RolloutStatus.SUCCESS, result.failure
    assert result.sample is not None
    report = result.sample.messages[-1]["content"]
    assert planted in report
    assert label not in report
    assert "network=unreachable" in report


@pytest.mark.sandbox
@pytest.mark.anyio
async def test_a_running_backend_holds_its_bundle_and_environment_against_pruning(
    relay: Relay, in_sandbox: Callable[..., HarborBackend]
) -> None:
    backend = in_sandbox("ReturnsOutput")
    result = await run_one(relay, backend)
    assert result.status is RolloutStatus.SUCCESS, result.failure
    plan = backend.settings.workflow
    assert plan is not None and plan.environment is not None
    environment = plan.environment
    # Another process prunes everything it can (a dry run: the cache is shared).
    script = str(Path(sys.executable).with_name("backends"))
    done = await anyio.run_process([script, "bundle", "prune", "--all", "--dry-run", "--json"])
    doc = json.loads(done.stdout)
    in_use = {entry["path"] for entry in doc["in_use"]}
    removed = {entry["path"] for entry in doc["removed"]}
    assert {str(environment.path), str(environment.bundle.path)} <= in_use
    assert not {str(environment.path), str(environment.bundle.path)} & removed
    await backend.aclose()  # from now on the cache may prune them
    assert plan.environment is None
    assert environment.holds and not environment.held


@pytest.mark.sandbox
@pytest.mark.anyio
async def test_the_install_check_cannot_alter_the_environment_it_imports_from(
    tmp_path: Path,
) -> None:
    project = copy_project(tmp_path)
    with (project / "main.py").open("a") as handle:
        handle.write(
            "\n\ntry:  # import-time code writing into its own installed environment\n"
            "    import sys as _sys\n"
            "    if '/environments/' in _sys.prefix:\n"
            "        open(_sys.prefix + '/planted-at-import', 'w').write('x')\n"
            "except OSError:\n"
            "    pass\n"
        )
    plan = WorkflowPlan.of(f"{project}/main.py:ReturnsOutput")
    assert plan is not None
    environment = await plan.prepare(TEMPLATE)
    try:
        assert environment.python.is_file()
        assert not (environment.path / "planted-at-import").exists()
    finally:
        plan.close()


@pytest.mark.sandbox
@pytest.mark.anyio
async def test_a_running_workflow_previews_live_from_inside_its_sandbox(
    relay: Relay, in_sandbox: Callable[..., HarborBackend]
) -> None:
    backend = in_sandbox("Previewed")
    await backend.start()
    assert backend.settings.workflow is not None
    backend.settings.workflow.preview_interval_sec = 0.2
    request = RolloutRequest(rollout_id="previewed", prompt=PROMPT, label="expected")
    relayed = RelayedBackend(backend, relay)
    seen: list[RolloutSample] = []
    tokens: set[str | None] = set()
    results: list[RolloutResult] = []

    async def run() -> None:
        results.append(await relayed.execute(request))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        while not results:
            live = backend.rollout_context("previewed")
            if live is not None:
                tokens.add(live.api_key)
                preview = await live.sample_source.get_preview(100)
                if preview is not None:
                    seen.append(preview)
            await anyio.sleep(0.1)
    assert results[0].status is RolloutStatus.SUCCESS, results[0].failure
    assert seen, "no preview reached the host while the workflow ran"
    assert seen[0].messages[-1]["content"] == "thinking it over"
    assert seen[0].reward is None and seen[0].label is None
    # The publisher redacts with the rollout's relay token (never the upstream key).
    assert tokens and None not in tokens and "upstream-key-never-in-a-sandbox" not in tokens
    assert backend.rollout_context("previewed") is None  # over: nothing left to preview


@pytest.mark.sandbox
@pytest.mark.anyio
async def test_an_unrelayed_request_is_refused_the_upstream_key_never_enters(
    in_sandbox: Callable[..., HarborBackend],
) -> None:
    backend = in_sandbox("ReturnsList")
    request = RolloutRequest(
        rollout_id="direct",
        prompt=PROMPT,
        label="expected",
        chat_completions_url="http://127.0.0.1:9/v1",
        api_key="upstream-key",
    )
    result = await backend.execute(request)
    assert result.failure is not None
    assert result.failure.category is ErrorCategory.VALIDATION_ERROR
    assert "no relay route" in result.failure.message


@pytest.mark.sandbox
@pytest.mark.anyio
async def test_arithmetic_in_sandboxes_matches_local_backend_row_by_row(
    relay: Relay, in_sandbox: Callable[..., HarborBackend]
) -> None:
    requests = requests_from_dataset(ROOT / "tasks" / "data" / "arithmetic.jsonl")
    local = LocalBackend(
        workflow=f"{ARITHMETIC}/main.py:ArithmeticWorkflow",
        grader=f"{ARITHMETIC}/main.py:ExactAnswerGrader",
        artifacts_root=None,
    )
    sandboxed = in_sandbox(
        "ArithmeticWorkflow",
        ARITHMETIC,
        grader=f"{ARITHMETIC}/main.py:ExactAnswerGrader",
        max_concurrent=4,
    )
    in_process = await collect(RelayedBackend(local, relay), requests)
    inside = await collect(RelayedBackend(sandboxed, relay), requests)
    assert _warm_servers(sandboxed)  # forked from warm runners (one per uid range)
    await sandboxed.aclose()
    by_id = {r.rollout_id: r for r in in_process}
    assert len(inside) == len(requests) == len(by_id)
    for result in inside:
        twin = by_id[result.rollout_id]
        assert result.status is RolloutStatus.SUCCESS, result.failure
        assert (result.reward, result.sample and result.sample.messages) == (
            twin.reward,
            twin.sample and twin.sample.messages,
        ), result.rollout_id
        assert result.policy_trace is not None and len(result.policy_trace.calls) == 1
    assert {r.reward for r in inside} <= {0.0, 1.0}


def _warm_servers(backend: HarborBackend) -> list[Any]:
    plan = backend.settings.workflow
    assert plan is not None
    servers = plan.warm._servers if plan.warm is not None else None
    return servers.servers() if servers is not None else []


@pytest.mark.sandbox
@pytest.mark.anyio
async def test_repeat_rollouts_fork_from_the_warm_runner_and_match_a_cold_one(
    tmp_path: Path, relay: Relay, in_sandbox: Callable[..., HarborBackend]
) -> None:
    warm = in_sandbox("ReportsParent", where=tmp_path / "warm")
    cold = in_sandbox("ReportsParent", where=tmp_path / "cold")
    assert cold.settings.workflow is not None
    cold.settings.workflow.fork_server = False
    try:
        first, repeat = [await run_one(relay, warm) for _ in range(2)]
        baseline = await run_one(relay, cold)
        servers = _warm_servers(warm)
    finally:
        await warm.aclose()
        await cold.aclose()
    for result in (first, repeat, baseline):
        assert result.status is RolloutStatus.SUCCESS, result.failure
        assert result.reward == 0.5 and result.sample is not None
        assert result.policy_trace is not None and len(result.policy_trace.calls) == 1
    assert first.sample and repeat.sample and baseline.sample
    assert first.sample.messages == repeat.sample.messages == baseline.sample.messages
    # Forked, both: the runner's parent is outside the trial's pid namespace.
    assert first.sample.metrics["parent_visible"] == repeat.sample.metrics["parent_visible"] == 0
    assert baseline.sample.metrics["parent_visible"] == 1
    # From the server the project's warm-up ran in (a cold runner never calls it).
    assert first.sample.metrics["warmed_up"] == repeat.sample.metrics["warmed_up"] == 1
    assert baseline.sample.metrics["warmed_up"] == 0
    # The workflow reached the relay with its own client on the plain base URL, and nothing
    # but the runner ran in the sandbox for it (no forwarder process).
    for result in (first, repeat, baseline):
        assert result.sample and result.sample.metrics["other_processes"] == 0
    assert len(servers) == 1  # one server (one uid range) served both
    # aclose() ended it.
    assert not await anyio.Path(f"/proc/{servers[0].proc.pid}").exists()


@pytest.mark.sandbox
@pytest.mark.anyio
async def test_killing_the_warm_runner_mid_batch_loses_no_rollout(
    relay: Relay, in_sandbox: Callable[..., HarborBackend]
) -> None:
    backend = in_sandbox("ReportsParent", max_concurrent=3)
    results: list[RolloutResult] = []
    killed: list[int] = []

    async def one() -> None:
        results.append(await run_one(relay, backend))

    try:
        async with anyio.create_task_group() as tg:
            for _ in range(8):
                tg.start_soon(one)
            with anyio.fail_after(900):
                while not results:  # the first rollouts went through a server
                    await anyio.sleep(0.05)
            for server in _warm_servers(backend):
                os.kill(server.proc.pid, 9)
                killed.append(server.proc.pid)
    finally:
        await backend.aclose()
    assert killed
    assert len(results) == 8
    for result in results:
        assert result.status is RolloutStatus.SUCCESS, result.failure
        assert result.reward == 0.5


async def _gone_within(names: set[str], seconds: float) -> set[str]:
    """Those of the sandboxes `names` still running after up to `seconds`."""
    with anyio.move_on_after(seconds):
        while names & set(running_sandboxes()):
            await anyio.sleep(0.05)
    return names & set(running_sandboxes())


class Warmed:
    """A backend that ran one bundled rollout: its warm runner's sandbox and server run."""

    def __init__(self, tmp_path: Path) -> None:
        self.backend: HarborBackend | None = HarborBackend(
            tasks_dir=TEMPLATE,
            agent=f"{PROJECT}/main.py:ReportsParent",
            grader=GRADER,
            trials_dir=tmp_path / "trials",
            artifacts=tmp_path / "out",
        )
        self.sandboxes: set[str] = set()
        self.servers: list[int] = []

    async def run(self, relay: Relay) -> None:
        assert self.backend is not None
        before = set(running_sandboxes())
        result = await run_one(relay, self.backend)
        assert result.status is RolloutStatus.SUCCESS, result.failure
        assert result.sample and result.sample.metrics["parent_visible"] == 0  # it forked
        self.sandboxes = set(running_sandboxes()) - before  # the trial's sandbox is stopped
        self.servers = [server.proc.pid for server in _warm_servers(self.backend)]
        assert len(self.sandboxes) == 1 and len(self.servers) == 1

    def drop(self) -> None:
        """Lose the last reference and collect it (in whatever thread this runs)."""
        self.backend = None
        gc.collect()

    async def assert_ended(self, within: float) -> None:
        assert not await _gone_within(self.sandboxes, within)
        assert not await anyio.Path(f"/proc/{self.servers[0]}").exists()


def nonroot_template(tmp_path: Path) -> Path:
    """The workflow template with an image that has a user "agent", which the task's agent
    runs as (``[agent] user``)."""
    task = tmp_path / "nonroot-template"
    shutil.copytree(TEMPLATE, task)
    config = (task / "task.toml").read_text()
    config = config.replace('docker_image = "debian:12"\n', "")
    config = config.replace("[agent]\n", '[agent]\nuser = "agent"\n')
    (task / "task.toml").write_text(config)
    (task / "environment").mkdir()
    (task / "environment" / "Dockerfile").write_text(
        "FROM debian:12\nRUN useradd --create-home --shell /bin/bash agent\n"
    )
    return task


def identity_of(result: RolloutResult, out: Path) -> dict[str, Any]:
    """What ReportsIdentity found: its metrics and its artifacts' identity.json."""
    assert result.status is RolloutStatus.SUCCESS, result.failure
    assert result.reward == 0.5 and result.sample is not None  # the host's grader decided
    assert result.policy_trace is not None and len(result.policy_trace.calls) == 1
    found = out / result.rollout_id / "artifacts" / "logs" / "artifacts" / "identity.json"
    return {**result.sample.metrics, **json.loads(found.read_text())}


@pytest.mark.sandbox
@pytest.mark.anyio
@pytest.mark.parametrize("ending", ["aclose", "aclosing", "dropped", "collected-in-a-thread"])
async def test_a_backends_warm_runner_ends_with_it_closed_or_dropped(
    tmp_path: Path, relay: Relay, ending: str
) -> None:
    warmed = Warmed(tmp_path)
    backend = warmed.backend
    assert backend is not None
    try:
        if ending == "aclosing":
            async with contextlib.aclosing(backend):
                await warmed.run(relay)
        else:
            await warmed.run(relay)
        if ending == "aclose":
            await backend.aclose()
    except BaseException:
        await backend.aclose()
        raise
    del backend
    if ending in ("aclose", "aclosing"):
        # Gone by the time aclose returned; collecting the backend later does nothing more.
        await warmed.assert_ended(within=0)
        warmed.drop()
        return
    # Never closed: once unreferenced and collected, it ends the runner's sandbox itself.
    assert warmed.sandboxes <= set(running_sandboxes())
    if ending == "dropped":
        warmed.drop()
    else:  # a finalizer may run in any thread: the kills still happen on the loop
        await anyio.to_thread.run_sync(warmed.drop)
    await warmed.assert_ended(within=10)


@pytest.mark.sandbox
@pytest.mark.anyio
async def test_an_agent_user_that_cannot_run_the_environment_is_told_why(
    tmp_path: Path, relay: Relay, in_sandbox: Callable[..., HarborBackend]
) -> None:
    """An image that closes the folder the environment is bound under (the cache's parent,
    such as /var/cache, 0700) to its non-root agent user: the agent's setup says so, an
    infrastructure failure (never a reward), before any policy call."""
    template = nonroot_template(tmp_path)
    closed = environment_module.environments_dir().parent.parent
    with (template / "environment" / "Dockerfile").open("a") as dockerfile:
        dockerfile.write(f"RUN mkdir -p {closed} && chmod 700 {closed}\n")
    backend = in_sandbox("ReportsIdentity", tasks_dir=template, infra_attempts=1)
    result = await run_one(relay, backend)
    assert result.reward is None and result.failure is not None
    assert result.failure.category is ErrorCategory.INFRA_ERROR, result.failure
    assert "user (agent) cannot run it" in result.failure.message, result.failure.message
    assert result.policy_trace is not None and not result.policy_trace.calls


@pytest.mark.sandbox
@pytest.mark.anyio
async def test_a_root_agent_user_runs_on_the_python_copy_and_cannot_write_it(
    tmp_path: Path, relay: Relay, in_sandbox: Callable[..., HarborBackend]
) -> None:
    """Root in the sandbox (the template's default user): the host's Python under /root is not
    there at all, and even root inside writes neither the copy, nor the environment, nor the
    project (read-only binds; remounting is refused)."""
    backend = in_sandbox("ReportsIdentity")
    result = await run_one(relay, backend, metadata={"host_prefix": sys.base_prefix})
    assert _warm_servers(backend)
    seen = identity_of(result, tmp_path / "out")
    assert seen["uid"] == 0 and seen["parent_visible"] == 0, seen
    assert seen["host_prefix_visible"] == 0 and seen["under_root"] == [], seen
    assert seen["written"] == [] and seen["remounted"] == [], seen
    plan = backend.settings.workflow
    assert plan is not None and plan.environment is not None
    binds = {b["target"]: b for b in plan.environment.binds()}
    assert str(plan.environment.python_prefix) == seen["prefix"]
    for path in (plan.environment.path, plan.environment.python_prefix):
        assert binds[str(path)]["read_only"], binds


@pytest.mark.sandbox
@pytest.mark.anyio
async def test_a_non_root_agent_user_runs_the_workflow_forked_and_cold(
    tmp_path: Path, relay: Relay, in_sandbox: Callable[..., HarborBackend]
) -> None:
    """A task whose agent user is not root: the bundled workflow runs as that user, forked
    from the warm runner and cold, on the copy of the host's Python in the cache (nothing
    under the host's /root is in its sandbox), and can write neither that Python, nor its
    environment, nor its project."""
    template = nonroot_template(tmp_path)
    warm = in_sandbox("ReportsIdentity", where=tmp_path / "warm", tasks_dir=template)
    cold = in_sandbox("ReportsIdentity", where=tmp_path / "cold", tasks_dir=template)
    assert cold.settings.workflow is not None
    cold.settings.workflow.fork_server = False
    metadata = {"host_prefix": sys.base_prefix}
    try:
        forked = [await run_one(relay, warm, metadata=metadata) for _ in range(2)]
        baseline = await run_one(relay, cold, metadata=metadata)
        servers = _warm_servers(warm)
    finally:
        await warm.aclose()
        await cold.aclose()
    assert len(servers) == 1  # both forked rollouts came from one server
    agent_uid = 1000  # the image's first useradd
    for result, out, was_forked in [
        *((r, tmp_path / "warm" / "out", True) for r in forked),
        (baseline, tmp_path / "cold" / "out", False),
    ]:
        seen = identity_of(result, out)
        assert seen["uid"] == seen["euid"] == agent_uid, seen
        assert seen["parent_visible"] == (0 if was_forked else 1), seen
        assert seen["under_root"] == [] and not seen["prefix"].startswith("/root"), seen
        assert seen["written"] == [] and seen["remounted"] == [], seen
        assert Path(seen["prefix"]).is_relative_to(runtimes_dir()), seen


@pytest.mark.sandbox
@pytest.mark.parametrize("loop_left", ["closed", "stopped"])
def test_a_backend_dropped_after_its_event_loop_ended_ends_its_warm_runner(
    tmp_path: Path, loop_left: str
) -> None:
    warmed = Warmed(tmp_path)

    async def warm_up() -> None:
        async with (
            ScriptedPolicy() as policy,
            Relay(upstream_url=policy.base_url, unix_socket_path=tmp_path / "relay.sock") as relay,
        ):
            await warmed.run(relay)

    # A script's run_until_complete without close() leaves its loop stopped, not closed: a
    # callback handed to it would wait for a run that may never come.
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(warm_up())
        if loop_left == "closed":
            loop.close()
        assert warmed.sandboxes <= set(running_sandboxes())
        warmed.drop()  # no loop running to hand the kills to: they run here
        anyio.run(warmed.assert_ended, 10)
    finally:
        loop.close()


def test_a_bundle_opens_from_its_folder(tmp_path: Path) -> None:
    built = build_bundle(ARITHMETIC)
    assert Bundle.open(built.path).key == built.key
    with pytest.raises(BundleError, match="not a built bundle"):
        Bundle.open(tmp_path)
    assert json.loads((built.path / "manifest.json").read_text())["key"] == built.key
    assert os.access(built.project_dir / "main.py", os.R_OK)


def test_cli_builds_and_inspects_a_bundle(tmp_path: Path) -> None:
    cli = [str(Path(sys.executable).parent / "backends"), "bundle"]
    built = subprocess.run(
        [*cli, "build", str(ARITHMETIC), "--entrypoint", "main.py:ArithmeticWorkflow", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    manifest = json.loads(built.stdout)
    assert manifest["name"] == "arithmetic-rollout" and manifest["size_bytes"] > 0
    for ref in (manifest["key"], manifest["path"]):
        shown = subprocess.run([*cli, "inspect", ref], capture_output=True, text=True, check=True)
        assert manifest["key"] in shown.stdout and "openai==" in shown.stdout
    refused = subprocess.run([*cli, "build", str(tmp_path)], capture_output=True, text=True)
    assert refused.returncode == 2 and "has no pyproject.toml" in refused.stderr
    missing = subprocess.run([*cli, "inspect", "nope"], capture_output=True, text=True)
    assert missing.returncode == 2 and "not a built bundle" in missing.stderr
