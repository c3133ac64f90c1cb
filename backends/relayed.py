"""RelayedBackend: route every rollout's policy calls through a rollout-scoped relay route.

The inner backend (and the agent inside it) sees only the relay route and a token valid for
this one rollout while it runs; the trainer's endpoint and key stay in the relay. When the
rollout ends its token is revoked and the relay's trace (every call, with token ids and
logprobs when the upstream returned them) is the result's ``policy_trace``. The backend gets
the route typed (``RolloutRequest.policy_route``): host URL, token, and the relay's socket and
advertised URL for agents inside sandboxes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import anyio

from backends.relay import Grant, Relay, RolloutTrace
from backends.rollout.backend import CancelDisposition, ExecutionBackend, start_backend
from backends.rollout.errors import ErrorCategory, Phase, RolloutFailure
from backends.rollout.request import (
    POLICY_TRACE_FIELD,
    RolloutRequest,
    RolloutResult,
    RolloutStatus,
)
from backends.rollout.route import PolicyRoute

TRACE_FIELD = POLICY_TRACE_FIELD  # the trace's key in a result's JSON form
# Where a sample lists its assistant turns (message indexes) that no relayed call produced.
UNRELAYED_FIELD = "unrelayed_assistant_turns"
# How many policy calls attempts the backend started over from made (left out of the trace).
DISCARDED_FIELD = "discarded_policy_calls"

log = logging.getLogger(__name__)


class RelayedBackend:
    """An ``ExecutionBackend`` that puts ``relay`` between ``backend`` and the policy.

    A request's ``chat_completions_url`` and ``api_key`` become the rollout's upstream; with
    none, the relay's own upstream serves it. An agent failure whose trace shows the policy
    failing (an upstream 5xx, timeout or refused connection) is reported as ``policy_error``.

    The route it hands the backend can be renewed (``PolicyRoute.renew``): a backend that
    retries a rollout after its agent made policy calls gets a fresh registration and token,
    the old token stops working, and the result's trace holds the last attempt's calls only
    (``extra_fields["discarded_policy_calls"]`` counts the others).
    """

    def __init__(self, backend: ExecutionBackend, relay: Relay) -> None:
        self.backend = backend
        self.relay = relay

    async def execute(self, request: RolloutRequest) -> RolloutResult:
        registration = Registration(self.relay, request)
        try:
            route = registration.open()
        except ValueError as exc:
            return RolloutResult.failed(
                request.rollout_id,
                RolloutFailure(
                    category=ErrorCategory.VALIDATION_ERROR, phase=Phase.SETUP, message=str(exc)
                ),
            )
        try:
            result = await self.backend.execute(route.onto(request))
        finally:
            trace = await registration.close()
        result = attach_trace(result, trace)
        if registration.discarded_calls:
            # Calls of attempts the backend started over from: not in the trace, counted.
            result.extra_fields[DISCARDED_FIELD] = registration.discarded_calls
        return result

    async def start(self) -> None:
        await start_backend(self.backend)

    def status(self, rollout_id: str) -> RolloutStatus | None:
        return self.backend.status(rollout_id)

    def has_capacity(self) -> bool:
        return self.backend.has_capacity()

    def cancel(
        self, ids: Iterable[str] | None = None, prefix: str | None = None, all: bool = False
    ) -> dict[str, CancelDisposition]:
        return self.backend.cancel(ids=ids, prefix=prefix, all=all)

    def health(self) -> dict[str, Any]:
        return {**self.backend.health(), "relay": self.relay.base_url}

    async def aclose(self) -> None:
        await self.backend.aclose()

    def __getattr__(self, name: str) -> Any:
        # Backend-specific hooks (a server sampling live previews, say) pass through.
        if name == "backend":
            raise AttributeError(name)
        return getattr(self.backend, name)


class Registration:
    """A rollout's registration with the relay, renewable while the rollout runs.

    ``open`` registers and returns the route (its ``renew`` set); ``route.renew()`` ends the
    current registration, so its token is refused from then on and its calls leave the
    trace (counted in ``discarded_calls``), then opens a fresh one with a new token: a
    backend retrying after policy calls were made starts over clean. ``close`` ends the
    last one and returns its trace.
    """

    def __init__(self, relay: Relay, request: RolloutRequest) -> None:
        self.relay = relay
        self.rollout_id = request.rollout_id
        # The upstream stays the relay's: the request's own URL and key go no further.
        self._upstream = {
            "upstream_url": request.chat_completions_url,
            "upstream_api_key": request.api_key,
        }
        self.discarded_calls = 0
        self._live = False

    def open(self) -> PolicyRoute:
        """Register; raises ``ValueError`` as ``Relay.register`` does."""
        grant = self.relay.register(self.rollout_id, **self._upstream)
        self._live = True
        # Like the reference protocol, the URL is the OpenAI base URL (clients append
        # /chat/completions); RolloutContext.base_url accepts either form.
        return policy_route(self.relay, grant).model_copy(update={"renew": self.renew})

    async def renew(self) -> PolicyRoute:
        self.discarded_calls += len((await self.close()).calls)
        return self.open()

    async def close(self) -> RolloutTrace:
        if not self._live:  # a renewal failed to register again: nothing since
            return RolloutTrace(rollout_id=self.rollout_id, registered_at=time.time())
        self._live = False
        # Shielded: a cancelled rollout must still revoke its token. `aend` revokes it at
        # once, then builds the trace (parsing every call) on a worker thread.
        with anyio.CancelScope(shield=True):
            trace = await self.relay.aend(self.rollout_id)
        return trace


def policy_route(relay: Relay, grant: Grant) -> PolicyRoute:
    """The route of ``grant``'s rollout: the relay's TCP URL, its socket and advertised URL."""
    return PolicyRoute(
        rollout_id=grant.rollout_id,
        base_url=grant.base_url,
        api_key=grant.token,
        relay_path=grant.path,
        relay_socket=relay.unix_socket_path,
        advertised_url=relay.advertised_url,
    )


def attach_trace(result: RolloutResult, trace: RolloutTrace) -> RolloutResult:
    """Put the trace on the result; blame the policy when it, not the agent, failed.

    Two cases: the agent failed after a policy failure (relabelled ``policy_error``), and the
    agent swallowed a policy failure and finished anyway, its last policy call unanswered.
    The second is a failure too: its reward would score a trajectory the policy never
    completed (a dead endpoint would otherwise train as reward 0). The sample is kept for
    diagnosis, without a reward.

    Assistant turns the relay never answered (a direct provider call, text the agent wrote
    itself) are listed in ``sample.extra_fields["unrelayed_assistant_turns"]`` (indexes into
    ``trajectory_messages``, else ``messages``): the trainer has no tokens of its policy for
    them.
    """
    result = flag_unrelayed_turns(result, trace)
    failure = result.failure
    policy = trace.policy_failure()
    if policy is not None and failure is not None and failure.category is ErrorCategory.AGENT_ERROR:
        failure = failure.model_copy(
            update={
                "category": ErrorCategory.POLICY_ERROR,
                "message": f"{policy.message} (the agent then failed: {failure.message})",
            }
        )
    elif (
        policy is not None
        and result.status is RolloutStatus.SUCCESS
        and trace.calls[-1].index == policy.call_index
    ):
        unanswered = RolloutFailure(
            category=ErrorCategory.POLICY_ERROR,
            phase=Phase.AGENT,
            message=f"{policy.message} (the rollout finished without a policy answer to its "
            "last call, so its reward is withheld)",
        )
        return RolloutResult.failed(
            result.rollout_id,
            unanswered,
            sample=result.sample,
            timings=result.timings,
            extra_fields=result.extra_fields,
            policy_trace=trace,
        )
    return result.model_copy(update={"policy_trace": trace, "failure": failure})


def flag_unrelayed_turns(result: RolloutResult, trace: RolloutTrace) -> RolloutResult:
    """List the sample's assistant turns that no call in ``trace`` produced (see above)."""
    sample = result.sample
    if sample is None:
        return result
    # The chat-completions copy when there is one: a framework's native history (Strands
    # content blocks, say) is not in the shape the relay's calls answered in.
    messages = sample.trajectory_messages or sample.messages
    if not (unseen := trace.unrelayed_turns(messages)):
        if UNRELAYED_FIELD in sample.extra_fields:  # only the relay may say so, not the agent
            extra = {k: v for k, v in sample.extra_fields.items() if k != UNRELAYED_FIELD}
            return result.model_copy(
                update={"sample": sample.model_copy(update={"extra_fields": extra})}
            )
        return result
    log.warning(
        "rollout %s: %d assistant turn(s) did not come through the relay (a direct provider "
        "call bypasses the rollout context), so they cannot be trained on",
        result.rollout_id,
        len(unseen),
    )
    extra = {**sample.extra_fields, UNRELAYED_FIELD: unseen}
    return result.model_copy(update={"sample": sample.model_copy(update={"extra_fields": extra})})
