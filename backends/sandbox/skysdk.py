"""Finding SkyPilot's Sandbox SDK (``sky.sandbox``) without depending on PyPI ``skypilot``.

The SDK ships with the SkyPilot Platform installer: as ``sky.sandbox`` (through SkyPilot's
``sky.client_sdks`` entry point) or as the top-level ``sky_sandbox`` shim. Either is imported
only when a SkyPilot sandbox is first used; a missing SDK or API server is an error naming
what to install or run.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

from backends.sandbox.errors import HostPrerequisiteError

MODULES = ("sky.sandbox", "sky_sandbox")
ENDPOINT_ENV = "SKYPILOT_API_SERVER_ENDPOINT"

MISSING = (
    "SkyPilot sandboxes need the SkyPilot Sandbox SDK (`sky.sandbox` or `sky_sandbox`), which "
    "ships with the SkyPilot Platform installer, not PyPI (the `skypilot` wheel has no "
    "sandbox module): install the Platform SDK into this environment, then run "
    "`sky api login -e <endpoint>`"
)


def load() -> ModuleType:
    """The Sandbox SDK module. Raises ``HostPrerequisiteError`` naming what is missing."""
    for name in MODULES:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name not in (name, "sky", *MODULES):
                raise HostPrerequisiteError(f"{name} is installed but broken: {exc}") from exc
        except Exception as exc:  # importing it reads ~/.sky: a malformed config raises here
            raise HostPrerequisiteError(
                f"{name} failed to import ({type(exc).__name__}: {exc}); check ~/.sky/config.yaml"
            ) from exc
    raise HostPrerequisiteError(MISSING)


def require_api_server() -> str:
    """The configured API server's URL. Raises ``HostPrerequisiteError`` when there is none."""
    endpoint = os.environ.get(ENDPOINT_ENV)
    if endpoint:
        return endpoint
    try:
        from sky.server import common  # type: ignore[import-not-found]

        url = common.get_server_url()
        if url:
            return str(url)
    except Exception:  # no `sky` client: only the endpoint variable can say where
        pass
    raise HostPrerequisiteError(
        "no SkyPilot API server is configured: run `sky api login -e <endpoint>` or set "
        f"{ENDPOINT_ENV} to the Platform API server's URL"
    )


def is_transient(exc: BaseException) -> bool:
    """Whether a failed create may succeed if tried again (never a bad argument)."""
    if isinstance(exc, ValueError | TypeError | HostPrerequisiteError):
        return False
    if isinstance(exc, ConnectionError | TimeoutError):
        return True
    name = type(exc).__name__.lower()
    return any(word in name for word in ("transient", "unavailable", "timeout", "retry"))
