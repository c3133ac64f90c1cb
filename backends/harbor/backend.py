"""HarborBackend: each rollout is a Harbor trial in a fresh sandbox; its verifier gives the reward.

Two modes (the reference SDK's keywords, so porting is an import change):

* ``task_mode="dataset"``: ``tasks_dir`` holds many Harbor tasks and each request names one with
  ``metadata["harbor_task_id"]``; the task's own instruction, environment, verifier, steps and
  artifacts are used.
* ``task_mode="template"`` (default): ``tasks_dir`` is one task; each request's prompt becomes its
  instruction. The reward comes from the template's ``tests/``, or from ``grader`` on the host.

Harbor runs the trial unmodified (its ``Trial``, agents, verifier); our sandbox
(``backends.sandbox.local:LocalSandbox``) is the default environment. A rollout goes through the
shared phases (``backends.rollout.phases``): admit (which task, which instruction), provision
(Harbor loads the trial), run the agent (Harbor's trial: sandbox, agent, verifier), grade (the
verifier's reward, or the host grader's), finalize (artifacts, scrubbing, retention).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import anyio
import tenacity
from harbor.models.environment_type import EnvironmentType
from harbor.models.trial.config import EnvironmentConfig

from backends.bundle.agent import BUNDLE_AGENT, WorkflowPlan
from backends.fdlimit import raise_open_file_limit
from backends.harbor.agents import AgentSpec, resolve_agent
from backends.harbor.files import ArtifactSink, Retention
from backends.harbor.phases import TrialPhases, TrialSettings
from backends.harbor.tasks import has_tests, is_task_dir
from backends.rollout.artifacts import default_rollout_root
from backends.rollout.backend import CancelDisposition, Startup
from backends.rollout.config import GraderConfig
from backends.rollout.inflight import InFlight, Tracked
from backends.rollout.loading import load_object
from backends.rollout.phases import run_phases
from backends.rollout.request import RolloutRequest, RolloutResult, RolloutStatus
from backends.rollout.workflow import Grader
from backends.runtimes import ensure_runtime, runtime_for

LOCAL_SANDBOX = "backends.sandbox.local:LocalSandbox"
SKYPILOT_SANDBOX = "backends.sandbox.skypilot:SkyPilotSandbox"


def build_environment_config(environment: str, base: EnvironmentConfig | None) -> EnvironmentConfig:
    """The Harbor ``EnvironmentConfig`` trials run in.

    ``base`` (the user's ``environment_config``) is copied; when it names no environment
    itself, ``environment`` does: ``"local"``, ``"skypilot"``, any Harbor environment type
    (``"docker"``, ``"modal"``, ...) or an import path ``"module:Class"``. Harbor fills in
    ``type="docker"`` for a config naming neither, so docker in ``base`` counts only when it
    comes with ``environment="docker"``: ``environment_config=EnvironmentConfig(kwargs=...)``
    alone keeps the local sandbox.
    """
    config = base.model_copy(deep=True) if base is not None else EnvironmentConfig(type=None)
    if base is not None and (
        base.import_path is not None
        or (base.type is not None and base.type is not EnvironmentType.DOCKER)
    ):
        return config
    if environment == "local":
        return config.model_copy(update={"type": None, "import_path": LOCAL_SANDBOX})
    if environment == "skypilot":
        return config.model_copy(update={"type": None, "import_path": SKYPILOT_SANDBOX})
    if ":" in environment:
        return config.model_copy(update={"type": None, "import_path": environment})
    try:
        kind = EnvironmentType(environment)
    except ValueError:
        known = ", ".join(sorted(t.value for t in EnvironmentType))
        raise ValueError(
            f"environment {environment!r} is not 'local', 'skypilot', an import path "
            f"'module:Class' or a Harbor environment type ({known})"
        ) from None
    return config.model_copy(update={"type": kind, "import_path": None})


class HarborBackend:
    """An ``ExecutionBackend`` running each rollout as a Harbor trial.

    ``agent`` is any name in Harbor's agent registry (``"oracle"``, ``"nop"``,
    ``"terminus-2"``, ...) or a Harbor ``BaseAgent`` (class or ``"module:Class"``). Agents that
    call a model get the rollout's policy route: ``terminus-2`` (it runs on the host) its
    ``api_base`` and token; agents installed in the sandbox the route's environment variables,
    through the relay's socket or advertised URL, never the upstream key; a ``BaseAgent`` of
    your own the kwargs ``policy_base_url`` and ``policy_api_key`` (host side). ``model_name``
    defaults to ``openai/policy`` for those. ``native_agent_kwargs`` go to the agent as they
    are.

    ``environment`` picks the sandbox (``"local"`` by default). ``max_concurrent`` bounds
    trials running at once; ``max_queue_depth`` bounds those waiting for a slot, past which
    ``has_capacity()`` is false (the server answers 429). An infrastructure failure (a sandbox
    that would not start or stay healthy, agent setup, a sandbox lost mid-run) retries with a
    fresh sandbox, up to ``infra_attempts`` trials in all. Once the agent may have made policy
    calls, a retry also takes a fresh relay registration (under ``RelayedBackend``: a new
    token, the old one refused, the trace holding the retried attempt's calls alone);
    without a relay such a failure is returned as a retryable ``infra_error`` for the caller
    to resubmit. None of them is ever a reward. A sandbox ended by what ran inside it (its
    pid 1 exited, the OOM killer) is the agent's (or the tests') failure, not retried.

    Files: trials run in ``trials_dir`` (default ``$BACKENDS_HOME/trials``); a successful
    trial's directory is removed once collected (``cleanup_successful_trials``), failed ones
    stay up to ``keep_failed_trials`` directories and ``keep_failed_trials_mb`` MiB. Artifacts
    go to ``artifacts``, an fsspec URL (default: the rollouts directory, beside
    trajectory.json), under ``<rollout id>/artifacts/``.

    Verification: before the task's tests run, every process the agent left in the sandbox
    is killed (``end_agent_processes``), so a daemon it started cannot rewrite the reward the
    tests write or the tests themselves. Set it to False for tasks whose tests check a
    service the agent was asked to leave running.

    Raises ``ValueError`` at construction for anything that cannot work: an unknown agent, a
    ``tasks_dir`` of the wrong shape for the mode, a template with neither tests nor grader,
    an unknown environment.
    """

    def __init__(
        self,
        *,
        tasks_dir: Path | str,
        agent: str | type = "oracle",
        task_mode: str = "template",
        model_name: str | None = None,
        native_agent_kwargs: dict[str, Any] | None = None,
        grader: type[Grader] | str | None = None,
        grader_config: GraderConfig | str | None = None,
        workflow_config: Any = None,
        environment_config: EnvironmentConfig | None = None,
        environment: str = "local",
        trials_dir: Path | str | None = None,
        cleanup_successful_trials: bool = True,
        keep_failed_trials: int = 100,
        keep_failed_trials_mb: int = 1024,
        agent_setup_timeout_sec: float | None = None,
        max_concurrent: int | None = None,
        max_queue_depth: int | None = None,
        artifacts: str | Path | None = None,
        infra_attempts: int = 3,
        end_agent_processes: bool = True,
    ) -> None:
        if task_mode not in ("template", "dataset"):
            raise ValueError(f"task_mode must be 'template' or 'dataset', not {task_mode!r}")
        tasks = Path(tasks_dir).resolve()
        if not tasks.is_dir():
            raise ValueError(f"tasks_dir {tasks_dir} is not a directory")
        grader_cls = load_object(grader) if grader is not None else None
        if grader_cls is not None and not (
            isinstance(grader_cls, type) and issubclass(grader_cls, Grader)
        ):
            raise ValueError(f"grader must be a Grader subclass, got {grader_cls!r}")
        if task_mode == "template":
            _check_template(tasks, grader_cls)
        elif is_task_dir(tasks):
            raise ValueError(
                f"tasks_dir {tasks_dir} is one Harbor task; dataset mode needs a directory of "
                "tasks (or use task_mode='template')"
            )
        elif grader_cls is not None:
            raise ValueError("dataset mode grades with each task's own tests: drop grader=")
        # agent=<AgentWorkflow>: it runs inside the sandbox from a rollout bundle.
        workflow = WorkflowPlan.of(agent, workflow_config=workflow_config)
        if workflow is not None and task_mode != "template":
            raise ValueError("an AgentWorkflow runs in template mode (one image for its bundle)")
        if workflow_config is not None and workflow is None:
            raise ValueError(
                "workflow_config configures an AgentWorkflow; pass native_agent_kwargs for a "
                "Harbor agent"
            )
        for name, value, low in (
            ("max_concurrent", max_concurrent, 1),
            ("max_queue_depth", max_queue_depth, 0),
            ("infra_attempts", infra_attempts, 1),
        ):
            if value is not None and value < low:
                raise ValueError(f"{name} must be >= {low}, not {value}")
        self.agent: AgentSpec = (
            AgentSpec(import_path=BUNDLE_AGENT) if workflow else resolve_agent(agent)
        )
        self.environment = build_environment_config(environment, environment_config)
        if self.agent.runtime is not None and not _is_local_sandbox(self.environment):
            raise ValueError(
                f"agent {self.agent.label!r} runs from a runtime prepared on this host and "
                "bound into local sandboxes; this environment cannot bind it. A remote sandbox "
                "needs an image with the runtime built in at the same path, which this version "
                "does not build; or pass Harbor's own class by import path "
                "(harbor.agents.installed...:Class) to let it install itself, with network"
            )
        self.settings = TrialSettings(
            tasks_dir=tasks,
            task_mode=task_mode,
            agent=self.agent,
            model_name=model_name,
            native_agent_kwargs=dict(native_agent_kwargs or {}),
            environment=self.environment,
            trials_dir=Path(trials_dir)
            if trials_dir is not None
            else default_rollout_root().parent / "trials",
            agent_setup_timeout_sec=agent_setup_timeout_sec,
            grader=grader_cls,
            grader_config=load_object(grader_config),
            sink=ArtifactSink(artifacts if artifacts is not None else default_rollout_root()),
            retention=Retention(
                keep_successful=not cleanup_successful_trials,
                max_failed=keep_failed_trials,
                max_failed_mb=keep_failed_trials_mb,
            ),
            local_sandbox=_is_local_sandbox(self.environment),
            remote_sandbox=self.environment.import_path == SKYPILOT_SANDBOX,
            workflow=workflow,
            end_agent_processes=end_agent_processes,
        )
        self.tasks_dir = tasks
        self.task_mode = task_mode
        self.max_concurrent = max_concurrent
        self.max_queue_depth = max_queue_depth
        self.infra_attempts = infra_attempts
        self._limiter = anyio.CapacityLimiter(max_concurrent) if max_concurrent else None
        self._in_flight = InFlight()
        self._drained: anyio.Event | None = None  # set when aclose() may return
        self.start = Startup(self._warm_up)

    @property
    def trials_dir(self) -> Path:
        return self.settings.trials_dir

    @property
    def artifacts_root(self) -> Path | None:
        """Where ``backends run`` saves trajectories: beside the artifacts, when they are local."""
        return self.settings.sink.local_root

    @artifacts_root.setter
    def artifacts_root(self, root: Path | str) -> None:
        # `backends run` moves a backend left on the default root into its run directory.
        self.settings.sink = ArtifactSink(root)

    async def _warm_up(self) -> None:
        """Pay one-time costs before the first rollout: the agent's module (for terminus-2,
        Harbor's LiteLLM, about 7 s), LiteLLM's offline model map, reaping the local
        sandboxes (or SkyPilot sandboxes) of a killed earlier run, and building the agent's
        runtime the first time on this host (mini-swe-agent's: about a minute, once)."""
        # LiteLLM fetches its model cost map from the network at import unless told not to.
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        raise_open_file_limit()  # each sandbox and relayed connection holds fds of this process
        await anyio.to_thread.run_sync(self.settings.agent_class)
        if self.settings.local_sandbox:
            # Sandboxes a killed orchestrator left behind go now, not at the first trial.
            from backends.sandbox.runtime import reap_orphans

            await anyio.to_thread.run_sync(reap_orphans)
        if self.settings.remote_sandbox:
            # The SDK and its API server are checked now, and a crashed run's pods reaped.
            from backends.sandbox.skypilot import reap_dead_runs

            await anyio.to_thread.run_sync(reap_dead_runs)
        if self.settings.workflow is not None:  # the bundle, built and installed once
            await self.settings.workflow.prepare(self.tasks_dir)
        recipe = runtime_for(self.agent.runtime)
        if recipe is not None and self.settings.runtime is None:  # built once per host
            self.settings.runtime = await ensure_runtime(recipe)

    # -- the backend contract -------------------------------------------------------------

    def has_capacity(self) -> bool:
        # Rollouts past the running ones wait for a slot; max_queue_depth bounds how many.
        if self.max_queue_depth is None:
            return True
        in_flight = self._in_flight.counts()["in_flight"]
        return in_flight < (self.max_concurrent or 0) + self.max_queue_depth

    def status(self, rollout_id: str) -> RolloutStatus | None:
        return self._in_flight.status(rollout_id)

    def cancel(
        self, ids: Iterable[str] | None = None, prefix: str | None = None, all: bool = False
    ) -> dict[str, CancelDisposition]:
        return self._in_flight.cancel(ids=ids, prefix=prefix, all=all)

    def rollout_context(self, rollout_id: str) -> Any:
        """A running in-sandbox workflow's live preview source, for the server's previews."""
        workflow = self.settings.workflow
        return workflow.live_context(rollout_id) if workflow is not None else None

    def health(self) -> dict[str, Any]:
        return {
            "backend": "harbor",
            "task_mode": self.task_mode,
            "agent": self.agent.label,
            **self._in_flight.counts(),
            "max_concurrent": self.max_concurrent,
            "max_queue_depth": self.max_queue_depth,
        }

    async def aclose(self) -> None:
        """Cancel every rollout; return once each one's sandbox is stopped."""
        self.cancel(all=True)
        if self._in_flight.counts()["in_flight"]:
            self._drained = anyio.Event()
            await self._drained.wait()
        if self.settings.workflow is not None:  # its warm runner ends; its bundle may go
            await self.settings.workflow.aclose()
        runtime, self.settings.runtime = self.settings.runtime, None
        if runtime is not None:  # likewise its agent's runtime
            runtime.release()
        if self.settings.remote_sandbox:  # creates still in flight end, unwanted pods go
            from backends.sandbox import skybatch

            await skybatch.aclose()

    async def execute(self, request: RolloutRequest) -> RolloutResult:
        await self.start()
        try:
            return await self._in_flight.run(
                request, lambda tracked: self._attempts(request, tracked)
            )
        finally:
            if self._drained is not None and not self._in_flight.counts()["in_flight"]:
                self._drained.set()

    async def _attempts(self, request: RolloutRequest, tracked: Tracked) -> RolloutResult:
        """Run the rollout's trial; retry an infrastructure failure with a fresh sandbox.

        After the agent may have called the policy, a retry needs a fresh relay registration
        too (the route's ``renew``), so the trace holds the retried attempt's calls alone;
        without one the failure is returned, retryable, for the caller to resubmit.
        """
        failures: list[str] = []
        current = request
        renew_first = False

        async def attempt() -> tuple[RolloutResult, bool]:
            nonlocal current, renew_first
            route = current.policy_route
            if renew_first and route is not None and route.renew is not None:
                current = (await route.renew()).onto(current)
            phases = TrialPhases(self.settings, current, tracked, len(failures) + 1)
            result = phases.complete(await run_phases(phases, limiter=self._limiter))
            renewable = route is not None and route.renew is not None
            retry = bool(
                result.failure and result.failure.retryable and (phases.retry_is_fresh or renewable)
            )
            renew_first = not phases.retry_is_fresh
            if retry and result.failure:
                failures.append(result.failure.message)
            return result, retry

        retrying = tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(self.infra_attempts),
            retry=tenacity.retry_if_result(lambda outcome: outcome[1]),
            wait=tenacity.wait_exponential(multiplier=0.2, max=5),
            retry_error_callback=_last_attempt,
            reraise=True,
        )
        outcome: tuple[RolloutResult, bool] = await retrying(attempt)
        result, retried_last = outcome
        earlier = failures[:-1] if retried_last else failures
        if earlier:
            # Counted; the sample (and the relay trace) are the last attempt's alone.
            result.extra_fields["infra_retries"] = {"count": len(earlier), "failures": earlier}
        return result


def _check_template(task_dir: Path, grader: type[Grader] | None) -> None:
    if not is_task_dir(task_dir):
        raise ValueError(
            f"template mode needs tasks_dir to be one Harbor task (with task.toml); "
            f"{task_dir} has none (for a directory of tasks use task_mode='dataset')"
        )
    if (task_dir / "steps").is_dir():
        raise ValueError(f"template {task_dir} has steps: template mode takes a single-step task")
    if has_tests(task_dir) and grader is not None:
        raise ValueError(
            f"template {task_dir} has tests/test.sh and a grader was given: pick one reward "
            "source (drop grader=, or use a template without tests)"
        )
    if not has_tests(task_dir) and grader is None:
        raise ValueError(
            f"template {task_dir} has no tests/test.sh and no grader= was given, so nothing "
            "would give a reward"
        )


def _is_local_sandbox(config: EnvironmentConfig) -> bool:
    if config.import_path is None:
        return False
    if config.import_path == LOCAL_SANDBOX:
        return True
    try:
        cls = load_object(config.import_path)
    except ImportError as exc:
        raise ValueError(f"environment {config.import_path!r} cannot be loaded: {exc}") from exc
    from backends.sandbox.local import LocalSandbox

    return isinstance(cls, type) and issubclass(cls, LocalSandbox)


def _last_attempt(state: tenacity.RetryCallState) -> tuple[RolloutResult, bool]:
    # Out of attempts: report the last one's failure (not tenacity's RetryError).
    assert state.outcome is not None
    return state.outcome.result()


__all__ = ["HarborBackend", "build_environment_config"]
