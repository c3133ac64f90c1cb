"""Real agents speaking other wire formats, offline in a sandbox, through the relay.

Codex (OpenAI's CLI agent) speaks only the Responses API; Claude Code only Anthropic Messages.
Both are pinned and installed by ``make setup`` (their npm packages ship native binaries). Each
runs in a no-network local sandbox with the relay's socket bound in, against the scripted
policy: the relay translates its calls to chat completions, the agent runs a real tool call and
reports back, and the trace holds each call with the policy's token ids.
"""

from __future__ import annotations

import os
import shlex
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from backends.relay import Grant, Relay
from backends.relay.scripted import Script, ScriptedPolicy

pytestmark = [pytest.mark.anyio, pytest.mark.sandbox]

# The folder the Makefile installs the pinned agents into.
AGENTS = (
    Path(__file__).resolve().parents[1]
    / ".venv" / "agents" / "codex-0.171.0+claude-code-2.1.197" / "node_modules"
)  # fmt: skip
TASK = "Create a file named hello.txt containing hi"
DONE = "Created hello.txt."


@dataclass(frozen=True)
class Agent:
    name: str
    api: str  # the wire format it speaks
    binary: Path  # its native executable, bound read-only at /opt/agent
    tool: str  # its shell tool, and the argument holding the command
    argument: str

    def command(self, base_url: str) -> str:
        if self.name == "codex":
            provider = (
                f'model_providers.relay={{name="relay", base_url="{base_url}", '
                'env_key="RELAY_TOKEN", wire_api="responses"}'
            )
            return (
                "/opt/agent/codex exec --skip-git-repo-check -c model_provider=relay "
                f"-c {shlex.quote(provider)} -c 'model=\"scripted\"' "
                # The sandbox is the wall; codex's own needs namespaces it cannot make here.
                f"--dangerously-bypass-approvals-and-sandbox {shlex.quote(TASK)}"
            )
        return f"/opt/agent/claude -p {shlex.quote(TASK)} --dangerously-skip-permissions"

    def env(self, grant: Grant, base_url: str) -> dict[str, str]:
        if self.name == "codex":
            return {"RELAY_TOKEN": grant.token, "CODEX_HOME": "/tmp/home"}
        return {
            # Anthropic clients add /v1/messages themselves; the token travels as x-api-key.
            "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"),
            "ANTHROPIC_API_KEY": grant.token,
            "ANTHROPIC_MODEL": "scripted",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "IS_SANDBOX": "1",  # lets it skip permission prompts as root
        }


CODEX = Agent(
    "codex",
    "responses",
    AGENTS / "@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex",
    "exec_command",
    "cmd",
)
CLAUDE_CODE = Agent(
    "claude-code",
    "messages",
    AGENTS / "@anthropic-ai/claude-code-linux-x64/claude",
    "Bash",
    "command",
)


def _script(agent: Agent) -> Script:
    call = {"name": agent.tool, "arguments": {agent.argument: "printf hi > hello.txt"}}
    return Script.model_validate(
        {"rules": [{"prompt": r"hello\.txt", "turns": [{"tool_calls": [call]}, {"content": DONE}]}]}
    )


@pytest.mark.parametrize("agent", [CODEX, CLAUDE_CODE], ids=lambda a: a.name)
async def test_a_real_agent_solves_a_task_offline_through_the_relay(
    agent: Agent, tmp_path: Path
) -> None:
    if os.geteuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("local sandboxes need root and bubblewrap")
    assert agent.binary.is_file(), f"{agent.name} is missing: run `make setup`"
    from harbor.models.task.config import EnvironmentConfig
    from harbor.models.trial.paths import TrialPaths

    from backends.sandbox.local import DEFAULT_RELAY_PORT, LocalSandbox

    sock = tmp_path / "relay" / "relay.sock"
    env_dir = tmp_path / "environment"
    env_dir.mkdir()
    trial_paths = TrialPaths(trial_dir=tmp_path / "trial")
    trial_paths.mkdir()
    async with (
        ScriptedPolicy(_script(agent)) as policy,
        Relay(upstream_url=policy.base_url, request_token_ids=True, unix_socket_path=sock) as relay,
    ):
        grant = relay.register(f"{agent.name}-1")
        sandbox = LocalSandbox(
            environment_dir=env_dir,
            environment_name=agent.name,
            session_id=f"{agent.name}__{uuid.uuid4().hex[:7]}__env",
            trial_paths=trial_paths,
            task_env_config=EnvironmentConfig(docker_image="debian:bookworm"),
            relay_socket=sock,
            network="none",
            extra_binds=[f"{agent.binary.parent}:/opt/agent:ro"],
        )
        await sandbox.start(force_build=False)
        try:
            base_url = grant.url_at(f"http://127.0.0.1:{DEFAULT_RELAY_PORT}")
            run = await sandbox.exec(
                f"mkdir -p /tmp/home /tmp/work && cd /tmp/work && {agent.command(base_url)} "
                "</dev/null",
                env={"HOME": "/tmp/home", **agent.env(grant, base_url)},
                timeout_sec=180,
            )
            assert run.return_code == 0, (run.stdout, run.stderr)
            assert DONE in run.stdout
            made = await sandbox.exec("cat /tmp/work/hello.txt")
            assert made.stdout == "hi"
            offline = await sandbox.exec("timeout 3 bash -c 'echo > /dev/tcp/1.1.1.1/80'")
            assert offline.return_code != 0  # no network: the relay was the only way out
        finally:
            await sandbox.stop(delete=True)
        trace = relay.end(grant.rollout_id)

    assert {(c.api, c.upstream_api, c.status) for c in trace.calls} == {
        (agent.api, "chat.completions", 200)
    }
    # The tool call, then the answer once the command's result came back as its tool result.
    ask, answer = [c for c in trace.calls if c.finish_reason in ("tool_calls", "stop")][-2:]
    assert ask.choices[0].message is not None
    (call,) = ask.choices[0].message["tool_calls"]
    assert call["function"]["name"] == agent.tool
    assert answer.request is not None
    result = answer.request["messages"][-1]
    assert result["role"] == "tool" and result["tool_call_id"] == call["id"]
    assert answer.choices[0].message == {"role": "assistant", "content": DONE}
    assert answer.completion_token_ids == [ord(c) for c in DONE]
    assert answer.logprobs is not None and len(answer.logprobs) == len(DONE)
    assert {c.rollout_id for c in policy.calls} == {grant.rollout_id}
