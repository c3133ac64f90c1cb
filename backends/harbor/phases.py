"""One Harbor trial as the shared rollout phases (``backends.rollout.phases``).

    admit       which task (dataset mode: ``metadata["harbor_task_id"]``) and which instruction
                (template mode: the prompt); a model-driven agent needs a policy route
    provision   Harbor loads the task and builds the trial (nothing runs yet)
    run_agent   Harbor's ``Trial.run``: sandbox, healthcheck, agent setup, agent, verifier
    grade       the verifier's reward, or the host ``Grader``'s (templates without tests)
    finalize    secrets scrubbed from the trial's files, artifacts to the sink, retention

Harbor's trial reports every failure as an exception name with timings; ``outcome_of`` maps it
to our category and phase once. The driver would put any failure raised from ``run_agent`` in
the agent phase, so ``complete`` restores the phase the trial itself recorded.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from harbor.agents.base import BaseAgent
from harbor.agents.factory import AgentFactory
from harbor.agents.installed.base import BaseInstalledAgent
from harbor.models.task.verifier_mode import VerifierEnvironmentMode, resolve_task_verifier_mode
from harbor.models.trial.config import (
    AgentConfig,
    EnvironmentConfig,
    TaskConfig,
    TrialConfig,
    VerifierConfig,
)
from harbor.models.trial.paths import EnvironmentPaths
from harbor.trial.hooks import TrialEvent, TrialHookEvent
from harbor.trial.trial import Trial
from harbor.utils.env import is_sensitive_env_key

from backends.bundle.agent import WorkflowPlan
from backends.harbor.agent_logs import convert_off_the_loop
from backends.harbor.agents import AgentSpec
from backends.harbor.files import (
    ArtifactSink,
    Retention,
    drop_unreachable,
    drop_unscannable,
    scrub_secrets,
)
from backends.harbor.outcome import TrialOutcome, outcome_of
from backends.harbor.sample import build_sample, phase_timings
from backends.harbor.tasks import TASK_ID_KEY, render_instruction, resolve_task_id
from backends.harbor.trial import create_trial, forget_loggers, run_to_end
from backends.rollout.errors import (
    ErrorCategory,
    Phase,
    RolloutError,
    RolloutFailure,
    RolloutValidationError,
    describe,
)
from backends.rollout.inflight import Tracked
from backends.rollout.phases import RolloutPhases
from backends.rollout.request import RolloutRequest, RolloutResult, RolloutStatus
from backends.rollout.route import PolicyRoute
from backends.rollout.sample import RolloutSample
from backends.rollout.user_code import fresh_config, grade_sample
from backends.rollout.workflow import Grader
from backends.runtimes.build import Runtime
from backends.sandbox.local import TRANSFER_TIMEOUT_SEC, LocalSandbox

log = logging.getLogger(__name__)

# The model a model-driven agent asks for when none is given: LiteLLM's OpenAI-compatible
# provider, which sends it to the route's base URL as "policy".
DEFAULT_MODEL = "openai/policy"
RELAY_PORT = 18080  # the in-sandbox forwarder's port (LocalSandbox's default)

# terminus-2 options for training: token ids and logprobs collected, no summarization (it
# would fork the token trajectory), its trajectory holding the model's raw answers (so each
# agent step matches its relay call), no terminal recording.
TERMINUS_DEFAULTS: dict[str, Any] = {
    "collect_rollout_details": True,
    "enable_summarize": False,
    "trajectory_config": {"raw_content": True, "linear_history": True},
    "record_terminal_session": False,
}


@dataclass
class TrialSettings:
    """What every trial of one HarborBackend shares."""

    tasks_dir: Path
    task_mode: str
    agent: AgentSpec
    model_name: str | None
    native_agent_kwargs: dict[str, Any]
    environment: EnvironmentConfig
    trials_dir: Path
    agent_setup_timeout_sec: float | None
    grader: type[Grader] | None
    grader_config: Any
    sink: ArtifactSink
    retention: Retention
    local_sandbox: bool
    remote_sandbox: bool = False  # a SkyPilot pod: told the relay's advertised URL
    workflow: WorkflowPlan | None = None  # agent=<AgentWorkflow>, run from its bundle
    runtime: Runtime | None = None  # the agent's prepared runtime (set at the backend's start)
    end_agent_processes: bool = True
    active_trials: set[str] = field(default_factory=set)
    _agent_class: type[BaseAgent] | None = None

    def agent_class(self) -> type[BaseAgent]:
        """The agent's class (imported once: terminus-2 brings Harbor's LiteLLM, ~7 s)."""
        if self._agent_class is None:
            self._agent_class = AgentFactory.get_agent_class_from_config(
                AgentConfig(**self.agent.harbor_config())
            )
        return self._agent_class


class TrialFailed(RolloutError):
    """A trial ended without a usable reward; ``failure`` says where and why."""

    def __init__(self, failure: RolloutFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


def _trial_name(rollout_id: str, attempt: int) -> str:
    """A directory name of its own for each (rollout id, attempt).

    Ids that are not already a short, safe name are shortened and sanitized, then told apart
    by a hash of the whole id; "~" never survives sanitizing, so no id's name can collide
    with another's, or with a retry's.
    """
    name = re.sub(r"[^A-Za-z0-9._-]", "_", rollout_id[:200])
    if name != rollout_id or name in (".", ".."):
        name = f"{name}~{hashlib.sha256(rollout_id.encode()).hexdigest()[:16]}"
    return name if attempt == 1 else f"{name}~attempt-{attempt}"


# Kills every process in the sandbox but pid 1 and itself, until none is left (a fork loop
# can outrun one `kill -1`); exits 1 if some survive.
_END_AGENT_PROCESSES = (
    "for ((i = 0; i < 50; i++)); do kill -KILL -1 2>/dev/null; left=0; "
    "for p in /proc/[0-9]*; do p=${p#/proc/}; [[ $p == 1 || $p == $$ ]] || ((left++)); done; "
    "((left == 0)) && exit 0; sleep 0.02; done; exit 1"
)

# What grading starts from, whatever the agent left there: an empty /tests for the tests'
# upload (a file at /tests would fail it, which Harbor counts as the sandbox's failure and
# retries) and an empty /logs/verifier (a tree too deep to download, or planted rewards).
_GRADING_DIRS = {
    str(EnvironmentPaths.tests_dir): 0o755,
    str(EnvironmentPaths.verifier_dir): 0o777,
}
_EMPTY_GRADING_DIRS = (
    "".join(
        f"rm -rf -- {d} && mkdir -p -- {d} && chmod {mode:o} {d} && "
        for d, mode in _GRADING_DIRS.items()
    )
    + "true"
)


class TrialPhases(RolloutPhases):
    """One attempt at one rollout: one Harbor trial."""

    no_reward_message = "the verifier produced no reward"

    def __init__(
        self, settings: TrialSettings, request: RolloutRequest, tracked: Tracked, attempt: int
    ) -> None:
        # Harbor enforces the agent timeout itself, on the agent's run alone, and still grades
        # an agent that ran out of time (its reward is a valid measurement): the driver's
        # deadline, which would also count the sandbox start and the verifier, stays off.
        super().__init__(request.model_copy(update={"agent_timeout_sec": None}), tracked)
        self.settings = settings
        self.agent_timeout_sec = request.agent_timeout_sec
        self.attempt = attempt
        self.trial_name = _trial_name(request.rollout_id, attempt)
        self.trial_dir = settings.trials_dir / self.trial_name
        self.task_dir = settings.tasks_dir
        self.instruction = ""
        self.trial: Trial | None = None
        self.outcome: TrialOutcome | None = None
        self.succeeded = False
        self.survivors = False  # some agent process outlived the kill before verification
        self.timings: dict[str, float] = {}

    @property
    def retry_is_fresh(self) -> bool:
        """Whether a retry starts clean: no policy call can have been made by this attempt."""
        if not self.settings.agent.calls_model:
            return True
        return self.outcome is None or self.outcome.stage in ("environment", "agent_setup")

    # -- the phases ------------------------------------------------------------------------

    def admit(self) -> None:
        request = self.request
        if self.settings.task_mode == "dataset":
            task_id = (request.metadata or {}).get(TASK_ID_KEY)
            self.task_dir = resolve_task_id(self.settings.tasks_dir, task_id)
        else:
            self.instruction = render_instruction(request.prompt)
            if not self.instruction.strip():
                raise RolloutValidationError(
                    "template mode needs a prompt: the request's messages become the instruction"
                )
            if self.settings.grader is not None and request.grade and request.label is None:
                raise RolloutValidationError(
                    "grading was requested but the request has no label for the grader"
                )
        agent = self.settings.agent
        # Harbor's model-driven agents need a route; an agent of the user's own may not call one.
        if agent.name is not None and agent.calls_model and self.route.base_url is None:
            raise RolloutValidationError(
                f"agent {self.settings.agent.label!r} calls a model, but the request names no "
                "policy endpoint: run it through the relay (RelayedBackend, `backends run`, "
                "the server's relay) or set chat_completions_url"
            )

    async def provision(self) -> None:
        self.settings.active_trials.add(self.trial_name)
        try:
            config = self._trial_config()
            self.trial = await create_trial(config)
        except RolloutValidationError:
            raise
        except Exception as exc:  # a task Harbor cannot load, a sandbox refusing the task
            raise RolloutValidationError(
                f"Harbor cannot set up a trial of {self.task_dir.name}: {describe(exc)}"
            ) from exc
        task = self.trial.task
        if self.settings.task_mode == "template":
            # The request's prompt is the instruction; the template's own text, if any, follows
            # it (where to put the answer, say).
            task.instruction = "\n\n".join(
                t for t in (self.instruction, task.instruction.strip()) if t
            )
        self.instruction = task.instruction
        for event in (
            TrialEvent.ENVIRONMENT_START,
            TrialEvent.AGENT_START,
            TrialEvent.VERIFICATION_START,
        ):
            self.trial.add_hook(event, self._bound_transfers)
        self.trial.add_hook(TrialEvent.AGENT_END, self._convert_agent_logs)
        self.trial.add_hook(TrialEvent.VERIFICATION_START, self._grading)
        self.trial.add_hook(TrialEvent.END, self._before_harbors_scrub)

    async def _bound_transfers(self, event: TrialHookEvent) -> None:
        """Let each upload or download take no longer than the phase starting may.

        Harbor's transfers run outside its timeouts, and root in the sandbox decides what
        its `tar` does: stalled, each would hold the trial (and its slot) for half an hour.
        """
        trial = self.trial
        if trial is None or not isinstance(trial.agent_environment, LocalSandbox):
            return
        budget: float | None
        if event.event is TrialEvent.ENVIRONMENT_START:
            budget = max(trial.environment_build_timeout_sec, trial.agent_setup_timeout_sec)
        elif event.event is TrialEvent.AGENT_START:
            budget = trial.agent_timeout_sec
        else:
            budget = trial.verifier_timeout_sec
        if budget:
            trial.agent_environment.transfer_timeout_sec = min(budget, TRANSFER_TIMEOUT_SEC)

    async def _convert_agent_logs(self, event: TrialHookEvent) -> None:
        if self.trial is not None:  # Harbor would convert them next, on the loop
            await convert_off_the_loop(self.trial)

    async def _grading(self, event: TrialHookEvent) -> None:
        self.tracked.status = RolloutStatus.GRADING
        if (
            self.settings.end_agent_processes
            and self.trial is not None
            # A separate verifier environment has no agent processes in it.
            and resolve_task_verifier_mode(self.trial.task.config)
            is not VerifierEnvironmentMode.SEPARATE
        ):
            # A daemon the agent left could rewrite the reward the tests write, or the tests.
            environment = self.trial.agent_environment
            if isinstance(environment, LocalSandbox):
                ended = await environment.end_processes()  # from the host: no command
                if ended:
                    await environment.replace_dirs(_GRADING_DIRS)
            else:
                result = await environment.exec(_END_AGENT_PROCESSES, user="root", timeout_sec=30)
                ended = result.return_code == 0
                if ended:  # as Harbor does between the steps of a multi-step task
                    await environment.empty_dirs([EnvironmentPaths.verifier_dir], chmod=True)
                    await environment.empty_dirs([EnvironmentPaths.tests_dir], chmod=False)
            # A survivor could still rewrite the reward: the verdict is not the tests'.
            self.survivors = not ended

    async def _before_harbors_scrub(self, event: TrialHookEvent) -> None:
        # Harbor's own scrub, right after this event, reads every text file of the trial
        # whole when an env it passes holds a sensitive key (a judge's key in
        # [verifier.env]); the sandbox wrote those files and may have made them huge.
        if self.trial is not None and _harbor_scrubs(self.trial):
            await anyio.to_thread.run_sync(drop_unscannable, self.trial_dir)

    async def run_agent(self) -> RolloutSample:
        assert self.trial is not None
        result = await run_to_end(self.trial)
        self.outcome = outcome = outcome_of(result, verifier_expected=self._task_verifies)
        self.timings = phase_timings(result)
        if self.survivors:
            failure = RolloutFailure(
                category=ErrorCategory.INFRA_ERROR,
                phase=Phase.GRADING,
                message="processes the agent left survived the kill before verification, "
                "so the reward cannot be trusted",
            )
            self.outcome = TrialOutcome(failure=failure, retryable=True, stage="verifier")
            raise TrialFailed(failure)
        steps = [s.name for s in self.trial.task.config.steps or []]
        sample = await anyio.to_thread.run_sync(
            lambda: build_sample(
                result, outcome, self.trial_dir, instruction=self.instruction, step_names=steps
            )
        )
        if self.settings.workflow is not None and outcome.failure is None:
            # The workflow's own sample (or its classified traceback), from the runner.
            collected = await anyio.to_thread.run_sync(
                self.settings.workflow.collect, self.trial_dir
            )
            if isinstance(collected, RolloutFailure):
                self.outcome = TrialOutcome(failure=collected, stage="agent")
                raise TrialFailed(collected)
            collected.metrics = {**sample.metrics, **collected.metrics}
            sample = collected
        sample.reward = None  # set in grade(), if grading was asked for
        self.extra_fields["harbor"] = {
            "trial_name": self.trial_name,
            "task": self.trial.task.name,
            "attempt": self.attempt,
            "exception_type": outcome.exception_type,
        }
        if outcome.failure is not None and outcome.stage != "verifier":
            raise TrialFailed(outcome.failure)
        return sample

    async def grade(self, sample: RolloutSample) -> None:
        assert self.outcome is not None
        if self.outcome.failure is not None:
            raise TrialFailed(self.outcome.failure)
        if self.settings.grader is not None:
            grader = self.settings.grader(config=fresh_config(self.settings.grader_config))
            await grade_sample(
                grader,
                sample,
                label=self.request.label,
                metadata=self.request.metadata,
                artifacts_dir=self.trial_dir / "artifacts",
            )
        else:
            sample.reward = self.outcome.reward
        self.succeeded = sample.reward is not None or sample.remove_sample

    async def finalize(self) -> None:
        if self.trial is not None:
            forget_loggers(self.trial)
        secrets = [self.request.api_key, self.route.api_key]
        stored = await anyio.to_thread.run_sync(self._finish_files, secrets)
        self.extra_fields.setdefault("harbor", {})["artifacts"] = stored

    # -- helpers -----------------------------------------------------------------------------

    @property
    def _task_verifies(self) -> bool:
        return self.request.grade and self.settings.grader is None

    def _trial_config(self) -> TrialConfig:
        settings = self.settings
        # Never auto_mounting by default: a bound /logs lets the sandbox plant symlinks and
        # sparse files that Harbor then reads (or writes) on the host as root; downloads are
        # the checked, bounded path.
        environment = settings.environment.model_copy(deep=True)
        return TrialConfig(
            task=TaskConfig(path=self.task_dir),
            trial_name=self.trial_name,
            trials_dir=settings.trials_dir,
            agent=self._agent_config(environment),
            environment=environment,
            verifier=VerifierConfig(
                override_timeout_sec=self.request.grader_timeout_sec,
                disable=not self._task_verifies,
            ),
        )

    def _agent_config(self, environment: EnvironmentConfig) -> AgentConfig:
        """The agent, wired to the rollout's policy route when it calls a model."""
        settings = self.settings
        if settings.workflow is not None:
            environment.kwargs = settings.workflow.environment_kwargs(
                self.request, environment.kwargs
            )
            return AgentConfig(
                import_path=settings.agent.import_path,
                kwargs=settings.workflow.agent_kwargs(self.request),
                override_timeout_sec=self.agent_timeout_sec,
                override_setup_timeout_sec=settings.agent_setup_timeout_sec,
            )
        kwargs = copy.deepcopy(settings.native_agent_kwargs)
        env: dict[str, str] = {}
        model = settings.model_name
        base_url: str | None = None
        route = self.route
        if settings.agent.calls_model and route.base_url is not None:
            model = model or DEFAULT_MODEL
            if issubclass(settings.agent_class(), BaseInstalledAgent):
                env = _sandbox_environment(route, environment, settings)
            elif settings.agent.name == "terminus-2":
                # Host-side LiteLLM: the relay's host URL, the rollout's token as its key
                # (scrubbed from the trial's files in finalize).
                kwargs = {**TERMINUS_DEFAULTS, **kwargs, "api_base": route.base_url}
                kwargs["llm_kwargs"] = {
                    **kwargs.get("llm_kwargs", {}),
                    "api_key": route.api_key or "none",
                }
            elif settings.agent.name is not None:
                base_url = route.base_url  # Harbor's other host-side agents take it as is
            else:
                # An agent of the user's own: the route as two kwargs it may read (Harbor
                # drops kwargs an agent does not declare).
                kwargs = {
                    **kwargs,
                    "policy_base_url": route.base_url,
                    "policy_api_key": route.api_key,
                }
        if settings.agent.runtime is not None:
            # Bound in read-only instead of Harbor's install (prepared at the backend's start).
            assert settings.runtime is not None, "the backend's start() prepares the runtime"
            environment.kwargs = settings.runtime.sandbox_kwargs(environment.kwargs)
            kwargs["runtime_dir"] = str(settings.runtime.path)
        return AgentConfig(
            **settings.agent.harbor_config(),
            model_name=model,
            base_url=base_url,
            kwargs=kwargs,
            env=env,
            override_timeout_sec=self.agent_timeout_sec,
            override_setup_timeout_sec=settings.agent_setup_timeout_sec,
        )

    def _finish_files(self, secrets: list[str | None]) -> list[str]:
        """Scrub, store artifacts, apply retention; return the stored artifact paths."""
        settings = self.settings
        settings.active_trials.discard(self.trial_name)
        if not self.trial_dir.is_dir():
            return []
        drop_unreachable(self.trial_dir)
        scrub_secrets(self.trial_dir, secrets)
        stored = settings.sink.store(self.request.rollout_id, self.trial_dir / "artifacts")
        settings.retention.finish(
            self.trial_dir,
            succeeded=self.succeeded,
            active=frozenset(settings.active_trials),
        )
        return stored

    def complete(self, result: RolloutResult) -> RolloutResult:
        """The driver's result, with the trial's own failure phase, Harbor's timings and
        where to look (the kept trial directory) when it failed."""
        extra = {**result.extra_fields, **self.extra_fields}
        if result.failure is not None:
            failure = result.failure
            if self.outcome is not None and self.outcome.failure is not None:
                failure = self.outcome.failure
            if self.trial_dir.is_dir():
                extra.setdefault("harbor", {})["trial_dir"] = str(self.trial_dir)
            result = result.model_copy(update={"failure": failure})
        timings = {**result.timings, **{f"harbor.{k}": v for k, v in self.timings.items()}}
        return result.model_copy(update={"extra_fields": extra, "timings": timings})


def _harbor_scrubs(trial: Trial) -> bool:
    """Whether Harbor's end-of-trial scrub will read the trial's files: it does when one of
    the envs it hands out has a key with a sensitive name, or a model key is named."""
    envs = [trial.agent.extra_env, trial.task.config.verifier.env, trial.config.verifier.env]
    if trial.user_agent is not None:
        envs.append(trial.user_agent.extra_env)
    named = [c.model_api_key_name for c in (trial.config.agent, trial.config.user_agent) if c]
    return any(named) or any(is_sensitive_env_key(key) for env in envs for key in env)


def _sandbox_environment(
    route: PolicyRoute, environment: EnvironmentConfig, settings: TrialSettings
) -> dict[str, str]:
    """Environment variables for an agent installed in the sandbox: the relay route only.

    A local sandbox reaches the relay through its Unix socket, bound in with a forwarder on
    127.0.0.1; other sandboxes through the relay's advertised URL. Raises
    ``RolloutValidationError`` for a route without a relay (the upstream key stays out).
    """
    if settings.local_sandbox:
        base = route.sandbox_base_url(forwarder_port=RELAY_PORT)
        environment.kwargs["relay_socket"] = str(route.relay_socket)
        environment.kwargs["relay_port"] = RELAY_PORT
    else:
        base = route.sandbox_base_url()
        if settings.remote_sandbox:  # it refuses to start where it cannot reach the relay
            environment.kwargs["relay_url"] = base
    return route.environment(base)
