"""HarborBackend: each rollout is a Harbor trial in a fresh sandbox; its verifier gives the reward.

Two modes (the reference SDK's keywords, so porting is an import change):

* ``task_mode="dataset"``: ``tasks_dir`` holds many Harbor tasks and each request names one with
  ``metadata["harbor_task_id"]``; the task's own instruction, environment, verifier, steps and
  artifacts are used.
* ``task_mode="template"`` (default): ``tasks_dir`` is one task; each request's prompt becomes its
  instruction. The reward comes from the template's ``tests/``.

Harbor runs the trial unmodified (its ``Trial``, agents, verifier); our sandbox
(``backends.sandbox.local:LocalSandbox``) is the default environment.
"""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import tenacity
from harbor.models.environment_type import EnvironmentType
from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig, TrialConfig
from harbor.models.trial.config import VerifierConfig as HarborVerifierConfig
from harbor.trial.trial import Trial

from backends.harbor.agents import AgentSpec, resolve_agent
from backends.harbor.files import ArtifactSink, Retention, scrub_secrets
from backends.harbor.outcome import TrialOutcome, outcome_of
from backends.harbor.sample import build_sample, phase_timings
from backends.harbor.tasks import (
    TASK_ID_KEY,
    has_tests,
    is_task_dir,
    render_instruction,
    resolve_task_id,
)
from backends.harbor.trial import run_to_end
from backends.rollout.artifacts import default_rollout_root
from backends.rollout.backend import CancelDisposition
from backends.rollout.errors import (
    ErrorCategory,
    Phase,
    RolloutFailure,
    RolloutValidationError,
    describe,
)
from backends.rollout.loading import load_object
from backends.rollout.request import RolloutRequest, RolloutResult, RolloutStatus

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


def _trial_name(rollout_id: str, attempt: int) -> str:
    # A directory name: rollout ids are safe already, but may be longer than a name can be.
    name = rollout_id if len(rollout_id) <= 200 else rollout_id[:200]
    name = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    return name if attempt == 1 else f"{name}.attempt-{attempt}"


@dataclass
class _InFlight:
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    status: RolloutStatus = RolloutStatus.QUEUED
    trial_names: set[str] = field(default_factory=set)


@dataclass
class _Attempt:
    """One trial of a rollout: its outcome, and the result to report if it is the last."""

    outcome: TrialOutcome
    result: RolloutResult
    trial_dir: Path | None = None

    @property
    def retryable(self) -> bool:
        return self.outcome.retryable


class HarborBackend:
    """An ``ExecutionBackend`` running each rollout as a Harbor trial.

    ``agent`` is any name in Harbor's agent registry (``"oracle"``, ``"nop"``,
    ``"terminus-2"``, ...) or a Harbor ``BaseAgent`` (class or ``"module:Class"``).
    ``environment`` picks the sandbox (``"local"`` by default). ``max_concurrent`` bounds
    trials running at once; ``max_queue_depth`` bounds those waiting for a slot, past which
    ``has_capacity()`` is false (the server answers 429). Infrastructure failures (a sandbox
    that would not start, a lost connection to it) retry with a fresh sandbox, up to
    ``infra_attempts`` trials in all; they never become a reward.

    Files: trials run in ``trials_dir`` (default ``$BACKENDS_HOME/trials``); a successful
    trial's directory is removed once collected (``cleanup_successful_trials``), failed ones
    stay up to ``keep_failed_trials`` directories and ``keep_failed_trials_mb`` MiB. Artifacts
    go to ``artifacts``, an fsspec URL (default: the rollouts directory, beside
    trajectory.json), under ``<rollout id>/artifacts/``.

    Raises ``ValueError`` at construction for anything that cannot work: an unknown agent, a
    ``tasks_dir`` of the wrong shape for the mode, an unknown environment.
    """

    def __init__(
        self,
        *,
        tasks_dir: Path | str,
        agent: str | type = "oracle",
        task_mode: str = "template",
        model_name: str | None = None,
        native_agent_kwargs: dict[str, Any] | None = None,
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
    ) -> None:
        if task_mode not in ("template", "dataset"):
            raise ValueError(f"task_mode must be 'template' or 'dataset', not {task_mode!r}")
        self.tasks_dir = Path(tasks_dir).resolve()
        self.task_mode = task_mode
        if not self.tasks_dir.is_dir():
            raise ValueError(f"tasks_dir {tasks_dir} is not a directory")
        if task_mode == "template":
            self._check_template()
        elif is_task_dir(self.tasks_dir):
            raise ValueError(
                f"tasks_dir {tasks_dir} is one Harbor task; dataset mode needs a directory of "
                "tasks (or use task_mode='template')"
            )
        self.agent: AgentSpec = resolve_agent(agent)
        self.model_name = model_name
        self.native_agent_kwargs = dict(native_agent_kwargs or {})
        self.environment = build_environment_config(environment, environment_config)
        self.trials_dir = (
            Path(trials_dir) if trials_dir is not None else default_rollout_root().parent / "trials"
        )
        self.retention = Retention(
            keep_successful=not cleanup_successful_trials,
            max_failed=keep_failed_trials,
            max_failed_mb=keep_failed_trials_mb,
        )
        self.agent_setup_timeout_sec = agent_setup_timeout_sec
        if max_concurrent is not None and max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, not {max_concurrent}")
        if max_queue_depth is not None and max_queue_depth < 0:
            raise ValueError(f"max_queue_depth must be >= 0, not {max_queue_depth}")
        if infra_attempts < 1:
            raise ValueError(f"infra_attempts must be >= 1, not {infra_attempts}")
        self.max_concurrent = max_concurrent
        self.max_queue_depth = max_queue_depth
        self.infra_attempts = infra_attempts
        self._limiter = anyio.CapacityLimiter(max_concurrent) if max_concurrent else None
        self.sink = ArtifactSink(artifacts if artifacts is not None else default_rollout_root())
        self._in_flight: dict[str, _InFlight] = {}
        self._drained: anyio.Event | None = None  # set when aclose() may return
        self._local_sandbox = _is_local_sandbox(self.environment)

    def _check_template(self) -> None:
        if not is_task_dir(self.tasks_dir):
            raise ValueError(
                f"template mode needs tasks_dir to be one Harbor task (with task.toml); "
                f"{self.tasks_dir} has none (for a directory of tasks use task_mode='dataset')"
            )
        if (self.tasks_dir / "steps").is_dir():
            raise ValueError(
                f"template {self.tasks_dir} has steps: template mode takes a single-step task"
            )
        if not has_tests(self.tasks_dir):
            raise RolloutValidationError(
                f"template {self.tasks_dir} has no tests/test.sh, so nothing would give a reward"
            )

    @property
    def artifacts_root(self) -> Path | None:
        """Where ``backends run`` saves trajectories: beside the artifacts, when they are local."""
        return self.sink.local_root

    # -- the backend contract -------------------------------------------------------------

    def has_capacity(self) -> bool:
        if self.max_concurrent is None:
            return self.max_queue_depth is None or len(self._in_flight) < self.max_queue_depth
        return len(self._in_flight) < self.max_concurrent + (self.max_queue_depth or 0)

    def status(self, rollout_id: str) -> RolloutStatus | None:
        entry = self._in_flight.get(rollout_id)
        return entry.status if entry else None

    def cancel(
        self, ids: Iterable[str] | None = None, prefix: str | None = None, all: bool = False
    ) -> dict[str, CancelDisposition]:
        if all:
            chosen = list(self._in_flight)
        elif prefix is not None:
            chosen = [rid for rid in self._in_flight if rid.startswith(prefix)]
        else:
            chosen = list(ids or [])
        dispositions = {}
        for rid in chosen:
            entry = self._in_flight.get(rid)
            if entry is None:
                dispositions[rid] = CancelDisposition.NOT_FOUND
                continue
            queued = entry.status is RolloutStatus.QUEUED
            entry.scope.cancel()
            dispositions[rid] = (
                CancelDisposition.CANCELLED_QUEUED
                if queued
                else CancelDisposition.CANCELLED_RUNNING
            )
        return dispositions

    def health(self) -> dict[str, Any]:
        running = sum(1 for e in self._in_flight.values() if e.status is not RolloutStatus.QUEUED)
        return {
            "backend": "harbor",
            "task_mode": self.task_mode,
            "agent": self.agent.label,
            "in_flight": len(self._in_flight),
            "running": running,
            "queued": len(self._in_flight) - running,
            "max_concurrent": self.max_concurrent,
            "max_queue_depth": self.max_queue_depth,
        }

    async def aclose(self) -> None:
        """Cancel every rollout; each one's ``execute`` returns once its sandbox is stopped."""
        self.cancel(all=True)
        if self._in_flight:
            self._drained = anyio.Event()
            await self._drained.wait()

    async def execute(self, request: RolloutRequest) -> RolloutResult:
        rid = request.rollout_id
        if rid in self._in_flight:
            return RolloutResult.failed(rid, _invalid(f"rollout {rid!r} is already running"))
        entry = _InFlight()
        self._in_flight[rid] = entry
        try:
            with entry.scope:
                return await self._execute(request, entry)
            return _cancelled(rid, entry)
        finally:
            del self._in_flight[rid]
            if not self._in_flight and self._drained is not None:
                self._drained.set()

    # -- one rollout -----------------------------------------------------------------------

    async def _execute(self, request: RolloutRequest, entry: _InFlight) -> RolloutResult:
        rid = request.rollout_id
        started = time.monotonic()
        try:
            task_dir, instruction = self._admit(request)
        except RolloutValidationError as exc:
            return RolloutResult.failed(rid, _invalid(str(exc)))
        async with self._slot():
            entry.status = RolloutStatus.RUNNING
            queued = time.monotonic() - started
            failures: list[str] = []

            async def attempt() -> _Attempt:
                outcome = await self._attempt(
                    request, entry, task_dir, instruction, len(failures) + 1
                )
                if outcome.retryable and outcome.result.failure:
                    failures.append(outcome.result.failure.message)
                return outcome

            retrying = tenacity.AsyncRetrying(
                stop=tenacity.stop_after_attempt(self.infra_attempts),
                retry=tenacity.retry_if_result(lambda a: a.retryable),
                wait=tenacity.wait_exponential(multiplier=0.2, max=5),
                retry_error_callback=_last_attempt,
                reraise=True,
            )
            last: _Attempt = await retrying(attempt)
        result = last.result
        result.timings["queued_sec"] = queued
        if failures:
            # Earlier attempts are counted; the trace and sample are the last attempt's.
            earlier = failures[:-1] if last.retryable else failures
            result.extra_fields["infra_retries"] = {"count": len(earlier), "failures": earlier}
        return result

    def _admit(self, request: RolloutRequest) -> tuple[Path, str]:
        """The task directory and instruction for ``request``, or a validation error."""
        if self.task_mode == "dataset":
            task_id = (request.metadata or {}).get(TASK_ID_KEY)
            task_dir = resolve_task_id(self.tasks_dir, task_id)
            return task_dir, ""
        instruction = render_instruction(request.prompt)
        if not instruction.strip():
            raise RolloutValidationError(
                "template mode needs a prompt: the request's messages become the instruction"
            )
        return self.tasks_dir, instruction

    def _slot(self) -> Any:
        return self._limiter if self._limiter is not None else _NoLimit()

    def _trial_config(
        self, request: RolloutRequest, task_dir: Path, trial_name: str
    ) -> TrialConfig:
        agent = AgentConfig(
            name=self.agent.name,
            import_path=self.agent.import_path,
            model_name=self.model_name,
            kwargs=copy.deepcopy(self.native_agent_kwargs),
            override_timeout_sec=request.agent_timeout_sec,
            override_setup_timeout_sec=self.agent_setup_timeout_sec,
        )
        # Never auto_mounting by default: a bound /logs lets the sandbox plant symlinks and
        # sparse files that Harbor then reads (or writes) on the host as root; downloads are
        # the checked, bounded path.
        environment = self.environment.model_copy(deep=True)
        return TrialConfig(
            task=TaskConfig(path=task_dir),
            trial_name=trial_name,
            trials_dir=self.trials_dir,
            agent=agent,
            environment=environment,
            verifier=HarborVerifierConfig(override_timeout_sec=request.grader_timeout_sec),
        )

    async def _attempt(
        self,
        request: RolloutRequest,
        entry: _InFlight,
        task_dir: Path,
        instruction: str,
        number: int,
    ) -> _Attempt:
        rid = request.rollout_id
        name = _trial_name(rid, number)
        entry.trial_names.add(name)
        trial_dir = self.trials_dir / name
        try:
            config = self._trial_config(request, task_dir, name)
            trial = await Trial.create(config)
        except Exception as exc:  # a task Harbor cannot load, a sandbox refusing the task
            failure = _invalid(f"Harbor cannot set up a trial of {task_dir.name}: {describe(exc)}")
            return _Attempt(TrialOutcome(failure=failure), RolloutResult.failed(rid, failure))
        if self.task_mode == "template":
            trial.task.instruction = instruction  # the request's prompt, not the template's text
        else:
            instruction = trial.task.instruction
        harbor_result = await run_to_end(trial)
        outcome = outcome_of(harbor_result)
        steps = [s.name for s in trial.task.config.steps or []]
        sample = await anyio.to_thread.run_sync(
            lambda: build_sample(
                harbor_result, outcome, trial_dir, instruction=instruction, step_names=steps
            )
        )
        stored = await anyio.to_thread.run_sync(
            self._finish_files, request, trial_dir, outcome.failure is None, entry
        )
        timings = phase_timings(harbor_result)
        extra: dict[str, Any] = {
            "harbor": {
                "trial_name": name,
                "task": trial.task.name,
                "attempt": number,
                "exception_type": outcome.exception_type,
                "artifacts": stored,
            }
        }
        if outcome.failure is not None:
            extra["harbor"]["trial_dir"] = str(trial_dir)
            result = RolloutResult.failed(
                rid, outcome.failure, sample, timings=timings, extra_fields=extra
            )
        else:
            result = RolloutResult(
                rollout_id=rid,
                status=RolloutStatus.SUCCESS,
                sample=sample,
                timings=timings,
                extra_fields=extra,
            )
        return _Attempt(outcome, result, trial_dir)

    def _finish_files(
        self, request: RolloutRequest, trial_dir: Path, succeeded: bool, entry: _InFlight
    ) -> list[str]:
        """Scrub, store artifacts, apply retention; return the stored artifact paths."""
        scrub_secrets(trial_dir, [request.api_key])
        stored = self.sink.store(request.rollout_id, trial_dir / "artifacts")
        active = frozenset(n for e in self._in_flight.values() for n in e.trial_names)
        self.retention.finish(trial_dir, succeeded=succeeded, active=active - {trial_dir.name})
        return stored


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


def _last_attempt(state: tenacity.RetryCallState) -> _Attempt:
    # Out of attempts: report the last one's failure (not tenacity's RetryError).
    assert state.outcome is not None
    return state.outcome.result()


class _NoLimit:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


def _invalid(message: str) -> RolloutFailure:
    return RolloutFailure(
        category=ErrorCategory.VALIDATION_ERROR, phase=Phase.SETUP, message=message
    )


def _cancelled(rid: str, entry: _InFlight) -> RolloutResult:
    phase = Phase.GRADING if entry.status is RolloutStatus.GRADING else Phase.AGENT
    return RolloutResult.failed(
        rid,
        RolloutFailure(category=ErrorCategory.CANCELLED, phase=phase, message="rollout cancelled"),
    )


__all__ = ["HarborBackend", "build_environment_config"]
