"""What a workflow's fork server imports once (``backends.bundle.warm``): the runner's own
dependencies and the workflow's entrypoint and config, as ``runner run`` would load them.

Not the runner module itself: each forked rollout runs it as ``python -m`` would, as
``__main__``, and finds everything it imports here already loaded.
"""

from __future__ import annotations

from pathlib import Path


def preload(project_dir: str, entrypoint: str, workflow_config: str | None) -> None:
    import anyio  # noqa: F401 - the runner's own imports, loaded once here
    import pydantic  # noqa: F401

    import backends.bundle.models
    import backends.rollout.context
    import backends.rollout.errors
    import backends.rollout.user_code  # noqa: F401
    from backends.rollout.loading import load_object

    load_object(entrypoint, base_dir=Path(project_dir))  # cached in sys.modules
    if workflow_config is not None:
        load_object(workflow_config, base_dir=Path(project_dir))
