"""Installing a bundle offline, once, into an environment cached by (image, Python, bundle).

The install runs inside a local sandbox of the task's own image with no network: a copy of
the host's Python (>= 3.12; the base image's python3 is 3.11) in the cache
(``backends.runtimes.interpreter``, the one Python runtimes run on: nothing under the host's
``/root``, so any agent user can run it) and uv are bound read-only, the bundle's wheels
read-only, and the new environment read-write at the path it will always have. The
wheels were resolved for the sandbox's platform, so native extensions match it; the bytecode
is compiled at install so read-only runs never recompile. Then the runner's ``check`` imports
the entrypoint with exactly what was installed, in a second sandbox that shows the environment
read-only (as every rollout sees it). Later rollouts bind the finished environment
read-only and install nothing.

For remote providers, the same steps belong in the image: a ``sandbox_images/`` Dockerfile
with Python 3.12 that copies a bundle and runs this install script in a RUN step.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from backends.bundle import cache
from backends.bundle.build import Bundle, BundleError, uv_binary
from backends.runtimes.build import runtimes_dir
from backends.runtimes.interpreter import ensure_python, interpreter, python_dir
from backends.sandbox.settings import UID_BASE, cache_dir

INSTALL_TIMEOUT_SEC = 900
UV_IN_SANDBOX = "/opt/backends/bin/uv"
Bind = dict[str, Any]  # a LocalSandbox extra_binds entry


@dataclass(frozen=True)
class Environment:
    """An installed bundle: its interpreter and project, at the same path inside and out.

    ``python_prefix`` is the copy of the host's Python its venv was made from (bound with it).
    """

    path: Path
    bundle: Bundle
    python_prefix: Path
    holds: tuple[cache.Hold, ...] = ()  # the environment's and the Python copy's

    def release(self) -> None:
        """Let the cache prune this environment and its Python again (once nobody else holds
        them)."""
        for held in self.holds:
            held.release()

    @property
    def held(self) -> bool:
        return any(held.held for held in self.holds)

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    def binds(self) -> list[Bind]:
        """LocalSandbox ``extra_binds`` showing the environment, the bundle and the Python copy,
        read-only."""
        return [
            _read_only(self.path),
            _read_only(self.bundle.path),
            _read_only(self.python_prefix),
        ]


def _read_only(path: Path) -> Bind:
    return {"source": str(path), "target": str(path), "read_only": True}


def environments_dir() -> Path:
    return cache_dir() / "environments"


def image_identity(environment_dir: Path, docker_image: str | None) -> str:
    """What the sandbox's image is made from: the image name, or the environment's files."""
    digest = hashlib.sha256(f"image\0{docker_image or ''}\0".encode())
    for path in sorted(p for p in environment_dir.rglob("*") if p.is_file()):
        digest.update(path.relative_to(environment_dir).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def platforms_dir() -> Path:
    return cache_dir() / "image-platforms"


async def image_platform(environment_dir: Path, docker_image: str | None) -> str:
    """The wheel platform of the sandbox's image, e.g. ``manylinux_2_36_x86_64``.

    Asked of the image itself (its glibc, the machine), in a sandbox, once per image: a
    bundle's native extensions must load there, whatever the host has.
    """
    identity = image_identity(environment_dir, docker_image)
    known = platforms_dir() / identity[:32]
    try:
        return known.read_text().strip()
    except OSError:
        pass
    out = await run_in_sandbox(
        environment_dir,
        docker_image,
        [],
        "getconf GNU_LIBC_VERSION 2>/dev/null || echo none; uname -m",
        name="bundle-platform",
        what="asking the sandbox's image for its platform",
    )
    platform = platform_of(out)
    known.parent.mkdir(parents=True, exist_ok=True)
    partial = known.with_name(f".{known.name}.{uuid.uuid4().hex[:8]}")
    partial.write_text(platform)
    os.replace(partial, known)
    return platform


def platform_of(probe: str) -> str:
    """``manylinux_2_NN_<arch>`` from ``getconf GNU_LIBC_VERSION`` and ``uname -m`` output."""
    lines = probe.strip().splitlines()
    libc = lines[0].split() if lines else []
    arch = lines[-1].strip() if len(lines) >= 2 else ""
    if len(libc) != 2 or libc[0] != "glibc" or not re.fullmatch(r"2\.\d+", libc[1]):
        raise BundleError(
            f"the sandbox's image has no glibc ({probe.strip()!r}): bundles ship manylinux "
            "wheels and run a copy of the host's Python, which need one"
        )
    if not re.fullmatch(r"[a-z0-9_]+", arch):
        raise BundleError(f"the sandbox's image reports an unusable machine {arch!r}")
    return f"manylinux_{libc[1].replace('.', '_')}_{arch}"


def environment_key(bundle: Bundle, image: str, python_prefix: Path) -> str:
    version = ".".join(map(str, sys.version_info[:3]))
    text = f"env-v1\0{image}\0{python_prefix}\0{version}\0{bundle.key}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def install_script(bundle: Bundle, env: Path, python: Path, entrypoint: str | None) -> str:
    """The offline install, as run inside the sandbox (or in an image's RUN step)."""
    q = shlex.quote
    lines = [
        "set -eu",
        "export UV_CACHE_DIR=/tmp/uv-cache UV_NO_PYTHON_DOWNLOADS=1 UV_OFFLINE=1",
        f"{UV_IN_SANDBOX} venv --quiet --python {q(str(python))} {q(str(env))}",
        f"{UV_IN_SANDBOX} pip install --quiet --offline --no-index "
        f"--find-links {q(str(bundle.wheels_dir))} --link-mode copy --compile-bytecode "
        f"--python {q(str(env / 'bin' / 'python'))} -r {q(str(bundle.requirements))}",
    ]
    if entrypoint:
        lines.append(
            f"{q(str(env / 'bin' / 'python'))} -m backends.bundle.runner check "
            f"{q(str(bundle.project_dir))} {q(entrypoint)}"
        )
    return "\n".join(lines)


async def ensure_environment(
    bundle: Bundle,
    *,
    environment_dir: Path,
    docker_image: str | None = None,
    entrypoint: str | None = None,
    root: Path | None = None,
) -> Environment:
    """The installed environment of ``bundle`` for this image, installed first if needed.

    ``environment_dir`` (and ``docker_image``) describe the sandbox's image, as in a Harbor
    task. Raises ``BundleError`` if the install or the entrypoint's import fails inside.
    Concurrent callers, in this process or others, install once. The environment comes held,
    with the copy of the host's Python it runs on (made first if there is none): the cache
    prunes neither until ``release()``.
    """
    image = image_identity(environment_dir, docker_image)
    root = root or environments_dir()
    python_held = await ensure_python(runtimes_dir())
    try:
        prefix = python_dir(runtimes_dir())
        path = root / environment_key(bundle, image, prefix)
        held = await cache.hold_built(
            path,
            lambda: _install(
                bundle, path, prefix, environment_dir, docker_image, entrypoint, image
            ),
        )
    except BaseException:
        python_held.release()
        raise
    return Environment(path, bundle, prefix, (held, python_held))


async def _install(
    bundle: Bundle,
    path: Path,
    prefix: Path,
    environment_dir: Path,
    docker_image: str | None,
    entrypoint: str | None,
    image: str,
) -> None:
    """Install into a stage shown at ``path``, check the entrypoint, then move it there."""
    stage = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    stage.mkdir(parents=True)
    os.chown(stage, UID_BASE, UID_BASE)  # sandbox root writes it
    try:
        await run_in_sandbox(
            environment_dir,
            docker_image,
            [
                {"source": uv_binary(), "target": UV_IN_SANDBOX, "read_only": True},
                _read_only(prefix),
                *_bundle_binds(bundle, stage, path, read_only=False),
            ],
            install_script(bundle, path, interpreter(prefix), entrypoint=None),
            name=f"bundle-install-{bundle.key[:12]}",
            what=f"installing bundle {bundle.key} offline in the sandbox",
        )
        if entrypoint:
            # With the environment read-only, as every rollout sees it: the project's
            # import-time code cannot alter what later rollouts run.
            await _check_in_sandbox(
                bundle, environment_dir, docker_image, stage, path, prefix, entrypoint
            )
        (stage / cache.SIZE_FILE).write_text(str(cache.disk_size(stage)))
        marker = {"bundle": bundle.key, "image": image, "python": str(prefix)}
        (stage / ".complete").write_text(json.dumps(marker))
        os.rename(stage, path)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


async def _check_in_sandbox(
    bundle: Bundle,
    environment_dir: Path,
    docker_image: str | None,
    stage: Path,
    path: Path,
    prefix: Path,
    entrypoint: str,
) -> None:
    q = shlex.quote
    script = (
        f"cd {q(str(bundle.project_dir))} && PYTHONDONTWRITEBYTECODE=1 "
        f"{q(str(path / 'bin' / 'python'))} -m backends.bundle.runner check "
        f"{q(str(bundle.project_dir))} {q(entrypoint)}"
    )
    stdout = await run_in_sandbox(
        environment_dir,
        docker_image,
        [_read_only(prefix), *_bundle_binds(bundle, stage, path, read_only=True)],
        script,
        name=f"bundle-check-{bundle.key[:12]}",
        what=f"checking entrypoint {entrypoint!r} in the sandbox",
    )
    verdict = json.loads(stdout.strip().splitlines()[-1])
    if not verdict["ok"]:
        raise BundleError(
            f"entrypoint {entrypoint!r} does not import in the sandbox, with the bundle's "
            f"dependencies installed: {verdict['error']}"
        )


def _bundle_binds(bundle: Bundle, stage: Path, target: Path, *, read_only: bool) -> list[Bind]:
    """The bundle (read-only) and the environment's stage at its final path."""
    return [
        _read_only(bundle.path),
        {"source": str(stage), "target": str(target), "read_only": read_only},
    ]


async def run_in_sandbox(
    environment_dir: Path,
    docker_image: str | None,
    binds: list[Bind],
    script: str,
    *,
    name: str,
    what: str,
) -> str:
    """Run ``script`` as root in a no-network sandbox of the image; its stdout, or BundleError.

    Only ``binds`` are shown from the host (nothing under its ``/root``).
    """
    from harbor.models.task.config import EnvironmentConfig
    from harbor.models.trial.paths import TrialPaths

    from backends.sandbox.local import LocalSandbox

    with tempfile.TemporaryDirectory(prefix="bundle-") as scratch:
        trial_paths = TrialPaths(trial_dir=Path(scratch))
        trial_paths.mkdir()
        sandbox = LocalSandbox(
            environment_dir=environment_dir,
            environment_name="bundle",
            session_id=name,
            trial_paths=trial_paths,
            task_env_config=EnvironmentConfig(docker_image=docker_image),
            network="none",
            extra_binds=binds,
        )
        await sandbox.start(force_build=False)
        try:
            result = await sandbox.exec(script, user="root", timeout_sec=INSTALL_TIMEOUT_SEC)
        finally:
            with anyio.CancelScope(shield=True):  # a cancelled install still stops its sandbox
                await sandbox.stop(delete=True)
    if result.return_code != 0:
        raise BundleError(
            f"{what} failed (exit {result.return_code}): "
            f"{(result.stderr or result.stdout or '').strip()[-4000:]}"
        )
    return result.stdout or ""
