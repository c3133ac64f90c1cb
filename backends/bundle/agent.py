"""An ``AgentWorkflow`` as a Harbor agent: HarborBackend's ``agent=<AgentWorkflow>``.

``WorkflowPlan`` is what HarborBackend holds for such an agent: it builds the project's bundle
and installs it (both cached) at the backend's start, tells each trial what to bind and which
input to hand the runner (the prompt, metadata, rollout id and relay route; never the label),
and reads back the runner's output as the sample or the workflow's classified failure. The
host grades that sample as any template-mode sample (its ``Grader``, or the template's tests).
``BundleAgent`` is the Harbor ``BaseAgent`` a trial runs: it hands the input in, runs the
runner with the bundle's Python, and brings the output out.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import sys
import tempfile
import uuid
import weakref
from pathlib import Path
from typing import Any

import anyio
from harbor.agents.base import BaseAgent
from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.models.agent.context import AgentContext
from harbor.models.task.config import TaskConfig as HarborTaskConfig

from backends.bundle.build import Bundle, BundleError, build_bundle
from backends.bundle.environment import Environment, ensure_environment, image_platform
from backends.bundle.models import (
    MAX_PREVIEW_BYTES,
    PreviewSnapshot,
    RunnerInput,
    RunnerOutput,
    read_bounded,
)
from backends.bundle.warm import WarmRunner
from backends.rollout.errors import ErrorCategory, Phase, RolloutFailure
from backends.rollout.loading import load_object
from backends.rollout.request import RolloutRequest
from backends.rollout.route import PolicyRoute
from backends.rollout.sample import RolloutSample
from backends.rollout.workflow import AgentWorkflow
from backends.sandbox.forkserver import ForkServerUnavailable
from backends.sandbox.local import DEFAULT_RELAY_PORT, LocalSandbox
from backends.trajectory.preview import MAX_PREVIEW_STEPS

log = logging.getLogger(__name__)

BUNDLE_AGENT = "backends.bundle.agent:BundleAgent"
OUTPUT_FILE = "runner_output.json"
INPUT_FILE = "runner_input.json"
PREVIEW_FILE = "runner_preview.json"
PREVIEW_INTERVAL_SEC = 2.0
ARTIFACTS_DIR = "/logs/artifacts"  # Harbor collects it like any agent's artifacts
# PYTHONDONTWRITEBYTECODE: the environment is read-only and compiled already.
RUNNER_ENV = {"PYTHONDONTWRITEBYTECODE": "1"}


class BundleRunnerError(RuntimeError):
    """The in-sandbox runner itself failed (not the workflow, whose errors it reports)."""


class WorkflowPlan:
    """How HarborBackend runs one ``AgentWorkflow`` inside its trials' sandboxes."""

    def __init__(self, project: Path, entrypoint: str, workflow_config: str | None) -> None:
        self.project = project
        self.entrypoint = entrypoint
        self.workflow_config = workflow_config
        self.environment: Environment | None = None
        self.preview_interval_sec = PREVIEW_INTERVAL_SEC
        # Rollouts fork from a warm runner (the entrypoint imported once) when it can serve.
        self.fork_server = True
        self.warm: WarmRunner | None = None
        self._lock = anyio.Lock()
        self._key = uuid.uuid4().hex  # this plan's rollouts in the live-preview registry

    @classmethod
    def of(cls, agent: Any, *, workflow_config: Any = None) -> WorkflowPlan | None:
        """The plan for ``agent`` if it names an ``AgentWorkflow`` (class or ``"main.py:Cls"``).

        Returns ``None`` for anything else (Harbor agents). Raises ``BundleError`` for a
        workflow whose project cannot ship: no pyproject.toml beside its file, a config that is
        not a ``"file.py:name"`` reference.
        """
        if isinstance(agent, str) and ":" not in agent:
            return None  # a Harbor registry name
        try:
            workflow = load_object(agent)
        except ImportError:
            return None  # not ours to explain: Harbor's agent resolution reports it
        if not (isinstance(workflow, type) and issubclass(workflow, AgentWorkflow)):
            return None
        module = sys.modules.get(workflow.__module__)
        source = Path(getattr(module, "__file__", None) or ".").resolve()
        if workflow_config is not None and not isinstance(workflow_config, str):
            raise BundleError(
                "a workflow run in a sandbox takes workflow_config as a reference inside its "
                "project ('main.py:config'), not an object: it is loaded there"
            )
        plan = cls(source.parent, f"{source.name}:{workflow.__qualname__}", workflow_config)
        if not (plan.project / "pyproject.toml").is_file():
            raise BundleError(
                f"workflow {workflow.__qualname__} lives in {plan.project}, which has no "
                "pyproject.toml: a rollout project is main.py beside a pyproject.toml"
            )
        return plan

    @property
    def label(self) -> str:
        return f"workflow {self.project.name}/{self.entrypoint}"

    async def prepare(self, task_dir: Path) -> Environment:
        """Build the bundle and install it for the task's image, once (both cached on disk).

        Both stay held (the cache never prunes them) until ``close()``.
        """
        async with self._lock:
            if self.environment is None:
                task = HarborTaskConfig.model_validate_toml((task_dir / "task.toml").read_text())
                image_dir, image = task_dir / "environment", task.environment.docker_image
                platform = await image_platform(image_dir, image)
                bundle: Bundle = await anyio.to_thread.run_sync(
                    lambda: build_bundle(
                        self.project, entrypoint=self.entrypoint, platform=platform
                    )
                )
                try:
                    self.environment = await ensure_environment(
                        bundle,
                        environment_dir=image_dir,
                        docker_image=image,
                        entrypoint=self.entrypoint,
                    )
                except BaseException:
                    bundle.release()
                    raise
                if self.fork_server:
                    self.warm = _WARM[self._key] = WarmRunner(
                        self.environment,
                        entrypoint=self.entrypoint,
                        workflow_config=self.workflow_config,
                        image_dir=image_dir,
                        docker_image=image,
                        name=f"fork-server-{self._key[:8]}",
                    )
            return self.environment

    async def aclose(self) -> None:
        """End the warm runner, then ``close()``."""
        warm, self.warm = self.warm, None
        _WARM.pop(self._key, None)
        _RUNNABLE.difference_update({seen for seen in _RUNNABLE if seen[0] == self._key})
        if warm is not None:
            await warm.aclose()
        self.close()

    def close(self) -> None:
        """Let the cache prune this plan's bundle and environment again."""
        environment, self.environment = self.environment, None
        if environment is not None:
            environment.release()
            environment.bundle.release()

    def runner_input(self, request: RolloutRequest) -> RunnerInput:
        """The runner's input for ``request``: its route through the relay, never its label.

        Raises ``RolloutValidationError`` when the request is not relayed (the upstream key
        never enters a sandbox).
        """
        assert self.environment is not None, "prepare() first"
        route = PolicyRoute.of(request)
        return RunnerInput(
            rollout_id=request.rollout_id,
            project_dir=str(self.environment.bundle.project_dir),
            entrypoint=self.entrypoint,
            workflow_config=self.workflow_config,
            prompt=request.prompt,
            metadata=request.metadata,
            base_url=route.sandbox_base_url(forwarder_port=DEFAULT_RELAY_PORT),
            api_key=route.api_key,
            artifacts_dir=ARTIFACTS_DIR,
            preview_interval_sec=self.preview_interval_sec,
            preview_messages=MAX_PREVIEW_STEPS,
        )

    def agent_kwargs(self, request: RolloutRequest) -> dict[str, Any]:
        """``AgentConfig.kwargs`` for ``BundleAgent`` in ``request``'s trial."""
        assert self.environment is not None, "prepare() first"
        return {
            "runner_input": self.runner_input(request).model_dump(mode="json"),
            "python": str(self.environment.python),
            "live_key": f"{self._key}/{request.rollout_id}",
            "warm_key": self._key if self.warm is not None else None,
            "plan_key": self._key,
        }

    def live_context(self, rollout_id: str) -> LivePreview | None:
        """What the preview publisher reads of ``rollout_id`` while its workflow runs."""
        return _LIVE.get(f"{self._key}/{rollout_id}")

    def environment_kwargs(self, request: RolloutRequest, kwargs: dict[str, Any]) -> dict[str, Any]:
        """LocalSandbox kwargs for the trial: the environment and its Python bound in (read-only,
        outside /root: any agent user runs them), the relay's socket."""
        assert self.environment is not None, "prepare() first"
        binds = kwargs.get("extra_binds") or []
        if isinstance(binds, str):
            binds = [b for b in binds.split(",") if b]
        route = PolicyRoute.of(request)
        return {
            **kwargs,
            "extra_binds": [*binds, *self.environment.binds()],
            "relay_socket": str(route.relay_socket) if route.relay_socket else None,
            "relay_port": DEFAULT_RELAY_PORT,
        }

    def collect(self, trial_dir: Path) -> RolloutSample | RolloutFailure:
        """The runner's sample (reward and label cleared: the host grades), or the failure.

        No output at all is a failure, never a sample to grade as 0.
        """
        path = trial_dir / "agent" / OUTPUT_FILE
        try:
            output = RunnerOutput.model_validate_json(read_bounded(path))
        except FileNotFoundError:
            return _agent_failure(
                "the workflow runner left no output in the sandbox (it crashed, was killed or "
                "timed out): the rollout has no sample"
            )
        except (OSError, ValueError) as exc:
            return _agent_failure(f"the workflow runner's output is unusable: {exc}")
        if output.status == "failure" or output.sample is None:
            error = output.error
            if error is None:
                return _agent_failure("the workflow runner reported a failure without an error")
            text = f"{error.message}\n{error.traceback}".strip()
            return RolloutFailure(category=error.category, phase=Phase.AGENT, message=text)
        sample = output.sample
        sample.reward = None
        sample.label = None
        if output.info:
            sample.extra_fields.setdefault("workflow_info", output.info)
        return sample


class LivePreview:
    """A running workflow as the preview publisher sees a ``RolloutContext``.

    Its sample source reads the runner's latest preview out of the sandbox (bounded, and
    only what the runner wrote whole); the publisher redacts it with ``api_key``.
    """

    preview_enabled = True

    def __init__(self, environment: BaseEnvironment, path: str, api_key: str | None) -> None:
        self.environment = environment
        self.path = path
        self.api_key = api_key

    @property
    def sample_source(self) -> LivePreview:
        return self

    async def get_preview(self, max_messages: int) -> RolloutSample | None:
        with tempfile.TemporaryDirectory() as scratch:
            local = Path(scratch) / PREVIEW_FILE
            try:
                await self.environment.download_file(self.path, local)
                snapshot = PreviewSnapshot.model_validate_json(
                    read_bounded(local, MAX_PREVIEW_BYTES)
                )
            except (OSError, ValueError):  # none yet, or unusable: no preview this time
                return None
        return RolloutSample(messages=snapshot.messages[-max_messages:])


# Rollouts whose runner runs now, by "<plan key>/<rollout id>".
_LIVE: dict[str, LivePreview] = {}
# Plans' warm runners, by plan key; held by their plan alone, so a backend dropped unclosed
# takes its runner (and its sandbox) with it.
_WARM: weakref.WeakValueDictionary[str, WarmRunner] = weakref.WeakValueDictionary()
# (plan key, agent user) pairs seen running the environment: checked once, not per trial.
_RUNNABLE: set[tuple[str, str]] = set()


def _agent_failure(message: str) -> RolloutFailure:
    return RolloutFailure(category=ErrorCategory.AGENT_ERROR, phase=Phase.AGENT, message=message)


class BundleAgent(BaseAgent):
    """Runs the bundle's runner in the trial's sandbox (built by ``WorkflowPlan``)."""

    def __init__(
        self,
        logs_dir: Path,
        model_name: str | None = None,
        *args: Any,
        runner_input: dict[str, Any] | None = None,
        python: str = "",
        live_key: str | None = None,
        warm_key: str | None = None,
        plan_key: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(logs_dir, model_name, *args, **kwargs)
        if runner_input is None or not python:
            raise ValueError("BundleAgent is started by HarborBackend with agent=<AgentWorkflow>")
        self.runner_input = RunnerInput.model_validate(runner_input)
        self.python = python
        self.live_key = live_key
        self.warm_key = warm_key
        self.plan_key = plan_key

    @staticmethod
    def name() -> str:
        return "backends-bundle"

    def version(self) -> str:
        return "1"

    async def setup(self, environment: BaseEnvironment) -> None:
        if isinstance(environment, LocalSandbox):
            # HarborBackend bound the environment in (WorkflowPlan.environment_kwargs).
            await self._check_agent_user(environment)
            return
        result = await environment.exec(f"test -x {self.python}", user="root")
        if result.return_code != 0:
            raise BundleRunnerError(
                f"the bundle's environment ({self.python}) is not in the sandbox: HarborBackend "
                "binds it into local sandboxes only"
            )

    async def _check_agent_user(self, environment: BaseEnvironment) -> None:
        """A non-root agent user can start the environment's Python in the project: an image
        may close a folder the binds sit under (such as /var/cache, 0700) to that user. Once
        per plan and user (every trial of a plan has its task's image); root always can."""
        user = environment.default_user
        if user in (None, 0, "root"):
            return
        seen = (self.plan_key or self.python, str(user))
        if seen in _RUNNABLE:
            return
        probe = f"cd {shlex.quote(self.runner_input.project_dir)} && {self.python} -I -S -c ''"
        result = await environment.exec(probe)
        if result.return_code != 0:
            raise BundleRunnerError(
                f"the bundle's environment is in the sandbox, but the agent's user ({user}) "
                "cannot run it: a folder it is bound under is closed to that user "
                f"({(result.stderr or result.stdout or '').strip()[-500:]})"
            )
        _RUNNABLE.add(seen)

    async def run(
        self, instruction: str, environment: BaseEnvironment, context: AgentContext
    ) -> None:
        agent_dir = str(self.environment_logs_dir)
        spec = self.runner_input
        if self.live_key:
            spec = spec.model_copy(update={"preview_file": f"{agent_dir}/{PREVIEW_FILE}"})
            # The host may preview the rollout meanwhile.
            _LIVE[self.live_key] = LivePreview(
                environment, f"{agent_dir}/{PREVIEW_FILE}", self.runner_input.api_key
            )
        try:
            result = await self._run_forked(environment, spec)
            if result is None:
                result = await self._run_cold(environment, spec, agent_dir)
        finally:
            if self.live_key:
                _LIVE.pop(self.live_key, None)
        if not (self.logs_dir / OUTPUT_FILE).exists():
            # No output: WorkflowPlan.collect reports the missing sample.
            with contextlib.suppress(Exception):
                await environment.download_file(
                    f"{agent_dir}/{OUTPUT_FILE}", self.logs_dir / OUTPUT_FILE
                )
        if result.return_code != 0:
            detail = (result.stderr or result.stdout or "").strip()[-4000:]
            raise BundleRunnerError(f"the runner exited {result.return_code}: {detail}")

    async def _run_cold(
        self, environment: BaseEnvironment, spec: RunnerInput, agent_dir: str
    ) -> ExecResult:
        """The runner in a fresh interpreter: its input and output as files in the sandbox."""
        with tempfile.TemporaryDirectory() as scratch:
            local = Path(scratch) / INPUT_FILE
            local.write_text(spec.model_dump_json())
            await environment.upload_file(local, f"{agent_dir}/{INPUT_FILE}")
        files = f"{agent_dir}/{INPUT_FILE} {agent_dir}/{OUTPUT_FILE}"
        command = (
            f"cd {self.runner_input.project_dir} && {self.python} -m backends.bundle.runner run "
            f"{files}; status=$?; rm -f {agent_dir}/{INPUT_FILE}; exit $status"
        )
        return await environment.exec(command, env=RUNNER_ENV, user=None)

    async def _run_forked(
        self, environment: BaseEnvironment, spec: RunnerInput
    ) -> ExecResult | None:
        """The runner forked from the plan's warm runner, its input on its stdin and its output
        on its stdout (no transfer into or out of the sandbox); None when it cannot (run it
        cold)."""
        warm = _WARM.get(self.warm_key) if self.warm_key else None
        if warm is None or not isinstance(environment, LocalSandbox):
            return None
        servers = await warm.servers()
        if servers is None:
            return None
        argv = [self.python, "-m", "backends.bundle.runner", "run", "-", "-"]
        try:
            result = await environment.exec_forked(
                servers, argv, env=RUNNER_ENV, user=None, stdin=spec.model_dump_json().encode()
            )
        except ForkServerUnavailable as e:
            log.info("rollout runs cold: %s", e)
            return None
        if result.return_code == 0 and result.stdout:
            (self.logs_dir / OUTPUT_FILE).write_text(result.stdout)  # collect() checks it
            result.stdout = ""
        return result
