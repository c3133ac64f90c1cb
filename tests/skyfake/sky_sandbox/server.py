"""The fake API server: every sandbox a real local bubblewrap sandbox, every command run in it.

``python -m sky_sandbox.server SOCKET`` serves the fake SDK (``sky_sandbox.client``) on a Unix
socket and prints ``ready`` once it listens. Sandboxes belong to this process, not to the
client's, so they outlive a killed orchestrator as pods do; each one's ``timeout`` (its
lifetime) is enforced, and SIGTERM stops them all. Secrets named at create time resolve from
this process's environment, standing in for the Platform's secrets manager. Started with
``FAKE_SKY_PARENT=<pid>``, it stops when that process dies, however it died.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ctypes
import itertools
import json
import os
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from harbor.models.task.config import EnvironmentConfig
from harbor.models.trial.paths import TrialPaths

from backends.sandbox.errors import ExecTimeoutError
from backends.sandbox.local import LocalSandbox

POD_PIDS_LIMIT = 256  # as a kubelet's podPidsLimit would set
# What a command's waiter hears when its pod is terminated under it. SkyPilot does not say:
# "killed" answers exit 137 (the pod's processes were killed); "hang" never answers, as a
# stream whose far end vanished without closing. Set in the server's environment.
LOST_EXECS_ENV = "FAKE_SKY_LOST_EXECS"
# The pid whose death stops the server (tests/sky_support.py sets it to the test process).
PARENT_ENV = "FAKE_SKY_PARENT"
PR_SET_PDEATHSIG = 1


@dataclass
class Pod:
    name: str
    env: LocalSandbox
    expires: float | None
    execs: dict[str, asyncio.Task[tuple[int, bytes, bytes]]] = field(default_factory=dict)


class FakeServer:
    def __init__(self, state: Path) -> None:
        self.state = state
        self.pods: dict[str, Pod] = {}
        self.starting: set[str] = set()
        self.pools: dict[str, dict[str, Any]] = {}
        self.execs: dict[str, tuple[Pod, asyncio.Task[tuple[int, bytes, bytes]]]] = {}
        self._ids = itertools.count()
        self.create_calls: list[dict[str, Any]] = []  # each create asked for: names and spec
        # Fake-only: faults the next create calls meet, in order. Each makes "all", "half" or
        # "none" of its sandboxes, then answers `status` (503: transient, else an error), as
        # a server that failed half-way or whose answer was lost.
        self.create_faults: list[dict[str, Any]] = []

    # -- sandboxes -------------------------------------------------------------------------

    def _sandbox(self, name: str, spec: dict[str, Any]) -> LocalSandbox:
        home = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.state))
        (home / "environment").mkdir()
        paths = TrialPaths(trial_dir=home / "trial")
        paths.mkdir()
        memory = spec.get("memory_gb")
        env = dict(spec.get("env") or {})
        for secret in spec.get("secrets") or []:
            if secret not in os.environ:
                raise _error(400, f"secret {secret!r} is not set on the server")
            env[secret] = os.environ[secret]
        return LocalSandbox(
            environment_dir=home / "environment",
            environment_name=name,
            session_id=f"{name}__pod",
            trial_paths=paths,
            task_env_config=EnvironmentConfig(
                docker_image=spec["image"],
                cpus=spec.get("cpus") or 1,
                memory_mb=int(memory * 1024) if memory else None,
            ),
            network="none" if spec.get("block_network") else "public",
            pids_limit=POD_PIDS_LIMIT,
            persistent_env=env,
        )

    async def create(self, body: dict[str, Any]) -> dict[str, Any]:
        names, spec = body["names"], dict(body["spec"])
        if not body.get("injected"):
            self.create_calls.append({"names": list(names), "spec": dict(spec)})
            if self.create_faults:
                fault = self.create_faults.pop(0)
                made = {"all": len(names), "half": len(names) // 2, "none": 0}[fault["make"]]
                if made:
                    await self.create({"names": names[:made], "spec": spec, "injected": True})
                raise _error(fault["status"], f"injected: a create of {len(names)} failed")
        taken = [n for n in names if n in self.pods or n in self.starting]
        if taken:
            raise _error(409, f"sandbox {taken[0]!r} already exists")
        if spec.get("pool"):
            pool = self.pools.get(spec["pool"])
            if pool is None:
                raise _error(404, f"no pool {spec['pool']!r}")
            spec.update({k: pool[k] for k in ("image", "cpus", "memory_gb")})
        self.starting.update(names)
        try:
            envs = [self._sandbox(n, spec) for n in names]
            results = await asyncio.gather(
                *(e.start(force_build=False) for e in envs), return_exceptions=True
            )
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                await asyncio.gather(*(e.stop(delete=True) for e in envs), return_exceptions=True)
                raise _error(500, f"sandbox failed to start: {failed[0]}")
            ttl = spec.get("timeout")
            for n, e in zip(names, envs, strict=True):
                self.pods[n] = Pod(n, e, time.monotonic() + ttl if ttl else None)
        finally:
            self.starting.difference_update(names)
        return {"names": names}

    def _pod(self, name: str) -> Pod:
        pod = self.pods.get(name)
        if pod is None:
            raise _error(404, f"no sandbox {name!r}")
        return pod

    async def terminate(self, body: dict[str, Any]) -> dict[str, Any]:
        pod = self.pods.pop(body["name"], None)
        if pod is None:
            raise _error(404, f"no sandbox {body['name']!r}")
        await self._stop(pod)
        return {}

    async def _stop(self, pod: Pod) -> None:
        for task in pod.execs.values():
            task.cancel()
        await pod.env.stop(delete=True)

    async def reap_expired(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            now = time.monotonic()
            for pod in [p for p in self.pods.values() if p.expires and p.expires < now]:
                self.pods.pop(pod.name, None)
                await self._stop(pod)

    # -- commands and files ----------------------------------------------------------------

    async def _run(self, pod: Pod, body: dict[str, Any]) -> tuple[int, bytes, bytes]:
        try:
            res = await pod.env.exec(
                "exec " + shlex.join(body["argv"]),  # argv as the pod's own process, no shell
                cwd=body.get("workdir"),
                env=body.get("env") or None,
                timeout_sec=body["timeout"],
            )
        except ExecTimeoutError as exc:
            return 124, b"", f"{exc}\n".encode()
        return res.return_code, (res.stdout or "").encode(), (res.stderr or "").encode()

    async def exec(self, body: dict[str, Any]) -> dict[str, Any]:
        pod = self._pod(body["name"])
        exec_id = f"x{next(self._ids)}"
        task = asyncio.ensure_future(self._run(pod, body))
        pod.execs[exec_id] = task
        self.execs[exec_id] = (pod, task)
        return {"id": exec_id}

    async def wait(self, body: dict[str, Any]) -> dict[str, Any]:
        pod, task = self.execs[body["id"]]
        try:
            code, out, err = await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():
                raise
            if os.environ.get(LOST_EXECS_ENV) == "hang":
                await asyncio.Event().wait()  # until the client gives up
            code, out, err = 137, b"", b"sandbox terminated\n"
        self.execs.pop(body["id"], None)
        pod.execs.pop(body["id"], None)
        return {
            "exit_code": code,
            "stdout": base64.b64encode(out).decode(),
            "stderr": base64.b64encode(err).decode(),
        }

    async def read(self, body: dict[str, Any]) -> dict[str, Any]:
        pod = self._pod(body["name"])
        with tempfile.TemporaryDirectory(dir=self.state) as tmp:
            try:
                await pod.env.download_file(body["path"], Path(tmp) / "data")
            except (FileNotFoundError, IsADirectoryError) as exc:
                raise _error(404, str(exc), kind="file") from exc
            data = (Path(tmp) / "data").read_bytes()
        return {"data": base64.b64encode(data).decode()}

    async def write(self, body: dict[str, Any]) -> dict[str, Any]:
        pod = self._pod(body["name"])
        with tempfile.TemporaryDirectory(dir=self.state) as tmp:
            source = Path(tmp) / "data"
            source.write_bytes(base64.b64decode(body["data"]))
            await pod.env.upload_file(source, body["path"])
        return {}

    async def ls(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"sandboxes": [{"name": n, "status": "RUNNING"} for n in self.pods]}

    async def pool_create(self, body: dict[str, Any]) -> dict[str, Any]:
        self.pools[body["name"]] = dict(body["spec"])
        return {}

    async def pool_size(self, body: dict[str, Any]) -> dict[str, Any]:
        self.pools[body["name"]]["replicas"] = body["replicas"]
        return {}

    async def pool_delete(self, body: dict[str, Any]) -> dict[str, Any]:
        self.pools.pop(body["name"], None)
        return {}

    async def fake_stats(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"create_calls": self.create_calls}

    async def fake_faults(self, body: dict[str, Any]) -> dict[str, Any]:
        self.create_faults = list(body["create"])
        if body.get("reset_log"):
            self.create_calls = []
        return {}

    async def close(self) -> None:
        pods, self.pods = list(self.pods.values()), {}
        await asyncio.gather(*(self._stop(p) for p in pods), return_exceptions=True)


def _error(status: int, message: str, kind: str = "") -> web.HTTPException:
    return _JSONError(status, message, kind)


class _JSONError(web.HTTPException):
    def __init__(self, status: int, message: str, kind: str) -> None:
        self.status_code = status
        super().__init__(
            text=_json({"error": message, "kind": kind}), content_type="application/json"
        )


def _json(data: Any) -> str:
    return json.dumps(data)


def app(server: FakeServer) -> web.Application:
    routes = {
        "/create": server.create,
        "/ls": server.ls,
        "/exec": server.exec,
        "/wait": server.wait,
        "/read": server.read,
        "/write": server.write,
        "/terminate": server.terminate,
        "/pool/create": server.pool_create,
        "/pool/size": server.pool_size,
        "/pool/delete": server.pool_delete,
        "/fake/stats": server.fake_stats,  # fake-only: what tests check at the server
        "/fake/faults": server.fake_faults,
    }
    application = web.Application(client_max_size=1024**3)

    def handler(fn: Any) -> Any:
        async def handle(request: web.Request) -> web.Response:
            try:
                return web.json_response(await fn(await request.json()))
            except web.HTTPException:
                raise
            except Exception as exc:  # the client sees what went wrong, the server lives on
                raise _JSONError(500, f"{type(exc).__name__}: {exc}", "") from exc

        return handle

    for path, fn in routes.items():
        application.router.add_post(path, handler(fn))
    return application


async def serve(socket_path: str) -> None:
    state = Path(tempfile.mkdtemp(prefix="fake-sky-"))
    server = FakeServer(state)
    runner = web.AppRunner(app(server))
    await runner.setup()
    site = web.UnixSite(runner, socket_path)
    await site.start()
    os.chmod(socket_path, 0o600)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stop_with_parent(stop)
    reaper = asyncio.ensure_future(server.reap_expired())
    print("ready", flush=True)
    await stop.wait()
    reaper.cancel()
    await server.close()
    await runner.cleanup()
    with contextlib.suppress(OSError):
        os.rmdir(state)
    with contextlib.suppress(OSError):  # the socket, and its folder if made for it alone
        os.unlink(socket_path)
        os.rmdir(os.path.dirname(socket_path))


def stop_with_parent(stop: asyncio.Event) -> None:
    """SIGTERM (so: stop, pods and all) once the process named in ``FAKE_SKY_PARENT`` dies,
    even by SIGKILL, when nothing could run its clean-up: a killed test suite must not leave
    the server running."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != int(parent):  # it died before the prctl: no signal will come
        stop.set()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1]))
