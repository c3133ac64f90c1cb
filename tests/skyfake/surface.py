"""Record a Sandbox SDK's surface: names, parameters, ``.aio`` siblings, result shapes.

``python tests/skyfake/surface.py`` prints it for whichever SDK is importable (run it where
the Platform SDK is installed to re-record ``tests/data/sky_sandbox_surface.json``; without
one, put tests/skyfake on PYTHONPATH to print the fake's). ``test_sky_surface`` compares the
fake with the recorded file, so a change of the documented surface fails a test.
"""

from __future__ import annotations

import inspect
import json
from types import ModuleType
from typing import Any

MODULE_CALLS = ("create", "ls", "create_pool", "set_pool_size", "delete_pool", "aclose")
SANDBOX_CALLS = (
    "exec",
    "read_bytes",
    "write_bytes",
    "read_text",
    "write_text",
    "terminate",
    "snapshot",
)
SANDBOX_ATTRIBUTES = ("name", "status", "error_message", "endpoints")


def _params(fn: Any) -> list[list[str]]:
    sig = inspect.signature(fn)
    return [[p.name, p.kind.name] for p in sig.parameters.values() if p.name != "self"]


def _call(fn: Any) -> dict[str, Any]:
    return {"params": _params(fn), "aio": callable(getattr(fn, "aio", None))}


def surface(sdk: ModuleType) -> dict[str, Any]:
    sandbox = sdk.Sandbox
    instance = object.__new__(sandbox)  # bound methods, as users call them; no server needed
    return {
        "module": {name: _call(getattr(sdk, name)) for name in MODULE_CALLS},
        "Sandbox": {name: _call(getattr(instance, name)) for name in SANDBOX_CALLS},
        "Sandbox attributes": list(SANDBOX_ATTRIBUTES),
        "context manager": hasattr(sandbox, "__enter__") and hasattr(sandbox, "__exit__"),
        "VolumeMount": _params(sdk.VolumeMount),
    }


if __name__ == "__main__":
    from backends.sandbox import skysdk

    print(json.dumps(surface(skysdk.load()), indent=2))
