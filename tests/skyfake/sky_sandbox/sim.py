"""The fake SDK's in-process latency model, for scale runs: nothing is executed.

``SKYPILOT_API_SERVER_ENDPOINT=sim://`` selects it. Every call waits as the model says
(create ~1 s, exec ~50 ms, transfers by size), a share of creates fail with
``TransientServerError``, and files live in memory per sandbox. Commands are not run, with
exceptions a provider's transfers need: ``tar -c ... -f ARCHIVE -C DIR ...`` packs the
sandbox's in-memory files under DIR into ARCHIVE, and chunked reads of it come back base64'd,
so downloads carry what the model says exists: ``seed_files`` (by default a verifier's
``/logs/verifier/reward.txt`` of ``1``).
"""

from __future__ import annotations

import asyncio
import base64
import io
import random
import re
import shlex
import tarfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from sky_sandbox import SandboxSDKError, TransientServerError


@dataclass
class LatencyModel:
    create_sec: float = 1.0
    exec_sec: float = 0.05
    transfer_sec: float = 0.02
    bytes_per_sec: float = 100e6
    jitter: float = 0.3  # each wait is scaled by a uniform factor in [1 - j, 1 + j]
    create_failure_rate: float = 0.03
    failing_first_creates: int = 0  # these fail whatever the rate: a test sees retries for sure
    seed_files: dict[str, bytes] = field(
        default_factory=lambda: {"/logs/verifier/reward.txt": b"1\n"}
    )


@dataclass
class Counters:
    creates: int = 0  # create calls (one may make a batch)
    sandboxes: int = 0  # sandboxes they made
    create_failures: int = 0
    execs: int = 0
    reads: int = 0
    writes: int = 0
    terminates: int = 0
    live: int = 0
    peak_live: int = 0


class SimEngine:
    def __init__(self, model: LatencyModel | None = None) -> None:
        self.model = model or LatencyModel()
        self.boxes: dict[str, dict[str, bytes]] = {}
        self.counters = Counters()

    async def _wait(self, seconds: float) -> None:
        j = self.model.jitter
        await asyncio.sleep(seconds * random.uniform(1 - j, 1 + j))

    async def create(self, names: list[str], spec: dict[str, Any]) -> list[str]:
        await self._wait(self.model.create_sec)
        self.counters.creates += 1
        failing = self.counters.creates <= self.model.failing_first_creates
        if failing or random.random() < self.model.create_failure_rate:
            self.counters.create_failures += 1
            raise TransientServerError("simulated: the cluster could not schedule the pod yet")
        for name in names:
            if name in self.boxes:
                raise SandboxSDKError(f"sandbox {name!r} already exists")
            self.boxes[name] = dict(self.model.seed_files)
        self.counters.sandboxes += len(names)
        self.counters.live = len(self.boxes)
        self.counters.peak_live = max(self.counters.peak_live, self.counters.live)
        return names

    def _box(self, name: str) -> dict[str, bytes]:
        box = self.boxes.get(name)
        if box is None:
            raise SandboxSDKError(f"no sandbox {name!r}")
        return box

    async def ls(self) -> list[tuple[str, str]]:
        return [(n, "RUNNING") for n in self.boxes]

    async def exec_start(
        self, name: str, argv: list[str], env: dict[str, str], workdir: str | None, seconds: int
    ) -> Callable[[], Awaitable[tuple[int, bytes, bytes]]]:
        box = self._box(name)
        self.counters.execs += 1

        async def wait() -> tuple[int, bytes, bytes]:
            await self._wait(self.model.exec_sec)
            return _respond(box, argv)

        return wait

    async def read(self, name: str, path: str) -> bytes:
        box = self._box(name)
        self.counters.reads += 1
        data = box.get(path)
        if data is None:
            raise FileNotFoundError(path)
        await self._wait(self.model.transfer_sec + len(data) / self.model.bytes_per_sec)
        return data

    async def write(self, name: str, path: str, data: bytes) -> None:
        box = self._box(name)
        self.counters.writes += 1
        await self._wait(self.model.transfer_sec + len(data) / self.model.bytes_per_sec)
        box[path] = data

    async def terminate(self, name: str, wait: bool) -> None:
        await self._wait(self.model.exec_sec)
        self.counters.terminates += 1
        if self.boxes.pop(name, None) is None:
            raise SandboxSDKError(f"no sandbox {name!r}")
        self.counters.live = len(self.boxes)

    async def create_pool(self, name: str, spec: dict[str, Any]) -> None:
        return None

    async def set_pool_size(self, name: str, replicas: int) -> None:
        return None

    async def delete_pool(self, name: str) -> None:
        return None


_READ = re.compile(r"tail -c \+(\d+) (\S+) \| head -c (\d+) \| base64")


def _respond(box: dict[str, bytes], argv: list[str]) -> tuple[int, bytes, bytes]:
    """Not executed: only what transfers need has effects. ``tar -c ... -f ARCHIVE`` packs
    the modelled files into ARCHIVE, ``tail -c +N F | head -c M | base64`` reads a chunk of
    a file, ``rm -f``/``rm -rf`` remove files."""
    script = argv[-1] if argv[:2] == ["sh", "-c"] else ""
    out = b""
    for part in script.split(";"):
        words = shlex.split(part.split("||")[0])
        if words[:2] == ["rm", "-f"]:
            for path in words[2:]:
                box.pop(path, None)
        elif words[:2] == ["rm", "-rf"]:
            for path in words[2:]:
                for key in [k for k in box if k == path or k.startswith(path.rstrip("/") + "/")]:
                    del box[key]
        elif words[:2] == ["tar", "-c"]:
            archive = words[words.index("-f") + 1]
            box[archive] = _pack(box, words, archive)
            out = f"{len(box[archive])}\n".encode()  # for a following `stat -c %s`
        elif read := _READ.search(part):
            start, path, size = int(read[1]), read[2], int(read[3])
            out = base64.encodebytes(box.get(path, b"")[start - 1 : start - 1 + size])
    return 0, out, b""


def _pack(box: dict[str, bytes], words: list[str], archive: str) -> bytes:
    root = words[words.index("-C") + 1].rstrip("/") if "-C" in words else ""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path, data in box.items():
            if path.startswith(root + "/") and path != archive:
                info = tarfile.TarInfo(path[len(root) + 1 :])
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


_engine: SimEngine | None = None


def engine() -> SimEngine:
    """This process's simulated cluster (one, shared by every call)."""
    global _engine
    if _engine is None:
        _engine = SimEngine()
    return _engine


def configure(model: LatencyModel) -> SimEngine:
    """Start a fresh simulated cluster with ``model``."""
    global _engine
    _engine = SimEngine(model)
    return _engine
