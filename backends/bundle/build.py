"""Building a rollout bundle: the project, this package, and every dependency as wheels.

A bundle is a directory under ``<cache>/bundles/<key>/``:

    project/            the rollout project (main.py, pyproject.toml, its other files)
    wheels/             every dependency for the target platform and Python, this package too
    requirements.txt    the resolved pins, installed offline from wheels/
    manifest.json       a ``BundleManifest``, written last: a bundle with one is complete

The key hashes the inputs (the project's files, this package's source, the target platform and
Python), so the same inputs find the same bundle and build nothing. Resolution runs on the host
with ``uv pip compile`` for the target platform; the wheels come by ``pip download`` with that
platform's tags (never the host's), into a shared wheelhouse so bundles share downloads.
Every problem is a ``BundleError`` raised here, before any sandbox starts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from backends.bundle import cache
from backends.bundle.models import BundleManifest
from backends.sandbox.settings import cache_dir

log = logging.getLogger(__name__)

PACKAGE = "backends"
# The base rootfs is Debian 12: glibc 2.36 on x86_64.
DEFAULT_PLATFORM = "manylinux_2_36_x86_64"
# Folders of a project that are never shipped: environments, caches, build output, VCS.
SKIPPED = frozenset(
    {
        ".git",
        ".venv",
        "venv",
        "__pycache__",
        "build",
        "dist",
        "node_modules",
        ".mypy_cache",
        ".ruff_cache",
        ".pytest_cache",
    }
)
RESOLVE_TIMEOUT_SEC = 600


class BundleError(ValueError):
    """A rollout project that cannot become a bundle; the message names the problem."""


@dataclass(frozen=True)
class Bundle:
    """A built bundle on disk; ``hold`` keeps the cache's pruning off it while it is used."""

    path: Path
    manifest: BundleManifest
    hold: cache.Hold | None = field(default=None, compare=False, repr=False)

    def release(self) -> None:
        """Let the cache prune this bundle again (once nobody else holds it)."""
        if self.hold is not None:
            self.hold.release()

    @property
    def key(self) -> str:
        return self.manifest.key

    @property
    def project_dir(self) -> Path:
        return self.path / "project"

    @property
    def wheels_dir(self) -> Path:
        return self.path / "wheels"

    @property
    def requirements(self) -> Path:
        return self.path / "requirements.txt"

    @classmethod
    def open(cls, path: Path | str) -> Bundle:
        """A built bundle at ``path``; raises ``BundleError`` when it has no manifest."""
        folder = Path(path)
        try:
            manifest = BundleManifest.model_validate_json((folder / "manifest.json").read_text())
        except (OSError, ValueError) as exc:
            raise BundleError(
                f"{path} is not a built bundle (no valid manifest.json): {exc}"
            ) from exc
        return cls(folder, manifest)


def bundles_dir() -> Path:
    return cache_dir() / "bundles"


def python_tag(python: str | None = None) -> str:
    """``"3.12"``: the target interpreter's version, this one's by default."""
    return python or f"{sys.version_info.major}.{sys.version_info.minor}"


def project_files(project: Path) -> list[Path]:
    """The files that ship, relative to ``project``, sorted. Symlinks are refused."""
    files = []
    for folder, dirs, names in os.walk(project):
        base = Path(folder)
        for name in [*dirs, *names]:
            if (base / name).is_symlink():
                raise BundleError(f"{base / name} is a symlink: a bundle ships regular files only")
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED and not d.endswith(".egg-info"))
        files += [(base / n).relative_to(project) for n in names if not n.endswith(".pyc")]
    return sorted(files)


def package_source() -> Path:
    """This package's source checkout (its pyproject.toml's folder); ``BundleError`` if none."""
    root = Path(__file__).resolve().parents[2]
    pyproject = root / "pyproject.toml"
    try:
        name = tomllib.loads(pyproject.read_text())["project"]["name"]
    except (OSError, KeyError, ValueError):
        name = None
    if name != PACKAGE:
        raise BundleError(
            f"bundles ship this package from its source checkout, and {root} is not one "
            "(install backends from a clone, e.g. `pip install -e .`)"
        )
    return root


def _package_files(root: Path) -> list[Path]:
    return [Path("pyproject.toml"), Path("README.md")] + [
        p.relative_to(root) for p in sorted((root / PACKAGE).rglob("*")) if _is_source(p)
    ]


def _is_source(path: Path) -> bool:
    return path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"


def bundle_key(project: Path, *, python: str, platform: str) -> str:
    """The hash of everything a bundle is made from."""
    digest = hashlib.sha256()
    digest.update(f"bundle-v1\0{python}\0{platform}\0".encode())
    for label, root, files in (
        ("project", project, project_files(project)),
        (PACKAGE, package_source(), _package_files(package_source())),
    ):
        for rel in files:
            digest.update(f"{label}\0{rel.as_posix()}\0".encode())
            digest.update(hashlib.sha256((root / rel).read_bytes()).digest())
    return digest.hexdigest()[:32]


def read_project(project: Path) -> tuple[str, list[str]]:
    """The project's name and dependencies from its pyproject.toml; ``BundleError`` if unusable."""
    if not project.is_dir():
        raise BundleError(f"rollout project {project} is not a directory")
    pyproject = project / "pyproject.toml"
    if not pyproject.is_file():
        raise BundleError(
            f"rollout project {project} has no pyproject.toml: declare the rollout's "
            "dependencies there ([project] name and dependencies)"
        )
    try:
        data = tomllib.loads(pyproject.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise BundleError(f"{pyproject} is not valid TOML: {exc}") from exc
    section = data.get("project")
    if not isinstance(section, dict) or not isinstance(section.get("name"), str):
        raise BundleError(f"{pyproject} has no [project] table with a name")
    deps = section.get("dependencies", [])
    if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
        raise BundleError(f"{pyproject}: [project].dependencies must be a list of strings")
    return section["name"], deps


def _requirement_name(requirement: str) -> str:
    try:
        return canonicalize_name(Requirement(requirement).name)
    except InvalidRequirement as exc:
        raise BundleError(f"dependency {requirement!r} is not a valid requirement: {exc}") from exc


def _pin(requirement: str) -> tuple[str, Version]:
    """``name==version`` as resolved: the canonical name and the version."""
    name, _, version = requirement.split(";")[0].partition("==")
    return canonicalize_name(name.strip()), Version(version.strip())


def check_entrypoint(project: Path, entrypoint: str, *, dependencies: list[str]) -> None:
    """Import ``entrypoint`` on the host, in a child process; ``BundleError`` if it fails.

    A module missing on the host that the project declares is left to the install's check
    inside the sandbox (the host need not have every rollout's dependencies).
    """
    out = _run(
        [sys.executable, "-m", "backends.bundle.runner", "check", str(project), entrypoint],
        what=f"checking entrypoint {entrypoint!r}",
    )
    verdict = json.loads(out.strip().splitlines()[-1])
    if verdict["ok"]:
        return
    missing = verdict.get("missing_module")
    declared = {_requirement_name(d) for d in dependencies}
    if missing and canonicalize_name(missing.split(".")[0]) in declared:
        log.warning(
            "entrypoint %s needs %s, not installed here: checked after install", entrypoint, missing
        )
        return
    raise BundleError(f"entrypoint {entrypoint!r} of {project} does not import: {verdict['error']}")


def _run(command: list[str], *, what: str, cwd: Path | None = None) -> str:
    env = {**os.environ, "UV_NO_PYTHON_DOWNLOADS": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    try:
        done = subprocess.run(
            command, cwd=cwd, env=env, capture_output=True, text=True, timeout=RESOLVE_TIMEOUT_SEC
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BundleError(f"{what} failed: {exc}") from exc
    if done.returncode != 0:
        detail = "\n".join(
            line for line in done.stderr.splitlines() if "WARNING: Location" not in line
        )
        raise BundleError(f"{what} failed:\n{detail.strip()[-4000:]}")
    return done.stdout


def uv_binary() -> str:
    found = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if found is None:
        raise BundleError("uv is needed to resolve a bundle's dependencies: pip install uv")
    return found


def platform_tags(platform: str) -> list[str]:
    """Every wheel platform tag a ``manylinux_2_NN_<arch>`` target accepts, newest first."""
    match = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not match:
        return [platform]
    glibc, arch = int(match.group(1)), match.group(2)
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(glibc, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    return tags + [f"{name}_{arch}" for minor, name in legacy.items() if minor <= glibc]


def _resolve(
    stage: Path, deps: list[str], package_wheel: Path, *, python: str, platform: str
) -> str:
    """Pin every dependency for the target; ``this package`` comes from its own wheel, with
    the extras the project asks of it (``backends[strands]``)."""
    lines = [d for d in deps if _requirement_name(d) != PACKAGE]
    extras = sorted(
        {e for d in deps if _requirement_name(d) == PACKAGE for e in Requirement(d).extras}
    )
    wanted = f"{PACKAGE}[{','.join(extras)}]" if extras else PACKAGE
    lines.append(f"{wanted} @ {package_wheel.as_uri()}")
    (stage / "requirements.in").write_text("\n".join(lines) + "\n")
    # uv spells the target "<arch>-manylinux_2_NN".
    match = re.fullmatch(r"manylinux_(2_\d+)_(\w+)", platform)
    target = f"{match.group(2)}-manylinux_{match.group(1)}" if match else platform
    return _run(
        [
            uv_binary(),
            "pip",
            "compile",
            "--quiet",
            "--no-header",
            "--no-annotate",
            "--python-version",
            python,
            "--python-platform",
            target,
            "--only-binary",
            ":all:",
            "requirements.in",
        ],
        what="resolving the project's dependencies",
        cwd=stage,
    )


def _download(pins: list[str], wheelhouse: Path, *, python: str, platform: str) -> None:
    wheelhouse.mkdir(parents=True, exist_ok=True)
    # What an earlier bundle fetched is not asked for again (wheels of one target only).
    have = {parse_wheel_filename(w.name)[:2] for w in wheelhouse.glob("*.whl")}
    pins = [p for p in pins if _pin(p) not in have]
    if not pins:
        return
    requirements = wheelhouse / f".pins-{os.getpid()}.txt"
    requirements.write_text("\n".join(pins) + "\n")
    tags = [arg for tag in platform_tags(platform) for arg in ("--platform", tag)]
    abi = "cp" + python.replace(".", "")
    try:
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary",
                ":all:",
                *tags,
                "--python-version",
                python,
                "--implementation",
                "cp",
                "--abi",
                abi,
                "--abi",
                "abi3",
                "--abi",
                "none",
                "-r",
                str(requirements),
                "-d",
                str(wheelhouse),
            ],
            what="downloading the dependencies' wheels",
        )
    finally:
        requirements.unlink(missing_ok=True)


def build_bundle(
    project: Path | str,
    *,
    entrypoint: str | None = None,
    python: str | None = None,
    platform: str = DEFAULT_PLATFORM,
    root: Path | None = None,
) -> Bundle:
    """The bundle of ``project`` for ``python`` on ``platform``, built unless already there.

    ``entrypoint`` (``"main.py:Workflow"``) is imported first. Raises ``BundleError`` for a
    project without pyproject.toml, an entrypoint that does not import, or a dependency that
    does not resolve for the target.
    """
    project = Path(project).resolve()
    name, deps = read_project(project)
    python = python_tag(python)
    if entrypoint is not None:
        check_entrypoint(project, entrypoint, dependencies=deps)
    key = bundle_key(project, python=python, platform=platform)
    root = root or bundles_dir()
    target = root / key
    # Held from here for as long as the caller uses the bundle: pruning never takes it.
    held = cache.hold_blocking(target)
    try:
        if not (target / "manifest.json").is_file():
            _build(project, target, name=name, deps=deps, entrypoint=entrypoint,
                   python=python, platform=platform)  # fmt: skip
            built = True
        else:
            built = False
        cache.stamp(target)
        bundle = Bundle.open(target)
    except BaseException:
        held.release()
        raise
    if built:
        cache.prune_to_bound()
    return Bundle(bundle.path, bundle.manifest, held)


def _build(
    project: Path,
    target: Path,
    *,
    name: str,
    deps: list[str],
    entrypoint: str | None,
    python: str,
    platform: str,
) -> None:
    root = target.parent
    started = time.monotonic()
    root.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        source = stage / "source"
        for rel in _package_files(package_source()):
            (source / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(package_source() / rel, source / rel)
        wheels = stage / "wheels"
        _run(
            [
                uv_binary(),
                "build",
                "--quiet",
                "--wheel",
                "--python",
                sys.executable,
                "--out-dir",
                str(wheels),
                str(source),
            ],
            what=f"building the {PACKAGE} wheel",
        )
        shutil.rmtree(source)
        for extra in wheels.iterdir():  # uv build leaves a .gitignore beside the wheel
            if extra.suffix != ".whl":
                extra.unlink()
        (own,) = wheels.glob("*.whl")
        pinned = _resolve(stage, deps, own, python=python, platform=platform)
        pins = [
            line.strip()
            for line in pinned.splitlines()
            if line.strip() and not line.lstrip().startswith("#")
        ]
        others = [p for p in pins if _requirement_name(p) != PACKAGE]
        wheelhouse = root / cache.WHEELHOUSE / f"{platform}-py{python}"
        using = cache.hold_blocking(wheelhouse)  # pruning leaves its wheels until linked
        try:
            _download(others, wheelhouse, python=python, platform=platform)
            wanted = {_pin(p) for p in others}
            for wheel in wheelhouse.glob("*.whl"):
                if parse_wheel_filename(wheel.name)[:2] in wanted:
                    os.link(wheel, wheels / wheel.name)
        finally:
            using.release()
        (stage / "requirements.txt").write_text("\n".join([*others, PACKAGE]) + "\n")
        files = project_files(project)
        for rel in files:
            (stage / "project" / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(project / rel, stage / "project" / rel)
        size = sum(p.stat().st_size for p in stage.rglob("*") if p.is_file())
        manifest = BundleManifest(
            key=target.name,
            name=name,
            python=python,
            platform=platform,
            entrypoint=entrypoint,
            dependencies=sorted({*others, f"{PACKAGE} (this checkout)"}),
            files=[f.as_posix() for f in files],
            size_bytes=size,
            build_sec=round(time.monotonic() - started, 3),
        )
        (stage / "manifest.json").write_text(manifest.model_dump_json(indent=2))
        stage.chmod(0o755)
        try:
            os.rename(stage, target)
        except OSError:
            if not (target / "manifest.json").is_file():  # another builder did not win either
                raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
