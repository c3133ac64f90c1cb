"""Configuration models for workflows and graders."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ConcurrencyConfig(BaseModel):
    """How many executions may run at once; ``None`` means no bound."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_concurrent: int | None = Field(default=None, ge=1)


class BaseConfig(BaseModel):
    """Base for user configs. Extra fields are allowed so small configs need no boilerplate."""

    model_config = ConfigDict(extra="allow", validate_assignment=True, arbitrary_types_allowed=True)

    name: str
    description: str | None = None


class AgentWorkflowConfig(BaseConfig):
    """Config passed to an ``AgentWorkflow``; ``concurrency`` bounds parallel executions."""

    concurrency: ConcurrencyConfig = ConcurrencyConfig()


class GraderConfig(BaseConfig):
    """Config passed to a ``Grader``."""

    concurrency: ConcurrencyConfig = ConcurrencyConfig()
