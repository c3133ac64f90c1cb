"""A process holding many fds still starts, runs and stops local sandboxes: fd numbers past
1,024 (an orchestrator with a hundred sandboxes and their relayed connections, or one agent
holding that many relay connections) once failed every start with "filedescriptor out of
range in select()"."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from backends.sandbox.contract import PROVIDERS

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.anyio,
    pytest.mark.skipif(os.geteuid() != 0, reason="local sandboxes need root"),
]


@pytest.fixture
def fds_past_1024() -> Iterator[None]:
    held = [os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC) for _ in range(1100)]
    assert held[-1] >= 1024
    try:
        yield
    finally:
        for fd in held:
            os.close(fd)


@pytest.mark.usefixtures("fds_past_1024")
async def test_sandboxes_start_run_and_stop_with_fd_numbers_past_1024(tmp_path: Path) -> None:
    sandbox = PROVIDERS[0].make(tmp_path)
    await sandbox.start(force_build=False)
    try:
        result = await sandbox.exec("echo alive", user="root")
        assert (result.return_code, (result.stdout or "").strip()) == (0, "alive")
        assert await sandbox.end_processes()  # type: ignore[attr-defined]
    finally:
        await sandbox.stop(delete=True)
