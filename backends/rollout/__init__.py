"""The rollout contract: what a user writes (workflow, grader), what a backend takes and returns."""

from backends.rollout.backend import CancelDisposition, ExecutionBackend, Startup
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
    CATEGORIES,
    RETRYABLE,
    AgentError,
    ErrorCategory,
    InfrastructureError,
    Phase,
    PolicyError,
    RolloutCancelledError,
    RolloutError,
    RolloutFailure,
    RolloutTimeoutError,
    RolloutValidationError,
    VerifierError,
    classify,
    is_retryable,
)
from backends.rollout.inflight import InFlight, Tracked
from backends.rollout.phases import RolloutPhases, run_phases
from backends.rollout.request import RolloutRequest, RolloutResult, RolloutStatus
from backends.rollout.route import PolicyRoute
from backends.rollout.sample import AgentWorkflowOutput, MessageDict, RolloutSample
from backends.rollout.trace import CallRecord, RolloutTrace
from backends.rollout.user_code import grade_sample, run_workflow
from backends.rollout.workflow import AgentWorkflow, Grader

__all__ = [
    "CATEGORIES",
    "RETRYABLE",
    "AgentError",
    "AgentWorkflow",
    "AgentWorkflowConfig",
    "AgentWorkflowContext",
    "AgentWorkflowOutput",
    "BaseConfig",
    "CallRecord",
    "CancelDisposition",
    "ConcurrencyConfig",
    "ErrorCategory",
    "ExecutionBackend",
    "Grader",
    "GraderConfig",
    "GraderContext",
    "InFlight",
    "InfrastructureError",
    "MessageDict",
    "Phase",
    "PolicyError",
    "PolicyRoute",
    "RolloutCancelledError",
    "RolloutContext",
    "RolloutError",
    "RolloutFailure",
    "RolloutPhases",
    "RolloutRequest",
    "RolloutResult",
    "RolloutSample",
    "RolloutStatus",
    "RolloutTimeoutError",
    "RolloutTrace",
    "RolloutValidationError",
    "SampleSource",
    "Startup",
    "Tracked",
    "VerifierError",
    "classify",
    "collect",
    "get_rollout_context",
    "grade_sample",
    "is_retryable",
    "run_batch",
    "run_phases",
    "run_workflow",
]
