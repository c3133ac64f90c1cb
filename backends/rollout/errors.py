"""The failure taxonomy: one exception root, one class per kind of failure, one table.

``RolloutError`` is the root of our own errors. ``CATEGORIES`` maps exception classes (ours and
the lower layers': sandbox, OpenAI client) to a category once; ``RETRYABLE`` says which
categories a fresh attempt may fix. ``classify`` turns any exception raised while a rollout runs
into the ``RolloutFailure`` its result carries, and ``RolloutFailure.retryable`` is what an
infrastructure retry reads.
"""

from __future__ import annotations

import asyncio
from enum import StrEnum

import anyio
from pydantic import BaseModel, ValidationError

from backends.rollout.sample import validation_summary


class ErrorCategory(StrEnum):
    """Why a rollout failed. Values shared with the reference protocol keep their spelling."""

    AGENT_ERROR = "agent_error"  # the user's workflow (or Harbor agent) raised
    TIMEOUT = "timeout"
    VALIDATION_ERROR = "validation_error"  # bad input, or output of the wrong shape
    POLICY_ERROR = "policy_error"  # the model endpoint failed (5xx, timeout, refused)
    INFRA_ERROR = "infra_error"  # sandbox, bundle install, host faults: retryable
    VERIFIER_ERROR = "verifier_error"  # the grader or the task's tests failed to produce a reward
    CANCELLED = "cancelled"
    LEASE_EXPIRED = "lease_expired"
    INTERNAL_ERROR = "internal_error"


class Phase(StrEnum):
    """Where in a rollout's life the failure happened."""

    SETUP = "setup"  # request validation, sandbox provisioning, bundle install
    AGENT = "agent"
    GRADING = "grading"


class RolloutFailure(BaseModel):
    """What a failed rollout's result says: the category, the phase and a message a user can act on."""

    category: ErrorCategory
    phase: Phase
    message: str

    @property
    def retryable(self) -> bool:
        """A fresh attempt may succeed (``RETRYABLE``): an infrastructure fault, not the agent's."""
        return self.category in RETRYABLE


class RolloutError(Exception):
    """Root of every error this project raises about a rollout. Its category comes from
    ``CATEGORIES``, and ``retryable`` from ``RETRYABLE``."""

    @property
    def category(self) -> ErrorCategory:
        return category_of(self) or ErrorCategory.INTERNAL_ERROR

    @property
    def retryable(self) -> bool:
        return self.category in RETRYABLE


class RolloutValidationError(RolloutError, ValueError):
    """The request, the workflow's return value or the grader's reward has the wrong shape."""


class InfrastructureError(RolloutError):
    """The machinery around the rollout failed (sandbox, bundle, host); a fresh attempt may
    succeed."""


class AgentError(RolloutError):
    """The agent (a workflow, or a Harbor agent in its sandbox) failed."""


class PolicyError(RolloutError):
    """The policy endpoint failed: an upstream 5xx, a timeout, a refused connection."""


class VerifierError(RolloutError):
    """The grader or verifier ran but produced no usable reward."""


class RolloutTimeoutError(RolloutError, TimeoutError):
    """A deadline (agent or grader) passed."""


class RolloutCancelledError(RolloutError):
    """The rollout was cancelled by its caller."""


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# The one table from exception classes to categories, by qualified name so this module imports
# none of the lower layers it names. The nearest class in an exception's MRO wins.
CATEGORIES: dict[str, ErrorCategory] = {
    _name(RolloutError): ErrorCategory.INTERNAL_ERROR,
    _name(RolloutValidationError): ErrorCategory.VALIDATION_ERROR,
    _name(InfrastructureError): ErrorCategory.INFRA_ERROR,
    _name(AgentError): ErrorCategory.AGENT_ERROR,
    _name(PolicyError): ErrorCategory.POLICY_ERROR,
    _name(VerifierError): ErrorCategory.VERIFIER_ERROR,
    _name(RolloutTimeoutError): ErrorCategory.TIMEOUT,
    _name(RolloutCancelledError): ErrorCategory.CANCELLED,
    "builtins.TimeoutError": ErrorCategory.TIMEOUT,
    # The sandbox layer: a task it cannot run is the request's fault, anything else is infra.
    "backends.sandbox.errors.SandboxError": ErrorCategory.INFRA_ERROR,
    # ...except a sandbox ended by what ran inside it: a fresh one would end the same way.
    "backends.sandbox.errors.SandboxEndedError": ErrorCategory.AGENT_ERROR,
    "backends.sandbox.errors.UnsupportedTaskError": ErrorCategory.VALIDATION_ERROR,
    "backends.sandbox.errors.SandboxPathError": ErrorCategory.VALIDATION_ERROR,
    "backends.sandbox.errors.BaseImageNotFoundError": ErrorCategory.VALIDATION_ERROR,
    "backends.sandbox.errors.UnsupportedInstructionError": ErrorCategory.VALIDATION_ERROR,
    "backends.sandbox.errors.ExecTimeoutError": ErrorCategory.TIMEOUT,
    # The OpenAI client failing to reach the policy (other statuses: see _is_policy_failure).
    "openai.APIConnectionError": ErrorCategory.POLICY_ERROR,
    "openai.APITimeoutError": ErrorCategory.POLICY_ERROR,
    "openai.InternalServerError": ErrorCategory.POLICY_ERROR,
}

# Categories where a fresh attempt (a new sandbox, a new relay registration) may succeed.
RETRYABLE: frozenset[ErrorCategory] = frozenset({ErrorCategory.INFRA_ERROR})


def category_of(exc: BaseException) -> ErrorCategory | None:
    """The category ``CATEGORIES`` gives ``exc``'s nearest listed class, else ``None``."""
    for cls in type(exc).__mro__:
        category = CATEGORIES.get(_name(cls))
        if category is None and cls.__module__.startswith("openai."):
            category = CATEGORIES.get(f"openai.{cls.__qualname__}")  # openai._exceptions.X
        if category is not None:
            return category
    return None


def is_retryable(exc: BaseException) -> bool:
    """Whether a fresh attempt may succeed where ``exc`` failed (infrastructure faults)."""
    return category_of(exc) in RETRYABLE


def classify(exc: BaseException, phase: Phase) -> RolloutFailure:
    """Map an exception raised during ``phase`` to the failure the result reports.

    ``CATEGORIES`` decides first (our errors, a bare ``TimeoutError``, the sandbox layer, the
    OpenAI client's connection errors); then any 5xx the OpenAI client raises is a policy
    error. Anything else is that phase's own failure: a verifier error while grading, an infra
    error while setting up, an agent error otherwise.
    """
    category = category_of(exc)
    if category is None and _is_policy_failure(exc):
        category = ErrorCategory.POLICY_ERROR
    if category is None and phase is Phase.AGENT and _is_output_refused(exc):
        category = ErrorCategory.VALIDATION_ERROR
    if category is None:
        category = _PHASE_DEFAULT[phase]
    message = describe(exc)
    if category is ErrorCategory.VALIDATION_ERROR and isinstance(exc, ValidationError):
        message = f"{exc.title}: {validation_summary(exc)}"
    return RolloutFailure(category=category, phase=phase, message=message)


_PHASE_DEFAULT = {
    Phase.SETUP: ErrorCategory.INFRA_ERROR,
    Phase.AGENT: ErrorCategory.AGENT_ERROR,
    Phase.GRADING: ErrorCategory.VERIFIER_ERROR,
}


def describe(exc: BaseException) -> str:
    text = str(exc).strip()
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


# The models a workflow or integration builds its output with: their refusal is bad output
# (a message that is not JSON, say), not a crash of the agent. (A grader's is its own failure.)
_OUTPUT_MODELS = frozenset({"AgentWorkflowOutput", "RolloutSample"})


def _is_output_refused(exc: BaseException) -> bool:
    return isinstance(exc, ValidationError) and exc.title in _OUTPUT_MODELS


def _is_policy_failure(exc: BaseException) -> bool:
    # An OpenAI client status error with a 5xx status, recognised without importing it.
    if not (type(exc).__module__ or "").startswith("openai"):
        return False
    status = getattr(exc, "status_code", None)
    return isinstance(status, int) and status >= 500


def is_caller_cancellation(exc: BaseException) -> bool:
    """Whether ``exc`` is the runtime's cancellation of the running task (so it must propagate).

    A ``CancelledError`` that user code raises or re-raises on its own (awaiting a future that
    something else cancelled, say) is not: on asyncio a real cancellation leaves
    ``current_task().cancelling()`` above zero. Trio's ``Cancelled`` cannot be raised by hand.
    """
    cancelled = anyio.get_cancelled_exc_class()
    if not isinstance(exc, cancelled):
        return False
    if cancelled is not asyncio.CancelledError:  # trio
        return True
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


def must_propagate(exc: BaseException) -> bool:
    """Exceptions user code must not turn into a failed result: a real cancellation, Ctrl-C."""
    if isinstance(exc, BaseExceptionGroup):
        return any(must_propagate(e) for e in exc.exceptions)
    return isinstance(exc, KeyboardInterrupt) or is_caller_cancellation(exc)


def user_code_failure(exc: BaseException, phase: Phase) -> RolloutFailure:
    """``classify`` for anything the workflow or grader raised that ``must_propagate`` lets through."""
    who = "grader" if phase is Phase.GRADING else "workflow"
    category = ErrorCategory.VERIFIER_ERROR if phase is Phase.GRADING else ErrorCategory.AGENT_ERROR
    if isinstance(exc, SystemExit):
        message = f"the {who} called sys.exit({exc.code!r}); it must return or raise instead"
        return RolloutFailure(category=category, phase=phase, message=message)
    if not isinstance(exc, Exception):
        # A stray CancelledError (nobody cancelled this rollout) or another BaseException.
        message = f"the {who} raised {describe(exc)} although the rollout was not cancelled"
        return RolloutFailure(category=category, phase=phase, message=message)
    return classify(exc, phase)
