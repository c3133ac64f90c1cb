"""The fake SDK's client side of the fake API server: JSON over HTTP on a Unix socket."""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from sky_sandbox import SandboxSDKError, TransientServerError


class ServerEngine:
    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path

    async def _call(self, path: str, body: dict[str, Any] | None = None) -> Any:
        # A session per call: the sync API runs each call on a loop of its own.
        connector = aiohttp.UnixConnector(path=self.socket_path)
        try:
            async with (
                aiohttp.ClientSession(
                    connector=connector, timeout=aiohttp.ClientTimeout(total=None)
                ) as s,
                s.post(f"http://fake-sky{path}", json=body or {}) as resp,
            ):
                data = await resp.json()
        except aiohttp.ClientConnectionError as exc:
            raise SandboxSDKError(
                f"cannot reach the API server at {self.socket_path}: {exc}"
            ) from exc
        if resp.status == 503:
            raise TransientServerError(data["error"])
        if resp.status == 404 and data.get("kind") == "file":
            raise FileNotFoundError(data["error"])
        if resp.status != 200:
            raise SandboxSDKError(data["error"])
        return data

    async def create(self, names: list[str], spec: dict[str, Any]) -> list[str]:
        return (await self._call("/create", {"names": names, "spec": spec}))["names"]

    async def ls(self) -> list[tuple[str, str]]:
        return [(s["name"], s["status"]) for s in (await self._call("/ls"))["sandboxes"]]

    async def exec_start(
        self, name: str, argv: list[str], env: dict[str, str], workdir: str | None, seconds: int
    ) -> Callable[[], Awaitable[tuple[int, bytes, bytes]]]:
        started = await self._call(
            "/exec",
            {"name": name, "argv": argv, "env": env, "workdir": workdir, "timeout": seconds},
        )

        async def wait() -> tuple[int, bytes, bytes]:
            done = await self._call("/wait", {"id": started["id"]})
            return (
                done["exit_code"],
                base64.b64decode(done["stdout"]),
                base64.b64decode(done["stderr"]),
            )

        return wait

    async def read(self, name: str, path: str) -> bytes:
        return base64.b64decode((await self._call("/read", {"name": name, "path": path}))["data"])

    async def write(self, name: str, path: str, data: bytes) -> None:
        await self._call(
            "/write", {"name": name, "path": path, "data": base64.b64encode(data).decode()}
        )

    async def terminate(self, name: str, wait: bool) -> None:
        await self._call("/terminate", {"name": name, "wait": wait})

    async def create_pool(self, name: str, spec: dict[str, Any]) -> None:
        await self._call("/pool/create", {"name": name, "spec": spec})

    async def set_pool_size(self, name: str, replicas: int) -> None:
        await self._call("/pool/size", {"name": name, "replicas": replicas})

    async def delete_pool(self, name: str) -> None:
        await self._call("/pool/delete", {"name": name})

    # Fake-only, for tests: what the server was asked, and faults to inject.

    async def fake_stats(self) -> dict[str, Any]:
        return dict(await self._call("/fake/stats"))

    async def fake_faults(self, create: list[dict[str, Any]], reset_log: bool = False) -> None:
        await self._call("/fake/faults", {"create": create, "reset_log": reset_log})
