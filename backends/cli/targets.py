"""What ``backends run`` runs: the backend, the rows, and the inputs that identify the run.

Three shapes, picked from the arguments:

* a **workflow** (an ``AgentWorkflow`` class, or a plain ``LocalBackend``, which names its
  workflow, config and grader) over a dataset file: ``--backend harbor`` (the default) runs it
  inside a sandbox from a rollout bundle, in the template task ``-p`` (default
  ``tasks/templates/workflow``); ``--backend local`` runs it in this process;
* a **ready backend** (a ``HarborBackend`` you configured, a backend class of your own): run as
  it is, so the options that build a backend are refused with it;
* **Harbor tasks** (``-p DIR`` and no entrypoint): a directory of tasks (dataset mode, one row
  per task, or the rows of ``-d`` naming tasks), one task (run as it is, or as a template for
  the rows of ``-d``), each with the Harbor agent ``-a``.

Every problem is a ``TargetError`` naming the option, raised before anything runs.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends.local import LocalBackend
from backends.rollout.backend import ExecutionBackend
from backends.rollout.dataset import DatasetError, DatasetRow, read_rows
from backends.rollout.loading import EntrypointError, load_object
from backends.rollout.workflow import AgentWorkflow, Grader

REPO_TASKS = Path(__file__).resolve().parents[2] / "tasks"
DEFAULT_ENTRYPOINT = str(REPO_TASKS / "rollouts" / "arithmetic" / "main.py") + ":backend"
DEFAULT_DATASET = REPO_TASKS / "data" / "arithmetic.jsonl"
DEFAULT_TEMPLATE = REPO_TASKS / "templates" / "workflow"
BACKENDS = ("harbor", "local")


class TargetError(ValueError):
    """The arguments name nothing runnable; ``option`` is the one to fix."""

    def __init__(self, message: str, option: str) -> None:
        super().__init__(message)
        self.option = option


@dataclass(frozen=True)
class Choice:
    """The options that pick what runs (``None``: not given)."""

    entrypoint: str | None
    path: Path | None
    dataset: Path | None
    backend: str | None
    environment: str | None
    agent: str | None
    model: str | None
    grader: str | None
    max_concurrent: int
    max_row_bytes: int


@dataclass
class Target:
    """A backend, its rows, and what identifies the run (compared when it is resumed)."""

    backend: ExecutionBackend
    rows: Callable[[], Iterator[DatasetRow]]
    row_count: int
    inputs: dict[str, Any] = field(default_factory=dict)
    display: dict[str, str] = field(default_factory=dict)


def resolve(choice: Choice) -> Target:
    """The target ``choice`` names; ``TargetError`` for anything that cannot run."""
    if choice.entrypoint is None and choice.path is not None:
        return _harbor_tasks(choice)
    entrypoint = choice.entrypoint or DEFAULT_ENTRYPOINT
    try:
        obj = load_object(entrypoint)
    except (EntrypointError, TypeError) as exc:
        raise TargetError(str(exc), "ENTRYPOINT") from None
    inputs: dict[str, Any] = {
        "mode": "rollout",
        "entrypoint": _canonical_ref(entrypoint),
        "entrypoint_sha256": _entry_file_hash(entrypoint),
    }
    display = {"entrypoint": entrypoint}
    if (isinstance(obj, type) and issubclass(obj, AgentWorkflow)) or type(obj) is LocalBackend:
        backend, built = _from_workflow(choice, obj)
        inputs.update(built)
    elif isinstance(obj, ExecutionBackend):
        given = [
            flag
            for flag, value in (
                ("--backend", choice.backend),
                ("-e/--env", choice.environment),
                ("-a/--agent", choice.agent),
                ("-m/--model", choice.model),
                ("--grader", choice.grader),
                ("-p/--path", choice.path),
            )
            if value is not None
        ]
        if given:
            raise TargetError(
                f"{entrypoint} is a ready {type(obj).__name__}, run as it is built; "
                f"{', '.join(given)} build a backend from a workflow (an AgentWorkflow class or "
                "a LocalBackend): drop them, or point ENTRYPOINT at the workflow",
                given[0],
            )
        backend = obj
        inputs["backend"] = type(obj).__name__
    else:
        raise TargetError(
            f"{entrypoint} is a {type(obj).__name__}, not a backend or an AgentWorkflow class",
            "ENTRYPOINT",
        )
    display["backend"] = str(inputs["backend"])
    dataset = choice.dataset or DEFAULT_DATASET
    rows, count, digest = _dataset(dataset, choice.max_row_bytes)
    inputs.update(dataset_sha256=digest, rows=count)
    display["dataset"] = str(dataset)
    return Target(backend=backend, rows=rows, row_count=count, inputs=inputs, display=display)


def _from_workflow(choice: Choice, obj: Any) -> tuple[ExecutionBackend, dict[str, Any]]:
    """A backend for a workflow class or a plain LocalBackend, on ``--backend``."""
    kind = choice.backend or "harbor"
    if kind not in BACKENDS:
        raise TargetError(
            f"--backend must be one of {', '.join(BACKENDS)}, not {kind!r}", "--backend"
        )
    if choice.agent is not None:
        raise TargetError(
            "-a/--agent names a Harbor agent; with a workflow, the workflow is the agent", "-a"
        )
    local = obj if isinstance(obj, LocalBackend) else None
    workflow = local.workflow_cls if local else obj
    if local is not None and choice.grader is not None:
        raise TargetError("this LocalBackend names its own grader: drop --grader", "--grader")
    grader = local.grader_cls if local else _grader(choice.grader)
    inputs: dict[str, Any] = {
        "backend": kind,
        "grader": _class_ref(grader) if grader else None,
        "workflow": _class_ref(workflow),
    }
    if kind == "local":
        for flag, value in (("-e/--env", choice.environment), ("-p/--path", choice.path)):
            if value is not None:
                raise TargetError(f"{flag} picks a sandbox: it needs --backend harbor", flag)
        if local is not None:
            return local, inputs
        return LocalBackend(workflow=workflow, grader=grader), inputs
    template = (choice.path or DEFAULT_TEMPLATE).resolve()
    config = _config_ref(workflow, local.workflow_config) if local else None
    from backends.harbor import HarborBackend

    try:
        backend = HarborBackend(
            tasks_dir=template,
            agent=workflow,
            grader=grader,
            grader_config=local.grader_config if local else None,
            workflow_config=config,
            environment=choice.environment or "local",
            model_name=choice.model,
            max_concurrent=choice.max_concurrent,
        )
    except ValueError as exc:
        raise TargetError(
            str(exc), _culprit(exc, "-p/--path" if choice.path else "ENTRYPOINT")
        ) from None
    inputs.update(
        template=_tree_hash(template),
        environment=choice.environment or "local",
        model=choice.model,
        workflow_config=config,
    )
    return backend, inputs


def _harbor_tasks(choice: Choice) -> Target:
    """``-p DIR`` without an entrypoint: Harbor tasks run by the Harbor agent ``-a``."""
    from backends.harbor import HarborBackend
    from backends.harbor.tasks import TASK_ID_KEY, discover_tasks, is_task_dir

    assert choice.path is not None
    path = choice.path.resolve()
    if not path.is_dir():
        raise TargetError(f"{choice.path} is not a directory of Harbor tasks or a task", "-p")
    if choice.backend not in (None, "harbor"):
        raise TargetError("Harbor tasks run on --backend harbor", "--backend")
    agent = choice.agent or "oracle"
    template = is_task_dir(path) and choice.dataset is not None
    tasks_dir = path if not is_task_dir(path) or template else path.parent
    try:
        backend = HarborBackend(
            tasks_dir=tasks_dir,
            task_mode="template" if template else "dataset",
            agent=agent,
            model_name=choice.model,
            grader=choice.grader,
            environment=choice.environment or "local",
            max_concurrent=choice.max_concurrent,
        )
    except ValueError as exc:
        raise TargetError(str(exc), _culprit(exc, "-p/--path")) from None
    inputs: dict[str, Any] = {
        "mode": "harbor-template" if template else "harbor-tasks",
        "backend": "harbor",
        "tasks_dir": _tree_hash(path),
        "agent": agent,
        "model": choice.model,
        "environment": choice.environment or "local",
        "grader": choice.grader,
    }
    display = {"tasks": str(choice.path), "agent": agent, "backend": "harbor"}
    if choice.dataset is not None:
        rows, count, digest = _dataset(choice.dataset, choice.max_row_bytes)
        inputs.update(dataset_sha256=digest, rows=count)
        display["dataset"] = str(choice.dataset)
    else:
        ids = [path.name] if is_task_dir(path) else discover_tasks(path)
        if not ids:
            raise TargetError(f"{choice.path} holds no Harbor task (no task.toml below it)", "-p")

        def rows() -> Iterator[DatasetRow]:
            return (DatasetRow(metadata={TASK_ID_KEY: task}) for task in ids)

        count = len(ids)
        inputs.update(rows=count)
    return Target(backend=backend, rows=rows, row_count=count, inputs=inputs, display=display)


def _culprit(exc: ValueError, default: str) -> str:
    """The option a HarborBackend construction error is about."""
    text = str(exc)
    for word, option in (("environment", "-e/--env"), ("agent", "-a/--agent")):
        if text.startswith(word) or f" {word} " in text.split(":")[0]:
            return option
    return default


def _dataset(path: Path, max_row_bytes: int) -> tuple[Callable[[], Iterator[DatasetRow]], int, str]:
    """Check every row now (``TargetError`` at the first bad one), hash the file, count the
    rows; the run streams the file again."""
    try:
        count = sum(1 for _ in read_rows(path, max_row_bytes=max_row_bytes))
    except DatasetError as exc:
        raise TargetError(str(exc), "--dataset") from None
    if not count:
        raise TargetError(f"{path} has no rows", "--dataset")

    def rows() -> Iterator[DatasetRow]:
        return (row for _, row in read_rows(path, max_row_bytes=max_row_bytes))

    return rows, count, _file_hash(path)


def _grader(ref: str | None) -> type[Grader] | None:
    if ref is None:
        return None
    try:
        grader = load_object(ref)
    except EntrypointError as exc:
        raise TargetError(str(exc), "--grader") from None
    if not (isinstance(grader, type) and issubclass(grader, Grader)):
        raise TargetError(f"{ref} is not a Grader class", "--grader")
    return grader


def _config_ref(workflow: type, config: Any) -> str | None:
    """A LocalBackend's workflow config as the ``"main.py:name"`` a sandbox loads it by."""
    if config is None:
        return None
    module = sys.modules.get(workflow.__module__)
    names = [name for name, value in vars(module).items() if value is config] if module else []
    source = getattr(module, "__file__", None)
    if not names or not source:
        raise TargetError(
            f"the workflow config of {workflow.__qualname__} is not a module-level name in its "
            "main.py, so a sandbox cannot load it: give it a name there",
            "ENTRYPOINT",
        )
    return f"{Path(source).name}:{names[0]}"


def _class_ref(cls: type) -> str:
    module = sys.modules.get(cls.__module__)
    source = getattr(module, "__file__", None)
    where = str(Path(source).resolve()) if source else cls.__module__
    return f"{where}:{cls.__qualname__}"


def _canonical_ref(ref: str) -> str:
    target, _, attr = ref.rpartition(":")
    if target.endswith(".py") or "/" in target:
        return f"{Path(target).resolve()}:{attr}"
    return ref


def _entry_file_hash(ref: str) -> str | None:
    target = ref.rpartition(":")[0]
    path = Path(target)
    if path.is_dir():
        path = path / "main.py"
    if not path.is_file():
        module = sys.modules.get(target)
        source = getattr(module, "__file__", None)
        if not source:
            return None
        path = Path(source)
    return _file_hash(path)


def _file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _tree_hash(root: Path) -> str:
    """A hash of every file's path and content under ``root`` (a task or a tasks directory)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(_file_hash(path).encode())
    return digest.hexdigest()
