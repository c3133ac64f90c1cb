"""Which Harbor agent runs a trial: any name in Harbor's registry or a ``BaseAgent`` import path.

A registry name with a runtime recipe (``backends.runtimes``, e.g. ``mini-swe-agent``) runs
as the recipe's agent class: Harbor's own, its install replaced by the prepared runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harbor.agents.base import BaseAgent
from harbor.agents.factory import AgentFactory

from backends.rollout.loading import load_object
from backends.rollout.workflow import AgentWorkflow
from backends.runtimes.recipes import runtime_for

# Harbor's agents that call no model: they need no relay route.
MODEL_FREE = frozenset({"oracle", "nop"})


class AgentSpecError(ValueError):
    """The ``agent=`` given to HarborBackend names no usable agent."""


@dataclass(frozen=True)
class AgentSpec:
    """A resolved agent: a registry name or an import path, never both."""

    name: str | None = None
    import_path: str | None = None
    runtime: str | None = None  # the recipe in backends.runtimes that replaces its install

    @property
    def label(self) -> str:
        return self.name or self.import_path or "?"

    @property
    def calls_model(self) -> bool:
        return self.name not in MODEL_FREE

    def harbor_config(self) -> dict[str, str | None]:
        """The ``name`` and ``import_path`` of Harbor's ``AgentConfig`` for this agent."""
        recipe = runtime_for(self.runtime)
        if recipe is not None:
            return {"name": None, "import_path": recipe.agent_class}
        return {"name": self.name, "import_path": self.import_path}


def resolve_agent(agent: str | type) -> AgentSpec:
    """Resolve ``agent``: a Harbor registry name, ``"module:Class"``, or a class.

    Raises ``AgentSpecError`` naming the problem: an unknown name (with the registry's names),
    an import path that does not load, a class that is not a Harbor ``BaseAgent``, or an
    ``AgentWorkflow`` (which needs the rollout bundle, not available yet).
    """
    if isinstance(agent, str) and ":" not in agent:
        names = AgentFactory.registered_names()
        if agent not in names:
            raise AgentSpecError(
                f"agent {agent!r} is not in Harbor's registry; known agents: {', '.join(names)} "
                "(or pass a BaseAgent import path 'module:Class')"
            )
        return AgentSpec(name=agent, runtime=agent if runtime_for(agent) else None)
    try:
        cls: Any = load_object(agent)
    except ImportError as exc:
        raise AgentSpecError(f"agent {agent!r} cannot be loaded: {exc}") from exc
    if isinstance(cls, type) and issubclass(cls, AgentWorkflow):
        raise AgentSpecError(
            f"agent {cls.__name__} is an AgentWorkflow: running a workflow inside a Harbor "
            "sandbox needs the rollout bundle, which this version does not ship yet; use a "
            "Harbor agent (a registry name or a BaseAgent import path), or LocalBackend"
        )
    if not (isinstance(cls, type) and issubclass(cls, BaseAgent)):
        raise AgentSpecError(
            f"agent {agent!r} is {cls!r}, not a Harbor BaseAgent subclass or registry name"
        )
    # By module name, which also covers classes loaded from a file path (already imported).
    return AgentSpec(import_path=f"{cls.__module__}:{cls.__qualname__}")
