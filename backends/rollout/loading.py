"""Resolve ``"module:attr"`` and ``"path/to/main.py:attr"`` references to objects."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


class EntrypointError(ImportError):
    """A reference could not be resolved; the message names the reference and the reason."""


def load_object(ref: str | Any, *, base_dir: Path | None = None) -> Any:
    """Return the object ``ref`` names, or ``ref`` itself when it is not a string.

    ``"pkg.mod:Name"`` imports a module; ``"dir/main.py:Name"`` loads a file (relative paths
    against ``base_dir`` or the working directory). Dotted attributes (``"mod:a.b"``) work.
    """
    if not isinstance(ref, str):
        return ref
    target, sep, attr = ref.rpartition(":")
    if not sep or not target or not attr:
        raise EntrypointError(f"entrypoint {ref!r} must look like 'module:attr' or 'file.py:attr'")
    module = load_module(target, base_dir=base_dir)
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise EntrypointError(
                f"entrypoint {ref!r}: {module.__name__!r} has no attribute {attr!r}"
            ) from None
    return obj


def load_module(target: str, *, base_dir: Path | None = None) -> Any:
    """Import a module by dotted name, or load a ``.py`` file (or a folder's ``main.py``)."""
    path = Path(target)
    if target.endswith(".py") or "/" in target or target in {".", ".."}:
        if not path.is_absolute():
            path = (base_dir or Path.cwd()) / path
        if path.is_dir():
            path = path / "main.py"
        return _load_file(path)
    try:
        return importlib.import_module(target)
    except ImportError as exc:
        raise EntrypointError(f"cannot import module {target!r}: {exc}") from exc


def _load_file(path: Path) -> Any:
    path = path.resolve()
    if not path.is_file():
        raise EntrypointError(f"entrypoint file {path} does not exist")
    # A stable, unique module name per file so two rollouts' main.py never collide.
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
    name = f"_backends_entry_{path.parent.name.replace('-', '_')}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise EntrypointError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    # The rollout's own folder is importable, as it would be when run as a script.
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        sys.modules.pop(name, None)
        raise EntrypointError(f"importing {path} failed: {type(exc).__name__}: {exc}") from exc
    return module
