"""What a grader reads of a sample: the text of its final assistant turn."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from backends.rollout.errors import VerifierError
from backends.rollout.sample import RolloutSample


def final_answer(sample: RolloutSample | None) -> str:
    """The text of the sample's last assistant message (text parts joined).

    Raises ``VerifierError`` when there is no sample or no assistant message to grade.
    """
    if sample is None:
        raise VerifierError("there is no sample to grade")
    for message in reversed(sample.messages):
        if message.get("role") == "assistant":
            return message_text(message)
    raise VerifierError("the sample has no assistant message to grade")


def message_text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts (OpenAI, Strands blocks): keep the text ones
        return "".join(
            str(part["text"])
            for part in content
            if isinstance(part, Mapping)
            and "text" in part
            and part.get("type") in (None, "text", "output_text")
        )
    return ""
