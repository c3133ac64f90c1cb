"""SkyPilotSandbox over the fake Sandbox SDK: errors, names, result shapes, image builds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sky_support import FAKE, fake_sky_server

from backends.sandbox import skyruns, skysdk
from backends.sandbox.contract import PROVIDERS
from backends.sandbox.errors import HostPrerequisiteError, SandboxStartError

pytestmark = [pytest.mark.anyio]

SKY = next(p for p in PROVIDERS if p.name == "skypilot")
ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def fake_sky() -> Iterator[dict[str, str]]:
    with fake_sky_server() as env:
        yield env


def test_without_the_sdk_the_error_names_the_platform_installer(tmp_path: Path) -> None:
    code = (
        "from backends.sandbox.contract import PROVIDERS\n"
        "p = [p for p in PROVIDERS if p.name == 'skypilot'][0]\n"
        "from pathlib import Path\n"
        f"p.make(Path({str(tmp_path)!r}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode != 0
    assert "HostPrerequisiteError" in res.stderr
    assert "SkyPilot Platform installer, not PyPI" in res.stderr


def test_without_an_api_server_the_error_says_how_to_log_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(skysdk.ENDPOINT_ENV, raising=False)
    with pytest.raises(HostPrerequisiteError, match="sky api login -e <endpoint>"):
        skysdk.require_api_server()


def test_a_broken_sdk_is_not_reported_as_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "sky_sandbox.py").write_text("raise RuntimeError('bad ~/.sky/config.yaml')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "sky_sandbox", raising=False)
    try:
        with pytest.raises(HostPrerequisiteError, match=r"failed to import.*bad ~/\.sky"):
            skysdk.load()
    finally:
        sys.modules.pop("sky_sandbox", None)


def test_names_are_dns_safe_short_and_keep_the_run_prefix() -> None:
    run = skyruns.Run("0123abcd")
    for session in ["x", "Trial__ÜBER_long" * 10, "__--__", "a.b/c"]:
        name = skyruns.sandbox_name(run, session)
        assert len(name) <= 53 and name.startswith("bk-0123abcd-")
        assert skyruns.run_of(name) == "0123abcd"
        assert name == name.lower() and name[-1].isalnum()
    assert skyruns.sandbox_name(run, "x", retry=2) != skyruns.sandbox_name(run, "x")


async def test_blocked_network_and_a_relay_url_is_refused_at_creation(
    tmp_path: Path, fake_sky: dict[str, str]
) -> None:
    with pytest.raises(SandboxStartError, match=r"cannot reach the relay at http://10\.0\.0\.1:9"):
        SKY.make(tmp_path, kwargs={"relay_url": "http://10.0.0.1:9", "network": "none"})
    SKY.make(tmp_path, kwargs={"relay_url": "http://10.0.0.1:9", "network": "public"})


@pytest.mark.sandbox
async def test_the_older_dict_exec_shape_reads_the_same(
    tmp_path: Path, fake_sky: dict[str, str]
) -> None:
    import sky_sandbox

    env = SKY.make(tmp_path)
    await env.start(force_build=False)
    try:
        sky_sandbox.use_exec_shape("dict")
        res = await env.exec("echo out; echo err >&2; exit 3")
        assert (res.return_code, res.stdout, res.stderr) == (3, "out\n", "err\n")
    finally:
        sky_sandbox.use_exec_shape("handle")
        await env.stop(delete=True)


DOCKERFILE_TASK = "FROM ubuntu:24.04\nRUN echo built\n"


def _stub(bin_dir: Path, name: str, log: Path, manifest_rc: int) -> None:
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / name
    script.write_text(
        f'#!/bin/sh\necho "$@" >> {log}\n[ "$1" = manifest ] && exit {manifest_rc}\nexit 0\n'
    )
    script.chmod(0o755)


async def test_dockerfile_tasks_build_once_under_a_content_addressed_tag(
    tmp_path: Path, fake_sky: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "calls"
    _stub(tmp_path / "bin", "podman", log, manifest_rc=1)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    env = SKY.make(tmp_path, dockerfile=DOCKERFILE_TASK, kwargs={"registry": "reg.example/rl"})
    image = await env._resolve_image(force_build=False)  # type: ignore[attr-defined]
    assert image.startswith("reg.example/rl/contract:")
    calls = log.read_text().splitlines()
    assert calls[0] == f"manifest inspect {image}"
    assert calls[1].startswith(f"build --platform linux/amd64 -t {image} -f ")
    assert calls[2] == f"push {image}"
    # The same task content: the tag exists, nothing is rebuilt.
    _stub(tmp_path / "bin", "podman", log, manifest_rc=0)
    log.unlink()
    again = SKY.make(tmp_path, dockerfile=DOCKERFILE_TASK, kwargs={"registry": "reg.example/rl"})
    assert await again._resolve_image(force_build=False) == image  # type: ignore[attr-defined]
    assert log.read_text().splitlines() == [f"manifest inspect {image}"]


async def test_a_dockerfile_task_without_a_builder_names_what_to_install(
    tmp_path: Path, fake_sky: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    env = SKY.make(tmp_path, dockerfile=DOCKERFILE_TASK, kwargs={"registry": "reg.example/rl"})
    with pytest.raises(HostPrerequisiteError, match="docker, podman or buildah"):
        await env._resolve_image(force_build=False)  # type: ignore[attr-defined]


def test_the_fake_is_importable_as_the_platform_shim() -> None:
    env = {**os.environ, "PYTHONPATH": str(FAKE)}
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            "from backends.sandbox import skysdk; print(skysdk.load().__name__)",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert res.stdout.strip() == "sky_sandbox", res.stderr


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its new parent to reap it counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_the_fake_server_dies_with_a_sigkilled_test_process() -> None:
    # A test process that starts the fake server, then is SIGKILLed: no clean-up runs in it.
    code = (
        "import os, sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from sky_support import fake_sky_server\n"
        "with fake_sky_server() as env:\n"
        "    print(env['SKYPILOT_API_SERVER_ENDPOINT'], flush=True)\n"
        "    time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    server = 0
    try:
        assert parent.stdout is not None
        socket = Path(parent.stdout.readline().strip().removeprefix("unix://"))
        assert socket.exists(), "the fake server did not start"
        children = subprocess.run(
            ["pgrep", "-P", str(parent.pid)], capture_output=True, text=True, check=True
        )
        (server,) = map(int, children.stdout.split())
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(server), "the fake server outlived the test process that started it"
        assert not socket.parent.exists()  # it removed its socket and the socket's folder
    finally:
        parent.kill()
        parent.wait()
        if server and _alive(server):
            os.kill(server, signal.SIGKILL)
