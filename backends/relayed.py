"""RelayedBackend: route every rollout's policy calls through a rollout-scoped relay route.

The inner backend (and the agent inside it) sees only the relay route and a token valid for
this one rollout while it runs; the trainer's endpoint and key stay in the relay. When the
rollout ends its token is revoked and the relay's trace (every call, with token ids and
logprobs when the upstream returned them) is attached to the result.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from backends.relay import Relay, RolloutTrace
from backends.rollout.backend import CancelDisposition, ExecutionBackend
from backends.rollout.errors import ErrorCategory, Phase, RolloutFailure
from backends.rollout.request import (
    POLICY_TRACE_FIELD,
    RolloutRequest,
    RolloutResult,
    RolloutStatus,
)

TRACE_FIELD = POLICY_TRACE_FIELD


class RelayedBackend:
    """An ``ExecutionBackend`` that puts ``relay`` between ``backend`` and the policy.

    A request's ``chat_completions_url`` and ``api_key`` become the rollout's upstream; with
    none, the relay's own upstream serves it. An agent failure whose trace shows the policy
    failing (an upstream 5xx, timeout or refused connection) is reported as ``policy_error``.
    """

    def __init__(self, backend: ExecutionBackend, relay: Relay) -> None:
        self.backend = backend
        self.relay = relay

    async def execute(self, request: RolloutRequest) -> RolloutResult:
        rid = request.rollout_id
        try:
            grant = self.relay.register(
                rid, upstream_url=request.chat_completions_url, upstream_api_key=request.api_key
            )
        except ValueError as exc:
            return RolloutResult.failed(
                rid,
                RolloutFailure(
                    category=ErrorCategory.VALIDATION_ERROR, phase=Phase.SETUP, message=str(exc)
                ),
            )
        # Like the reference protocol, the URL is the OpenAI base URL (clients append
        # /chat/completions); RolloutContext.base_url accepts either form.
        routed = request.model_copy(
            update={"chat_completions_url": grant.base_url, "api_key": grant.token}
        )
        try:
            result = await self.backend.execute(routed)
        finally:
            trace = self.relay.end(rid)
        return attach_trace(result, trace)

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


def attach_trace(result: RolloutResult, trace: RolloutTrace) -> RolloutResult:
    """Put the trace on the result; blame the policy when it, not the agent, failed."""
    extra = {**result.extra_fields, TRACE_FIELD: trace.model_dump(mode="json")}
    failure = result.failure
    if failure is not None and failure.category is ErrorCategory.AGENT_ERROR:
        policy = trace.policy_failure()
        if policy is not None:
            failure = failure.model_copy(
                update={
                    "category": ErrorCategory.POLICY_ERROR,
                    "message": f"{policy.message} (the agent then failed: {failure.message})",
                }
            )
    return result.model_copy(update={"extra_fields": extra, "failure": failure})
