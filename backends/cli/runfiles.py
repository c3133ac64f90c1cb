"""The files of a run directory, typed: ``run.json``, ``results.jsonl`` lines, ``metrics.json``.

Layout (``backends run`` writes it, ``backends report`` and a resumed run read it)::

    RUN_DIR/run.json              RunManifest: the run's inputs (checked on resume), sessions
    RUN_DIR/results.jsonl         one ResultRecord per finished try, append-only
    RUN_DIR/metrics.json          RunMetrics over the current try of each slot
    RUN_DIR/rollouts/<id>/        result.json, trajectory.json, artifacts/

A slot is ``(row, attempt)``; a slot may have several tries (a cancelled one, then its resume; a
failure, then ``--retry-failed``): the last line of a slot is its current try.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from backends.rollout.errors import RolloutFailure

SCHEMA = 1
MANIFEST_FILE = "run.json"
RESULTS_FILE = "results.jsonl"
METRICS_FILE = "metrics.json"
ROLLOUTS_DIR = "rollouts"
RESULT_FILE = "result.json"
REPORT_FILE = "report.html"

Slot = tuple[int, int]  # (row, attempt)


class Session(BaseModel):
    """One invocation of ``backends run`` on the directory."""

    started_at: float
    ended_at: float | None = None
    finished: int = 0  # tries finished in this session
    exit_code: int | None = None
    argv: list[str] = Field(default_factory=list)


InputValue = str | int | float | bool | None


class RunManifest(BaseModel):
    """``run.json``: what the run is (``inputs``, compared on resume) and its sessions."""

    schema_: int = Field(default=SCHEMA, alias="schema")
    run_id: str
    created_at: float
    inputs: dict[str, InputValue]
    display: dict[str, str] = Field(default_factory=dict)
    success_threshold: float = 1.0
    attempts: int = 1
    rows: int = 0
    sessions: list[Session] = Field(default_factory=list)

    model_config = {"populate_by_name": True}

    def changes(self, inputs: dict[str, InputValue]) -> list[str]:
        """What differs between this run's inputs and ``inputs``, one phrase per field."""
        return [
            f"{key}: {_shown(self.inputs.get(key))} -> {_shown(inputs.get(key))}"
            for key in sorted(set(self.inputs) | set(inputs))
            if self.inputs.get(key) != inputs.get(key)
        ]


def _shown(value: InputValue) -> str:
    if isinstance(value, str) and len(value) == 64 and value.isalnum():
        return value[:12]  # a sha256
    return json.dumps(value)


class Tokens(BaseModel):
    prompt: int = 0
    completion: int = 0


class ResultRecord(BaseModel):
    """One line of ``results.jsonl``: one finished try of one slot."""

    rollout_id: str
    row: int
    attempt: int
    session: int = 1
    task: str | None = None
    prompt: str = ""
    status: str
    reward: float | None = None
    passed: bool | None = None
    failure: RolloutFailure | None = None
    failed_phase: str | None = None
    answer: str = ""
    metrics: dict[str, float] = Field(default_factory=dict)
    timings: dict[str, float] = Field(default_factory=dict)
    tokens: Tokens = Field(default_factory=Tokens)
    policy_calls: int = 0
    started_at: float = 0.0
    finished_at: float = 0.0
    result: str = ""
    trajectory: str | None = None
    artifacts: str | None = None

    @property
    def slot(self) -> Slot:
        return (self.row, self.attempt)


class TimeStats(BaseModel):
    count: int
    mean: float
    p50: float
    p90: float
    max: float
    total: float


class GroupStats(BaseModel):
    """One row's attempts: a GRPO group."""

    row: int
    task: str | None = None
    prompt: str = ""
    attempts: int = 0
    graded: int = 0
    failed: int = 0
    passed: int = 0
    mean_reward: float | None = None
    reward_std: float | None = None
    reward_min: float | None = None
    reward_max: float | None = None


class GroupSummary(BaseModel):
    groups: int = 0
    zero_variance: int = 0  # >= 2 graded, all rewards equal: no learning signal for GRPO
    all_passed: int = 0
    none_passed: int = 0
    mean_reward_std: float | None = None


class TokenTotals(BaseModel):
    prompt: int = 0
    completion: int = 0
    mean_prompt: float | None = None
    mean_completion: float | None = None


class RunMetrics(BaseModel):
    """``metrics.json``: the run's numbers, over the current try of each slot."""

    schema_: int = Field(default=SCHEMA, alias="schema")
    run_id: str
    updated_at: float
    complete: bool
    planned: int
    counts: dict[str, int]
    graded: int
    mean_reward: float | None
    reward_std: float | None
    reward_min: float | None
    reward_max: float | None
    success_threshold: float
    pass_at_k: dict[str, float]
    pass_at_k_rows: dict[str, int]
    groups: list[GroupStats]
    group_summary: GroupSummary
    failures_by_phase: dict[str, dict[str, int]]
    failures_by_category: dict[str, int]
    time_per_phase: dict[str, TimeStats]
    tokens: TokenTotals
    policy_calls: int
    wall_sec: float
    rollouts_per_sec: float | None

    model_config = {"populate_by_name": True}


class RunFileError(ValueError):
    """A run directory's file is unreadable or not of this schema; the message names it."""


def read_manifest(run_dir: Path) -> RunManifest | None:
    """``run.json``, or ``None`` when the directory has none."""
    path = run_dir / MANIFEST_FILE
    try:
        return RunManifest.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValidationError) as exc:
        raise RunFileError(f"{path} is not a run manifest of this version: {exc}") from None


def read_records(run_dir: Path) -> Iterator[ResultRecord]:
    """Every whole line of ``results.jsonl``, in order (a torn last line is skipped)."""
    path = run_dir / RESULTS_FILE
    if not path.exists():
        return
    with path.open("rb") as handle:
        for number, line in enumerate(handle, 1):
            if not line.endswith(b"\n"):
                return  # torn by a crash mid-write; the next run cuts it off
            if not line.strip():
                continue
            try:
                yield ResultRecord.model_validate_json(line)
            except ValidationError as exc:
                raise RunFileError(f"{path}:{number}: not a result line: {exc}") from None


def current_records(run_dir: Path) -> dict[Slot, ResultRecord]:
    """The current (last) try of each slot that has one."""
    return {record.slot: record for record in read_records(run_dir)}


def write_json_atomic(path: Path, data: BaseModel | dict[str, Any]) -> None:
    """Write ``path`` whole or not at all (a temporary file renamed over it)."""
    text = (
        data.model_dump_json(by_alias=True, indent=1)
        if isinstance(data, BaseModel)
        else json.dumps(data, indent=1)
    )
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def relative(path: Path, run_dir: Path) -> str:
    """``path`` relative to the run directory (POSIX) when inside it, else absolute."""
    try:
        return path.resolve().relative_to(run_dir.resolve()).as_posix()
    except ValueError:
        return str(path.resolve())
