"""The rollout context an integration binds to when its agent or model is constructed."""

from __future__ import annotations

from backends.rollout.context import RolloutContext, get_rollout_context


def active_route(what: str) -> RolloutContext:
    """The active rollout context, with a policy endpoint; ``RuntimeError`` outside a rollout.

    Integrations call this at construction: built inside ``AgentWorkflow.run()``, the agent
    talks to this rollout's route with this rollout's token, never a fixed provider.
    """
    rollout = get_rollout_context()
    if rollout is None or not rollout.base_url:
        raise RuntimeError(
            f"{what} must be constructed inside AgentWorkflow.run(), where the backend has set "
            "the rollout context and its policy endpoint"
        )
    return rollout
