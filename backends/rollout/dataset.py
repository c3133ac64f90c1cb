"""Dataset rows (JSONL: ``system_prompt``, ``user_prompt``, ``ground_truth``, ``metadata``) as requests."""

from __future__ import annotations

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
from backends.rollout.sample import MessageDict


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


def read_rows(path: Path) -> Iterator[tuple[int, DatasetRow]]:
    """Yield ``(line_number, row)``; a malformed line raises ``DatasetError`` naming it."""
    if not path.is_file():
        raise DatasetError(f"dataset {path} does not exist")
    # Bytes, decoded line by line, so that a bad encoding is reported with its line number.
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(
                    f"{path}:{number}: not UTF-8 text (byte {raw[exc.start]:#04x} "
                    f"at column {exc.start + 1})"
                ) from None
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
            if not isinstance(data, dict):
                raise DatasetError(f"{path}:{number}: a row must be a JSON object")
            try:
                row = DatasetRow.model_validate(data)
            except ValidationError as exc:
                error = exc.errors()[0]
                # The column, not the union member pydantic tried last ("ground_truth", not ".str").
                field = error["loc"][0] if error["loc"] else "row"
                raise DatasetError(f"{path}:{number}: {field}: {error['msg']}") from None
            if not row.user_prompt and not row.metadata:
                raise DatasetError(f"{path}:{number}: a row needs user_prompt or metadata")
            yield number, row


def requests_from_dataset(
    path: Path,
    *,
    id_prefix: str = "row",
    n_samples: int = 1,
    agent_timeout_sec: float | None = None,
    grader_timeout_sec: float | None = None,
    chat_completions_url: str | None = None,
    api_key: str | None = None,
    grade: bool = True,
) -> list[RolloutRequest]:
    """One request per row and sample: ids ``<prefix>-<row>-<sample>``, row index in extra_fields."""
    requests = []
    for index, (_, row) in enumerate(read_rows(path)):
        for run in range(n_samples):
            requests.append(
                RolloutRequest(
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
            )
    return requests
