"""A finished rollout's files in the run directory: ``result.json`` and its ``results.jsonl`` line.

The full result (policy trace, token ids, messages) goes to ``rollouts/<id>/result.json``; the
line in ``results.jsonl`` is the short ``ResultRecord`` the table, the metrics, the report and
a resumed run read. Each line goes out in one piece and the file is only ever appended to; a
write that fails part-way (a full disk, a quota) is cut back to the last whole line, as is a
line torn by a crash when the file is next opened, so what was written still parses, and the
error names the path. Secrets are scrubbed from both.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass
from pathlib import Path

from backends.cli.runfiles import RESULT_FILE, ResultRecord, Tokens, relative
from backends.graders.text import message_text
from backends.rollout.errors import ErrorCategory, Phase, RolloutFailure, describe
from backends.rollout.request import RolloutResult
from backends.rollout.sample import utf8_json_text
from backends.trajectory import Redactor

MESSAGE_CHARS = 2000  # a failure message in the line; result.json has it whole
TEXT_CHARS = 200  # the prompt and the answer in the line


class ResultsFileError(Exception):
    """The results file could not be written; the message names the path and the cause."""


class ResultsFile:
    """Append ``ResultRecord`` lines to ``path`` (created if missing, never truncated)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.written = 0  # whole lines written by this process
        try:
            self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
            self._size = _cut_torn_line(self._fd)
        except OSError as exc:
            raise ResultsFileError(_cannot(path, exc)) from None

    def write(self, record: ResultRecord) -> None:
        """Append one line or raise ``ResultsFileError`` (the file keeps whole lines)."""
        line = record.model_dump_json().encode() + b"\n"
        if self._fd is None:
            raise ResultsFileError(f"{self.path} is closed")
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            try:
                os.ftruncate(self._fd, self._size)
            except OSError:
                pass
            raise ResultsFileError(_cannot(self.path, exc)) from None
        self._size += len(line)
        self.written += 1

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _cut_torn_line(fd: int) -> int:
    """Cut a last line without its newline (a crash mid-write); return the file's size."""
    size = os.fstat(fd).st_size
    end = size
    while end > 0:
        start = max(0, end - 65536)
        chunk = os.pread(fd, end - start, start)
        if end == size and chunk.endswith(b"\n"):
            return size
        cut = chunk.rfind(b"\n")
        if cut >= 0:
            end = start + cut + 1
            break
        end = start
    os.ftruncate(fd, end)
    return end


@dataclass(frozen=True)
class Try:
    """Which slot a rollout fills, and what the table shows of its row."""

    rollout_id: str
    row: int
    attempt: int
    session: int
    task: str | None
    prompt: str
    started_at: float


def save_result(folder: Path, result: RolloutResult, redactor: Redactor) -> Path:
    """Write the full result as ``folder/result.json`` (secrets scrubbed); return its path.

    A result that cannot be serialized is saved as the internal failure it is."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / RESULT_FILE
    tmp = folder / f".{RESULT_FILE}.tmp"
    tmp.write_bytes(_result_json(result, redactor))
    os.replace(tmp, path)
    return path


def _result_json(result: RolloutResult, redactor: Redactor) -> bytes:
    try:
        data = redactor.value(json.loads(result.model_dump_json()))
        text = json.dumps(data, ensure_ascii=False, allow_nan=False)
    except Exception as exc:  # samples are checked when built: only a backend bug gets here
        failure = RolloutFailure(
            category=ErrorCategory.INTERNAL_ERROR,
            phase=Phase.AGENT,
            message=f"the result could not be saved as JSON: {describe(exc)}",
        )
        failed = RolloutResult.failed(result.rollout_id, failure)
        text = json.dumps(redactor.value(json.loads(failed.model_dump_json())), ensure_ascii=False)
    return utf8_json_text(text)[1] + b"\n"


def record_of(
    result: RolloutResult,
    attempt: Try,
    *,
    run_dir: Path,
    folder: Path,
    result_path: Path | None,
    trajectory: Path | None,
    redactor: Redactor,
    success_threshold: float,
    finished_at: float,
) -> ResultRecord:
    """The ``results.jsonl`` line of one finished try."""
    failure = result.failure
    if failure is not None:
        failure = failure.model_copy(
            update={"message": redactor.text(failure.message)[:MESSAGE_CHARS]}
        )
    sample = result.sample
    answer = ""
    if sample is not None and sample.messages:
        answer = redactor.text(message_text(sample.messages[-1]))[:TEXT_CHARS]
    reward = result.reward
    artifacts = folder / "artifacts"
    return ResultRecord(
        rollout_id=result.rollout_id,
        row=attempt.row,
        attempt=attempt.attempt,
        session=attempt.session,
        task=attempt.task,
        prompt=redactor.text(attempt.prompt)[:TEXT_CHARS],
        status=str(result.status),
        reward=reward,
        passed=None if reward is None else reward >= success_threshold,
        failure=failure,
        failed_phase=str(failure.phase) if failure else None,
        answer=answer,
        metrics=sample.json_safe_metrics() if sample is not None else {},
        timings=result.timings,
        tokens=_tokens(result),
        policy_calls=len(result.policy_trace.calls) if result.policy_trace else 0,
        started_at=attempt.started_at,
        finished_at=finished_at,
        result=relative(result_path, run_dir) if result_path else "",
        trajectory=relative(trajectory, run_dir) if trajectory else None,
        artifacts=relative(artifacts, run_dir) if artifacts.is_dir() else None,
    )


def _tokens(result: RolloutResult) -> Tokens:
    tokens = Tokens()
    for call in result.policy_trace.calls if result.policy_trace else []:
        usage = call.usage or {}
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        tokens.prompt += prompt if isinstance(prompt, int) else 0
        tokens.completion += completion if isinstance(completion, int) else 0
    return tokens


def _cannot(path: Path, exc: OSError) -> str:
    reason = exc.strerror or errno.errorcode.get(exc.errno or 0) or str(exc)
    return f"cannot write {path}: {reason}"
