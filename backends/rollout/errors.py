"""The failure taxonomy: one exception class per kind of failure, mapped once to a category.

Callers catch exactly what they can handle; ``classify`` turns any exception raised while a
rollout runs into the ``RolloutFailure`` its result carries.
"""

from __future__ import annotations

import asyncio
from enum import StrEnum
from typing import ClassVar

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


class RolloutError(Exception):
    """Base of every error this package raises about a rollout."""

    category: ClassVar[ErrorCategory] = ErrorCategory.INTERNAL_ERROR
    retryable: ClassVar[bool] = False


class RolloutValidationError(RolloutError, ValueError):
    """The request, the workflow's return value or the grader's reward has the wrong shape."""

    category = ErrorCategory.VALIDATION_ERROR


class PolicyError(RolloutError):
    """The policy endpoint failed: an upstream 5xx, a timeout, a refused connection."""

    category = ErrorCategory.POLICY_ERROR


class InfrastructureError(RolloutError):
    """The machinery around the rollout failed; a fresh attempt may succeed."""

    category = ErrorCategory.INFRA_ERROR
    retryable = True


class SandboxError(InfrastructureError):
    """A sandbox could not be created, reached or torn down."""


class VerifierError(RolloutError):
    """The grader or verifier ran but produced no usable reward."""

    category = ErrorCategory.VERIFIER_ERROR


class RolloutTimeoutError(RolloutError, TimeoutError):
    """A deadline (agent or grader) passed."""

    category = ErrorCategory.TIMEOUT


class RolloutCancelledError(RolloutError):
    """The rollout was cancelled by its caller."""

    category = ErrorCategory.CANCELLED


class UnknownRolloutError(RolloutError, KeyError):
    """No rollout with that id is known."""

    category = ErrorCategory.VALIDATION_ERROR


def classify(exc: BaseException, phase: Phase) -> RolloutFailure:
    """Map an exception raised during ``phase`` to the failure the result reports.

    Our own errors carry their category. A bare ``TimeoutError`` is a timeout. Errors that the
    OpenAI client raises for a failing endpoint are policy errors. Anything else raised by user
    code is that phase's own failure: an agent error, or a verifier error while grading.
    """
    if isinstance(exc, RolloutError):
        category = exc.category
    elif isinstance(exc, TimeoutError):
        category = ErrorCategory.TIMEOUT
    elif _is_policy_failure(exc):
        category = ErrorCategory.POLICY_ERROR
    elif phase is Phase.AGENT and _is_output_refused(exc):
        category = ErrorCategory.VALIDATION_ERROR
    elif phase is Phase.GRADING:
        category = ErrorCategory.VERIFIER_ERROR
    elif phase is Phase.SETUP:
        category = ErrorCategory.INFRA_ERROR
    else:
        category = ErrorCategory.AGENT_ERROR
    message = describe(exc)
    if category is ErrorCategory.VALIDATION_ERROR and isinstance(exc, ValidationError):
        message = f"{exc.title}: {validation_summary(exc)}"
    return RolloutFailure(category=category, phase=phase, message=message)


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
    # Recognised by the client library's exception types, without importing it: a 5xx status,
    # a connection failure or a client-side timeout from the model endpoint.
    module = type(exc).__module__ or ""
    if not module.startswith("openai"):
        return False
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & {"APIConnectionError", "APITimeoutError", "InternalServerError"}:
        return True
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
