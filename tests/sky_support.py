"""Starting the fake SkyPilot API server (tests/skyfake) for a test, as a user's server runs."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FAKE = Path(__file__).parent / "skyfake"


def fake_env(socket_path: str) -> dict[str, str]:
    """What a process needs to reach the fake: the shim on its path and the endpoint."""
    path = os.pathsep.join(p for p in (str(FAKE), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "SKYPILOT_API_SERVER_ENDPOINT": f"unix://{socket_path}"}


@contextlib.contextmanager
def fake_sky_server() -> Iterator[dict[str, str]]:
    """Run the fake API server; yield the environment pointing at it (also set in os.environ).

    The server dies with the thread that starts it (PR_SET_PDEATHSIG), so start it from one
    that outlives it: the main thread, as pytest's fixtures run.
    """
    tmp = tempfile.mkdtemp(prefix="fake-sky-sock-")
    sock = f"{tmp}/api.sock"
    env = fake_env(sock)
    server = subprocess.Popen(
        [sys.executable, "-m", "sky_sandbox.server", sock],
        stdout=subprocess.PIPE,
        text=True,
        # It dies with this process, even SIGKILLed (a killed suite would orphan it).
        env={**os.environ, **env, "FAKE_SKY_PARENT": str(os.getpid())},
    )
    assert server.stdout is not None
    assert server.stdout.readline().strip() == "ready", "the fake API server did not start"
    saved = {k: os.environ.get(k) for k in env}
    os.environ["SKYPILOT_API_SERVER_ENDPOINT"] = env["SKYPILOT_API_SERVER_ENDPOINT"]
    if str(FAKE) not in sys.path:
        sys.path.insert(0, str(FAKE))
    try:
        yield env
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        with contextlib.suppress(OSError):
            os.unlink(sock)
            os.rmdir(tmp)


def _server() -> Any:
    from sky_sandbox.client import ServerEngine

    return ServerEngine(os.environ["SKYPILOT_API_SERVER_ENDPOINT"].removeprefix("unix://"))


async def create_calls() -> list[dict[str, Any]]:
    """Every create call the fake API server got (names asked for, spec), oldest first."""
    return list((await _server().fake_stats())["create_calls"])


async def inject_create_faults(*faults: dict[str, Any]) -> None:
    """The next create calls meet these faults, in order: each ``{"make": "all" | "half" |
    "none", "status": 503 | 500}`` makes that share of its sandboxes, then fails. Also
    forgets the calls counted so far."""
    await _server().fake_faults(list(faults), reset_log=True)
