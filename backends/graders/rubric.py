"""``RubricGrader``: an LLM judge scores the final answer against a natural-language rubric.

A rubric is configured as in the reference SDK, in YAML or Python::

    rubrics:
      - id: helpful
        rubric: "Award 1 when the answer is correct and explains its steps, 0 otherwise."
        model_info: {provider: openai, model: gpt-4o-mini, api_key_env: OPENAI_API_KEY}
        score_min: 0.0
        score_max: 1.0

    grader_config = RubricGraderConfig(rubric_file="rubrics.yaml", rubric_id="helpful")
    backend = LocalBackend(workflow=MyWorkflow, grader=RubricGrader, grader_config=grader_config)

The judge is any OpenAI-compatible chat completions endpoint (``model_info.base_url``; the
``openai`` provider has a default). Its score is clamped to ``[score_min, score_max]`` and becomes
the reward. A judge that cannot be reached, errs, or answers without a usable score is a
verifier error: the rollout gets no reward, never a 0 it did not earn.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Self

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from backends.graders.config import config_as
from backends.graders.text import final_answer, message_text
from backends.rollout.config import GraderConfig
from backends.rollout.context import GraderContext
from backends.rollout.errors import VerifierError
from backends.rollout.sample import RolloutSample
from backends.rollout.workflow import Grader

# Providers whose OpenAI-compatible endpoint is known; any other needs model_info.base_url.
DEFAULT_BASE_URLS = {"openai": "https://api.openai.com/v1"}


class ModelInfo(BaseModel):
    """The judge model: ``provider``, ``model``, and the environment variable holding its key."""

    model_config = ConfigDict(extra="forbid")

    provider: str
    model: str
    api_key_env: str | None = None
    base_url: str | None = None
    temperature: float | None = 0.0
    max_tokens: int | None = Field(default=512, ge=1)
    timeout_sec: float = Field(default=60.0, gt=0)

    @model_validator(mode="after")
    def _endpoint(self) -> Self:
        if self.base_url is None and self.provider not in DEFAULT_BASE_URLS:
            known = ", ".join(sorted(DEFAULT_BASE_URLS))
            raise ValueError(
                f"provider {self.provider!r} needs model_info.base_url (an OpenAI-compatible "
                f"endpoint); providers with a default: {known}"
            )
        return self

    @property
    def endpoint(self) -> str:
        return self.base_url or DEFAULT_BASE_URLS[self.provider]


class Rubric(BaseModel):
    """One rubric: its ``id``, the judge's instructions, the judge model and the score range."""

    model_config = ConfigDict(extra="forbid")

    id: str
    rubric: str
    model_info: ModelInfo
    score_min: float = 0.0
    score_max: float = 1.0

    @model_validator(mode="after")
    def _range(self) -> Self:
        if not (math.isfinite(self.score_min) and math.isfinite(self.score_max)):
            raise ValueError("score_min and score_max must be finite numbers")
        if self.score_min >= self.score_max:
            raise ValueError(
                f"score_min ({self.score_min}) must be below score_max ({self.score_max})"
            )
        return self


def load_rubrics(path: Path | str) -> dict[str, Rubric]:
    """Rubrics of a YAML file, by id: a list, a ``rubrics:`` list, or one rubric mapping.

    Raises ``ValueError`` naming the file and the problem (unreadable, not YAML, a bad rubric,
    a repeated id).
    """
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read rubrics from {path}: {exc}") from None
    if isinstance(data, dict) and "rubrics" in data:
        data = data["rubrics"]
    items = data if isinstance(data, list) else [data]
    rubrics: dict[str, Rubric] = {}
    for number, item in enumerate(items):
        try:
            rubric = Rubric.model_validate(item)
        except ValidationError as exc:
            raise ValueError(f"{path}: rubric {number}: {exc}") from None
        if rubric.id in rubrics:
            raise ValueError(f"{path}: rubric id {rubric.id!r} appears twice")
        rubrics[rubric.id] = rubric
    return rubrics


class RubricGraderConfig(GraderConfig):
    """Either ``rubric`` (Python) or ``rubric_file`` (YAML; ``rubric_id`` picks one when it
    holds several). ``include_label`` shows the judge the label as a reference answer."""

    name: str = "rubric"
    rubric: Rubric | None = None
    rubric_file: Path | None = None
    rubric_id: str | None = None
    include_label: bool = True

    @model_validator(mode="after")
    def _resolve(self) -> Self:
        if (self.rubric is None) == (self.rubric_file is None):
            raise ValueError("give exactly one of rubric= and rubric_file=")
        if self.rubric_file is not None:
            rubrics = load_rubrics(self.rubric_file)
            if self.rubric_id is None and len(rubrics) != 1:
                raise ValueError(
                    f"{self.rubric_file} holds {len(rubrics)} rubrics: pick one with rubric_id"
                )
            chosen = self.rubric_id or next(iter(rubrics))
            if chosen not in rubrics:
                raise ValueError(f"{self.rubric_file} has no rubric {chosen!r}")
            # Resolved once; the file is not read again per rollout.
            object.__setattr__(self, "rubric", rubrics[chosen])
            object.__setattr__(self, "rubric_file", None)
        return self


class RubricGrader(Grader):
    """Asks the rubric's judge for a score and sets it, clamped, as the reward.

    The judge's explanation and raw score go to ``sample.extra_fields["rubric"]``.
    """

    def __init__(self, config: GraderConfig | None = None) -> None:
        if config is None:
            raise TypeError("RubricGrader needs a RubricGraderConfig (rubric= or rubric_file=)")
        super().__init__(config_as(RubricGraderConfig, config))

    async def grade(self, ctx: GraderContext) -> Any:
        config = config_as(RubricGraderConfig, self.config)
        rubric = config.rubric
        assert rubric is not None  # the config's validator resolved it
        answer = final_answer(ctx.sample)
        label = ctx.label if config.include_label else None
        messages = judge_messages(rubric, _task(ctx.sample), answer, label)
        reply = await ask_judge(rubric.model_info, messages)
        raw, explanation = parse_score(reply)
        score = min(max(raw, rubric.score_min), rubric.score_max)
        assert ctx.sample is not None
        ctx.sample.extra_fields["rubric"] = {
            "id": rubric.id,
            "raw_score": raw,
            "explanation": explanation,
        }
        ctx.set_reward(score)


def judge_messages(
    rubric: Rubric, task: str | None, answer: str, label: str | None
) -> list[dict[str, str]]:
    system = (
        "You grade a response against a rubric. Reply with only a JSON object "
        '{"score": <number>, "explanation": "<one sentence>"}, the score between '
        f"{rubric.score_min:g} and {rubric.score_max:g}."
    )
    parts = [f"Rubric:\n{rubric.rubric}"]
    if task:
        parts.append(f"Task:\n{task}")
    if label is not None:
        parts.append(f"Reference answer:\n{label}")
    parts.append(f"Response to grade:\n{answer}")
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]


async def ask_judge(model_info: ModelInfo, messages: list[dict[str, str]]) -> str:
    """The judge's reply text. Every way the call can fail is a ``VerifierError``."""
    from openai import AsyncOpenAI, OpenAIError

    key = "none"
    if model_info.api_key_env is not None:
        key = os.environ.get(model_info.api_key_env, "")
        if not key:
            raise VerifierError(
                f"the judge's key variable {model_info.api_key_env} is not set in the environment"
            )
    options: dict[str, Any] = {}
    if model_info.temperature is not None:
        options["temperature"] = model_info.temperature
    if model_info.max_tokens is not None:
        options["max_tokens"] = model_info.max_tokens
    try:
        async with AsyncOpenAI(
            base_url=model_info.endpoint, api_key=key, timeout=model_info.timeout_sec
        ) as client:
            response = await client.chat.completions.create(
                model=model_info.model,
                messages=messages,  # type: ignore[arg-type]
                **options,
            )
    except OpenAIError as exc:
        # Not a policy error: the judge is the grader's own endpoint, not the policy. An error
        # body may echo the key; the message lands in results and files.
        detail = str(exc).replace(key, "[REDACTED]") if key != "none" else str(exc)
        raise VerifierError(f"the judge {model_info.model!r} failed: {detail}") from None
    if not response.choices or not response.choices[0].message.content:
        raise VerifierError(f"the judge {model_info.model!r} answered with no text")
    return response.choices[0].message.content


_JSON_OBJECT = re.compile(r"\{.*\}", re.DOTALL)
_NUMBER = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*$")


def parse_score(reply: str) -> tuple[float, str | None]:
    """The score (and explanation) in a judge's reply: a JSON object with ``score``, possibly
    inside prose or a code fence, or a bare number. Anything else is a ``VerifierError``."""
    data: Any = None
    match = _JSON_OBJECT.search(reply)
    if match:
        try:
            data = json.loads(match.group(0))
        except ValueError:
            data = None
    if isinstance(data, dict) and "score" in data:
        value, explanation = data["score"], data.get("explanation")
    elif number := _NUMBER.match(reply):
        value, explanation = number.group(1), None
    else:
        raise VerifierError(f"the judge's reply has no score: {reply[:200]!r}")
    try:
        if isinstance(value, bool):
            raise ValueError
        score = float(value)
    except (TypeError, ValueError):
        raise VerifierError(f"the judge's score {value!r} is not a number") from None
    if not math.isfinite(score):
        raise VerifierError(f"the judge's score {value!r} is not a finite number")
    return score, str(explanation) if explanation is not None else None


def _task(sample: RolloutSample | None) -> str | None:
    # The last user turn before the answer: what the response is a response to.
    if sample is None:
        return None
    for message in reversed(sample.messages):
        if message.get("role") == "user":
            return message_text(message)
    return None
