"""Errors raised by sandbox providers, as a small tree.

Callers catch exactly what they can act on: a bad task definition (the user fixes the task),
a missing host prerequisite (the operator installs something), or a sandbox that failed at run
time (retry with a fresh sandbox). A command that exits non-zero is not an error: it is an
ordinary `ExecResult`.
"""

from __future__ import annotations


class SandboxError(RuntimeError):
    """Base class for every error a sandbox provider raises on purpose."""


class HostPrerequisiteError(SandboxError):
    """The host lacks something the provider needs (root, bubblewrap, cgroups, a rootfs)."""


class SandboxStartError(SandboxError):
    """The sandbox could not be created; retrying with a fresh sandbox may help."""


class SandboxNotRunningError(SandboxError):
    """An operation needs a started sandbox, but it was never started or already stopped."""


class SandboxEndedError(SandboxNotRunningError):
    """The sandbox died of what ran inside it: its pid 1 exited or was OOM-killed while nothing
    on the host stopped it. Not an infrastructure fault: the same code in a fresh sandbox would
    end it again (root inside can neither SIGKILL nor trace pid 1, so a SIGKILL with no OOM
    kill is the host's doing, a plain `SandboxNotRunningError`)."""


class ExecTimeoutError(SandboxError):
    """A command ran past its timeout; its whole process tree was killed."""


class UnsupportedTaskError(SandboxError, ValueError):
    """The task asks for something this provider cannot enforce (GPUs, allowlists, ...)."""


class ImageError(SandboxError, ValueError):
    """The task's image cannot be provided: unknown base image, bad or unsupported Dockerfile."""


class BaseImageNotFoundError(ImageError):
    """No entry of the substitution table serves the requested base image."""


class UnsupportedInstructionError(ImageError):
    """The Dockerfile uses an instruction (or a form of one) the layer builder refuses."""


class ImageBuildError(ImageError):
    """A Dockerfile step failed while building a layer."""


class SandboxPathError(SandboxError, ValueError):
    """A transfer path escapes the sandbox or the host target directory."""
