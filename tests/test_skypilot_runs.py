"""No SkyPilot sandbox a run made is forgotten: a terminate that fails at exit keeps the run's
record, so the next start (or `backends sandbox reap`) reaps them; a create whose answer was
lost has its sandbox terminated before the retry."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sky_support import fake_sky_server

from backends.sandbox import skyruns
from backends.sandbox.contract import PROVIDERS

pytestmark = [pytest.mark.anyio]

# Creates one sandbox and exits without stopping it; with "blip", the API server is unreachable
# at that moment.
HOLDER = """
import os, sys, anyio
from pathlib import Path
from backends.sandbox.contract import PROVIDERS

async def main():
    failing = "fail" in sys.argv[2:]  # a create the server refuses: no sandbox is made
    kwargs = {"secrets": ["NOT_SET_ON_THE_SERVER"]} if failing else {}
    env = PROVIDERS[1].make(Path(sys.argv[1]), kwargs=kwargs)
    try:
        await env.start(force_build=False)
    except Exception as exc:
        assert failing, exc
    print(env._sandbox_name, flush=True)

anyio.run(main)
if "blip" in sys.argv[2:]:
    os.environ["SKYPILOT_API_SERVER_ENDPOINT"] = "unix:///nonexistent/api.sock"
"""


@pytest.fixture(scope="module")
def fake_sky() -> Iterator[dict[str, str]]:
    with fake_sky_server() as env:
        yield env


def _run(argv: list[str], env: dict[str, str], stderr: list[str] | None = None) -> str:
    res = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    if stderr is not None:
        stderr.append(res.stderr)
    return res.stdout


def test_a_sandbox_whose_exit_terminate_failed_is_reaped_by_the_next_start(
    fake_sky: dict[str, str], tmp_path: Path
) -> None:
    import sky_sandbox

    env = {**os.environ, **fake_sky, "BACKENDS_HOME": str(tmp_path / "home")}
    stderr: list[str] = []
    name = _run([sys.executable, "-c", HOLDER, str(tmp_path), "blip"], env, stderr).split()[-1]
    assert name in {s.name for s in sky_sandbox.ls()}
    assert f"could not terminate this run's SkyPilot sandboxes ({name})" in stderr[0]
    assert os.listdir(tmp_path / "home" / "skypilot-runs"), "the run was forgotten"
    reaped = _run([sys.executable, "-m", "backends.cli", "sandbox", "reap", "-p", "skypilot"], env)
    assert name in reaped
    assert name not in {s.name for s in sky_sandbox.ls()}
    assert os.listdir(tmp_path / "home" / "skypilot-runs") == []


def test_a_run_whose_sandboxes_are_gone_is_forgotten_at_exit(
    fake_sky: dict[str, str], tmp_path: Path
) -> None:
    import sky_sandbox

    env = {**os.environ, **fake_sky, "BACKENDS_HOME": str(tmp_path / "home")}
    name = _run([sys.executable, "-c", HOLDER, str(tmp_path)], env).split()[-1]
    assert name not in {s.name for s in sky_sandbox.ls()}
    assert os.listdir(tmp_path / "home" / "skypilot-runs") == []


def test_no_warning_at_exit_about_sandboxes_a_run_never_held(
    fake_sky: dict[str, str], tmp_path: Path
) -> None:
    """A create the server refused leaves its name to look for at exit; with no API server
    then, that is not a sandbox left running, and nothing is said."""
    env = {**os.environ, **fake_sky, "BACKENDS_HOME": str(tmp_path / "home")}
    stderr: list[str] = []
    _run([sys.executable, "-c", HOLDER, str(tmp_path), "fail", "blip"], env, stderr)
    assert "could not terminate" not in stderr[0], stderr[0]


async def test_a_create_whose_answer_was_lost_leaves_no_sandbox_behind(
    fake_sky: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sky_sandbox

    env: Any = PROVIDERS[1].make(tmp_path)
    create = env.sdk.create.aio
    made: list[str] = []

    async def answer_lost_once(*args: Any, **kwargs: Any) -> Any:
        box = await create(*args, **kwargs)
        made.append(kwargs["name"])
        if len(made) == 1:
            raise TimeoutError("the response was lost")
        return box

    monkeypatch.setattr(env.sdk.create, "aio", answer_lost_once)
    await env.start(force_build=False)
    try:
        assert len(made) == 2 and env._sandbox_name == made[1]
        assert made[0] not in {s.name for s in await sky_sandbox.ls.aio()}
        assert made[0] not in skyruns.current().live
    finally:
        await env.stop(delete=True)
    assert not {s.name for s in await sky_sandbox.ls.aio()} & set(made)
