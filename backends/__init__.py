"""backends: sandboxed rollouts for agent reinforcement learning.

Write an ``AgentWorkflow`` (and optionally a ``Grader``), wire them into a backend, and run
rollouts from Python (``collect``/``run_batch``), the command line (``backends run``) or a
trainer over HTTP (``create_rollout_server``).
"""

from backends.local import LocalBackend
from backends.rollout import (
    AgentWorkflow,
    AgentWorkflowConfig,
    AgentWorkflowContext,
    AgentWorkflowOutput,
    BaseConfig,
    CancelDisposition,
    ConcurrencyConfig,
    ErrorCategory,
    ExecutionBackend,
    Grader,
    GraderConfig,
    GraderContext,
    Phase,
    RolloutContext,
    RolloutFailure,
    RolloutRequest,
    RolloutResult,
    RolloutSample,
    RolloutStatus,
    SampleSource,
    collect,
    get_rollout_context,
    run_batch,
)

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
    "LocalBackend",
    "Phase",
    "RolloutContext",
    "RolloutFailure",
    "RolloutRequest",
    "RolloutResult",
    "RolloutSample",
    "RolloutStatus",
    "SampleSource",
    "collect",
    "get_rollout_context",
    "run_batch",
]
