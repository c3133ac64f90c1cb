"""SkyPilot sandboxes against the holes a review found: lifetimes, names, reaping, downloads."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sky_support import fake_sky_server

from backends.harbor.phases import _trial_name
from backends.sandbox import skyruns
from backends.sandbox.contract import PROVIDERS

pytestmark = [pytest.mark.anyio]

SKY = next(p for p in PROVIDERS if p.name == "skypilot")


@pytest.fixture(scope="module")
def fake_sky() -> Iterator[dict[str, str]]:
    with fake_sky_server() as env:
        yield env


def _spy_creates(env: Any, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []
    create = env.sdk.create.aio

    async def spy(*args: Any, **kwargs: Any) -> Any:
        sent.append(kwargs)
        return await create(*args, **kwargs)

    monkeypatch.setattr(env.sdk.create, "aio", spy)
    return sent


@pytest.mark.sandbox
async def test_each_sandbox_is_created_with_its_own_ttl(
    tmp_path: Path, fake_sky: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    short = SKY.make(tmp_path / "a", kwargs={"ttl_sec": 7})
    default = SKY.make(tmp_path / "b")
    sent = _spy_creates(short, monkeypatch)
    for env in (short, default):
        await env.start(force_build=False)
        await env.stop(delete=True)
    # The lifetime is the server's only backstop for a run recorded elsewhere: 24 h is not it.
    assert [s["timeout"] for s in sent] == [7, 6 * 3600]


def test_ids_that_sanitize_alike_get_distinct_names() -> None:
    run = skyruns.Run("0123abcd")
    for a, b in [("Row-A", "row-a"), ("a.b", "a_b"), ("q1", "Q1"), ("x" * 80 + "A", "x" * 80)]:
        na = skyruns.sandbox_name(run, f"{_trial_name(a, 1)}__env")
        nb = skyruns.sandbox_name(run, f"{_trial_name(b, 1)}__env")
        assert na != nb, (a, b, na)
        assert len(na) <= 53 and len(nb) <= 53 and na.startswith("bk-0123abcd-")
    # An id that needs no sanitizing keeps its plain name.
    assert skyruns.sandbox_name(run, "row-a-1") == "bk-0123abcd-row-a-1"
    assert skyruns.sandbox_name(run, "Row-A", retry=2) != skyruns.sandbox_name(run, "row-a", 2)


HOLDER = """
import sys
from backends.sandbox import skyruns
run = skyruns.current()
run.register()
print(run.id, flush=True)
sys.stdin.read()  # held until the test closes stdin
"""


def _sandbox_cli(*args: str, env: dict[str, str]) -> str:
    res = subprocess.run(
        [sys.executable, "-m", "backends.cli", "sandbox", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_a_live_run_recorded_from_another_pid_namespace_is_not_reaped(
    tmp_path: Path, fake_sky: dict[str, str]
) -> None:
    """Two hosts or containers sharing $BACKENDS_HOME: the other's pid means nothing here."""
    import sky_sandbox

    env = {**fake_sky, "BACKENDS_HOME": str(tmp_path / "home")}
    holder = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", HOLDER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        run_id = holder.stdout.readline().strip()
        assert len(run_id) == 8, run_id
        box = sky_sandbox.create(name=f"bk-{run_id}-held", image="ubuntu:24.04")
        try:
            listed = _sandbox_cli("ls", "-p", "skypilot", env=env).splitlines()
            assert "unknown" in next(line for line in listed if box.name in line), listed
            assert "0 sandbox(es) reaped" in _sandbox_cli("reap", "-p", "skypilot", env=env)
            assert box.name in [s.name for s in sky_sandbox.ls()]
            assert (tmp_path / "home" / "skypilot-runs" / run_id).exists()
        finally:
            box.terminate()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
