"""ATIF step metrics from the relay's trace: what the policy really sampled, per agent step.

Each assistant message of a sample is matched, in order, with the relay call whose answer it
is (same text and same tool calls), so a message the agent wrote without a policy call, or a
call whose answer was discarded, never borrows another call's token ids. Fields come only
from what the upstream returned; nothing is invented.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from harbor.models.trajectories import Metrics


def agent_step_metrics(
    messages: Sequence[Mapping[str, Any]], trace: Mapping[str, Any]
) -> list[Metrics | None]:
    """One entry per assistant message: the metrics of its policy call, or ``None``."""
    calls = [c for c in trace.get("calls") or [] if c.get("choices")]
    out: list[Metrics | None] = []
    next_call = 0
    for message in messages:
        if message.get("role") != "assistant":
            continue
        match = next(
            (
                k
                for k in range(next_call, len(calls))
                if _same_reply(message, calls[k]["choices"][0].get("message"))
            ),
            None,
        )
        if match is None:
            out.append(None)
            continue
        next_call = match + 1
        out.append(_metrics(calls[match]))
    return out


def _same_reply(message: Mapping[str, Any], reply: Mapping[str, Any] | None) -> bool:
    if not reply:
        return False
    if _text(message.get("content")) != _text(reply.get("content")):
        return False
    return _calls(message.get("tool_calls")) == _calls(reply.get("tool_calls"))


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content.strip()
    return json.dumps(content, sort_keys=True)


def _calls(tool_calls: Any) -> list[tuple[str, str]]:
    out = []
    for call in tool_calls or []:
        function = (call.get("function") or {}) if isinstance(call, Mapping) else {}
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, sort_keys=True)
        out.append((str(function.get("name")), arguments))
    return out


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
