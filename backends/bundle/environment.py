"""Installing a bundle offline, once, into an environment cached by (image, Python, bundle).

The install runs inside a local sandbox of the task's own image with no network: the host's
Python (>= 3.12; the base image's python3 is 3.11) and uv are bound read-only, the bundle's
wheels read-only, and the new environment read-write at the path it will always have. The
wheels were resolved for the sandbox's platform, so native extensions match it; the bytecode
is compiled at install so read-only runs never recompile. Then the runner's ``check`` imports
the entrypoint with exactly what was installed. Later rollouts bind the finished environment
read-only and install nothing.

For remote providers, the same steps belong in the image: a ``sandbox_images/`` Dockerfile
with Python 3.12 that copies a bundle and runs this install script in a RUN step.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shlex
import shutil
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from backends.bundle.build import Bundle, BundleError, uv_binary
from backends.sandbox.settings import UID_BASE, cache_dir

INSTALL_TIMEOUT_SEC = 900
UV_IN_SANDBOX = "/opt/backends/bin/uv"


@dataclass(frozen=True)
class Environment:
    """An installed bundle: its interpreter and project, at the same path inside and out."""

    path: Path
    bundle: Bundle
    python_prefix: Path

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    def binds(self) -> list[dict[str, Any]]:
        """LocalSandbox ``extra_binds`` showing the environment and the bundle, read-only."""
        return [
            {"source": str(self.path), "target": str(self.path), "read_only": True},
            {"source": str(self.bundle.path), "target": str(self.bundle.path), "read_only": True},
        ]


def environments_dir() -> Path:
    return cache_dir() / "environments"


def image_identity(environment_dir: Path, docker_image: str | None) -> str:
    """What the sandbox's image is made from: the image name, or the environment's files."""
    digest = hashlib.sha256(f"image\0{docker_image or ''}\0".encode())
    for path in sorted(p for p in environment_dir.rglob("*") if p.is_file()):
        digest.update(path.relative_to(environment_dir).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


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
    Concurrent callers, in this process or others, install once.
    """
    prefix = Path(sys.base_prefix)
    image = image_identity(environment_dir, docker_image)
    root = root or environments_dir()
    path = root / environment_key(bundle, image, prefix)
    found = Environment(path, bundle, prefix)
    if (path / ".complete").is_file():
        return found
    root.mkdir(parents=True, exist_ok=True)
    lock_path = root / f"{path.name}.lock"
    async with _file_lock(lock_path):
        if (path / ".complete").is_file():
            return found
        stage = root / f".{path.name}.{uuid.uuid4().hex[:8]}"
        stage.mkdir()
        os.chown(stage, UID_BASE, UID_BASE)  # sandbox root writes it
        try:
            await _install_in_sandbox(
                bundle, stage, path, environment_dir, docker_image, entrypoint
            )
            marker = {"bundle": bundle.key, "image": image, "python": str(prefix)}
            (stage / ".complete").write_text(json.dumps(marker))
            os.rename(stage, path)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    return found


async def _install_in_sandbox(
    bundle: Bundle,
    stage: Path,
    target: Path,
    environment_dir: Path,
    docker_image: str | None,
    entrypoint: str | None,
) -> None:
    from harbor.models.task.config import EnvironmentConfig
    from harbor.models.trial.paths import TrialPaths

    from backends.sandbox.local import LocalSandbox

    with tempfile.TemporaryDirectory(prefix="bundle-install-") as scratch:
        trial_paths = TrialPaths(trial_dir=Path(scratch))
        trial_paths.mkdir()
        sandbox = LocalSandbox(
            environment_dir=environment_dir,
            environment_name="bundle-install",
            session_id=f"bundle-install-{bundle.key[:12]}",
            trial_paths=trial_paths,
            task_env_config=EnvironmentConfig(docker_image=docker_image),
            network="none",
            host_python=True,
            extra_binds=[
                {"source": uv_binary(), "target": UV_IN_SANDBOX, "read_only": True},
                {"source": str(bundle.path), "target": str(bundle.path), "read_only": True},
                {"source": str(stage), "target": str(target), "read_only": False},
            ],
        )
        await sandbox.start(force_build=False)
        try:
            script = install_script(
                bundle, target, Path(sys.base_prefix) / "bin" / "python3", entrypoint
            )
            result = await sandbox.exec(script, user="root", timeout_sec=INSTALL_TIMEOUT_SEC)
        finally:
            await sandbox.stop(delete=True)
    if result.return_code != 0:
        raise BundleError(
            f"installing bundle {bundle.key} offline in the sandbox failed (exit "
            f"{result.return_code}): {(result.stderr or '').strip()[-4000:]}"
        )
    if entrypoint:
        verdict = json.loads((result.stdout or "").strip().splitlines()[-1])
        if not verdict["ok"]:
            raise BundleError(
                f"entrypoint {entrypoint!r} does not import in the sandbox, with the bundle's "
                f"dependencies installed: {verdict['error']}"
            )


class _file_lock:
    """An exclusive lock on ``path`` across processes, waited for off the event loop."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1

    async def __aenter__(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                await anyio.sleep(0.1)

    async def __aexit__(self, *exc: object) -> None:
        os.close(self.fd)  # releases the lock
