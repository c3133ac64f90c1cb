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
    PolicyRoute,
    RolloutContext,
    RolloutError,
    RolloutFailure,
    RolloutRequest,
    RolloutResult,
    RolloutSample,
    RolloutStatus,
    RolloutTrace,
    SampleSource,
    collect,
    get_rollout_context,
    run_batch,
)

# Harbor, the server, its client and the relay pull in heavy stacks: import them only when
# asked for (a bundle runner inside a sandbox imports ``backends`` and needs none of them).
_LAZY = {
    "HarborBackend": "backends.harbor",
    "create_rollout_server": "backends.server",
    "RolloutClient": "backends.server",
    "Relay": "backends.relay",
    "RelayedBackend": "backends.relayed",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'backends' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


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
    "HarborBackend",
    "LocalBackend",
    "Phase",
    "PolicyRoute",
    "Relay",
    "RelayedBackend",
    "RolloutClient",
    "RolloutContext",
    "RolloutError",
    "RolloutFailure",
    "RolloutRequest",
    "RolloutResult",
    "RolloutSample",
    "RolloutStatus",
    "RolloutTrace",
    "SampleSource",
    "collect",
    "create_rollout_server",
    "get_rollout_context",
    "run_batch",
]
