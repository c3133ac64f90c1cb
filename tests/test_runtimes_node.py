"""Node agent runtimes: Harbor's own ``codex`` and ``claude-code`` classes, their install
replaced by a runtime prepared once on the host (the pinned npm package beside a pinned Node),
solving tasks offline through the relay against the scripted policy; and the clear errors of a
Node runtime that cannot be built.

Codex speaks the Responses API, Claude Code Anthropic Messages: the relay translates both to
the policy's chat completions and traces each call with its token ids. The first test to need
a runtime builds it from the npm registry (seconds, once per host); later runs find it cached.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from harbor.models.trajectories import Trajectory
from harbor.models.trial.config import EnvironmentConfig
from harbor.utils.trajectory_validator import validate_trajectory

from backends import HarborBackend, RolloutRequest, RolloutStatus, collect
from backends.relay import Relay, Script, ScriptedPolicy
from backends.relayed import RelayedBackend
from backends.runtimes import RUNTIMES, RuntimeBuildError, ensure_runtime, runtimes_dir
from backends.runtimes.agents import ClaudeCode, Codex, OpenCode
from backends.runtimes.recipes import NodeRuntime
from backends.sandbox.settings import cache_dir

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(1800)]

ROOT = Path(__file__).parents[1]
TASKS = ROOT / "tasks" / "harbor"
TEMPLATES = ROOT / "tasks" / "harbor-templates"
UPSTREAM_KEY = "sk-upstream-" + uuid.uuid4().hex
HOST_SECRET = "host-credential-" + uuid.uuid4().hex
# Where Harbor's classes look for credentials on the host: none may reach the sandbox.
HOST_CREDENTIALS = (
    "OPENAI_API_KEY",
    "CODEX_API_KEY",
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_AUTH_TOKEN",
    "CLAUDE_CODE_OAUTH_TOKEN",
    "AWS_ACCESS_KEY_ID",
    "AWS_BEARER_TOKEN_BEDROCK",
)
# Host switches Harbor's model-connection resolution and commands read: none may move the
# agent off the relay (Bedrock would time out offline, a reward-0 "success"), drop its key or
# change how it runs.
HOST_SWITCHES = {
    "CLAUDE_CODE_USE_BEDROCK": "1",
    "CODEX_FORCE_AUTH_JSON": "1",
    "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "7",
    "CLAUDE_CODE_DISABLE_ADAPTIVE_THINKING": "1",
}
OFFLINE = EnvironmentConfig(kwargs={"network": "none"})

# Saves the environment of every process in the sandbox (the agent's own among them), which
# `node` the agent's shell finds, and tries to plant a file in every folder on its PATH.
SPY = (
    "for p in /proc/[0-9]*; do tr '\\0' '\\n' < $p/environ 2>/dev/null; done "
    "> /logs/artifacts/env.txt; "
    "command -v node > /logs/artifacts/node.txt; "
    'for d in $(echo "$PATH" | tr : " "); do touch "$d/planted" 2>/dev/null && echo "$d"; '
    "done > /logs/artifacts/writable.txt; "
)


@dataclass(frozen=True)
class Agent:
    name: str
    api: str  # the wire format it speaks to the relay
    argument: str  # its shell tool's argument holding the command
    calls: int = 2  # policy calls per task: the command, then the answer (and any extra)

    @property
    def script_path(self) -> Path:
        return TEMPLATES / f"{self.name}.json"

    def spying_script(self, then: str = "") -> Script:
        """The agent's script, its command run after the spy (and then ``then``)."""
        data = json.loads(self.script_path.read_text())
        for rule in data["rules"]:
            arguments = rule["turns"][0]["tool_calls"][0]["arguments"]
            arguments[self.argument] = SPY + arguments[self.argument] + then
        return Script.model_validate(data)


CODEX = Agent("codex", "responses", "cmd")
CLAUDE_CODE = Agent("claude-code", "messages", "command")
OPENCODE = Agent("opencode", "responses", "command", calls=3)  # it also asks for a title
AGENTS = [CODEX, CLAUDE_CODE, OPENCODE]
AGENT_CLASSES = {"codex": Codex, "claude-code": ClaudeCode, "opencode": OpenCode}


@pytest.fixture
def then() -> str:
    return ""  # what the agent's command runs last (none unless a test says so)


@pytest.fixture
async def relay(agent: Agent, tmp_path: Path, then: str) -> AsyncIterator[Relay]:
    async with (
        ScriptedPolicy(agent.spying_script(then)) as policy,
        Relay(
            upstream_url=policy.base_url,
            upstream_api_key=UPSTREAM_KEY,
            unix_socket_path=tmp_path / "relay.sock",
            request_token_ids=True,
        ) as relay,
    ):
        yield relay


def backend_for(agent: Agent, tmp_path: Path, **kwargs: Any) -> HarborBackend:
    return HarborBackend(
        agent=agent.name,
        trials_dir=tmp_path / "trials",
        artifacts=tmp_path / "out",
        environment_config=OFFLINE,
        cleanup_successful_trials=False,
        **kwargs,
    )


def check_solved(agent: Agent, result: Any, tmp_path: Path) -> None:
    """Reward 1 from the task's verifier; both policy calls through the relay in the agent's
    format, traced with token ids and logprobs; the sample is what the policy said; Harbor's
    class parsed the agent's own files into a valid trajectory; and the sandbox held the
    rollout's token only, never the upstream key or a host credential."""
    assert result.status is RolloutStatus.SUCCESS, result.failure
    assert result.reward == 1.0, result.sample
    calls = result.policy_trace.calls
    assert [(c.api, c.upstream_api, c.status) for c in calls] == [
        (agent.api, "chat.completions", 200)
    ] * agent.calls
    ask, answer = calls[-2:]
    for call in calls:
        assert call.completion_token_ids and call.logprobs is not None
        assert len(call.logprobs) == len(call.completion_token_ids)
    (tool_call,) = ask.choices[0].message["tool_calls"]
    assert answer.request["messages"][-1]["tool_call_id"] == tool_call["id"]
    messages = result.sample.messages
    assert [m["role"] for m in messages][-3:] == ["assistant", "tool", "assistant"]
    assert messages[-3]["tool_calls"][0]["function"] == tool_call["function"]
    assert messages[-2]["tool_call_id"] == tool_call["id"]
    # Harbor's own conversion of the agent's native session files (populate_context_post_run).
    [native] = (tmp_path / "trials").glob("*/agent/trajectory.json")
    trajectory = Trajectory.model_validate_json(native.read_text())
    assert validate_trajectory(trajectory.to_json_dict())
    assert trajectory.agent.version == RUNTIMES[agent.name].packages[0].rpartition("@")[2]
    assert [c.function_name for s in trajectory.steps for c in s.tool_calls or []] == [
        tool_call["function"]["name"]
    ]
    seen = tmp_path / "out" / result.rollout_id / "artifacts" / "logs" / "artifacts"
    env = (seen / "env.txt").read_text()
    route = f"http://127.0.0.1:18080/rollouts/{result.rollout_id}"
    assert (
        f"OPENAI_BASE_URL={route}/v1" if agent is CODEX else f"ANTHROPIC_BASE_URL={route}"
    ) in env
    assert UPSTREAM_KEY not in env and HOST_SECRET not in env
    assert not {line.partition("=")[0] for line in env.splitlines()} & set(HOST_SWITCHES)
    # The runtime's Node stays off the agent's PATH, and the runtime is read-only to it.
    assert not (seen / "node.txt").read_text().startswith(str(runtimes_dir()))
    writable = (seen / "writable.txt").read_text().split()
    assert "/usr/local/bin" in writable  # the control: the spy plants where it may
    assert not [d for d in writable if d.startswith(str(runtimes_dir()))], writable
    assert not list(runtimes_dir().glob("*/bin/planted"))
    written = "".join(
        p.read_text(errors="replace") for p in (tmp_path / "trials").rglob("*") if p.is_file()
    )
    assert UPSTREAM_KEY not in written and HOST_SECRET not in written


async def solve_workdir_copy(agent: Agent, tmp_path: Path, relay: Relay) -> Any:
    """One rollout of the dataset's workdir-copy task, through the relay."""
    backend = backend_for(agent, tmp_path, tasks_dir=TASKS, task_mode="dataset")
    rollout = RolloutRequest(
        rollout_id=f"{agent.name}-copy", prompt=[], metadata={"harbor_task_id": "workdir-copy"}
    )
    [result] = await collect(RelayedBackend(backend, relay), [rollout])
    await backend.aclose()
    return result


@pytest.fixture
def host_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in HOST_CREDENTIALS:
        monkeypatch.setenv(name, HOST_SECRET)
    for name, value in HOST_SWITCHES.items():
        monkeypatch.setenv(name, value)
    auth = tmp_path / "host-auth.json"
    auth.write_text(json.dumps({"OPENAI_API_KEY": HOST_SECRET}))
    monkeypatch.setenv("CODEX_AUTH_JSON_PATH", str(auth))


@pytest.mark.sandbox
@pytest.mark.usefixtures("host_credentials")
@pytest.mark.parametrize("agent", AGENTS, ids=lambda a: a.name)
async def test_harbors_node_agent_solves_a_dataset_task_offline(
    agent: Agent, tmp_path: Path, relay: Relay
) -> None:
    check_solved(agent, await solve_workdir_copy(agent, tmp_path, relay), tmp_path)


@pytest.mark.sandbox
@pytest.mark.usefixtures("host_credentials")
@pytest.mark.parametrize("agent", AGENTS, ids=lambda a: a.name)
async def test_the_hosts_environment_leaves_the_model_connection_alone(
    agent: Agent, tmp_path: Path
) -> None:
    # Harbor's resolver read the host's environment after the agent's: Bedrock for
    # claude-code (no relay), no API key for codex (its auth.json switches).
    runtime = await ensure_runtime(RUNTIMES[agent.name])
    route = {"OPENAI_BASE_URL": "http://relay/v1", "ANTHROPIC_BASE_URL": "http://relay"}
    route |= {"OPENAI_API_KEY": "rollout-token", "ANTHROPIC_API_KEY": "rollout-token"}
    try:
        instance = AGENT_CLASSES[agent.name](
            logs_dir=tmp_path,
            model_name="openai/policy",
            extra_env=route,
            runtime_dir=str(runtime.path),
        )
        connection = instance.model_connection
    finally:
        runtime.release()
    assert connection.api_key == "rollout-token"
    # The route's values only (Harbor blanks ANTHROPIC_AUTH_TOKEN), no Bedrock or AWS switch.
    assert {v for v in connection.env.values() if v} <= set(route.values()), connection.env


# A sparse 1 GiB file where Harbor's class reads the agent's output after the run (codex: in
# its home's sessions, copied to the logs at the end; the name sorts last, so it is the one
# converted; opencode: its output, which the agent's command goes on writing at the start).
SPARSE_SESSION = {
    "claude-code": "; mkdir -p /logs/agent/sessions/projects/-app && truncate -s 1G "
    "/logs/agent/sessions/projects/-app/00000000-0000-4000-8000-000000000000.jsonl",
    "codex": "; for d in /installed-agent/codex-home/sessions/*/*/*; do truncate -s 1G "
    "$d/rollout-9999-12-31T00-00-00-zzzz.jsonl; done; true",
    "opencode": "; truncate -s 1G /logs/agent/opencode.txt",
}


@pytest.mark.sandbox
@pytest.mark.parametrize(
    ("agent", "then"),
    [(a, SPARSE_SESSION[a.name]) for a in AGENTS],
    ids=lambda a: getattr(a, "name", ""),
)
async def test_a_sparse_session_file_is_never_read_by_the_host(
    agent: Agent, tmp_path: Path, relay: Relay
) -> None:
    # Harbor's claude-code and codex classes read each session line whole after the run (on
    # the event loop), opencode its output file: 1 GiB of holes took +2 GiB of the
    # orchestrator's memory and blocked every rollout for seconds. The agent's logs are refused at the download instead, naming
    # the file: the reward and the relay's trace stay, the sample is the instruction alone.
    result = await solve_workdir_copy(agent, tmp_path, relay)
    assert result.status is RolloutStatus.SUCCESS, result.failure
    assert result.reward == 1.0
    assert len(result.policy_trace.calls) == agent.calls
    assert [m["role"] for m in result.sample.messages] == ["user"]
    [log] = (tmp_path / "trials").glob("*/trial.log")
    assert "' is 1073741824 bytes; files named like it are read whole" in log.read_text()
    agent_logs = [p for p in (tmp_path / "trials").glob("*/agent/**/*") if p.is_file()]
    assert not [p for p in agent_logs if p.stat().st_size > 1024 * 1024], agent_logs


# Two session files of small valid events, each just within what a download may bring
# (unpack.PARSED_PATTERN_LIMITS: 32 MiB a file, 64 MiB in all): Harbor's claude-code class
# converts every line of both after the run, 1-3 s of CPU.
EVENT = json.dumps(
    {"type": "user", "uuid": "e&", "message": {"role": "user", "content": "a" * 200}}
)
EVENTS_PER_FILE = 30 * 1024 * 1024 // (len(EVENT) + 8)
LARGE_SESSIONS = (  # events numbered by sed's "&", each its own step
    "; d=/logs/agent/sessions/projects/-app; mkdir -p $d; for i in 1 2; do "
    f"seq {EVENTS_PER_FILE} | sed -e s/^/$i-/ -e {shlex.quote(f's/.*/{EVENT}/')} "
    "> $d/0000000$i-0000-4000-8000-000000000000.jsonl; done"
)


@pytest.mark.sandbox
@pytest.mark.parametrize(("agent", "then"), [(CLAUDE_CODE, LARGE_SESSIONS)], ids=["claude-code"])
async def test_converting_a_large_session_leaves_the_event_loop_free(
    agent: Agent, tmp_path: Path, relay: Relay, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Harbor converts the agent's session files after the run; on the event loop that stood
    # every other rollout and the relay still as long as it took. Measured: the worst
    # lateness of a 10 ms tick on the same loop, against how long the conversion took (the
    # ratio holds on a loaded host; single calls into pydantic over the whole trajectory
    # still hold the interpreter's lock, so the tick is not free of it entirely).
    converting: list[float] = []
    convert = ClaudeCode.populate_context_post_run

    def timed(self: ClaudeCode, context: Any) -> None:
        start = time.monotonic()
        convert(self, context)
        converting.append(time.monotonic() - start)

    monkeypatch.setattr(ClaudeCode, "populate_context_post_run", timed)
    backend = backend_for(agent, tmp_path, tasks_dir=TASKS, task_mode="dataset")
    await backend.start()  # its one-time imports are not what this measures
    rollout = RolloutRequest(
        rollout_id=f"{agent.name}-copy", prompt=[], metadata={"harbor_task_id": "workdir-copy"}
    )
    worst, done = 0.0, False

    async def tick() -> None:
        nonlocal worst
        while not done:
            start = time.monotonic()
            await anyio.sleep(0.01)
            worst = max(worst, time.monotonic() - start - 0.01)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(tick)
            [result] = await collect(RelayedBackend(backend, relay), [rollout])
            done = True
    finally:
        await backend.aclose()
    assert result.status is RolloutStatus.SUCCESS, result.failure
    assert result.reward == 1.0 and len(result.policy_trace.calls) == agent.calls
    assert result.sample.metrics["n_output_tokens"] > 0  # the session's counts, converted
    [took] = converting  # once: Harbor's own call found it done
    print(f"conversion {took:.2f} s, worst tick lateness {worst:.2f} s")
    assert took > 0.3  # the sessions were large enough to measure against
    assert worst < 0.5 * took, f"the loop stood still {worst:.2f} s of the {took:.2f} s"


# A session of the agent's own making, named to sort last: the one Harbor's codex class converts.
FAKE_SESSION = "".join(
    json.dumps({"type": "response_item", "payload": {"type": "message", **m}}) + "\n"
    for m in (
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "FABRICATED"}]},
    )
)
SUBSTITUTED_SESSION = (
    "; for d in /installed-agent/codex-home/sessions/*/*/*; do printf %s "
    f"{shlex.quote(FAKE_SESSION)} > $d/rollout-9999-12-31T00-00-00-zzzz.jsonl; done; true"
)


@pytest.mark.sandbox
@pytest.mark.parametrize(("agent", "then"), [(CODEX, SUBSTITUTED_SESSION)], ids=["codex"])
async def test_a_session_the_agent_substitutes_is_flagged_by_the_relays_trace(
    agent: Agent, tmp_path: Path, relay: Relay
) -> None:
    # Harbor's codex class converts the session file whose name sorts last, so the agent can
    # choose the sample's messages; the relay's trace shows no policy call produced them.
    result = await solve_workdir_copy(agent, tmp_path, relay)
    assert result.status is RolloutStatus.SUCCESS and result.reward == 1.0, result.failure
    assert len(result.policy_trace.calls) == 2
    assert result.sample.messages[-1] == {"role": "assistant", "content": "FABRICATED"}
    assert result.sample.extra_fields["unrelayed_assistant_turns"] == [1]


@pytest.mark.sandbox
@pytest.mark.parametrize("agent", AGENTS, ids=lambda a: a.name)
async def test_harbors_node_agent_runs_as_a_non_root_agent_user(
    agent: Agent, tmp_path: Path
) -> None:
    """`[agent] user = "agent"`: the runtime is bound under folders open to every user, so
    the agent runs as that user (the task's verifier checks who wrote ~/whoami.txt)."""
    async with (
        ScriptedPolicy(Script.load(agent.script_path)) as policy,
        Relay(upstream_url=policy.base_url, unix_socket_path=tmp_path / "relay.sock") as relay,
    ):
        backend = backend_for(agent, tmp_path, tasks_dir=TASKS, task_mode="dataset")
        rollout = RolloutRequest(
            rollout_id=f"{agent.name}-nonroot",
            prompt=[],
            metadata={"harbor_task_id": "nonroot-agent"},
        )
        [result] = await collect(RelayedBackend(backend, relay), [rollout])
        await backend.aclose()
    assert result.status is RolloutStatus.SUCCESS, result.failure
    assert result.reward == 1.0
    assert [c.status for c in result.policy_trace.calls] == [200] * agent.calls


@pytest.mark.sandbox
@pytest.mark.parametrize("agent", [CODEX], ids=lambda a: a.name)
async def test_codex_in_template_mode_with_a_host_grader(
    agent: Agent, tmp_path: Path, relay: Relay
) -> None:
    from backends.rollout.loading import load_object

    grader = load_object(f"{ROOT}/tasks/rollouts/harbor/main.py:ExactAnswer")
    backend = backend_for(CODEX, tmp_path, tasks_dir=TEMPLATES / "arithmetic-graded", grader=grader)
    rollout = RolloutRequest(
        rollout_id="codex-mul", prompt=[{"role": "user", "content": "What is 6 * 7?"}], label="42"
    )
    [result] = await collect(RelayedBackend(backend, relay), [rollout])
    await backend.aclose()
    check_solved(CODEX, result, tmp_path)
    answer = tmp_path / "out" / result.rollout_id / "artifacts" / "app" / "answer.txt"
    assert answer.read_text() == "42\n"


@pytest.mark.sandbox
@pytest.mark.parametrize("agent", AGENTS, ids=lambda a: a.name)
def test_backends_run_drives_a_node_agent_with_a_policy_script(
    agent: Agent, tmp_path: Path
) -> None:
    """The command line, as a user runs it: one Harbor task, Harbor's codex (or claude-code)
    class, the embedded scripted policy playing the repository's script, through the relay."""
    done = subprocess.run(
        [sys.executable, "-m", "backends.cli", "run", "-p", str(TASKS / "workdir-copy"),
         "-a", agent.name, "--policy-script", str(agent.script_path),
         "--run-dir", str(tmp_path / "run")],
        cwd=ROOT, env={**os.environ, "BACKENDS_HOME": str(tmp_path / "home")},
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["mean_reward"] == 1.0 and summary["policy_calls"] == agent.calls, summary
    assert "handshake" not in done.stderr  # Codex's websocket try is refused cleanly


# -- a Node runtime that cannot be built -------------------------------------------------------


def node_recipe(*packages: str) -> NodeRuntime:
    return NodeRuntime(
        name="node-broken",
        agent_class="backends.runtimes.agents:Codex",
        packages=packages,
        commands=("codex",),
        check="codex --version",
        version_of="@openai/codex",
    )


async def test_a_node_runtime_without_npm_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no npm on it
    with pytest.raises(RuntimeBuildError, match=r"built with npm, which is not installed"):
        await ensure_runtime(node_recipe("@openai/codex@0.171.0"), root=tmp_path / "runtimes")


async def test_a_node_runtime_without_the_registry_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Offline: the registry is a port nothing listens on, and npm's own cache is empty.
    monkeypatch.setenv("npm_config_registry", "http://127.0.0.1:9/")
    monkeypatch.setenv("npm_config_cache", str(tmp_path / "npm-cache"))
    monkeypatch.setenv("npm_config_fetch_retries", "0")
    with pytest.raises(
        RuntimeBuildError,
        match=r"(?s)downloading @openai/codex@0.171.0 and Node .* failed.*ECONNREFUSED",
    ):
        await ensure_runtime(node_recipe("@openai/codex@0.171.0"), root=tmp_path / "runtimes")
    assert not [p for p in (tmp_path / "runtimes").iterdir() if not p.name.endswith(".lock")]


async def test_a_node_package_without_the_command_is_refused(tmp_path: Path) -> None:
    # A real package with no `codex` command: nothing of it is linked or run.
    with pytest.raises(RuntimeBuildError, match=r"no 'codex' command after installing semver"):
        await ensure_runtime(node_recipe("semver@7.6.3"), root=tmp_path / "runtimes")


def local_package(folder: Path, postinstall: str) -> str:
    """A package of our own with one Node command, ``fake-tool``, and an install script."""
    folder.mkdir(parents=True)
    (folder / "package.json").write_text(
        json.dumps(
            {
                "name": "fake-tool",
                "version": "1.0.0",
                "bin": {"fake-tool": "cli.js"},
                "scripts": {"postinstall": postinstall},
            }
        )
    )
    (folder / "cli.js").write_text(
        "#!/usr/bin/env node\nconsole.log(`fake-tool on node ${process.version}`)\n"
    )
    return f"file:{folder}"


@pytest.mark.sandbox
async def test_a_packages_install_script_runs_offline_in_a_sandbox_never_on_the_host(
    tmp_path: Path,
) -> None:
    """The install script of a package runs, but in a sandbox that sees only the runtime: what
    it writes to /tmp stays there, the network is not there, and what it makes in its own
    folder is kept. The command runs on the runtime's own Node."""
    canary = Path("/tmp") / f"runtime-canary-{uuid.uuid4().hex}"
    script = (
        f"touch {canary}; "
        "if timeout 3 bash -c 'echo > /dev/tcp/1.1.1.1/80' 2>/dev/null; then echo online; "
        "else echo offline; fi > made-by-install.txt"
    )
    recipe = NodeRuntime(
        name="fake-tool",
        agent_class="backends.runtimes.agents:Codex",
        packages=(local_package(tmp_path / "pkg", script),),
        commands=("fake-tool",),
        check="fake-tool",
        version_of="fake-tool",
    )
    cache = Path(tempfile.mkdtemp(dir=cache_dir(), prefix="test-runtimes-"))
    runtime = await ensure_runtime(recipe, root=cache / "runtimes")
    try:
        assert not canary.exists()  # it ran, but not here
        made = runtime.path / "node_modules" / "fake-tool" / "made-by-install.txt"
        assert made.read_text() == "offline\n"
        assert made.stat().st_uid == 0  # given back to root: no sandbox uid owns the runtime
        done = await anyio.run_process([str(runtime.bin_dir / "fake-tool")])
        assert done.stdout.decode().strip() == f"fake-tool on node v{recipe.node}"
        assert runtime.manifest.packages["fake-tool"] == "1.0.0"
    finally:
        runtime.release()
        shutil.rmtree(cache)


@pytest.mark.sandbox
async def test_a_failing_install_script_is_refused_naming_it(tmp_path: Path) -> None:
    recipe = NodeRuntime(
        name="fake-tool",
        agent_class="backends.runtimes.agents:Codex",
        packages=(local_package(tmp_path / "pkg", "echo cannot >&2; exit 9"),),
        commands=("fake-tool",),
        check="fake-tool",
        version_of="fake-tool",
    )
    cache = Path(tempfile.mkdtemp(dir=cache_dir(), prefix="test-runtimes-"))
    try:
        with pytest.raises(
            RuntimeBuildError,
            match=r"(?s)install scripts of node_modules/fake-tool.*exit 9.*cannot",
        ):
            await ensure_runtime(recipe, root=cache / "runtimes")
    finally:
        shutil.rmtree(cache)
    # Outside the cache the sandbox's root could not write what the scripts make: refused.
    with pytest.raises(RuntimeBuildError, match=r"install scripts run in a sandbox"):
        await ensure_runtime(recipe, root=tmp_path / "runtimes")
