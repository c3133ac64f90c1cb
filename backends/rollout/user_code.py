"""Running the user's ``AgentWorkflow`` and ``Grader`` for one rollout.

Shared by every place user code runs: ``LocalBackend`` in this process, a bundle runner inside a
sandbox, a backend grading on the host with a ``Grader``. Deadlines, failure categories and
checks on the reward belong to the caller (``backends.rollout.phases``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import anyio

from backends.rollout.context import AgentWorkflowContext, GraderContext, RolloutContext
from backends.rollout.normalize import sample_from_output
from backends.rollout.sample import MessageDict, RolloutSample, json_copy
from backends.rollout.workflow import AgentWorkflow, Grader

CLOSE_TIMEOUT_SEC = 10.0  # for what integrations registered with RolloutContext.call_on_close


async def run_workflow(
    workflow: AgentWorkflow[Any],
    context: RolloutContext,
    *,
    prompt: list[MessageDict],
    metadata: dict[str, Any] | None = None,
    artifacts_dir: Path | None = None,
) -> tuple[RolloutSample, dict[str, Any]]:
    """Run ``workflow`` on ``prompt`` with ``context`` as the ambient rollout context.

    Returns the sample and the workflow's ``info``. Raises whatever the workflow raises, and
    ``RolloutValidationError`` when its output has the wrong shape. What integrations
    registered with ``context.call_on_close`` is closed when the workflow ends. The workflow gets copies of
    the prompt and metadata, never the label.
    """
    ctx = AgentWorkflowContext(
        prompt=json_copy(prompt),
        config=workflow.config,
        metadata=json_copy(metadata),
        artifacts_dir=artifacts_dir,
    )
    with context:
        try:
            output = await workflow.run(ctx)
            return await sample_from_output(output, context)
        finally:
            # A cancelled rollout still closes its clients, but a hung close cannot hold it.
            if context.has_closers:
                with anyio.move_on_after(CLOSE_TIMEOUT_SEC, shield=True):
                    await context.aclose()


async def grade_sample(
    grader: Grader,
    sample: RolloutSample,
    *,
    label: str | None,
    metadata: dict[str, Any] | None = None,
    artifacts_dir: Path | None = None,
) -> None:
    """Let ``grader`` set ``sample``'s reward. Raises whatever the grader raises."""
    ctx = GraderContext(
        label=label, sample=sample, metadata=json_copy(metadata), artifacts_dir=artifacts_dir
    )
    await grader.grade(ctx)


def fresh_config(config: Any) -> Any:
    """A copy of ``config`` for one rollout, so one rollout's mutation cannot leak into the next."""
    if config is None:
        return None
    try:
        return copy.deepcopy(config)
    except Exception:
        return config
