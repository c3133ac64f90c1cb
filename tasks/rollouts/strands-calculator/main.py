"""Example rollout: a Strands agent with a calculator tool, graded by exact match.

The agent reaches the policy only through the rollout context (``RolloutModel``) and registers
its history as the sample, so ``run`` returns nothing. With the embedded scripted policy,
``backends run`` plays a tool call and then the answer, both through the relay:

    backends run tasks/rollouts/strands-calculator/main.py:backend -d tasks/data/calculator.jsonl
"""

from __future__ import annotations

from strands import tool

from backends import AgentWorkflow, AgentWorkflowConfig, AgentWorkflowContext, LocalBackend
from backends.graders import ExactMatchGrader
from backends.integrations.strands import RolloutModel, RolloutStrandsAgent


@tool
def calculator(a: float, op: str, b: float) -> str:
    """Compute ``a op b`` for op one of + - * /."""
    if op == "/" and b == 0:
        return "undefined"
    value = {"+": a + b, "-": a - b, "*": a * b, "x": a * b, "/": a / b if b else 0.0}[op]
    return str(int(value)) if value.is_integer() else str(value)


class CalculatorConfig(AgentWorkflowConfig):
    name: str = "strands-calculator"
    temperature: float = 1.0


class CalculatorWorkflow(AgentWorkflow[CalculatorConfig]):
    async def run(self, ctx: AgentWorkflowContext[CalculatorConfig]) -> None:
        config = ctx.config or CalculatorConfig()
        agent = RolloutStrandsAgent(
            name="calculator-agent",
            model=RolloutModel(params={"temperature": config.temperature}),
            messages=ctx.prompt,
            tools=[calculator],
            callback_handler=None,
        )
        await agent.invoke_async()


backend = LocalBackend(
    workflow=CalculatorWorkflow, workflow_config=CalculatorConfig(), grader=ExactMatchGrader
)
