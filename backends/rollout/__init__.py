"""The rollout contract: what a user writes (workflow, grader), what a backend takes and returns."""

from backends.rollout.backend import CancelDisposition, ExecutionBackend
from backends.rollout.batch import collect, run_batch
from backends.rollout.config import AgentWorkflowConfig, BaseConfig, ConcurrencyConfig, GraderConfig
from backends.rollout.context import (
    AgentWorkflowContext,
    GraderContext,
    RolloutContext,
    SampleSource,
    get_rollout_context,
)
from backends.rollout.errors import (
    ErrorCategory,
    InfrastructureError,
    Phase,
    PolicyError,
    RolloutCancelledError,
    RolloutError,
    RolloutFailure,
    RolloutTimeoutError,
    RolloutValidationError,
    SandboxError,
    VerifierError,
)
from backends.rollout.request import RolloutRequest, RolloutResult, RolloutStatus
from backends.rollout.sample import AgentWorkflowOutput, MessageDict, RolloutSample
from backends.rollout.workflow import AgentWorkflow, Grader

__all__ = [
    "AgentWorkflow",
    "AgentWorkflowConfig",
    "AgentWorkflowContext",
    "AgentWorkflowOutput",
    "BaseConfig",
    "CancelDisposition",
    "ConcurrencyConfig",
    "ErrorCategory",
    "ExecutionBackend",
    "Grader",
    "GraderConfig",
    "GraderContext",
    "InfrastructureError",
    "MessageDict",
    "Phase",
    "PolicyError",
    "RolloutCancelledError",
    "RolloutContext",
    "RolloutError",
    "RolloutFailure",
    "RolloutRequest",
    "RolloutResult",
    "RolloutSample",
    "RolloutStatus",
    "RolloutTimeoutError",
    "RolloutValidationError",
    "SampleSource",
    "SandboxError",
    "VerifierError",
    "collect",
    "get_rollout_context",
    "run_batch",
]
