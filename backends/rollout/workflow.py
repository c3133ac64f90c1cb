"""The two classes a user writes: an ``AgentWorkflow`` that acts, a ``Grader`` that scores."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from backends.rollout.config import AgentWorkflowConfig, GraderConfig
from backends.rollout.context import AgentWorkflowContext, GraderContext
from backends.rollout.sample import AgentWorkflowOutput, MessageDict


class AgentWorkflow[TConfig: AgentWorkflowConfig](ABC):
    """Rollout behaviour: given one dataset prompt, run the agent and produce one sample.

    ``run`` may return an ``AgentWorkflowOutput``, a list of message dicts, or ``None`` to take
    the sample from the source registered on the active ``RolloutContext``.
    """

    def __init__(self, config: TConfig | None = None) -> None:
        self.config = config

    @abstractmethod
    async def run(
        self, ctx: AgentWorkflowContext[TConfig]
    ) -> AgentWorkflowOutput | list[MessageDict] | None:
        raise NotImplementedError


class Grader(ABC):
    """Reward logic: read ``ctx.sample`` and ``ctx.label``, call ``ctx.set_reward``.

    The return value of ``grade`` is ignored.
    """

    def __init__(self, config: GraderConfig | None = None) -> None:
        self.config = config

    @abstractmethod
    async def grade(self, ctx: GraderContext) -> Any:
        raise NotImplementedError
