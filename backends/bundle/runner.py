"""The in-sandbox runner: ``python -m backends.bundle.runner run INPUT OUTPUT``.

It reads a ``RunnerInput``, imports the workflow from the bundle's project, runs it through
``run_workflow`` (the code LocalBackend runs, with a ``RolloutContext`` installed, so
integrations and ``SampleSource`` registration behave as in-process) and writes a
``RunnerOutput``: the sample, or the workflow's traceback classified as its error. It exits 0
either way once the output is written; a non-zero exit means the runner itself broke.

``python -m backends.bundle.runner check PROJECT ENTRYPOINT`` imports the entrypoint and
prints a JSON verdict, for the build's preflight and the install's final check.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from backends.bundle.models import RunnerError, RunnerInput, RunnerOutput
from backends.rollout.context import RolloutContext
from backends.rollout.errors import Phase, must_propagate, user_code_failure
from backends.rollout.loading import load_object
from backends.rollout.user_code import fresh_config, run_workflow
from backends.rollout.workflow import AgentWorkflow


def load_workflow(project_dir: Path, entrypoint: str) -> type[AgentWorkflow[Any]]:
    """The ``AgentWorkflow`` class ``entrypoint`` names; raises ``ImportError``/``TypeError``."""
    workflow = load_object(entrypoint, base_dir=project_dir)
    if not (isinstance(workflow, type) and issubclass(workflow, AgentWorkflow)):
        raise TypeError(f"entrypoint {entrypoint!r} is {workflow!r}, not an AgentWorkflow class")
    return workflow


async def run(spec: RunnerInput) -> RunnerOutput:
    """Run one rollout's workflow; every outcome is an output (the caller writes it)."""
    project = Path(spec.project_dir)
    try:
        workflow_cls = load_workflow(project, spec.entrypoint)
        config = load_object(spec.workflow_config, base_dir=project)
        context = RolloutContext(
            chat_completions_url=spec.base_url, api_key=spec.api_key, rollout_id=spec.rollout_id
        )
        sample, info = await run_workflow(
            workflow_cls(config=fresh_config(config)),
            context,
            prompt=spec.prompt,
            metadata=spec.metadata,
            artifacts_dir=Path(spec.artifacts_dir) if spec.artifacts_dir else None,
        )
    except BaseException as exc:  # sys.exit in the workflow too: it is the workflow's failure
        if must_propagate(exc):
            raise
        failure = user_code_failure(exc, Phase.AGENT)
        error = RunnerError(
            category=failure.category, message=failure.message, traceback=traceback.format_exc()
        )
        return RunnerOutput(status="failure", error=error)
    return RunnerOutput(status="success", sample=sample, info=info)


def write_output(path: Path, output: RunnerOutput) -> None:
    # Whole or absent: the host never reads a half-written sample.
    partial = path.with_name(path.name + ".partial")
    partial.write_text(output.model_dump_json())
    os.replace(partial, path)


def check(project_dir: Path, entrypoint: str) -> dict[str, Any]:
    """Whether ``entrypoint`` imports: ``{"ok": ...}``, else the error and any missing module."""
    try:
        load_workflow(project_dir, entrypoint)
    except BaseException as exc:
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, ModuleNotFoundError):
            cause = cause.__cause__ or cause.__context__
        missing = cause.name if isinstance(cause, ModuleNotFoundError) else None
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "missing_module": missing}
    return {"ok": True}


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "run":
        import anyio

        spec = RunnerInput.model_validate_json(Path(argv[1]).read_text())
        write_output(Path(argv[2]), anyio.run(run, spec))
        return 0
    if len(argv) == 3 and argv[0] == "check":
        print(json.dumps(check(Path(argv[1]), argv[2])))
        return 0
    print("usage: python -m backends.bundle.runner run INPUT OUTPUT | check PROJECT ENTRYPOINT")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
