"""Harbor's installed agents, run from a prepared runtime instead of installing themselves.

``PreparedRuntimeAgent`` goes first in the bases of a subclass of Harbor's own agent class and
changes two things through Harbor's public agent API: ``install()`` only checks that the
runtime is in the sandbox (bound there read-only by HarborBackend), and every command the
agent runs (``exec_as_agent``) finds the runtime's tools first on its PATH, with the recipe's
variables. Everything else (the command line, the model connection, the trajectory and its
ATIF conversion) is Harbor's.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from harbor.agents.installed.base import BaseInstalledAgent
from harbor.agents.installed.claude_code import ClaudeCode as HarborClaudeCode
from harbor.agents.installed.codex import Codex as HarborCodex
from harbor.agents.installed.mini_swe_agent import MiniSweAgent as HarborMiniSweAgent
from harbor.agents.installed.opencode import OpenCode as HarborOpenCode
from harbor.environments.base import BaseEnvironment
from harbor.models.agent.context import AgentContext
from harbor.models.trajectories import Trajectory

from backends.bundle.models import read_bounded
from backends.runtimes.build import RuntimeManifest
from backends.sandbox.unpack import PARSED_FILE_LIMITS

# What the host reads of the trial's trajectories, which the sandbox wrote (the download
# refuses larger ones already, by name).
TRAJECTORY_LIMIT = PARSED_FILE_LIMITS["mini-swe-agent.trajectory.json"]


class RuntimeMissingError(RuntimeError):
    """The prepared runtime is not in the trial's sandbox."""


class PreparedRuntimeAgent(BaseInstalledAgent):
    """Put first in the bases, before Harbor's agent class; takes ``runtime_dir``."""

    def __init__(self, *args: Any, runtime_dir: str | None = None, **kwargs: Any) -> None:
        if not runtime_dir:
            raise ValueError(
                f"{type(self).__name__} runs from a prepared runtime: HarborBackend passes "
                "runtime_dir (use agent=<Harbor's name> there)"
            )
        self.runtime_dir = Path(runtime_dir)
        self.runtime = RuntimeManifest.load(runtime_dir)
        super().__init__(*args, **kwargs)
        if self.version() is None:
            self._version = self.runtime.version

    def get_version_command(self) -> str | None:
        return None  # known from the manifest; no command to run

    def _env_sources(self) -> tuple[Mapping[str, str], ...]:
        # Only what HarborBackend hands the agent (its env and its options'), never the
        # host's environment, where Harbor's classes also look for credentials to carry into
        # the sandbox (Claude Code's OAuth token, Codex's login file).
        return tuple(s for s in super()._env_sources() if s is not os.environ)

    @classmethod
    def resolve_model_connection_config(
        cls,
        model_name: str | None,
        resolve_env: Callable[..., tuple[str, str] | None],
        *,
        explicit_env: Mapping[str, str] | None = None,
        **options: Any,
    ) -> Any:
        # Harbor resolves the model connection (provider, auth, endpoint) from the agent's
        # env and then the host's, where CLAUDE_CODE_USE_BEDROCK or CODEX_FORCE_AUTH_JSON
        # would take every rollout off the relay: resolve from the agent's own env only.
        own = dict(explicit_env or {})

        def own_env(*names: str) -> tuple[str, str] | None:
            return next(((name, own[name]) for name in names if name in own), None)

        return super().resolve_model_connection_config(
            model_name, own_env, explicit_env=explicit_env, **options
        )

    async def install(self, environment: BaseEnvironment) -> None:
        tools = " ".join(
            shlex.quote(str(self.runtime_dir / "bin" / c)) for c in self.runtime.commands
        )
        # Each tool is there, and what they run on (the venv's Python, the runtime's Node)
        # starts.
        interpreter = shlex.quote(str(self.runtime_dir / self.runtime.interpreter))
        probe = (
            f'for t in {tools}; do test -x "$t" || exit 1; done; '
            f"exec {interpreter} --version >/dev/null"
        )
        if (await environment.exec(probe, user="root")).return_code != 0:
            raise RuntimeMissingError(
                f"the {self.runtime.name} runtime ({self.runtime_dir}) is not in this sandbox: "
                "HarborBackend binds it into local sandboxes only"
            )
        if (await environment.exec(probe)).return_code != 0:
            raise RuntimeMissingError(
                f"the {self.runtime.name} runtime is in the sandbox, but the agent's user "
                f"({environment.default_user}) cannot run it: a folder it is bound under is "
                "closed to that user"
            )

    async def exec_as_agent(
        self,
        environment: BaseEnvironment,
        command: str,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout_sec: int | None = None,
    ) -> Any:
        path = shlex.quote(str(self.runtime_dir / "bin"))
        return await super().exec_as_agent(
            environment,
            f'export PATH={path}:"$PATH"; {command}',
            # Read-only and compiled at build: no bytecode to write.
            env={**self.runtime.env, "PYTHONDONTWRITEBYTECODE": "1", **(env or {})},
            cwd=cwd,
            timeout_sec=timeout_sec,
        )


class MiniSweAgent(PreparedRuntimeAgent, HarborMiniSweAgent):
    """Harbor's mini-swe-agent, from the ``mini-swe-agent`` runtime.

    Harbor's ATIF conversion drops which tool call each observation answers, so the sample
    would show the tool results as user turns, which is not what the policy saw; the ids are
    put back from mini-swe-agent's own trajectory.
    """

    def populate_context_post_run(self, context: AgentContext) -> None:
        super().populate_context_post_run(context)
        atif, native = self.logs_dir / "trajectory.json", self._mini_swe_agent_trajectory_path
        try:
            trajectory = Trajectory.model_validate_json(read_bounded(atif, TRAJECTORY_LIMIT))
            messages = json.loads(read_bounded(self.logs_dir / native.name, TRAJECTORY_LIMIT))[
                "messages"
            ]
        except (OSError, ValueError, KeyError, TypeError):
            return  # no trajectory to mend (Harbor logged why)
        # The sandbox wrote that file: take from it only what has the expected shape.
        answers = [
            (m.get("content"), m["tool_call_id"])
            for m in (messages if isinstance(messages, list) else [])
            if isinstance(m, dict)
            and m.get("role") == "tool"
            and isinstance(m.get("tool_call_id"), str)
        ]
        if link_tool_results(trajectory, answers):
            atif.write_text(json.dumps(trajectory.to_json_dict(), indent=2))


def link_tool_results(trajectory: Trajectory, answers: list[tuple[Any, str]]) -> bool:
    """Give each observation its tool call's id: ``answers`` are the tool messages' (content,
    tool_call_id) in order, matched to the results in order by content (results from other
    turns, such as format-error feedback, keep none). True if any id was set."""
    pending = iter(answers)
    want = next(pending, None)
    changed = False
    for step in trajectory.steps:
        ids = {call.tool_call_id for call in step.tool_calls or []}
        for result in step.observation.results if step.observation else []:
            if want is None:
                return changed
            if result.source_call_id is None and result.content == want[0] and want[1] in ids:
                result.source_call_id = want[1]
                changed = True
                want = next(pending, None)
    return changed


# Codex's own settings for a sandbox with only the relay to reach: the relay's route as a
# Responses provider of its own (Codex's built-in OpenAI provider first tries a websocket,
# which the relay refuses, six times with backoff: 6.5 s a trial), and nothing to phone home
# (analytics, feedback and the update check each waited for a name lookup that never comes:
# 4.6 s). Harbor fills in the route's URL and key.
OFFLINE_CODEX_CONFIG: dict[str, Any] = {
    "model_provider": "relay",
    "model_providers": {
        "relay": {"name": "relay", "wire_api": "responses", "env_key": "OPENAI_API_KEY"}
    },
    "analytics": {"enabled": False},
    "feedback": {"enabled": False},
    "check_for_update_on_startup": False,
}


class Codex(PreparedRuntimeAgent, HarborCodex):
    """Harbor's codex, from the ``codex`` runtime, configured for the relay
    (``OFFLINE_CODEX_CONFIG``, unless the user passes a ``config`` of their own)."""

    def __init__(self, *args: Any, config: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, config=OFFLINE_CODEX_CONFIG if config is None else config, **kwargs)


class ClaudeCode(PreparedRuntimeAgent, HarborClaudeCode):
    """Harbor's claude-code, from the ``claude-code`` runtime.

    It speaks the Messages API, which the relay serves on the rollout's route, so its model is
    reached as an Anthropic one whatever provider the name gives (HarborBackend's default
    ``openai/`` would have Harbor point it at the route's OpenAI URL instead).
    """

    def __init__(self, *args: Any, model_name: str | None = None, **kwargs: Any) -> None:
        if model_name and "/" in model_name:
            model_name = "anthropic/" + model_name.partition("/")[2]
        super().__init__(*args, model_name=model_name, **kwargs)

    async def exec_as_agent(
        self,
        environment: BaseEnvironment,
        command: str,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout_sec: int | None = None,
    ) -> Any:
        # Harbor's run() copies these two from the host's environment: take them from the
        # agent's own env only.
        env = dict(env or {})
        for name in HOST_READ_CLAUDE_SETTINGS:
            env.pop(name, None)
            if (value := self._get_env(name)) is not None:
                env[name] = value
        return await super().exec_as_agent(
            environment, command, env=env, cwd=cwd, timeout_sec=timeout_sec
        )


HOST_READ_CLAUDE_SETTINGS = (
    "CLAUDE_CODE_MAX_OUTPUT_TOKENS",
    "CLAUDE_CODE_DISABLE_ADAPTIVE_THINKING",
)


class OpenCode(PreparedRuntimeAgent, HarborOpenCode):
    """Harbor's opencode, from the ``opencode`` runtime."""
