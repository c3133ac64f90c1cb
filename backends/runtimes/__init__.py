"""Agent runtimes: Harbor's installed agents prepared once on the host, offline in sandboxes.

``RUNTIMES`` (``recipes.py``) maps a Harbor agent name to a recipe; ``ensure_runtime`` builds
the recipe's runtime once into the shared cache (locked, content-addressed, prunable) and
returns it held; ``Runtime.sandbox_kwargs`` binds it into a local sandbox read-only; the
recipe's ``agent_class`` (``agents.py``) is Harbor's agent with its install step replaced by
that runtime. HarborBackend does all of this for ``agent="mini-swe-agent"`` (a
``PythonRuntime``), ``"codex"``, ``"claude-code"`` and ``"opencode"`` (``NodeRuntime``s).
"""

from backends.runtimes.build import Runtime, RuntimeManifest, ensure_runtime, runtimes_dir
from backends.runtimes.recipes import (
    RUNTIMES,
    NodeRuntime,
    PythonRuntime,
    Recipe,
    RuntimeBuildError,
    runtime_for,
)

__all__ = [
    "RUNTIMES",
    "NodeRuntime",
    "PythonRuntime",
    "Recipe",
    "Runtime",
    "RuntimeBuildError",
    "RuntimeManifest",
    "ensure_runtime",
    "runtime_for",
    "runtimes_dir",
]
