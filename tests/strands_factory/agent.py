"""The factory Harbor's installed Strands agent calls inside the sandbox: a plain agent on the
model the runner built from the agent's environment (the rollout's relay route)."""

from typing import Any

from strands import Agent


def create_agent(sandbox: Any, model: Any = None) -> Agent:
    return Agent(model=model, callback_handler=None)
