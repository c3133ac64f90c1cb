"""A fake of SkyPilot's Sandbox SDK (``sky.sandbox``), for tests. Not SkyPilot's code.

It mirrors the documented surface of the Platform SDK (newest documented shape: ``exec``
returns a process handle; ``terminate``; pools), every per-call entry point with its ``.aio``
sibling, as recorded in ``tests/data/sky_sandbox_surface.json``; ``test_sky_surface`` pins it.
It is importable as the Platform SDK's top-level ``sky_sandbox`` shim (put this directory on
``sys.path``), the name ``backends.sandbox.skypilot`` falls back to without a ``sky`` package.

Two engines, picked by ``SKYPILOT_API_SERVER_ENDPOINT`` as the real SDK picks its server:

- ``unix:///path/to.sock``: the fake API server (``python -m sky_sandbox.server``), which runs
  every sandbox as a real local bubblewrap sandbox and every command for real in it. Sandboxes
  outlive the client process, as pods outlive a crashed orchestrator.
- ``sim://``: an in-process latency model for scale runs (``sky_sandbox.sim``): nothing is
  executed, files live in memory.

Limits the docs do not state are Harbor 0.25.0-derived (``MAX_NAME_LEN``, ``MAX_TIMEOUT_SEC``)
and enforced here, so a provider that breaks them fails a test. A sync call made on a thread
that runs an event loop is refused (``BlockingCallError``): use ``.aio`` there.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_NAME_LEN = 53  # Harbor 0.25.0-derived, not documented
MAX_TIMEOUT_SEC = 3600  # Harbor 0.25.0-derived: exec and file API server-side cap
DEFAULT_EXEC_TIMEOUT_SEC = 60  # documented default of exec's timeout_seconds
ENDPOINT_ENV = "SKYPILOT_API_SERVER_ENDPOINT"
_DNS = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


class SandboxSDKError(RuntimeError):
    """An error the (fake) API server reported."""


class TransientServerError(SandboxSDKError):
    """A create the server could not serve right now (capacity, a scheduling hiccup)."""


class BlockingCallError(RuntimeError):
    """A sync SDK call from a thread running an event loop: it would block every task."""


def _check_loop(name: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise BlockingCallError(f"sky.sandbox {name}() blocks: call {name}.aio() in async code")


class _Call:
    """A documented entry point: calling it is synchronous, ``.aio`` is its async sibling."""

    def __init__(self, aio: Callable[..., Awaitable[Any]], name: str) -> None:
        self.aio = aio
        self._name = name
        functools.update_wrapper(self, aio)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _check_loop(self._name)
        return _to_sync(asyncio.run(self.aio(*args, **kwargs)))


def _to_sync(value: Any) -> Any:
    if isinstance(value, Sandbox):
        return value
    if isinstance(value, _AioProcess):
        return Process(value)
    if isinstance(value, list):
        return [_to_sync(v) for v in value]
    return value


def entry_point(fn: Callable[..., Awaitable[Any]]) -> _Call:
    return _Call(fn, fn.__name__)


class _Method:
    """``entry_point`` for methods: binds the instance, keeps ``.aio``."""

    def __init__(self, fn: Callable[..., Awaitable[Any]]) -> None:
        self._fn = fn
        functools.update_wrapper(self, fn)

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return _Call(functools.partial(self._fn, obj), self._fn.__name__)


@dataclass(frozen=True)
class VolumeMount:
    name: str
    sub_path: str | None = None


# -- the engine the calls go to ------------------------------------------------------------


def _engine() -> Any:
    endpoint = os.environ.get(ENDPOINT_ENV, "")
    if endpoint.startswith("sim://"):
        from sky_sandbox.sim import engine as sim_engine

        return sim_engine()
    if endpoint.startswith("unix://"):
        from sky_sandbox.client import ServerEngine

        return ServerEngine(endpoint.removeprefix("unix://"))
    raise SandboxSDKError(
        f"no SkyPilot API server: {ENDPOINT_ENV} is {endpoint!r} (the fake takes unix:// or sim://)"
    )


# -- sandboxes -------------------------------------------------------------------------------


class _Stream:
    def __init__(self, data: bytes, aio: bool) -> None:
        self._data = data
        self._aio = aio

    def read(self) -> Any:
        text = self._data.decode(errors="replace")
        if self._aio:

            async def done() -> str:
                return text

            return done()
        return text


class _AioProcess:
    """The handle ``exec.aio`` returns: ``await wait()`` gives the exit code."""

    def __init__(self, waiter: Callable[[], Awaitable[tuple[int, bytes, bytes]]]) -> None:
        self._waiter = waiter
        self._result: tuple[int, bytes, bytes] | None = None
        self.stdout: _Stream | None = None
        self.stderr: _Stream | None = None

    async def wait(self) -> int:
        if self._result is None:
            self._result = await self._waiter()
            self.stdout = _Stream(self._result[1], aio=True)
            self.stderr = _Stream(self._result[2], aio=True)
        return self._result[0]


class Process:
    """The handle sync ``exec`` returns: ``wait()`` blocks for the exit code."""

    def __init__(self, aio: _AioProcess) -> None:
        self._aio = aio
        self.stdout: _Stream | None = None
        self.stderr: _Stream | None = None

    def wait(self) -> int:
        _check_loop("Process.wait")
        code = asyncio.run(self._aio.wait())
        assert self._aio._result is not None
        self.stdout = _Stream(self._aio._result[1], aio=False)
        self.stderr = _Stream(self._aio._result[2], aio=False)
        return code


class Sandbox:
    """One sandbox (one pod). Usable as a context manager: terminated on exit."""

    def __init__(self, name: str, status: str = "RUNNING", error_message: str | None = None):
        self.name = name
        self.status = status
        self.error_message = error_message
        self.endpoints: dict[int, str] = {}

    def __repr__(self) -> str:
        return f"Sandbox(name={self.name!r}, status={self.status!r})"

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.terminate()

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.terminate.aio()

    @_Method
    async def exec(
        self,
        *argv: str,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        timeout_seconds: int = DEFAULT_EXEC_TIMEOUT_SEC,
    ) -> Any:
        """Start ``argv`` (no shell) in the sandbox; returns its process handle."""
        if not argv or not all(isinstance(a, str) for a in argv):
            raise TypeError("exec takes the command as argv strings: exec('ls', '-l')")
        _check_timeout(timeout_seconds, "timeout_seconds")
        engine = _engine()
        run = await engine.exec_start(
            self.name, list(argv), dict(env or {}), workdir, timeout_seconds
        )
        if _EXEC_SHAPE["shape"] == "dict":  # the older documented shape
            code, out, err = await run()
            return {
                "exit_code": code,
                "stdout": out.decode(errors="replace"),
                "stderr": err.decode(errors="replace"),
            }
        return _AioProcess(run)

    @_Method
    async def read_bytes(self, path: str) -> bytes:
        return await _engine().read(self.name, path)

    @_Method
    async def write_bytes(self, data: bytes, path: str) -> None:
        if not isinstance(data, bytes | bytearray):
            raise TypeError("write_bytes(data, path) takes bytes first")
        await _engine().write(self.name, path, bytes(data))

    @_Method
    async def read_text(self, path: str) -> str:
        return (await _engine().read(self.name, path)).decode()

    @_Method
    async def write_text(self, text: str, path: str) -> None:
        await _engine().write(self.name, path, text.encode())

    @_Method
    async def terminate(self, wait: bool = True) -> None:
        await _engine().terminate(self.name, wait)
        self.status = "TERMINATED"

    @_Method
    async def snapshot(self) -> str:
        raise SandboxSDKError("snapshot needs a registry configured on the Platform dashboard")


_EXEC_SHAPE = {"shape": "handle"}


def use_exec_shape(shape: str) -> None:
    """Fake-only: ``"dict"`` makes ``exec`` return the older documented dict shape."""
    if shape not in ("handle", "dict"):
        raise ValueError(shape)
    _EXEC_SHAPE["shape"] = shape


def _check_timeout(value: Any, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{what} must be a positive int of seconds, not {value!r}")
    if what == "timeout_seconds" and value > MAX_TIMEOUT_SEC:
        raise ValueError(f"{what}={value} is past the server's cap of {MAX_TIMEOUT_SEC}s")


def _check_name(name: str) -> None:
    if len(name) > MAX_NAME_LEN or not _DNS.fullmatch(name):
        raise ValueError(
            f"sandbox name {name!r} must be a DNS-1123 label of at most {MAX_NAME_LEN} chars"
        )


@entry_point
async def create(
    name: str | None = None,
    *,
    num_sandboxes: int | None = None,
    pool: str | None = None,
    image: str | None = None,
    cpus: float | None = None,
    memory_gb: float | None = None,
    env: Mapping[str, str] | None = None,
    secrets: Sequence[str] | None = None,
    volumes: Mapping[str, Any] | None = None,
    ports: Sequence[int] | None = None,
    enable_docker: bool = False,
    context_name: str | None = None,
    namespace: str | None = None,
    timeout: int | None = None,  # noqa: ASYNC109 - the documented name of the lifetime
    block_network: bool = False,
    registry: str | None = None,
) -> Any:
    """Create a sandbox (or ``num_sandboxes`` of them, named ``<name>-0001``, ...)."""
    base = name or "sandbox"
    if num_sandboxes is not None and (
        not isinstance(num_sandboxes, int) or isinstance(num_sandboxes, bool) or num_sandboxes < 1
    ):
        raise ValueError(f"num_sandboxes must be an int >= 1, not {num_sandboxes!r}")
    names = (
        [base]
        if num_sandboxes is None
        else [f"{base}-{i:04d}" for i in range(1, num_sandboxes + 1)]
    )
    for n in names:
        _check_name(n)
    if pool is not None and (
        image is not None or block_network or cpus or memory_gb or enable_docker
    ):
        raise ValueError("a pool launch takes its image, shape and network from the pool")
    if timeout is not None:
        _check_timeout(timeout, "timeout")
    spec = {
        "pool": pool,
        "image": image or (None if pool else "python:3.12"),
        "cpus": cpus,
        "memory_gb": memory_gb,
        "env": dict(env or {}),
        "secrets": list(secrets or []),
        "ports": list(ports or []),
        "block_network": bool(block_network),
        "timeout": timeout,
    }
    created = await _engine().create(names, spec)
    boxes = [Sandbox(n) for n in created]
    for box in boxes:
        box.endpoints = {
            p: f"{box.name}.{namespace or 'default'}.svc.cluster.local:{p}" for p in spec["ports"]
        }
    return boxes if num_sandboxes is not None else boxes[0]


@entry_point
async def ls() -> list[Sandbox]:
    """Every live sandbox on the server."""
    return [Sandbox(n, status) for n, status in await _engine().ls()]


@entry_point
async def create_pool(
    name: str,
    *,
    image: str | None = None,
    cpus: float | None = None,
    memory_gb: float | None = None,
    replicas: int = 1,
    enable_docker: bool = False,
) -> None:
    _check_name(name)
    await _engine().create_pool(
        name,
        {
            "image": image or "python:3.12",
            "cpus": cpus,
            "memory_gb": memory_gb,
            "replicas": replicas,
        },
    )


@entry_point
async def set_pool_size(name: str, replicas: int) -> None:
    await _engine().set_pool_size(name, replicas)


@entry_point
async def delete_pool(name: str) -> None:
    await _engine().delete_pool(name)


@entry_point
async def aclose() -> None:
    """Release the shared session."""
    return None


__all__ = [
    "BlockingCallError",
    "Process",
    "Sandbox",
    "SandboxSDKError",
    "TransientServerError",
    "VolumeMount",
    "aclose",
    "create",
    "create_pool",
    "delete_pool",
    "ls",
    "set_pool_size",
    "use_exec_shape",
]
