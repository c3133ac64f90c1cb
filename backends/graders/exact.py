"""``ExactMatchGrader``: reward 1 when the final answer equals the label, else 0."""

from __future__ import annotations

from typing import Any

from backends.graders.config import config_as
from backends.graders.text import final_answer
from backends.rollout.config import GraderConfig
from backends.rollout.context import GraderContext
from backends.rollout.errors import VerifierError
from backends.rollout.workflow import Grader


class ExactMatchConfig(GraderConfig):
    """``strip`` trims surrounding whitespace and ``case_sensitive=False`` folds case, on both
    sides, before comparing."""

    name: str = "exact_match"
    strip: bool = True
    case_sensitive: bool = True


class ExactMatchGrader(Grader):
    """Compares the last assistant message's text with ``ctx.label``.

    A rollout without a label, sample or assistant message is a verifier error, not reward 0.
    """

    def __init__(self, config: GraderConfig | None = None) -> None:
        super().__init__(config_as(ExactMatchConfig, config))

    async def grade(self, ctx: GraderContext) -> Any:
        config = config_as(ExactMatchConfig, self.config)
        if ctx.label is None:
            raise VerifierError("exact match needs a label (ground truth) to compare with")
        answer, label = final_answer(ctx.sample), ctx.label
        if config.strip:
            answer, label = answer.strip(), label.strip()
        if not config.case_sensitive:
            answer, label = answer.casefold(), label.casefold()
        ctx.set_reward(1.0 if answer == label else 0.0)
