"""Sandbox providers as Harbor environments.

`backends.sandbox.local:LocalSandbox` is the local bubblewrap provider; `BwrapSandbox` is the
Harbor-free sandbox it drives; `backends.sandbox.contract` holds the provider contract suite's
helpers.
"""

from backends.sandbox.errors import (
    BaseImageNotFoundError,
    ExecTimeoutError,
    HostPrerequisiteError,
    ImageBuildError,
    ImageError,
    SandboxError,
    SandboxNotRunningError,
    SandboxPathError,
    SandboxStartError,
    UnsupportedInstructionError,
    UnsupportedTaskError,
)

__all__ = [
    "BaseImageNotFoundError",
    "ExecTimeoutError",
    "HostPrerequisiteError",
    "ImageBuildError",
    "ImageError",
    "SandboxError",
    "SandboxNotRunningError",
    "SandboxPathError",
    "SandboxStartError",
    "UnsupportedInstructionError",
    "UnsupportedTaskError",
]
