"""Prepared agent runtimes: built once on the host, cached, bound read-only into sandboxes.

A runtime lives in ``$BACKENDS_CACHE/runtimes/<name>-<key>/``:

    venv/           a Python tool and its packages (relocatable: built in a stage, then moved)
    node_modules/   or a Node tool's npm packages, with the Node binary it runs on
    bin/            the recipe's commands only, for the agent's PATH (links, or launchers on
                    the runtime's Node): the venv's own python, pip, ... and the Node stay off
                    it, so the agent's shell keeps the image's
    .complete       the ``RuntimeManifest``, written last: a runtime with one is finished

The key hashes the recipe and the host's Python and platform, so the same recipe finds the
same runtime. Builders take the entry's lock exclusively (one builds, in this process or any
other; the others wait and find it built); users hold it shared for as long as they bind it,
so ``backends bundle prune`` (the cache's one pruner) never removes a runtime in use.
Before a runtime counts as built, its ``check`` runs in a sandbox with no network that sees it
read-only, as every trial will: a runtime that cannot run offline fails here, before any
trial's sandbox starts.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from pydantic import BaseModel

from backends.bundle import cache
from backends.bundle.build import BundleError
from backends.runtimes.interpreter import ensure_python, python_dir
from backends.runtimes.recipes import Recipe, RuntimeBuildError
from backends.sandbox.settings import cache_dir

MANIFEST = cache.COMPLETE  # the RuntimeManifest
CHECK_IMAGE = "debian:12"  # the check's sandbox: the local base image


class RuntimeManifest(BaseModel):
    """What a built runtime holds; the agent reads it on the host to know its commands."""

    name: str
    kind: str
    key: str
    packages: dict[str, str]  # every installed package's version
    version: str | None  # the agent's own version (its ``version_of`` package)
    commands: list[str]
    env: dict[str, str]
    size_bytes: int
    build_sec: float
    interpreter: str = "venv/bin/python"  # what the commands run on, relative to the runtime
    python: str | None = None  # the copy of Python a Python runtime runs on, bound beside it

    @classmethod
    def load(cls, runtime_dir: Path | str) -> RuntimeManifest:
        path = Path(runtime_dir) / MANIFEST
        try:
            return cls.model_validate_json(path.read_text())
        except (OSError, ValueError) as exc:
            raise RuntimeBuildError(f"{runtime_dir} is not a built agent runtime: {exc}") from exc


@dataclass(frozen=True)
class Runtime:
    """A built runtime, held (the cache does not prune it) until ``release()``."""

    path: Path
    manifest: RuntimeManifest
    holds: tuple[cache.Hold, ...] = field(default=(), compare=False, repr=False)

    @property
    def bin_dir(self) -> Path:
        return self.path / "bin"

    def release(self) -> None:
        for held in self.holds:
            held.release()

    def binds(self) -> list[dict[str, Any]]:
        """LocalSandbox ``extra_binds`` showing the runtime read-only at its own path, and the
        copy of Python it runs on, if any (a Node runtime carries its own Node)."""
        return _binds(self.path, self.path, self.manifest.python)

    def sandbox_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """LocalSandbox kwargs with the runtime bound in."""
        binds = kwargs.get("extra_binds") or []
        if isinstance(binds, str):
            binds = [b for b in binds.split(",") if b]
        return {**kwargs, "extra_binds": [*binds, *self.binds()]}


def _binds(source: Path, target: Path, python: str | None) -> list[dict[str, Any]]:
    binds = [{"source": str(source), "target": str(target), "read_only": True}]
    if python is not None:
        binds.append({"source": python, "target": python, "read_only": True})
    return binds


def runtimes_dir() -> Path:
    return cache_dir() / "runtimes"


def runtime_key(recipe: Recipe) -> str:
    return hashlib.sha256(f"runtime-v1\0{recipe.identity()}".encode()).hexdigest()[:24]


async def ensure_runtime(recipe: Recipe, *, root: Path | None = None) -> Runtime:
    """``recipe``'s runtime, built first if this host has none yet (a one-time cost).

    Concurrent callers, in this process or others, build once. Raises ``RuntimeBuildError``
    naming what failed: the package index refused a package, a command is missing, or the
    check failed in the sandbox. The runtime comes held.
    """
    root = root or runtimes_dir()
    path = root / f"{recipe.name}-{runtime_key(recipe)}"
    python = python_dir(root) if recipe.kind == "python" else None
    holds: list[cache.Hold] = []
    try:
        if python is not None:  # it runs on a copy of the host's Python, held with it
            holds.append(await ensure_python(root))
        holds.append(await cache.hold_built(path, lambda: _build(recipe, path, python)))
        return Runtime(path, RuntimeManifest.load(path), tuple(holds))
    except BaseException:
        for held in holds:
            held.release()
        raise


async def _build(recipe: Recipe, path: Path, python: Path | None) -> None:
    started = time.monotonic()
    stage = await anyio.to_thread.run_sync(_new_stage, path)
    try:
        packages = await recipe.install(stage)
        await check_runtime(recipe, stage, path, python)
        manifest = RuntimeManifest(
            name=recipe.name,
            kind=recipe.kind,
            key=path.name,
            packages=packages,
            version=packages.get(recipe.version_of),
            commands=list(recipe.commands),
            env=dict(recipe.env),
            interpreter=recipe.interpreter,
            python=None if python is None else str(python),
            size_bytes=0,
            build_sec=round(time.monotonic() - started, 3),
        )
        await anyio.to_thread.run_sync(_finish, stage, path, manifest)
    finally:
        await anyio.to_thread.run_sync(lambda: shutil.rmtree(stage, ignore_errors=True))


def _new_stage(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():  # only a finished build is renamed here; anything else is debris
        shutil.rmtree(path)
    stage = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    stage.mkdir()
    return stage


def _finish(stage: Path, path: Path, manifest: RuntimeManifest) -> None:
    """Record the runtime's size and manifest, then show it at ``path`` at once."""
    manifest.size_bytes = cache.disk_size(stage)
    (stage / cache.SIZE_FILE).write_text(str(manifest.size_bytes))
    (stage / MANIFEST).write_text(manifest.model_dump_json(indent=2))
    stage.chmod(0o755)  # sandbox users (any uid) read it
    os.rename(stage, path)


async def check_runtime(recipe: Recipe, stage: Path, path: Path, python: Path | None) -> None:
    """Run the recipe's check offline in a sandbox that sees ``stage`` read-only at ``path``
    (and the copy of Python it runs on), as an unprivileged user: every agent user can."""
    from backends.bundle.environment import run_in_sandbox

    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in recipe.env.items())
    script = (
        f'export PATH={shlex.quote(str(path / "bin"))}:"$PATH" HOME=/tmp PYTHONDONTWRITEBYTECODE=1 '
        f"{exports}; "
        f"{recipe.check}"
    )
    with tempfile.TemporaryDirectory(prefix="runtime-check-") as empty:
        try:
            await run_in_sandbox(
                Path(empty),
                CHECK_IMAGE,
                _binds(stage, path, None if python is None else str(python)),
                f"setpriv --reuid=65534 --regid=65534 --clear-groups -- sh -c {shlex.quote(script)}",
                name=f"runtime-check-{recipe.name}"[:40],
                what=f"checking the {recipe.name} runtime offline in a sandbox ({recipe.check!r})",
            )
        except BundleError as exc:
            raise RuntimeBuildError(str(exc)) from exc
