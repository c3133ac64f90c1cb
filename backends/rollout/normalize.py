"""Turn whatever ``AgentWorkflow.run`` returned into the rollout's one sample."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from backends.rollout.context import RolloutContext
from backends.rollout.errors import RolloutValidationError
from backends.rollout.sample import (
    AgentWorkflowOutput,
    RolloutSample,
    json_problem,
    validation_summary,
)


async def sample_from_output(output: Any, context: RolloutContext) -> tuple[RolloutSample, dict]:
    """Return the sample and the workflow's reserved ``info`` (which never reaches the grader).

    ``AgentWorkflowOutput`` and a list of message dicts are taken as the sample; ``None``
    (or an output with no messages) takes it from the registered sample source. Whatever the
    path, the sample is JSON (messages, metrics, extra fields) or the rollout fails here as a
    validation error naming the field: nothing downstream can fail to serialize it.
    """
    if isinstance(output, list | tuple):
        return _sample(list(output), "run() returned an invalid message list"), {}
    if output is not None and not isinstance(output, AgentWorkflowOutput):
        raise RolloutValidationError(
            "run() must return AgentWorkflowOutput, a list of message dicts or None, "
            f"not {type(output).__name__}"
        )
    info = _info(output)
    if output is not None and output.messages is not None:
        sample = _sample(output.messages, "run() returned invalid output", dict(output.metrics))
        return sample, info

    if context.sample_source is None:
        raise RolloutValidationError(
            "run() returned None but no sample source was registered on the rollout context: "
            "return the messages, or use an integration that registers its conversation"
        )
    sample = await context.sample_source.get_sample()
    if not isinstance(sample, RolloutSample):
        raise RolloutValidationError(
            f"the sample source returned {type(sample).__name__}, not a RolloutSample"
        )
    # Built by an integration, perhaps with model_construct or mutated since: check again.
    if problem := json_problem(sample.messages, "messages") or json_problem(
        sample.extra_fields, "extra_fields"
    ):
        raise RolloutValidationError(f"the sample source returned an invalid sample: {problem}")
    if output is not None:
        sample.metrics = {**sample.metrics, **output.metrics}
    return sample, info


def _sample(messages: list[Any], what: str, metrics: dict[str, Any] | None = None) -> RolloutSample:
    try:
        return RolloutSample(messages=messages, metrics=metrics or {})
    except ValidationError as exc:
        raise RolloutValidationError(f"{what}: {validation_summary(exc)}") from None


def _info(output: AgentWorkflowOutput | None) -> dict[str, Any]:
    if output is None:
        return {}
    # Validated when built, but a dict can be filled in afterwards.
    if problem := json_problem(output.info, "info"):
        raise RolloutValidationError(f"run() returned invalid output: {problem}")
    return dict(output.info)
