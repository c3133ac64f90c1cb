"""The typed files that cross the sandbox wall, and a bundle's manifest.

The host writes a ``RunnerInput`` into the sandbox; the in-sandbox runner writes a
``RunnerOutput`` back. Neither has a field for the label: the ground truth stays on the host,
and ``extra="forbid"`` refuses one smuggled in. Kept to pydantic and our rollout models, so
the runner imports them cheaply inside the sandbox.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from backends.rollout.errors import ErrorCategory
from backends.rollout.sample import MessageDict, RolloutSample

# What the host reads back from a sandbox is bounded: the sandbox could write any size.
MAX_OUTPUT_BYTES = 64 * 1024 * 1024
MAX_PREVIEW_BYTES = 1024 * 1024  # a preview is polled every few seconds: keep it small


class RunnerInput(BaseModel):
    """One rollout's input to the in-sandbox runner: never the label."""

    model_config = ConfigDict(extra="forbid")

    rollout_id: str
    project_dir: str  # the bundle's project folder, as the sandbox sees it
    entrypoint: str  # "main.py:Workflow", relative to project_dir
    workflow_config: str | None = None  # "main.py:config", resolved inside
    prompt: list[MessageDict]
    metadata: dict[str, Any] | None = None
    base_url: str | None = None  # the rollout's relay route as the sandbox reaches it
    api_key: str | None = Field(default=None, repr=False)  # the rollout's relay token
    artifacts_dir: str | None = None
    preview_file: str | None = None  # where the runner keeps the live preview, if anywhere
    preview_interval_sec: float = Field(default=2.0, gt=0)
    preview_messages: int = Field(default=100, gt=0)  # the most recent ones


class RunnerError(BaseModel):
    """The workflow's exception, classified inside by the same table as in-process."""

    model_config = ConfigDict(extra="forbid")

    category: ErrorCategory
    message: str
    traceback: str = ""


class RunnerOutput(BaseModel):
    """What the runner leaves for the host: the sample, or the classified error."""

    model_config = ConfigDict(extra="forbid")

    status: Literal["success", "failure"]
    sample: RolloutSample | None = None
    info: dict[str, Any] = Field(default_factory=dict)
    error: RunnerError | None = None


class PreviewSnapshot(BaseModel):
    """The latest steps of a running workflow, as its sample source previews them."""

    model_config = ConfigDict(extra="forbid")

    messages: list[MessageDict]


class BundleManifest(BaseModel):
    """What a bundle holds: written last, so a bundle with a manifest is complete."""

    model_config = ConfigDict(extra="forbid")

    key: str
    name: str  # the project's [project].name
    python: str  # "3.12"
    platform: str  # the wheels' target, e.g. "manylinux_2_36_x86_64"
    entrypoint: str | None = None  # the one checked when the bundle was built
    dependencies: list[str]  # "name==version", every wheel shipped
    files: list[str]  # the project's files, relative paths
    size_bytes: int
    build_sec: float


def read_bounded(path: Path, limit: int = MAX_OUTPUT_BYTES) -> bytes:
    """Read a file the sandbox wrote: no symlinks followed, at most ``limit`` bytes.

    Raises ``OSError`` (a symlink planted in place of the file gives ``ELOOP``) and
    ``ValueError`` past the limit.
    """
    # O_NONBLOCK: a FIFO planted in the file's place must not hang the host.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a regular file")
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path} is larger than {limit} bytes")
    return data
