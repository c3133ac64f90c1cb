"""The contract's own rules: output validation, samples, rewards, contexts, requests."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from backends import (
    AgentWorkflowConfig,
    AgentWorkflowOutput,
    BaseConfig,
    ConcurrencyConfig,
    GraderContext,
    RolloutContext,
    RolloutRequest,
    RolloutSample,
    SampleSource,
    get_rollout_context,
)
from backends.rollout.errors import ErrorCategory, Phase, classify


def test_output_rejects_unknown_fields() -> None:
    with pytest.raises(ValidationError, match="reward"):
        AgentWorkflowOutput(messages=[], reward=1.0)  # type: ignore[call-arg]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_output_rejects_non_finite_metrics(bad: float) -> None:
    with pytest.raises(ValidationError, match="finite"):
        AgentWorkflowOutput(messages=[], metrics={"steps": bad})


def test_output_rejects_messages_that_are_not_dicts() -> None:
    with pytest.raises(ValidationError, match=r"messages\[1\] must be a dict"):
        AgentWorkflowOutput(messages=[{"role": "user", "content": "a"}, "oops"])


def test_sample_trajectory_defaults_to_a_copy_and_none_skips() -> None:
    messages = [{"role": "user", "content": "hi"}]
    sample = RolloutSample(messages=messages)
    assert sample.trajectory_messages == messages
    sample.messages[0]["content"] = "changed"
    assert sample.trajectory_messages[0]["content"] == "hi"  # type: ignore[index]
    assert RolloutSample(messages=messages, trajectory_messages=None).trajectory_messages is None


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_sample_reward_must_be_finite(bad: float) -> None:
    with pytest.raises(ValidationError):
        RolloutSample(reward=bad)
    sample = RolloutSample()
    with pytest.raises(ValidationError):
        sample.reward = bad


def test_grader_context_set_reward_checks_value_and_sample() -> None:
    ctx = GraderContext(label="4", sample=RolloutSample())
    ctx.set_reward(1)
    assert ctx.sample is not None and ctx.sample.reward == 1.0
    with pytest.raises(ValueError, match="finite"):
        ctx.set_reward(math.nan)
    with pytest.raises(TypeError, match="number"):
        ctx.set_reward("1.0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no sample"):
        GraderContext(label="4", sample=None).set_reward(1.0)


def test_config_allows_extra_fields_and_bounds_concurrency() -> None:
    config = AgentWorkflowConfig(name="w", temperature=0.7)
    assert config.temperature == 0.7  # type: ignore[attr-defined]
    assert config.concurrency.max_concurrent is None
    with pytest.raises(ValidationError):
        ConcurrencyConfig(max_concurrent=0)
    with pytest.raises(ValidationError):
        BaseConfig()  # type: ignore[call-arg]


class _Source(SampleSource):
    async def get_sample(self) -> RolloutSample:
        return RolloutSample(messages=[{"role": "assistant", "content": "x"}])


def test_rollout_context_is_ambient_and_takes_one_source() -> None:
    assert get_rollout_context() is None
    with RolloutContext(chat_completions_url="http://h/v1/chat/completions", rollout_id="r") as ctx:
        assert get_rollout_context() is ctx
        assert ctx.base_url == "http://h/v1"
        source = _Source()
        ctx.set_sample_source(source)
        ctx.set_sample_source(source)  # the same source again is harmless
        with pytest.raises(RuntimeError, match="already registered"):
            ctx.set_sample_source(_Source())
    assert get_rollout_context() is None


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("rollout_id", "a/b", "rollout id"),
        ("rollout_id", "..", "rollout id"),
        ("prompt", "hello", "prompt must be a list"),
        ("prompt", [{"content": "no role"}], "no 'role'"),
        ("agent_timeout_sec", -1.0, "agent_timeout_sec"),
        ("grader_timeout_sec", math.inf, "grader_timeout_sec"),
    ],
)
def test_request_rejects_bad_input_naming_it(field: str, value: object, message: str) -> None:
    data: dict[str, object] = {"rollout_id": "ok", "prompt": [{"role": "user", "content": "q"}]}
    data[field] = value
    with pytest.raises(ValidationError, match=message):
        RolloutRequest.model_validate(data)


def test_classify_keeps_categories_apart() -> None:
    assert classify(RuntimeError("x"), Phase.AGENT).category is ErrorCategory.AGENT_ERROR
    assert classify(RuntimeError("x"), Phase.GRADING).category is ErrorCategory.VERIFIER_ERROR
    assert classify(TimeoutError(), Phase.AGENT).category is ErrorCategory.TIMEOUT
    failure = classify(ValueError("bad value in my code"), Phase.AGENT)
    assert failure.category is ErrorCategory.AGENT_ERROR
    assert "bad value in my code" in failure.message


def test_classify_recognises_policy_endpoint_failures() -> None:
    openai = pytest.importorskip("openai")
    import httpx

    request = httpx.Request("POST", "http://policy/v1/chat/completions")
    response = httpx.Response(502, request=request)
    exc = openai.InternalServerError("bad gateway", response=response, body=None)
    assert classify(exc, Phase.AGENT).category is ErrorCategory.POLICY_ERROR
    conn = openai.APIConnectionError(request=request)
    assert classify(conn, Phase.AGENT).category is ErrorCategory.POLICY_ERROR
    bad_request = openai.BadRequestError(
        "bad", response=httpx.Response(400, request=request), body=None
    )
    assert classify(bad_request, Phase.AGENT).category is ErrorCategory.AGENT_ERROR


@pytest.mark.parametrize("bad", [True, "1.0", "1e308"])
def test_sample_reward_refuses_bools_and_strings(bad: object) -> None:
    # Lax validation used to turn True into 1.0 and "1e308" into a float.
    with pytest.raises(ValidationError, match="reward must be a number"):
        RolloutSample(reward=bad)
    sample = RolloutSample()
    with pytest.raises(ValidationError, match="reward must be a number"):
        sample.reward = bad  # type: ignore[assignment]
    assert RolloutSample(reward=1).reward == 1.0
