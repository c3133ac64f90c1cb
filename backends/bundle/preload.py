"""What a workflow's fork server does once (``backends.bundle.warm``) so forked rollouts start
warm: the runner's own dependencies and event-loop machinery, the workflow's entrypoint and
config as ``runner run`` loads them, and the project's own warm-up, if it names one.

A project names it in its ``pyproject.toml``::

    [tool.backends]
    warm_up = "main.py:warm_up"

a function called once with no arguments, with no network and no rollout: it imports or
builds what every rollout would on first use (a client library's lazily loaded modules).

Not the runner module itself: each forked rollout runs it as ``python -m`` would, as
``__main__``, and finds everything it imports here already loaded.
"""

from __future__ import annotations

import tomllib
from pathlib import Path


def preload(project_dir: str, entrypoint: str, workflow_config: str | None) -> None:
    import anyio
    import pydantic  # noqa: F401 - the runner's own imports, loaded once here

    import backends.bundle.models
    import backends.rollout.context
    import backends.rollout.errors
    import backends.rollout.user_code  # noqa: F401
    from backends.rollout.loading import load_object

    async def nothing() -> None:
        pass

    anyio.run(nothing)  # the event loop's own modules, as the runner's anyio.run needs them
    project = Path(project_dir)
    load_object(entrypoint, base_dir=project)  # cached in sys.modules
    if workflow_config is not None:
        load_object(workflow_config, base_dir=project)
    warm_up = warm_up_ref(project)
    if warm_up is not None:
        load_object(warm_up, base_dir=project)()


def warm_up_ref(project: Path) -> str | None:
    """The project's ``[tool.backends] warm_up`` reference, if any."""
    try:
        config = tomllib.loads((project / "pyproject.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return None
    ref = config.get("tool", {}).get("backends", {}).get("warm_up")
    if ref is not None and not isinstance(ref, str):
        raise TypeError(f"[tool.backends] warm_up must be a 'file.py:function' string: {ref!r}")
    return ref
