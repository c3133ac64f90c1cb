"""A rollout's policy trace: every policy call the relay saw, typed, as a result carries it.

The relay (``backends.relay``) records calls and builds these models when a rollout ends; they
live here, in the contract, so a result can carry its trace without importing the relay's HTTP
stack.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field

from backends.rollout.replies import match_replies


class CallError(StrEnum):
    """Why a call got no normal answer from the upstream."""

    TIMEOUT = "timeout"  # the upstream did not answer (or stopped streaming) in time
    CONNECTION = "connection"  # the upstream could not be reached, or dropped the connection
    INTERRUPTED = "interrupted"  # the call was still running when the trace was read
    CLIENT_DISCONNECTED = "client_disconnected"  # the agent hung up before the answer ended
    # The upstream answered, but not as a chat completion the agent's format can be made of.
    UNTRANSLATABLE = "untranslatable"


# Upstream statuses that mean "the policy failed", not "the agent asked for something wrong":
# server faults, overload, and the upstream refusing the relay's own credentials.
_POLICY_STATUSES = frozenset({401, 403, 429})


class ChoiceRecord(BaseModel):
    """One choice of a completion: the assistant message and what the upstream said about it."""

    index: int
    message: dict[str, Any] | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # sampled token ids, exactly as the upstream sent them
    logprobs: list[float] | None = None  # one per sampled token, when the upstream sent them
    logprob_tokens: list[str] | None = None  # the token strings the logprobs belong to


class CallRecord(BaseModel):
    """One policy call as the relay saw it. A client retry of the same request shares a record."""

    index: int
    method: str
    path: str  # relative to the rollout's base URL, e.g. "/chat/completions"
    # The format the agent spoke ("chat.completions", "responses", "messages"), and the one
    # the relay spoke upstream: ``request`` and ``response`` are in the upstream's format, so a
    # translated call's hold the chat completion the policy saw. ``choices`` and ``usage`` are
    # in chat-completions form whatever the formats.
    api: str = "chat.completions"
    upstream_api: str = "chat.completions"
    started_at: float  # unix time the request reached the relay
    latency_s: float | None = None  # until the last byte was sent back (None: never finished)
    # Until the upstream's answer began: its headers, or for a stream its first body bytes.
    ttfb_s: float | None = None
    status: int | None = None  # what the client got
    upstream_status: int | None = None  # what the upstream answered (None: no answer)
    error: CallError | None = None
    error_message: str | None = None
    stream: bool = False
    attempts: int = 1  # > 1 when client retries of the same request were folded in
    request: dict[str, Any] | None = None  # as the client sent it (translated: as forwarded)
    # As the upstream sent it (a stream reassembled), minus the token ids and logprobs read
    # into ``choices`` and ``prompt_token_ids``: each list is stored once, not twice.
    response: dict[str, Any] | None = None
    model: str | None = None
    usage: dict[str, Any] | None = None
    choices: list[ChoiceRecord] = Field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    policy_version: str | None = None

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason if self.choices else None

    @property
    def completion_token_ids(self) -> list[int] | None:
        return self.choices[0].token_ids if self.choices else None

    @property
    def logprobs(self) -> list[float] | None:
        return self.choices[0].logprobs if self.choices else None

    @property
    def scripted(self) -> bool:
        """Answered by the embedded scripted policy, not a model."""
        return bool(self.model and self.model.startswith("scripted:"))

    @property
    def is_policy_failure(self) -> bool:
        """The policy, not the agent, is why this call has no answer."""
        if self.error in (CallError.TIMEOUT, CallError.CONNECTION, CallError.UNTRANSLATABLE):
            return True
        status = self.upstream_status
        return status is not None and (status >= 500 or status in _POLICY_STATUSES)


class PolicyFailure(BaseModel):
    """Why a rollout's policy failed, for a result's error message."""

    call_index: int
    upstream_status: int | None
    error: CallError | None
    message: str


class RolloutTrace(BaseModel):
    """Every policy call of one rollout, in the order the requests arrived."""

    rollout_id: str
    registered_at: float
    ended_at: float | None = None
    calls: list[CallRecord] = Field(default_factory=list)

    def policy_failure(self) -> PolicyFailure | None:
        """The latest call whose final outcome was a policy failure, or None.

        A backend whose rollout failed calls this to label the failure "policy_error" (the model
        endpoint answered 5xx, 429, refused the relay's key, timed out or was unreachable)
        rather than "agent_error". Retries the client made of the same request are folded into
        one record, so a call that failed once and then succeeded is not a failure.
        """
        for call in reversed(self.calls):
            if call.is_policy_failure:
                return PolicyFailure(
                    call_index=call.index,
                    upstream_status=call.upstream_status,
                    error=call.error,
                    message=_failure_message(call),
                )
        return None

    def unrelayed_turns(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Indexes (among ``messages``) of assistant turns that no call of this trace answered."""
        replies = [c.choices[0].message if c.choices else None for c in self.calls]
        matches = iter(match_replies(messages, replies))
        return [
            i
            for i, message in enumerate(messages)
            if message.get("role") == "assistant" and next(matches) is None
        ]

    @property
    def scripted(self) -> bool:
        """Every answered call came from the scripted policy (label results accordingly)."""
        answered = [c for c in self.calls if c.model is not None]
        return bool(answered) and all(c.scripted for c in answered)


def policy_failure(trace: RolloutTrace) -> PolicyFailure | None:
    """Function form of ``RolloutTrace.policy_failure``."""
    return trace.policy_failure()


def _failure_message(call: CallRecord) -> str:
    where = f"policy call {call.index} ({call.method} {call.path})"
    if call.error is not None:
        return f"{where}: {call.error.value}: {call.error_message or 'no detail'}"
    return f"{where}: upstream answered HTTP {call.upstream_status}"
