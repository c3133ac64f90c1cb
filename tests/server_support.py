"""Helpers for the server tests: real uvicorn on a real socket, in-process or as a subprocess."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import uvicorn

from backends import (
    AgentWorkflow,
    AgentWorkflowConfig,
    AgentWorkflowContext,
    ConcurrencyConfig,
    Grader,
    GraderContext,
    LocalBackend,
    RolloutSample,
    SampleSource,
    get_rollout_context,
)
from backends.server import LEASE_HEADER, create_rollout_server

ROOT = Path(__file__).resolve().parents[1]


class ScriptedWorkflow(AgentWorkflow[AgentWorkflowConfig]):
    """Behaviour chosen per row through metadata: sleep, fail, or stream via a sample source."""

    async def run(self, ctx: AgentWorkflowContext[AgentWorkflowConfig]) -> Any:
        meta = ctx.metadata or {}
        rollout = get_rollout_context()
        if meta.get("no_preview") and rollout is not None:
            rollout.preview_enabled = False
        if meta.get("fail"):
            raise RuntimeError("the workflow failed on purpose")
        if meta.get("block"):
            time.sleep(float(meta["block"]))  # blocks the event loop, as a careless workflow does
        if meta.get("stream") and rollout is not None:
            source = _Growing([*ctx.prompt])
            rollout.set_sample_source(source)
            for i in range(int(meta["stream"])):
                source.messages.append({"role": "assistant", "content": f"step {i}"})
                await anyio.sleep(0.05)
            await anyio.sleep(float(meta.get("sleep", 0)))
            return None
        if meta.get("sleep"):
            await anyio.sleep(float(meta["sleep"]))
        messages = [*ctx.prompt, {"role": "assistant", "content": str(meta.get("reply", "42"))}]
        if meta.get("no_trajectory"):
            return None if rollout is None else _no_trajectory(rollout, messages)
        return messages


def _no_trajectory(rollout: Any, messages: list[dict[str, Any]]) -> None:
    rollout.set_sample_source(_Fixed(RolloutSample(messages=messages, trajectory_messages=None)))


class _Fixed(SampleSource):
    def __init__(self, sample: RolloutSample) -> None:
        self.sample = sample

    async def get_sample(self) -> RolloutSample:
        return self.sample


class _Growing(SampleSource):
    def __init__(self, messages: list[dict[str, Any]]) -> None:
        self.messages = messages

    async def get_sample(self) -> RolloutSample:
        return RolloutSample(messages=list(self.messages))

    async def get_preview(self, max_messages: int) -> RolloutSample | None:
        return RolloutSample(messages=[dict(m) for m in self.messages[-max_messages:]])


class ExactGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        assert ctx.sample is not None
        ctx.set_reward(1.0 if ctx.sample.messages[-1]["content"] == ctx.label else 0.0)


def make_backend(
    max_concurrent: int | None = None, artifacts_root: Path | None = None
) -> LocalBackend:
    config = AgentWorkflowConfig(
        name="scripted", concurrency=ConcurrencyConfig(max_concurrent=max_concurrent)
    )
    return LocalBackend(
        workflow=ScriptedWorkflow,
        workflow_config=config,
        grader=ExactGrader,
        artifacts_root=artifacts_root,
    )


def rollout_body(rid: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "rollout_id": rid,
        "initial_messages": [{"role": "user", "content": "What is 6 * 7?"}],
        "label": "42",
        "chat_completions_url": "http://127.0.0.1:9/v1/chat/completions",
        "llm_api_key": "sk-test-key-0123456789abcdef",
    }
    body.update(extra)
    return body


class _QuietServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # the test process keeps its own signal handling


@contextlib.asynccontextmanager
async def serve_in_process(app: Any) -> AsyncIterator[str]:
    """Serve ``app`` over real HTTP on 127.0.0.1; yield its base URL; stop it on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, lifespan="on", log_level="warning", http="httptools")
    server = _QuietServer(config)
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve, [sock])
        while not server.started:
            await anyio.sleep(0.01)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
    sock.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


WORKFLOW_MAIN = """
import sys
sys.path.insert(0, {tests!r})
from server_support import make_backend
backend = make_backend(max_concurrent={max_concurrent!r}, artifacts_root={artifacts!r})
"""


@contextlib.contextmanager
def server_process(
    tmp_path: Path,
    state_file: Path,
    *extra_args: str,
    max_concurrent: int | None = None,
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """Run ``python -m backends.server main.py:backend`` as a real subprocess."""
    main = tmp_path / "main.py"
    main.write_text(
        WORKFLOW_MAIN.format(
            tests=str(ROOT / "tests"),
            max_concurrent=max_concurrent,
            artifacts=str(tmp_path / "rollouts"),
        )
    )
    port = free_port()
    cmd = [
        sys.executable, "-m", "backends.server", f"{main}:backend",
        "--port", str(port), "--state-file", str(state_file), "--log-level", "warning",
        "--artifacts-root", str(tmp_path / "rollouts"), *extra_args,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        # Generous: importing the server takes seconds on a loaded host (20 s ran out once);
        # a server that cannot start exits, which ends the wait at once.
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start (exit code {proc.poll()})")
            time.sleep(0.05)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(10)


def server(tmp_path: Path, backend: Any = None, **options: Any) -> Any:
    """A rollout server app with its state and artifacts under tmp_path."""
    options.setdefault("state_file", tmp_path / "state.sqlite3")
    options.setdefault("artifacts_root", tmp_path / "rollouts")
    return create_rollout_server(backend=backend or make_backend(), **options)


async def submit(http: httpx.AsyncClient, rid: str, **extra: Any) -> str:
    """POST a rollout; return its lease token (the answer must be 202, queued)."""
    response = await http.post("/rollout", json=rollout_body(rid, **extra))
    assert response.status_code == 202, response.text
    data = response.json()
    assert data["rollout_id"] == rid and data["status"] == "queued"
    return str(data["polling_lease_token"])


async def result(http: httpx.AsyncClient, rid: str, lease: str, wait: float = 10) -> dict[str, Any]:
    """Long-poll a rollout's result (the answer must be 200)."""
    response = await http.get(
        f"/rollout/{rid}/result", headers={LEASE_HEADER: lease}, params={"wait": wait}
    )
    assert response.status_code == 200, response.text
    return dict(response.json())
