"""Turn whatever ``AgentWorkflow.run`` returned into the rollout's one sample."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from backends.rollout.context import RolloutContext
from backends.rollout.errors import RolloutValidationError
from backends.rollout.sample import AgentWorkflowOutput, RolloutSample


async def sample_from_output(output: Any, context: RolloutContext) -> tuple[RolloutSample, dict]:
    """Return the sample and the workflow's reserved ``info`` (which never reaches the grader).

    ``AgentWorkflowOutput`` and a list of message dicts are taken as the sample; ``None``
    (or an output with no messages) takes it from the registered sample source.
    """
    if isinstance(output, list | tuple):
        try:
            return RolloutSample(messages=list(output)), {}
        except ValidationError as exc:
            raise RolloutValidationError(f"run() returned an invalid message list: {exc}") from None
    if output is not None and not isinstance(output, AgentWorkflowOutput):
        raise RolloutValidationError(
            "run() must return AgentWorkflowOutput, a list of message dicts or None, "
            f"not {type(output).__name__}"
        )
    if output is not None and output.messages is not None:
        sample = RolloutSample(messages=output.messages, metrics=dict(output.metrics))
        return sample, dict(output.info)

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
    if output is not None:
        sample.metrics = {**sample.metrics, **output.metrics}
        return sample, dict(output.info)
    return sample, {}
