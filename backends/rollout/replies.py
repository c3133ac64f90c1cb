"""Which policy call produced each assistant turn of a sample.

Each assistant message is matched, in order, with the next relay call whose answer it is (same
text and same tool calls). A message the agent wrote itself, or got from a provider it called
directly, matches nothing: it was never sampled by the policy being trained, so its tokens
cannot be trained on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any


def match_replies(
    messages: Sequence[Mapping[str, Any]], replies: Sequence[Mapping[str, Any] | None]
) -> list[int | None]:
    """For each assistant message, the index into ``replies`` of its call, or ``None``.

    ``replies`` are the calls' answer messages in call order (``None`` for a call without one).
    """
    out: list[int | None] = []
    next_call = 0
    for message in messages:
        if message.get("role") != "assistant":
            continue
        match = next(
            (k for k in range(next_call, len(replies)) if same_reply(message, replies[k])),
            None,
        )
        if match is not None:
            next_call = match + 1
        out.append(match)
    return out


def same_reply(message: Mapping[str, Any], reply: Mapping[str, Any] | None) -> bool:
    if not reply:
        return False
    if _text(message.get("content")) != _text(reply.get("content")):
        return False
    return _calls(message.get("tool_calls")) == _calls(reply.get("tool_calls"))


def _text(content: Any) -> str:
    # Text parts (``[{"type": "text", "text": ...}]``) read as the string they spell, so a
    # framework that stores the answer as parts still matches the call's plain-text answer.
    if content is None:
        return ""
    if isinstance(content, str):
        return content.strip()
    if isinstance(content, list) and all(
        isinstance(p, Mapping) and p.get("type") in ("text", "output_text") for p in content
    ):
        return "".join(str(p.get("text", "")) for p in content).strip()
    return json.dumps(content, sort_keys=True)


def _calls(tool_calls: Any) -> list[tuple[str, str]]:
    out = []
    for call in tool_calls or []:
        function = (call.get("function") or {}) if isinstance(call, Mapping) else {}
        out.append((str(function.get("name")), _canonical(function.get("arguments"))))
    return out


def _canonical(arguments: Any) -> str:
    # Frameworks parse the model's arguments and dump them again: compare the JSON, not spacing.
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True)
