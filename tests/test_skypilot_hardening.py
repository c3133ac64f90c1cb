"""SkyPilot sandboxes against the holes a review found: lifetimes, names, reaping, downloads."""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sky_support import fake_sky_server

from backends.harbor.phases import _trial_name
from backends.sandbox import skypilot, skyruns, unpack
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
    # A warm pool's launch (Harbor's other create call) gets it too.
    await short.sdk.create_pool.aio("warm", image="ubuntu:24.04")
    try:
        pooled = SKY.make(tmp_path / "c", kwargs={"ttl_sec": 9, "pool": "warm"})
        await pooled.start(force_build=False)
        await pooled.stop(delete=True)
    finally:
        await short.sdk.delete_pool.aio("warm")
    assert sent[-1]["timeout"] == 9 and sent[-1]["pool"] == "warm"


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


SWAP = (
    "for f in $(find /tmp -path '*.bk-down-*' -type f); do"
    ' truncate -s 64M /tmp/.big && mv -f /tmp/.big "$f"; done; true'
)


def _swap_after_each_exec(env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pod's adversary at its best moment: right after every host command returns, it
    replaces whatever the host staged for a download with a 64 MiB (sparse) file."""
    box = env._sandbox
    run = box.exec.aio

    async def exec_then_swap(*argv: str, **kwargs: Any) -> Any:
        handle = await run(*argv, **kwargs)
        if any(".bk-down-" in a for a in argv):
            await handle.wait()
            await (await run("sh", "-c", SWAP, timeout_seconds=60)).wait()
        return handle

    monkeypatch.setattr(box, "exec", SimpleNamespace(aio=exec_then_swap))


async def _peak_traced(download: Any) -> tuple[int, BaseException | None]:
    tracemalloc.start()
    try:
        await download
        error = None
    except Exception as exc:
        error = exc
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak, error


@pytest.mark.sandbox
async def test_a_staged_download_swapped_by_the_pod_never_reaches_host_memory(
    tmp_path: Path, fake_sky: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    env = SKY.make(tmp_path, kwargs={"max_download_bytes": 1024 * 1024})
    await env.start(force_build=False)
    try:
        await env.exec("mkdir -p /logs/agent && echo hi > /logs/agent/a.txt")
        payload = os.urandom(200 * 1024)
        (tmp_path / "big.bin").write_bytes(payload)
        await env.upload_file(tmp_path / "big.bin", "/logs/big.bin")
        # An honest download of several chunks comes back whole.
        monkeypatch.setattr(skypilot, "DOWNLOAD_CHUNK", 64 * 1024)
        await env.download_file("/logs/big.bin", tmp_path / "back.bin")
        assert (tmp_path / "back.bin").read_bytes() == payload

        _swap_after_each_exec(env, monkeypatch)
        # One chunk: what was tarred is what comes back, the swap comes too late.
        monkeypatch.setattr(skypilot, "DOWNLOAD_CHUNK", 4 * 1024**2)
        peak, error = await _peak_traced(env.download_dir("/logs/agent", tmp_path / "agent"))
        assert error is None and (tmp_path / "agent" / "a.txt").read_text() == "hi\n"
        assert peak < 16 * 1024**2, peak
        # Several chunks, swapped between them: the cap holds on the bytes that arrive.
        monkeypatch.setattr(skypilot, "DOWNLOAD_CHUNK", 64 * 1024)
        peak, error = await _peak_traced(env.download_file("/logs/big.bin", tmp_path / "b2"))
        assert isinstance(error, unpack.DownloadTooLargeError), error
        assert peak < 16 * 1024**2, peak
    finally:
        await env.stop(delete=True)
