"""The in-sandbox runner: ``python -m backends.bundle.runner run INPUT OUTPUT``
(or ``run - -``: the input on stdin, the output on stdout, the workflow's own on stderr).

It reads a ``RunnerInput``, imports the workflow from the bundle's project, runs it through
``run_workflow`` (the code LocalBackend runs, with a ``RolloutContext`` installed, so
integrations and ``SampleSource`` registration behave as in-process) and writes a
``RunnerOutput``: the sample, or the workflow's traceback classified as its error. It exits 0
either way once the output is written; a non-zero exit means the runner itself broke. While
the workflow runs, its sample source's preview is kept in the input's ``preview_file`` (whole,
bounded), which the host polls for the server's live previews.

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

import anyio

from backends.bundle.models import (
    MAX_PREVIEW_BYTES,
    PreviewSnapshot,
    RunnerError,
    RunnerInput,
    RunnerOutput,
)
from backends.rollout.context import RolloutContext
from backends.rollout.errors import Phase, must_propagate, user_code_failure
from backends.rollout.loading import load_object
from backends.rollout.user_code import fresh_config, run_workflow
from backends.rollout.workflow import AgentWorkflow

PREVIEW_TIMEOUT_SEC = 1.0


def load_workflow(project_dir: Path, entrypoint: str) -> type[AgentWorkflow[Any]]:
    """The ``AgentWorkflow`` class ``entrypoint`` names; raises ``ImportError``/``TypeError``."""
    workflow = load_object(entrypoint, base_dir=project_dir)
    if not (isinstance(workflow, type) and issubclass(workflow, AgentWorkflow)):
        raise TypeError(f"entrypoint {entrypoint!r} is {workflow!r}, not an AgentWorkflow class")
    return workflow


async def run(spec: RunnerInput) -> RunnerOutput:
    """Run one rollout's workflow; every outcome is an output (the caller writes it).

    With ``spec.preview_file``, the workflow's sample source is previewed there meanwhile.
    """
    context = RolloutContext(
        chat_completions_url=spec.base_url, api_key=spec.api_key, rollout_id=spec.rollout_id
    )
    if spec.preview_file is None:
        return await _run(spec, context)
    preview = Path(spec.preview_file)
    async with anyio.create_task_group() as tg:
        tg.start_soon(keep_preview, context, preview, spec)
        try:
            output = await _run(spec, context)
        finally:
            tg.cancel_scope.cancel()
            _remove(preview)  # the sample is there now
    return output


async def keep_preview(context: RolloutContext, path: Path, spec: RunnerInput) -> None:
    """Every interval, write the sample source's latest messages to ``path``, bounded.

    Written whole or not at all (the host may read it any time); a preview is diagnostic,
    so its failures never touch the rollout.
    """
    while True:
        await anyio.sleep(spec.preview_interval_sec)
        source = context.sample_source
        if source is None or not context.preview_enabled:
            _remove(path)  # opted out: nothing stays to be read
            continue
        sample = None
        try:
            with anyio.move_on_after(PREVIEW_TIMEOUT_SEC):
                sample = await source.get_preview(spec.preview_messages)
            if sample is None:
                continue
            messages = (sample.trajectory_messages or sample.messages)[-spec.preview_messages :]
            data = PreviewSnapshot(messages=messages).model_dump_json()
            while len(data.encode()) > MAX_PREVIEW_BYTES and messages:
                messages = messages[len(messages) // 2 + 1 :]  # keep the latest half
                data = PreviewSnapshot(messages=messages).model_dump_json()
            _write_whole(path, data)
        except Exception:  # diagnostic only: the next interval tries again
            continue


def _write_whole(path: Path, data: str) -> None:
    """Write ``path`` whole or not at all: the host may read it at any time."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(data)
    os.replace(partial, path)


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)


async def _run(spec: RunnerInput, context: RolloutContext) -> RunnerOutput:
    project = Path(spec.project_dir)
    try:
        workflow_cls = load_workflow(project, spec.entrypoint)
        config = load_object(spec.workflow_config, base_dir=project)
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
    _write_whole(path, output.model_dump_json())  # the host never reads a half-written sample


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
    if argv == ["run", "-", "-"]:  # input on stdin, output on stdout (the workflow's: stderr)
        spec = RunnerInput.model_validate_json(sys.stdin.buffer.read())
        out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
        with out:
            out.write(anyio.run(run, spec).model_dump_json())
        return 0
    if len(argv) == 3 and argv[0] == "run":
        spec = RunnerInput.model_validate_json(Path(argv[1]).read_text())
        write_output(Path(argv[2]), anyio.run(run, spec))
        return 0
    if len(argv) == 3 and argv[0] == "check":
        print(json.dumps(check(Path(argv[1]), argv[2])))
        return 0
    print(
        "usage: python -m backends.bundle.runner run INPUT OUTPUT | run - - | check PROJECT ENTRYPOINT"
    )
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
