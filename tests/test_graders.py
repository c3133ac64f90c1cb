"""Ready-made graders, run the way a user runs them: through LocalBackend, judges over real HTTP."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from policy_support import completion, policy_server

from backends import (
    AgentWorkflow,
    AgentWorkflowContext,
    ErrorCategory,
    GraderConfig,
    LocalBackend,
    Phase,
    RolloutRequest,
    RolloutResult,
    RolloutStatus,
)
from backends.graders import (
    ExactMatchGrader,
    ModelInfo,
    Rubric,
    RubricGrader,
    RubricGraderConfig,
    load_rubrics,
    reward_function,
)

pytestmark = pytest.mark.anyio


class Answers(AgentWorkflow[Any]):
    """Answers what the row's metadata says (no policy needed to test a grader)."""

    async def run(self, ctx: AgentWorkflowContext[Any]) -> list[dict[str, Any]]:
        meta = ctx.metadata or {}
        if meta.get("no_answer"):
            return list(ctx.prompt)
        return [*ctx.prompt, {"role": "assistant", "content": meta["answer"]}]


def req(answer: str, label: str | None = "42", rid: str = "r1", **meta: Any) -> RolloutRequest:
    return RolloutRequest(
        rollout_id=rid,
        prompt=[{"role": "user", "content": "What is 6 * 7?"}],
        label=label,
        metadata={"answer": answer, **meta},
    )


async def grade(grader: Any, request: RolloutRequest, config: Any = None) -> RolloutResult:
    backend = LocalBackend(
        workflow=Answers, grader=grader, grader_config=config, artifacts_root=None
    )
    return await backend.execute(request)


def verifier_failure(result: RolloutResult) -> str:
    assert result.status is RolloutStatus.FAILURE and result.reward is None
    assert result.failure is not None
    assert (result.failure.category, result.failure.phase) == (
        ErrorCategory.VERIFIER_ERROR,
        Phase.GRADING,
    )
    return result.failure.message


# -- exact match -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "config", "reward"),
    [
        ("42", None, 1.0),
        (" 42\n", None, 1.0),
        ("41", None, 0.0),
        ("Paris", GraderConfig(name="exact", case_sensitive=False), 1.0),
        ("Paris", None, 0.0),
        (" 42", GraderConfig(name="exact", strip=False), 0.0),
    ],
)
async def test_exact_match(answer: str, config: Any, reward: float) -> None:
    label = "paris" if answer == "Paris" else "42"
    result = await grade(ExactMatchGrader, req(answer, label), config)
    assert result.status is RolloutStatus.SUCCESS and result.reward == reward


async def test_exact_match_without_an_answer_is_a_verifier_error_not_zero() -> None:
    message = verifier_failure(await grade(ExactMatchGrader, req("", no_answer=True)))
    assert "no assistant message" in message


# -- the reward function decorator -------------------------------------------------------------


@reward_function
def numeric(solution_str: str, ground_truth: str, extra_info: dict[str, Any]) -> float:
    tolerance = float(extra_info.get("tolerance", 0))
    return float(abs(float(solution_str) - float(ground_truth)) <= tolerance)


@reward_function
async def async_numeric(solution_str: str, ground_truth: str | None, extra_info: dict) -> float:
    return 0.5 if solution_str == ground_truth else 0.0


async def test_a_decorated_reward_function_grades() -> None:
    assert (await grade(numeric, req("42"))).reward == 1.0
    assert (await grade(numeric, req("41"))).reward == 0.0
    assert (await grade(numeric, req("41", tolerance=1))).reward == 1.0  # extra_info: metadata
    assert (await grade(async_numeric, req("42"))).reward == 0.5
    assert numeric.__name__ == "numeric"


async def test_a_reward_function_that_raises_or_returns_junk_is_a_verifier_error() -> None:
    assert "could not convert" in verifier_failure(await grade(numeric, req("forty-two")))

    @reward_function
    def junk(solution_str: str, ground_truth: str, extra_info: dict) -> Any:
        return {"nan": float("nan"), "true": True, "text": "1"}[extra_info["kind"]]

    for kind in ("nan", "true", "text"):
        message = verifier_failure(await grade(junk, req("42", kind=kind)))
        assert "not a" in message and "junk" in message


def _two(solution_str: str, ground_truth: str) -> float:
    return 0.0


def _renamed(answer: str, ground_truth: str, extra_info: dict) -> float:
    return 0.0


def _keyword_only(solution_str: str, ground_truth: str, *, extra_info: dict) -> float:
    return 0.0


def _wrong_type(solution_str: int, ground_truth: str, extra_info: dict) -> float:
    return 0.0


def _star(*args: Any) -> float:
    return 0.0


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (_two, "must take exactly (solution_str, ground_truth, extra_info)"),
        (_renamed, "must take exactly"),
        (_keyword_only, "must take exactly"),
        (_star, "must take exactly"),
        (_wrong_type, "solution_str is annotated"),
        (42, "needs a function"),
        (ExactMatchGrader, "needs a function"),
    ],
)
def test_the_decorator_checks_the_signature_at_decoration(fn: Any, message: str) -> None:
    with pytest.raises(TypeError, match=re.escape(message)):
        reward_function(fn)


# -- the rubric grader -------------------------------------------------------------------------

JUDGE_KEY = "sk-judge-0123456789abcdef"
JUDGED: list[dict[str, Any]] = []


@pytest.fixture
async def judge(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[str]:
    """An OpenAI-compatible judge that answers what the graded answer asks it to."""
    monkeypatch.setenv("JUDGE_KEY", JUDGE_KEY)
    JUDGED.clear()

    def reply(body: dict[str, Any], auth: str) -> tuple[int, dict[str, Any]]:
        JUDGED.append({"body": body, "auth": auth})
        text = body["messages"][-1]["content"].rsplit("Response to grade:\n", 1)[1]
        if text == "judge is down":
            return 500, {"error": {"message": "judge overloaded"}}
        if text == "key refused":  # as providers do: the refused key echoed in the error
            return 401, {"error": {"message": f"Incorrect API key provided: {auth[7:]}"}}
        verdicts = {
            "perfect": '{"score": 9, "explanation": "above the range"}',
            "fenced": 'Sure.\n```json\n{"score": 0.75, "explanation": "mostly right"}\n```',
            "bare": "0.25",
            "negative": '{"score": -3}',
            "rambling": "I think it is quite good overall.",
            "nan": '{"score": "NaN"}',
        }
        return 200, completion(body, verdicts[text])

    async with policy_server(reply) as url:
        yield url


def rubric(url: str, **fields: Any) -> Rubric:
    return Rubric(
        id="correct",
        rubric="Award 1 for a correct answer, 0 otherwise.",
        model_info=ModelInfo(
            provider="local", model="judge", api_key_env="JUDGE_KEY", base_url=url
        ),
        **fields,
    )


@pytest.mark.parametrize(
    ("answer", "reward", "raw"),
    [("perfect", 1.0, 9.0), ("fenced", 0.75, 0.75), ("bare", 0.25, 0.25), ("negative", 0.0, -3)],
)
async def test_the_judges_score_is_clamped_to_the_range(
    judge: str, answer: str, reward: float, raw: float
) -> None:
    config = RubricGraderConfig(rubric=rubric(judge))
    result = await grade(RubricGrader, req(answer), config)
    assert result.status is RolloutStatus.SUCCESS and result.reward == reward
    assert result.sample is not None
    assert result.sample.extra_fields["rubric"]["raw_score"] == raw
    (call,) = JUDGED
    assert call["auth"] == f"Bearer {JUDGE_KEY}" and call["body"]["model"] == "judge"
    prompt = call["body"]["messages"][-1]["content"]
    # The judge sees the rubric, the task, the reference answer and the response.
    assert "Award 1 for a correct answer" in prompt and "What is 6 * 7?" in prompt
    assert "Reference answer:\n42" in prompt


async def test_a_wider_range_is_kept(judge: str) -> None:
    config = RubricGraderConfig(rubric=rubric(judge, score_min=0, score_max=10))
    assert (await grade(RubricGrader, req("perfect"), config)).reward == 9.0


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ("judge is down", "the judge 'judge' failed"),
        ("key refused", "Incorrect API key provided: [REDACTED]"),
        ("rambling", "has no score"),
        ("nan", "not a finite number"),
    ],
)
async def test_judge_failures_are_verifier_errors_not_zero(
    judge: str, answer: str, message: str
) -> None:
    config = RubricGraderConfig(rubric=rubric(judge))
    failure = verifier_failure(await grade(RubricGrader, req(answer), config))
    assert message in failure and JUDGE_KEY not in failure


async def test_a_missing_judge_key_is_named(judge: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JUDGE_KEY")
    config = RubricGraderConfig(rubric=rubric(judge))
    message = verifier_failure(await grade(RubricGrader, req("perfect"), config))
    assert "JUDGE_KEY is not set" in message and not JUDGED


async def test_an_unreachable_judge_is_a_verifier_error_not_a_policy_error() -> None:
    # The OpenAI client's connection error is a policy error for agents; for the judge it is
    # the grader failing.
    info = ModelInfo(provider="local", model="judge", base_url="http://127.0.0.1:9/v1")
    config = RubricGraderConfig(rubric=Rubric(id="r", rubric="Award 1.", model_info=info))
    assert "failed" in verifier_failure(await grade(RubricGrader, req("perfect"), config))


async def test_rubrics_load_from_yaml(judge: str, tmp_path: Path) -> None:
    path = tmp_path / "rubrics.yaml"
    path.write_text(
        "rubrics:\n"
        "  - id: correct\n"
        "    rubric: Award 1 for a correct answer.\n"
        f"    model_info: {{provider: local, model: judge, api_key_env: JUDGE_KEY, base_url: '{judge}'}}\n"
        "    score_max: 1.0\n"
        "  - id: strict\n"
        "    rubric: Award 0.5 at most.\n"
        f"    model_info: {{provider: local, model: judge, base_url: '{judge}'}}\n"
        "    score_max: 0.5\n"
    )
    assert set(load_rubrics(path)) == {"correct", "strict"}
    config = RubricGraderConfig(rubric_file=path, rubric_id="strict")
    assert (await grade(RubricGrader, req("perfect"), config)).reward == 0.5
    with pytest.raises(ValueError, match="pick one with rubric_id"):
        RubricGraderConfig(rubric_file=path)
    with pytest.raises(ValueError, match="no rubric 'other'"):
        RubricGraderConfig(rubric_file=path, rubric_id="other")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"score_min": 1, "score_max": 1}, "must be below"),
        ({"score_max": float("inf")}, "finite"),
    ],
)
def test_bad_rubrics_are_refused_at_configuration(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rubric("http://judge/v1", **fields)


def test_an_unknown_provider_needs_a_base_url() -> None:
    with pytest.raises(ValueError, match=r"needs model_info\.base_url"):
        ModelInfo(provider="acme", model="judge")


def test_the_judge_key_never_lands_in_the_config() -> None:
    config = RubricGraderConfig(rubric=rubric("http://judge/v1"))
    assert JUDGE_KEY not in json.dumps(config.model_dump(mode="json"))
