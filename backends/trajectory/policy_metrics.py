"""ATIF step metrics from the relay's trace: what the policy really sampled, per agent step.

Each assistant message of a sample is matched, in order, with the relay call whose answer it
is (``backends.rollout.replies``), so a message the agent wrote without a policy call, or a
call whose answer was discarded, never borrows another call's token ids. Fields come only
from what the upstream returned; nothing is invented.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from harbor.models.trajectories import Metrics

from backends.rollout.replies import match_replies


def agent_step_metrics(
    messages: Sequence[Mapping[str, Any]], trace: Mapping[str, Any]
) -> list[Metrics | None]:
    """One entry per assistant message: the metrics of its policy call, or ``None``."""
    calls = [c for c in trace.get("calls") or [] if c.get("choices")]
    replies = [c["choices"][0].get("message") for c in calls]
    return [None if k is None else _metrics(calls[k]) for k in match_replies(messages, replies)]


def _metrics(call: Mapping[str, Any]) -> Metrics:
    choice = call["choices"][0]
    usage = call.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    extra = {
        key: call[source]
        for key, source in (
            ("policy_version", "policy_version"),
            ("relay_call_index", "index"),
            ("latency_s", "latency_s"),
            ("model", "model"),
        )
        if call.get(source) is not None
    }
    return Metrics(
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        cached_tokens=details.get("cached_tokens") if isinstance(details, Mapping) else None,
        prompt_token_ids=call.get("prompt_token_ids"),
        completion_token_ids=choice.get("token_ids"),
        logprobs=choice.get("logprobs"),
        extra=extra or None,
    )
