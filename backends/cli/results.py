"""The results file of ``backends run``: one JSON result per line, valid whatever happens.

Each line goes out in one piece; a write that fails part-way (a full disk, a quota) is cut
back to the last whole line, so what was written still parses, and the error names the path.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from backends.rollout.errors import ErrorCategory, Phase, RolloutFailure, describe
from backends.rollout.request import RolloutResult
from backends.rollout.sample import utf8_json_text
from backends.trajectory import Redactor


class ResultsFileError(Exception):
    """The results file could not be written; the message names the path and the cause."""


class ResultsFile:
    """Append results as JSON lines to ``path`` (created, or truncated if it exists)."""

    def __init__(self, path: Path, redactor: Redactor) -> None:
        self.path = path
        self.redactor = redactor
        self.written = 0  # whole lines on disk
        try:
            self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as exc:
            raise ResultsFileError(_cannot(path, exc)) from None
        self._size = 0

    def write(self, result: RolloutResult) -> None:
        """Write one result (secrets scrubbed, as in trajectory.json) or raise
        ``ResultsFileError``; a result that cannot be serialized is written as a failure."""
        line = _line(result, self.redactor)
        if self._fd is None:
            raise ResultsFileError(f"{self.path} is closed")
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            # Cut the partial line off: the file stays whole JSON lines.
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


def _line(result: RolloutResult, redactor: Redactor) -> bytes:
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


def _cannot(path: Path, exc: OSError) -> str:
    reason = exc.strerror or errno.errorcode.get(exc.errno or 0) or str(exc)
    return f"cannot write {path}: {reason}"
