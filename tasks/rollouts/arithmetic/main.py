"""Example rollout: one policy call per dataset row, graded by exact match against the label.

The workflow reaches the policy only through the rollout context, so the same code runs
against the embedded scripted policy, a local vLLM server, or a trainer's endpoint.
"""

from __future__ import annotations

import re
from typing import Any

import anyio
from openai import AsyncOpenAI

from backends import (
    AgentWorkflow,
    AgentWorkflowConfig,
    AgentWorkflowContext,
    AgentWorkflowOutput,
    ConcurrencyConfig,
    Grader,
    GraderContext,
    LocalBackend,
    create_rollout_server,
    get_rollout_context,
)


class ArithmeticConfig(AgentWorkflowConfig):
    name: str = "arithmetic"
    model: str = "policy"
    temperature: float = 1.0
    max_tokens: int = 64
    concurrency: ConcurrencyConfig = ConcurrencyConfig(max_concurrent=16)


class ArithmeticWorkflow(AgentWorkflow[ArithmeticConfig]):
    async def run(self, ctx: AgentWorkflowContext[ArithmeticConfig]) -> AgentWorkflowOutput:
        config = ctx.config or ArithmeticConfig()
        rollout = get_rollout_context()
        if rollout is None or not rollout.base_url:
            raise RuntimeError("no policy endpoint: run this workflow through a backend")
        async with AsyncOpenAI(
            base_url=rollout.base_url, api_key=rollout.api_key or "none"
        ) as client:
            response = await client.chat.completions.create(
                model=config.model,
                messages=ctx.prompt,  # type: ignore[arg-type]
                temperature=config.temperature,
                max_tokens=config.max_tokens,
            )
        reply = response.choices[0].message.model_dump(exclude_none=True)
        if ctx.artifacts_dir:
            await anyio.Path(ctx.artifacts_dir / "reply.txt").write_text(reply.get("content") or "")
        usage = response.usage
        metrics = {"completion_tokens": float(usage.completion_tokens)} if usage else {}
        return AgentWorkflowOutput(messages=[*ctx.prompt, reply], metrics=metrics)


def final_number(text: str) -> str | None:
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
    return numbers[-1] if numbers else None


class ExactAnswerGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        assert ctx.sample is not None
        content: Any = ctx.sample.messages[-1].get("content") or ""
        answer = final_number(content if isinstance(content, str) else str(content))
        ctx.set_reward(1.0 if answer is not None and answer == ctx.label else 0.0)


arithmetic_config = ArithmeticConfig()

backend = LocalBackend(
    workflow=ArithmeticWorkflow,
    workflow_config=arithmetic_config,
    grader=ExactAnswerGrader,
)

# A trainer drives this rollout over HTTP: `backends serve tasks/rollouts/arithmetic/main.py:app`.
app = create_rollout_server(backend=backend)
