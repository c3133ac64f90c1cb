"""Agent runtimes: Harbor's mini-swe-agent (its own class, its install replaced by a runtime
prepared once on the host) solving tasks offline through the relay, against the scripted
policy; and the runtime cache (one build, held while used, pruned when not, bad recipes refused
before any trial's sandbox starts).

The first test to need the mini-swe-agent runtime builds it from the package index (a one-time
cost on a fresh machine, about a minute); later runs find it in the cache.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from harbor.models.trial.config import EnvironmentConfig
from harbor.utils.trajectory_validator import validate_trajectory

from backends import HarborBackend, RolloutRequest, RolloutStatus, collect
from backends.bundle import cache
from backends.relay import Relay, Script, ScriptedPolicy
from backends.relayed import RelayedBackend
from backends.rollout.loading import load_object
from backends.runtimes import (
    RUNTIMES,
    PythonRuntime,
    RuntimeBuildError,
    ensure_runtime,
    runtime_for,
    runtimes_dir,
)
from backends.runtimes.agents import MiniSweAgent
from backends.runtimes.interpreter import python_dir
from backends.trajectory.save import trajectory_of

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(1800)]

ROOT = Path(__file__).parents[1]
TASKS = ROOT / "tasks" / "harbor"
TEMPLATES = ROOT / "tasks" / "harbor-templates"
SCRIPT = TEMPLATES / "mini-swe-agent.json"
UPSTREAM_KEY = "sk-upstream-" + uuid.uuid4().hex
ExactAnswer = load_object(f"{ROOT}/tasks/rollouts/harbor/main.py:ExactAnswer")
OFFLINE = EnvironmentConfig(kwargs={"network": "none"})


# Saves the environment the agent was given, and tries to plant a file in every folder on its
# PATH (the runtime's among them), beside the venv's Python and in the Python copy's bin/,
# listing where that worked.
SPY = (
    "env > /logs/artifacts/env.txt; "
    'for d in $(echo "$PATH" | tr : " ") "$(dirname "$(readlink -f "$(command -v '
    f'mini-swe-agent)")")" {python_dir(runtimes_dir())}/bin; do touch "$d/planted" 2>/dev/null '
    '&& echo "$d"; done > /logs/artifacts/writable.txt; '
)


def spying_script() -> Script:
    """The repository's script, except that the agent's first command spies first."""
    data = json.loads(SCRIPT.read_text())
    for rule in data["rules"]:
        call = rule["turns"][0]["tool_calls"][0]["arguments"]
        call["command"] = SPY + call["command"]
    return Script.model_validate(data)


@pytest.fixture
async def relay(tmp_path: Path) -> AsyncIterator[Relay]:
    async with (
        ScriptedPolicy(spying_script()) as policy,
        Relay(
            upstream_url=policy.base_url,
            upstream_api_key=UPSTREAM_KEY,
            unix_socket_path=tmp_path / "relay.sock",
            request_token_ids=True,
        ) as relay,
    ):
        yield relay


def mini(tmp_path: Path, **kwargs: Any) -> HarborBackend:
    return HarborBackend(
        agent="mini-swe-agent",
        trials_dir=tmp_path / "trials",
        artifacts=tmp_path / "out",
        environment_config=OFFLINE,
        cleanup_successful_trials=False,
        **kwargs,
    )


def check_solved(result: Any, tmp_path: Path) -> None:
    """Reward 1, every model call through the relay, a valid ATIF trajectory of those calls,
    and a sandbox that saw the relay's forwarder and the rollout's token, never the upstream."""
    assert result.status is RolloutStatus.SUCCESS, result.failure
    assert result.reward == 1.0, result.sample
    trace = result.policy_trace
    assert trace is not None and len(trace.calls) == 2  # the command, then the submission
    assert all(call.status == 200 for call in trace.calls)
    sample = result.sample
    sample_calls = [
        json.loads(call["function"]["arguments"])["command"]
        for m in sample.messages
        if m["role"] == "assistant"
        for call in m.get("tool_calls", [])
    ]
    relayed = [
        json.loads(call["function"]["arguments"])["command"]
        for c in trace.calls
        for call in c.choices[0].message["tool_calls"]
    ]
    assert sample_calls == relayed  # the sample is what the policy said, through the relay
    # The observation came back as the answer to its tool call, as the policy saw it.
    ids = [c["id"] for m in sample.messages if m["role"] == "assistant" for c in m["tool_calls"]]
    tools = [m for m in sample.messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tools] == ids[:1] and '"returncode": 0' in tools[0][
        "content"
    ]
    assert [m["role"] for m in sample.messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
    ]
    trajectory = trajectory_of(result)
    assert trajectory is not None
    assert validate_trajectory(trajectory.to_json_dict())
    assert [s for s in trajectory.steps if s.source == "agent" and s.tool_calls]
    seen = tmp_path / "out" / result.rollout_id / "artifacts" / "logs" / "artifacts" / "env.txt"
    env = seen.read_text()
    assert f"OPENAI_BASE_URL=http://127.0.0.1:18080/rollouts/{result.rollout_id}/v1" in env
    assert UPSTREAM_KEY not in env
    # The runtime is read-only to the agent: nothing it plants reaches the next rollout.
    path = next(line for line in env.splitlines() if line.startswith("PATH="))
    on_path = [
        d for d in path.removeprefix("PATH=").split(":") if d.startswith(str(runtimes_dir()))
    ]
    assert len(on_path) == 1 and on_path[0].endswith("/bin"), path  # its bin/, not the venv's
    writable = (seen.parent / "writable.txt").read_text().split()
    assert "/usr/local/bin" in writable  # the control: the spy plants where it may
    assert not [d for d in writable if d.startswith(str(runtimes_dir()))], writable
    assert not list(runtimes_dir().glob("*/*/planted")) and not list(
        runtimes_dir().glob("*/planted")
    )
    trial = tmp_path / "trials"
    written = "".join(p.read_text(errors="replace") for p in trial.rglob("*") if p.is_file())
    assert UPSTREAM_KEY not in written


@pytest.mark.sandbox
async def test_mini_swe_agent_solves_a_dataset_task_offline(
    tmp_path: Path, relay: Relay, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Keys in the host's environment (where Harbor's agent looks for credentials) stay there.
    for name in ("OPENAI_API_KEY", "MSWEA_API_KEY", "ANTHROPIC_API_KEY"):
        monkeypatch.setenv(name, UPSTREAM_KEY)
    backend = mini(tmp_path, tasks_dir=TASKS, task_mode="dataset")
    request = RolloutRequest(
        rollout_id="mini-sum", prompt=[], metadata={"harbor_task_id": "workdir-copy"}
    )
    started = time.monotonic()
    await RelayedBackend(backend, relay).start()
    prepared = time.monotonic() - started
    started = time.monotonic()
    [result] = await collect(RelayedBackend(backend, relay), [request])
    trial_sec = time.monotonic() - started
    await backend.aclose()
    check_solved(result, tmp_path)
    assert result.sample.metrics["harbor.agent_sec"] > 0
    # What a trial costs, once the runtime is built (see the report for measured figures).
    print(f"runtime ready in {prepared:.1f} s; one trial {trial_sec:.1f} s, "
          f"agent {result.sample.metrics['harbor.agent_sec']:.1f} s")  # fmt: skip


@pytest.mark.sandbox
async def test_mini_swe_agent_in_template_mode_with_a_host_grader(
    tmp_path: Path, relay: Relay
) -> None:
    backend = mini(
        tmp_path, tasks_dir=TEMPLATES / "arithmetic-graded", grader=ExactAnswer, max_concurrent=2
    )
    requests = [
        RolloutRequest(rollout_id="mini-mul", prompt=[{"role": "user", "content": "What is 6 * 7?"}], label="42"),
        RolloutRequest(rollout_id="mini-add", prompt=[{"role": "user", "content": "What is 40 + 2?"}], label="42"),
    ]  # fmt: skip
    results = await collect(RelayedBackend(backend, relay), requests)
    await backend.aclose()
    for result in results:
        check_solved(result, tmp_path)
        answer = tmp_path / "out" / result.rollout_id / "artifacts" / "app" / "answer.txt"
        assert answer.read_text() == "42\n"


# -- the runtime cache, with recipes small enough to build in seconds ---------------------------


@dataclass(frozen=True)
class ScriptRuntime:
    """A recipe kind of its own: one shell tool, no index. Counts its builds."""

    name: str = "script-tool"
    agent_class: str = "backends.runtimes.agents:MiniSweAgent"
    commands: tuple[str, ...] = ("hello",)
    env: dict[str, str] = field(default_factory=dict)
    check: str = "hello"
    version_of: str = "hello"
    interpreter: str = "bin/hello"
    builds: list[float] = field(default_factory=list, compare=False)
    tag: str = "1"

    @property
    def kind(self) -> str:
        return "script"

    def identity(self) -> str:
        return f"{self.name}\0{self.check}\0{self.tag}"

    async def install(self, stage: Path) -> dict[str, str]:
        self.builds.append(time.monotonic())
        await anyio.sleep(0.2)  # long enough for a second builder to arrive meanwhile
        (stage / "bin").mkdir()
        tool = stage / "bin" / "hello"
        tool.write_text("#!/bin/sh\necho hello\n")
        tool.chmod(0o755)
        return {"hello": "1.0"}


@pytest.mark.sandbox
async def test_a_runtime_is_built_once_held_while_used_and_pruned_after(tmp_path: Path) -> None:
    recipe = ScriptRuntime(tag=uuid.uuid4().hex)
    root = tmp_path / "cache"
    async with anyio.create_task_group() as tg:
        got: list[Any] = []

        async def one() -> None:
            got.append(await ensure_runtime(recipe, root=root / "runtimes"))

        for _ in range(3):
            tg.start_soon(one)
    assert len(recipe.builds) == 1  # three callers, one build (the others waited for it)
    assert len({r.path for r in got}) == 1
    runtime = got[0]
    assert runtime.manifest.version == "1.0" and runtime.manifest.commands == ["hello"]
    again = await ensure_runtime(recipe, root=root / "runtimes")
    assert again.path == runtime.path and len(recipe.builds) == 1  # found, not rebuilt
    # Held: the cache's pruner keeps it and says so; released, it goes.
    report = cache.prune(everything=True, root=root)
    assert [e.path for e in report.in_use] == [runtime.path] and runtime.path.is_dir()
    for r in [*got, again]:
        r.release()
    report = cache.prune(everything=True, root=root)
    assert [e.kind for e in report.removed] == ["runtime"] and not runtime.path.exists()


@pytest.mark.sandbox
async def test_a_runtime_whose_check_fails_offline_is_refused(tmp_path: Path) -> None:
    recipe = ScriptRuntime(check="hello && exit 3", tag=uuid.uuid4().hex)
    with pytest.raises(RuntimeBuildError, match=r"checking the script-tool runtime.*exit 3"):
        await ensure_runtime(recipe, root=tmp_path / "runtimes")
    assert not [p for p in (tmp_path / "runtimes").iterdir() if not p.name.endswith(".lock")]


async def test_a_package_the_index_does_not_have_is_refused(tmp_path: Path) -> None:
    recipe = PythonRuntime(
        name="broken",
        agent_class="backends.runtimes.agents:MiniSweAgent",
        packages=(f"no-such-package-{uuid.uuid4().hex[:12]}==1.0",),
        commands=("broken",),
        check="true",
        version_of="broken",
    )
    with pytest.raises(RuntimeBuildError, match=r"installing no-such-package-\w+==1.0 .*failed"):
        await ensure_runtime(recipe, root=tmp_path / "runtimes")


async def test_a_recipe_whose_command_is_not_installed_is_refused(tmp_path: Path) -> None:
    recipe = PythonRuntime(
        name="no-tool",
        agent_class="backends.runtimes.agents:MiniSweAgent",
        packages=("six",),  # installs, but has no command of that name
        commands=("no-such-tool",),
        check="true",
        version_of="six",
    )
    with pytest.raises(RuntimeBuildError, match=r"no 'no-such-tool' command after installing six"):
        await ensure_runtime(recipe, root=tmp_path / "runtimes")


@pytest.mark.sandbox
async def test_a_bad_runtime_fails_the_start_before_any_rollout(
    tmp_path: Path, relay: Relay, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = ScriptRuntime(check="exit 7", tag=uuid.uuid4().hex)
    monkeypatch.setitem(RUNTIMES, "mini-swe-agent", broken)  # type: ignore[arg-type]
    backend = mini(tmp_path, tasks_dir=TASKS, task_mode="dataset")
    request = RolloutRequest(
        rollout_id="never", prompt=[], metadata={"harbor_task_id": "workdir-copy"}
    )
    with pytest.raises(RuntimeBuildError, match=r"script-tool runtime.*exit 7"):
        await collect(RelayedBackend(backend, relay), [request])
    assert not (tmp_path / "trials").exists() or not any((tmp_path / "trials").iterdir())


def test_runtime_agents_are_local_only_and_started_by_the_backend(tmp_path: Path) -> None:
    assert runtime_for("mini-swe-agent") is RUNTIMES["mini-swe-agent"]
    assert runtime_for("terminus-2") is None
    backend = HarborBackend(tasks_dir=TASKS, task_mode="dataset", agent="mini-swe-agent")
    assert backend.agent.name == "mini-swe-agent" and backend.agent.runtime == "mini-swe-agent"
    assert backend.agent.harbor_config()["import_path"] == "backends.runtimes.agents:MiniSweAgent"
    with pytest.raises(ValueError, match=r"prepared on this host.*local sandboxes"):
        HarborBackend(
            tasks_dir=TASKS, task_mode="dataset", agent="mini-swe-agent", environment="skypilot"
        )
    # Harbor's own class, by import path, installs itself as Harbor does (needs network).
    own = HarborBackend(
        tasks_dir=TASKS,
        task_mode="dataset",
        agent="harbor.agents.installed.mini_swe_agent:MiniSweAgent",
    )
    assert own.agent.runtime is None
    with pytest.raises(ValueError, match="runs from a prepared runtime"):
        MiniSweAgent(logs_dir=tmp_path, model_name="openai/policy")


@pytest.mark.sandbox
def test_backends_run_drives_mini_swe_agent_with_a_policy_script(tmp_path: Path) -> None:
    """The command line, as a user runs it: one Harbor task, mini-swe-agent, the embedded
    scripted policy playing the repository's script, through the relay."""
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "backends.cli", "run", "-p", str(TASKS / "workdir-copy"),
         "-a", "mini-swe-agent", "--policy-script", str(SCRIPT), "-o", str(tmp_path / "run")],
        cwd=ROOT, env={**os.environ, "BACKENDS_HOME": str(tmp_path / "home")},
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["mean_reward"] == 1.0 and summary["policy_calls"] == 2, summary


@pytest.mark.sandbox
async def test_mini_swe_agent_runs_as_a_non_root_agent_user(tmp_path: Path) -> None:
    """A task whose agent runs as a non-root user (`[agent] user = "agent"`): the runtime and
    the copy of Python it runs on are bound outside /root, under folders open to every user,
    so the agent runs as that user and the task's verifier sees what it wrote."""
    async with (
        ScriptedPolicy(Script.load(SCRIPT)) as policy,
        Relay(upstream_url=policy.base_url, unix_socket_path=tmp_path / "relay.sock") as relay,
    ):
        backend = mini(tmp_path, tasks_dir=TASKS, task_mode="dataset", infra_attempts=1)
        request = RolloutRequest(
            rollout_id="mini-nonroot", prompt=[], metadata={"harbor_task_id": "nonroot-agent"}
        )
        [result] = await collect(RelayedBackend(backend, relay), [request])
        await backend.aclose()
    assert result.status is RolloutStatus.SUCCESS, result.failure
    assert result.reward == 1.0  # ~/whoami.txt says "agent", and the agent user owns it
    assert len(result.policy_trace.calls) == 2


def test_a_python_runtime_binds_nothing_of_the_hosts_root(tmp_path: Path) -> None:
    """What a trial's sandbox is given for mini-swe-agent: the runtime and the copy of Python,
    read-only, in the cache; not the host's Python under /root (the copy runs on its own
    libpython, as its check, run as an unprivileged user with no /root, showed)."""
    runtime = anyio.run(ensure_runtime, RUNTIMES["mini-swe-agent"])
    try:
        kwargs = runtime.sandbox_kwargs({"network": "none"})
    finally:
        runtime.release()
    assert "host_python" not in kwargs
    binds = kwargs["extra_binds"]
    assert {b["target"] for b in binds} == {str(runtime.path), runtime.manifest.python}
    assert all(b["read_only"] and b["source"] == b["target"] for b in binds)
    assert all(Path(b["target"]).is_relative_to(runtimes_dir()) for b in binds)
    python = Path(runtime.manifest.python or "")
    venv = (runtime.path / "venv" / "pyvenv.cfg").read_text()
    assert f"home = {python / 'bin'}" in venv and "/root" not in venv
    library = python / "lib" / "python3.12"
    assert not any((library / "site-packages").iterdir()) and not (library / "test").exists()


@pytest.mark.sandbox
async def test_an_agent_user_that_cannot_run_the_runtime_is_told_why(
    tmp_path: Path, relay: Relay
) -> None:
    """A task image that closes a folder the runtime is bound under (the cache's parent, such
    as /var/cache, 0700) to its non-root agent user: the agent's setup fails saying so (never
    a reward, no policy call)."""
    task = tmp_path / "tasks" / "closed-cache"
    shutil.copytree(TASKS / "nonroot-agent", task)
    closed = runtimes_dir().parent.parent  # wherever BACKENDS_CACHE puts the cache
    with (task / "environment" / "Dockerfile").open("a") as dockerfile:
        dockerfile.write(f"RUN mkdir -p {closed} && chmod 700 {closed}\n")
    backend = mini(tmp_path, tasks_dir=task.parent, task_mode="dataset", infra_attempts=1)
    request = RolloutRequest(
        rollout_id="mini-closed", prompt=[], metadata={"harbor_task_id": "closed-cache"}
    )
    [result] = await collect(RelayedBackend(backend, relay), [request])
    await backend.aclose()
    assert result.reward is None and result.failure is not None
    assert result.failure.category == "infra_error", result.failure
    assert "user (agent) cannot run it" in result.failure.message, result.failure.message
    assert result.policy_trace is not None and not result.policy_trace.calls


@pytest.mark.sandbox
def test_backends_runtime_build_and_list(tmp_path: Path) -> None:
    """`backends runtime build` prepares a runtime ahead of any run (a set-up step);
    an unknown name is refused with exit 2."""
    import os
    import subprocess
    import sys

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "backends.cli", "runtime", *args],
            cwd=ROOT, env={**os.environ, "BACKENDS_HOME": str(tmp_path)},
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip

    built = cli("build", "mini-swe-agent", "--json")
    assert built.returncode == 0, built.stderr[-3000:]
    manifest = json.loads(built.stdout.strip().splitlines()[-1])
    assert manifest["version"] == "2.4.6" and manifest["commands"] == ["mini-swe-agent"]
    assert Path(manifest["path"], "bin", "mini-swe-agent").exists()
    listed = cli("list")
    assert listed.returncode == 0 and manifest["path"] in listed.stdout
    unknown = cli("build", "no-such-agent")
    assert unknown.returncode == 2 and "no runtime recipe for no-such-agent" in unknown.stderr


def test_tool_results_are_linked_only_from_a_well_formed_native_trajectory(
    tmp_path: Path,
) -> None:
    """The agent's own trajectory comes from the sandbox: ids of the wrong type or for no call
    of the step are not taken; a well-formed one links each result to its call, by content."""
    from harbor.models.agent.context import AgentContext
    from harbor.models.trajectories import Trajectory

    from backends.runtimes.build import RuntimeManifest

    runtime = tmp_path / "runtime"
    runtime.mkdir()
    manifest = RuntimeManifest(
        name="mini-swe-agent", kind="python", key="k", packages={}, version="2.4.6",
        commands=["mini-swe-agent"], env={}, size_bytes=0, build_sec=0.0,
    )  # fmt: skip
    (runtime / ".complete").write_text(manifest.model_dump_json())
    logs = tmp_path / "logs"
    logs.mkdir()
    agent = MiniSweAgent(logs_dir=logs, model_name="openai/policy", runtime_dir=str(runtime))
    call = {"id": "call_0", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
    native = {
        "info": {},
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "task"},
            {"role": "assistant", "content": "run it", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": "out"},
            {"role": "user", "content": "format error: try again"},
        ],
    }
    path = logs / "mini-swe-agent.trajectory.json"
    agent.populate_context_post_run(AgentContext())  # none written: nothing to do
    # Ids of the wrong type, or answering no call of the step, are not taken.
    bad = json.loads(json.dumps(native))
    bad["messages"][3]["tool_call_id"] = 7
    bad["messages"].insert(4, {"role": "tool", "tool_call_id": "call_9", "content": "out"})
    path.write_text(json.dumps(bad))
    agent.populate_context_post_run(AgentContext())
    trajectory = Trajectory.model_validate_json((logs / "trajectory.json").read_text())
    assert not [r.source_call_id for s in trajectory.steps if s.observation
                for r in s.observation.results if r.source_call_id]  # fmt: skip
    path.write_text(json.dumps(native))
    agent.populate_context_post_run(AgentContext())
    trajectory = Trajectory.model_validate_json((logs / "trajectory.json").read_text())
    [step] = [s for s in trajectory.steps if s.source == "agent"]
    assert step.observation is not None
    results = [(r.content, r.source_call_id) for r in step.observation.results]
    assert results == [("out", "call_0"), ("format error: try again", None)]
