"""Example rollout: an OpenAI Agents SDK agent with a calculator tool, graded by exact match.

``RolloutAgent`` talks to the policy through the rollout context and ``RolloutMemorySession``
records the run (tool calls and outputs included) as the sample, so ``run`` returns nothing.
The SDK's tracing to OpenAI is off. With the embedded scripted policy:

    backends run tasks/rollouts/openai-agents-calculator/main.py:backend \\
        -d tasks/data/calculator.jsonl
"""

from __future__ import annotations

from agents import ModelSettings, Runner, function_tool

from backends import AgentWorkflow, AgentWorkflowConfig, AgentWorkflowContext, LocalBackend
from backends.graders import ExactMatchGrader
from backends.integrations.openai_agents import RolloutAgent, RolloutMemorySession, RolloutModel


@function_tool
def calculator(a: float, op: str, b: float) -> str:
    """Compute ``a op b`` for op one of + - * /."""
    if op == "/" and b == 0:
        return "undefined"
    value = {"+": a + b, "-": a - b, "*": a * b, "x": a * b, "/": a / b if b else 0.0}[op]
    return str(int(value)) if value.is_integer() else str(value)


class CalculatorConfig(AgentWorkflowConfig):
    name: str = "openai-agents-calculator"
    temperature: float = 1.0
    max_turns: int = 6


class CalculatorWorkflow(AgentWorkflow[CalculatorConfig]):
    async def run(self, ctx: AgentWorkflowContext[CalculatorConfig]) -> None:
        config = ctx.config or CalculatorConfig()
        agent = RolloutAgent(
            name="calculator-agent",
            instructions="Use the calculator tool, then reply with just the number.",
            model=RolloutModel(),
            model_settings=ModelSettings(temperature=config.temperature),
            tools=[calculator],
        )
        session = RolloutMemorySession()
        await Runner.run(agent, ctx.prompt, session=session, max_turns=config.max_turns)


backend = LocalBackend(
    workflow=CalculatorWorkflow, workflow_config=CalculatorConfig(), grader=ExactMatchGrader
)
