"""Agent-framework integrations: the framework's agent, bound to the active rollout context.

    backends.integrations.strands        Strands Agents   (pip extra: strands)
    backends.integrations.openai_agents  OpenAI Agents SDK (pip extra: openai-agents)

Each gives a model placeholder that resolves to the rollout's policy route when constructed
inside ``AgentWorkflow.run()``, and registers the conversation as the rollout's sample source,
so the workflow returns ``None``. Nothing here is imported until a submodule is.
"""

from backends.integrations.context import active_route

__all__ = ["active_route"]
