"""LocalBackend: run a workflow (and its grader) in this process, one fresh instance per rollout."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import anyio

from backends.rollout.artifacts import default_rollout_root, make_artifacts_dir
from backends.rollout.backend import CancelDisposition
from backends.rollout.config import AgentWorkflowConfig, GraderConfig
from backends.rollout.context import RolloutContext
from backends.rollout.errors import RolloutValidationError
from backends.rollout.inflight import InFlight, Tracked
from backends.rollout.loading import load_object
from backends.rollout.phases import RolloutPhases, run_phases
from backends.rollout.request import RolloutRequest, RolloutResult, RolloutStatus
from backends.rollout.sample import RolloutSample
from backends.rollout.user_code import fresh_config, grade_sample, run_workflow
from backends.rollout.workflow import AgentWorkflow, Grader


class LocalBackend:
    """Runs ``workflow`` in-process for each request, then ``grader`` when grading is asked.

    Classes and configs may be objects or ``"module:attr"`` / ``"path/main.py:attr"`` strings.
    ``workflow_config.concurrency.max_concurrent`` bounds parallel executions (``None``: no
    bound); the grader runs in the same slot. The agent deadline counts time spent queued.
    Cancellation is cooperative: code that blocks the event loop keeps its slot until it
    yields, and a result that arrives after its deadline is still reported as a timeout.
    """

    def __init__(
        self,
        *,
        workflow: type[AgentWorkflow[Any]] | str,
        workflow_config: AgentWorkflowConfig | str | None = None,
        grader: type[Grader] | str | None = None,
        grader_config: GraderConfig | str | None = None,
        artifacts_root: Path | str | None = "default",
    ) -> None:
        self.workflow_cls = _require_subclass(load_object(workflow), AgentWorkflow, "workflow")
        self.workflow_config = load_object(workflow_config)
        self.grader_cls = (
            _require_subclass(load_object(grader), Grader, "grader") if grader else None
        )
        self.grader_config = load_object(grader_config)
        if artifacts_root == "default":
            artifacts_root = default_rollout_root()
        self.artifacts_root = Path(artifacts_root) if artifacts_root is not None else None
        limit = _max_concurrent(self.workflow_config)
        self._limiter = anyio.CapacityLimiter(limit) if limit else None
        self._in_flight = InFlight()

    # -- the backend contract -------------------------------------------------------------

    async def start(self) -> None:
        """Nothing to warm up: the workflow and grader classes are loaded at construction."""

    async def execute(self, request: RolloutRequest) -> RolloutResult:
        return await self._in_flight.run(
            request,
            lambda tracked: run_phases(_LocalPhases(self, request, tracked), limiter=self._limiter),
        )

    def has_capacity(self) -> bool:
        return True

    def status(self, rollout_id: str) -> RolloutStatus | None:
        return self._in_flight.status(rollout_id)

    def cancel(
        self, ids: Iterable[str] | None = None, prefix: str | None = None, all: bool = False
    ) -> dict[str, CancelDisposition]:
        return self._in_flight.cancel(ids=ids, prefix=prefix, all=all)

    def rollout_context(self, rollout_id: str) -> RolloutContext | None:
        """The live context of a running workflow (its sample source), else ``None``."""
        entry = self._in_flight.get(rollout_id)
        return entry.context if entry else None

    def health(self) -> dict[str, Any]:
        return {
            "backend": "local",
            **self._in_flight.counts(),
            "max_concurrent": self._limiter.total_tokens if self._limiter else None,
        }

    async def aclose(self) -> None:
        self.cancel(all=True)

    def _grading_problem(self, request: RolloutRequest) -> str | None:
        """Why ``request`` cannot be graded here, or ``None``."""
        if self.grader_cls is None:
            return "grading was requested but this backend has no grader (pass grader=...)"
        if request.label is None and request.metadata is None:
            return (
                "grading was requested but the request has no label (ground truth) to grade against"
            )
        return None


class _LocalPhases(RolloutPhases):
    """One in-process rollout: an artifacts directory, the workflow, the grader."""

    no_reward_message = "the grader finished without calling ctx.set_reward()"

    def __init__(self, backend: LocalBackend, request: RolloutRequest, tracked: Tracked) -> None:
        super().__init__(request, tracked)
        self.backend = backend
        self.artifacts_dir: Path | None = None

    def admit(self) -> None:
        if self.request.grade and (problem := self.backend._grading_problem(self.request)):
            raise RolloutValidationError(problem)

    async def provision(self) -> None:
        root = self.backend.artifacts_root
        if root is not None:
            # Off the event loop: a slow or remote filesystem must not stall other rollouts.
            self.artifacts_dir = await anyio.to_thread.run_sync(
                make_artifacts_dir, root, self.request.rollout_id
            )

    async def run_agent(self) -> RolloutSample:
        backend, request = self.backend, self.request
        workflow = backend.workflow_cls(config=fresh_config(backend.workflow_config))
        context = RolloutContext(
            chat_completions_url=self.route.base_url,
            api_key=self.route.api_key,
            rollout_id=request.rollout_id,
        )
        self.tracked.context = context
        sample, info = await run_workflow(
            workflow,
            context,
            prompt=request.prompt,
            metadata=request.metadata,
            artifacts_dir=self.artifacts_dir,
        )
        if info:
            self.extra_fields["workflow_info"] = info
        return sample

    async def grade(self, sample: RolloutSample) -> None:
        backend, request = self.backend, self.request
        assert backend.grader_cls is not None
        grader = backend.grader_cls(config=fresh_config(backend.grader_config))
        await grade_sample(
            grader,
            sample,
            label=request.label,
            metadata=request.metadata,
            artifacts_dir=self.artifacts_dir,
        )


def _require_subclass(obj: Any, base: type, what: str) -> Any:
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise TypeError(f"{what} must be a subclass of {base.__name__}, got {obj!r}")
    return obj


def _max_concurrent(config: Any) -> int | None:
    concurrency = getattr(config, "concurrency", None)
    return getattr(concurrency, "max_concurrent", None)
