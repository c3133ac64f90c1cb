"""Runtime recipes: how to prepare one of Harbor's installed agents once, on the host.

Harbor's installed agents install themselves at trial time (uv, a Python, packages, Node),
from the internet, inside the sandbox. A recipe says instead what the agent's tool needs, so
``backends.runtimes.build`` can prepare it once from the package index, cache it, and bind it
into every trial's sandbox read-only. ``RUNTIMES`` maps Harbor's agent names to recipes;
``agent_class`` is the Harbor agent (a subclass of Harbor's own, ``backends.runtimes.agents``)
that runs the tool from the prepared runtime instead of installing it.

A recipe kind is a class with ``kind``, ``identity()`` (what the cache key hashes) and
``install(stage)`` (build into a folder that may later move: nothing may hard-code its
path). ``PythonRuntime`` is the only kind so far; the Node-based agents (codex, opencode) would
be a ``NodeRuntime`` installing npm packages beside a Node binary from the npm registry.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import anyio


class RuntimeBuildError(ValueError):
    """A runtime that cannot be prepared, or is not usable; the message names the problem."""


class Recipe(Protocol):
    """What ``build.ensure_runtime`` needs of a recipe of any kind (read-only attributes)."""

    @property
    def name(self) -> str: ...  # the runtime folder's prefix, e.g. "mini-swe-agent"

    @property
    def agent_class(self) -> str: ...  # "module:Class" of the Harbor agent that runs it

    @property
    def commands(self) -> tuple[str, ...]: ...  # the tools put on the agent's PATH

    @property
    def env(self) -> dict[str, str]: ...  # variables the tools need in the sandbox

    @property
    def check(self) -> str: ...  # a shell command that must pass, offline, in a sandbox

    @property
    def version_of(self) -> str: ...  # the package whose version is the agent's

    @property
    def kind(self) -> str: ...

    def identity(self) -> str:
        """Everything the runtime is made from, as text: the cache key hashes it."""
        ...

    async def install(self, stage: Path) -> dict[str, str]:
        """Build into ``stage``; return the installed packages' versions by name."""
        ...


def _host_platform() -> str:
    libc, version = platform.libc_ver()
    return f"{libc or 'unknown'}-{version or '0'}-{platform.machine()}"


@dataclass(frozen=True)
class PythonRuntime:
    """A Python tool from the package index, in a relocatable venv of the host's Python.

    The venv runs on the host's interpreter, which local sandboxes bind read-only at its own
    path (``host_python``), so its wheels are the ones that interpreter takes (this host's
    glibc and machine, both in the key). Only wheels are installed: no package's build code
    runs on the host. Bytecode is compiled at build, as the sandbox sees the runtime read-only.
    """

    name: str
    agent_class: str
    packages: tuple[str, ...]
    commands: tuple[str, ...]
    check: str
    version_of: str
    env: dict[str, str] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "python"

    def identity(self) -> str:
        python = f"{sys.base_prefix}\0{'.'.join(map(str, sys.version_info[:3]))}"
        return json.dumps(
            {"recipe": asdict(self), "kind": self.kind, "python": python, "host": _host_platform()},
            sort_keys=True,
        )

    async def install(self, stage: Path) -> dict[str, str]:
        from backends.bundle.build import uv_binary

        venv = stage / "venv"
        interpreter = (
            Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
        )
        uv = uv_binary()
        await _run([uv, "venv", "--quiet", "--relocatable", "--python", str(interpreter), str(venv)],
                   what=f"creating the {self.name} runtime's virtualenv")  # fmt: skip
        await _run(
            [uv, "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"),
             "--only-binary", ":all:", "--compile-bytecode", "--link-mode", "copy",
             *self.packages],
            what=f"installing {', '.join(self.packages)} for the {self.name} runtime",
        )  # fmt: skip
        frozen = await _run(
            [uv, "pip", "freeze", "--python", str(venv / "bin" / "python")],
            what=f"listing the {self.name} runtime's packages",
        )
        (stage / "bin").mkdir()
        for command in self.commands:
            tool = venv / "bin" / command
            if not tool.is_file():
                raise RuntimeBuildError(
                    f"the {self.name} runtime has no {command!r} command after installing "
                    f"{', '.join(self.packages)} (its bin/ has: "
                    f"{', '.join(sorted(p.name for p in (venv / 'bin').iterdir()))})"
                )
            # Relative, so the runtime may move; the venv's own scripts find their Python
            # through the link's real path.
            (stage / "bin" / command).symlink_to(Path("..") / "venv" / "bin" / command)
        versions = {}
        for line in frozen.splitlines():
            name, sep, version = line.partition("==")
            if sep:
                versions[name.strip().lower()] = version.strip()
        return versions


async def _run(command: list[str], *, what: str) -> str:
    env = {**os.environ, "UV_NO_PYTHON_DOWNLOADS": "1"}
    try:
        done = await anyio.run_process(command, env=env, check=False)
    except OSError as exc:
        raise RuntimeBuildError(f"{what} failed: {exc}") from exc
    if done.returncode != 0:
        detail = "\n".join(
            line
            for line in done.stderr.decode(errors="replace").splitlines()
            if "WARNING: Location" not in line
        )
        raise RuntimeBuildError(
            f"{what} failed (exit {done.returncode}):\n{detail.strip()[-4000:]}"
        )
    return done.stdout.decode(errors="replace")


MINI_SWE_AGENT = PythonRuntime(
    name="mini-swe-agent",
    agent_class="backends.runtimes.agents:MiniSweAgent",
    # What Harbor's own install asks for (mini-swe-agent with litellm, orjson, fastapi),
    # pinned: the same recipe gives the same runtime.
    packages=("mini-swe-agent==2.4.6", "litellm==1.110.2", "orjson", "fastapi"),
    commands=("mini-swe-agent",),
    check="mini-swe-agent --help >/dev/null",
    version_of="mini-swe-agent",
    # LiteLLM fetches its model price list at import unless told not to: offline, it would
    # wait on the network first. The setup wizard is off too (Harbor sets it for its run).
    env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "MSWEA_CONFIGURED": "true"},
)

# Harbor agent name -> the recipe HarborBackend prepares for it.
RUNTIMES: dict[str, Recipe] = {MINI_SWE_AGENT.name: MINI_SWE_AGENT}


def runtime_for(agent_name: str | None) -> Recipe | None:
    """The recipe for Harbor's agent ``agent_name``, if this package prepares one."""
    return RUNTIMES.get(agent_name) if agent_name else None
