"""Dataset rows (``system_prompt``, ``user_prompt``, ``ground_truth``, ``metadata``) as requests.

A dataset is a JSONL file (one object a line), a CSV file with a header row (``metadata`` a JSON
object in its cell) or a Parquet file (``metadata`` a struct or a JSON string), picked by the
file's suffix (``.csv``, ``.parquet`` / ``.pq``; anything else is JSONL). Each is streamed.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictInt,
    StrictStr,
    ValidationError,
)

from backends.rollout.request import RolloutRequest
from backends.rollout.sample import MAX_JSON_DEPTH, MessageDict, json_problem


class DatasetError(ValueError):
    """A dataset file or row is malformed; the message names the file and line."""


# Strict: JSON `true` is not the label "1", nor NaN the label "nan".
GroundTruth = StrictStr | StrictInt | Annotated[float, Strict(), AllowInfNan(False)]


class DatasetRow(BaseModel):
    """One row. Extra columns are kept out of the prompt and ignored."""

    model_config = ConfigDict(extra="ignore")

    user_prompt: str | None = None
    system_prompt: str | None = None
    ground_truth: GroundTruth | None = Field(default=None)
    label: GroundTruth | None = None
    metadata: dict[str, Any] | None = None

    def prompt(self) -> list[MessageDict]:
        messages: list[MessageDict] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        if self.user_prompt:
            messages.append({"role": "user", "content": self.user_prompt})
        return messages

    def ground_truth_text(self) -> str | None:
        value = self.ground_truth if self.ground_truth is not None else self.label
        return None if value is None else str(value)


# A row is one rollout's prompt and metadata: larger than the server's request limit is not
# a prompt but a mistake (or an attack), refused before it is read into memory.
DEFAULT_MAX_ROW_BYTES = 16 * 1024 * 1024


def read_rows(
    path: Path, *, max_row_bytes: int = DEFAULT_MAX_ROW_BYTES
) -> Iterator[tuple[int, DatasetRow]]:
    """Yield ``(line_number, row)`` as the file is read (memory does not grow with the rows);
    a malformed line raises ``DatasetError`` naming it: bad JSON or UTF-8, a row over
    ``max_row_bytes``, nesting deeper than ``MAX_JSON_DEPTH``, a number Python cannot print,
    text with a lone surrogate (no UTF-8 form, so no rollout could send it), a bad field."""
    if not path.is_file():
        raise DatasetError(f"dataset {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".csv":
        yield from _csv_rows(path, max_row_bytes)
    elif suffix in (".parquet", ".pq"):
        yield from _parquet_rows(path, max_row_bytes)
    else:
        yield from _jsonl_rows(path, max_row_bytes)


def _jsonl_rows(path: Path, max_row_bytes: int) -> Iterator[tuple[int, DatasetRow]]:
    # Bytes, decoded line by line, so that a bad encoding is reported with its line number;
    # read with a bound, so a huge line is refused without being held whole.
    with path.open("rb") as handle:
        number = 0
        while raw := handle.readline(max_row_bytes + 1):
            number += 1
            if len(raw.rstrip(b"\r\n")) > max_row_bytes:
                raise DatasetError(
                    f"{path}:{number}: the row is larger than the {max_row_bytes}-byte limit"
                )
            if (row := _parse_row(path, number, raw)) is not None:
                yield number, row


def _parse_row(path: Path, number: int, raw: bytes) -> DatasetRow | None:
    where = f"{path}:{number}"
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DatasetError(
            f"{where}: not UTF-8 text (byte {raw[exc.start]:#04x} at column {exc.start + 1})"
        ) from None
    if not line.strip():
        return None
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{where}: not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise DatasetError(f"{where}: nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise DatasetError(f"{where}: not usable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise DatasetError(f"{where}: a row must be a JSON object")
    return _checked_row(where, data)


def _checked_row(where: str, data: dict[str, Any]) -> DatasetRow:
    if problem := json_problem(data, "row", strict_text=True):
        raise DatasetError(f"{where}: {problem.removeprefix('row.')}")
    try:
        row = DatasetRow.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        # The column, not the union member pydantic tried last ("ground_truth", not ".str").
        field = error["loc"][0] if error["loc"] else "row"
        raise DatasetError(f"{where}: {field}: {error['msg']}") from None
    if not row.user_prompt and not row.metadata:
        raise DatasetError(f"{where}: a row needs user_prompt or metadata")
    return row


def _csv_rows(path: Path, max_row_bytes: int) -> Iterator[tuple[int, DatasetRow]]:
    """A header row, then one row a record; empty cells are absent, ``metadata`` is JSON."""
    csv.field_size_limit(max_row_bytes)
    with path.open("rb") as raw:
        text = io.TextIOWrapper(raw, encoding="utf-8", newline="")
        reader = csv.DictReader(text)
        number = 1
        try:
            for record in reader:
                number = reader.line_num
                where = f"{path}:{number}"
                if None in record:
                    raise DatasetError(f"{where}: more cells than the header has columns")
                data: dict[str, Any] = {k: v for k, v in record.items() if v not in ("", None)}
                if not data:
                    continue
                if "metadata" in data:
                    data["metadata"] = _json_cell(where, data["metadata"])
                yield number, _checked_row(where, data)
        except UnicodeDecodeError as exc:
            raise DatasetError(
                f"{path}:{reader.line_num + 1}: not UTF-8 text ({exc.reason})"
            ) from None
        except csv.Error as exc:
            raise DatasetError(f"{path}:{reader.line_num}: not valid CSV ({exc})") from None


def _json_cell(where: str, cell: Any) -> Any:
    if not isinstance(cell, str):
        return cell
    try:
        return json.loads(cell)
    except (json.JSONDecodeError, RecursionError, ValueError):
        raise DatasetError(f"{where}: metadata: not a JSON object") from None


def _parquet_rows(path: Path, max_row_bytes: int) -> Iterator[tuple[int, DatasetRow]]:
    """Row by row in batches; ``metadata`` a struct column or JSON text. Rows count from 1."""
    try:
        import pyarrow.parquet as pq  # optional: `pip install 'backends[parquet]'`
    except ImportError:
        raise DatasetError(
            f"{path}: reading Parquet needs pyarrow (pip install 'backends[parquet]')"
        ) from None
    try:
        handle = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises its own ArrowInvalid, OSError, ...
        raise DatasetError(f"{path}: not a readable Parquet file ({exc})") from None
    number = 0
    with handle:
        for batch in handle.iter_batches(batch_size=256):
            for record in batch.to_pylist():
                number += 1
                where = f"{path}: row {number}"
                data = {k: v for k, v in record.items() if v is not None}
                if "metadata" in data:
                    data["metadata"] = _json_cell(where, data["metadata"])
                if len(json.dumps(data, default=str)) > max_row_bytes:
                    raise DatasetError(
                        f"{where}: the row is larger than the {max_row_bytes}-byte limit"
                    )
                yield number, _checked_row(where, data)


def count_rows(path: Path, *, max_row_bytes: int = DEFAULT_MAX_ROW_BYTES) -> int:
    """Check every row (``DatasetError`` at the first bad one) and count them, keeping none:
    a run refuses bad input before its first rollout without holding the dataset."""
    return sum(1 for _ in read_rows(path, max_row_bytes=max_row_bytes))


def iter_requests(
    path: Path,
    *,
    id_prefix: str = "row",
    n_samples: int = 1,
    agent_timeout_sec: float | None = None,
    grader_timeout_sec: float | None = None,
    chat_completions_url: str | None = None,
    api_key: str | None = None,
    grade: bool = True,
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
) -> Iterator[RolloutRequest]:
    """One request per row and sample, built as they are taken (the dataset is streamed): ids
    ``<prefix>-<row>-<sample>``, row and sample index in ``extra_fields``."""
    index = 0
    for _, row in read_rows(path, max_row_bytes=max_row_bytes):
        for run in range(n_samples):
            yield RolloutRequest(
                rollout_id=f"{id_prefix}-{index}-{run}",
                prompt=row.prompt(),
                label=row.ground_truth_text(),
                metadata=row.metadata,
                agent_timeout_sec=agent_timeout_sec,
                grader_timeout_sec=grader_timeout_sec,
                chat_completions_url=chat_completions_url,
                api_key=api_key,
                grade=grade,
                extra_fields={"row_index": index, "run_index": run},
            )
        index += 1


def requests_from_dataset(path: Path, **options: Any) -> list[RolloutRequest]:
    """Every request of ``iter_requests`` at once (small datasets; a run streams instead)."""
    return list(iter_requests(path, **options))
