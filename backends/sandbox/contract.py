"""Helpers for the provider contract suite (tests/contract/): one suite, every provider.

A provider enters the suite as a `Provider`: a name, a way to check the host can run it,
and a factory building a started-able Harbor environment from a task-like description.
Add new providers to `PROVIDERS`; the suite parametrizes over it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harbor.environments.base import BaseEnvironment
from harbor.models.task.config import EnvironmentConfig
from harbor.models.trial.paths import TrialPaths


@dataclass(frozen=True)
class Provider:
    name: str
    available: Callable[[], str | None]  # None when usable, else the reason it is not
    environment_class: type[BaseEnvironment]
    # Features the suite may probe; a provider that lacks one skips those checks honestly.
    enforces_limits: bool = True
    # Local-only knobs and internals (host binds, disk images, cgroups, pids_limit, dying
    # with its owner); a remote provider's sandboxes outlive their owner until reaped.
    local_internals: bool = True

    def make(
        self,
        tmp: Path,
        *,
        dockerfile: str | None = None,
        docker_image: str | None = "ubuntu:24.04",
        files: dict[str, str] | None = None,
        kwargs: dict[str, Any] | None = None,
        **env_config: Any,
    ) -> BaseEnvironment:
        """Build an (unstarted) environment for a throwaway task under `tmp`."""
        env_dir = tmp / f"env-{uuid.uuid4().hex[:6]}"
        env_dir.mkdir(parents=True)
        for name, text in (files or {}).items():
            (env_dir / name).write_text(text)
        if dockerfile is not None:
            (env_dir / "Dockerfile").write_text(dockerfile)
            docker_image = None
        trial_paths = TrialPaths(trial_dir=tmp / f"trial-{uuid.uuid4().hex[:6]}")
        trial_paths.mkdir()
        return self.environment_class(
            environment_dir=env_dir,
            environment_name="contract",
            session_id=f"contract__{uuid.uuid4().hex[:7]}__env",
            trial_paths=trial_paths,
            task_env_config=EnvironmentConfig(docker_image=docker_image, **env_config),
            **(kwargs or {}),
        )


def _local_available() -> str | None:
    import os
    import shutil

    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("bwrap") is None:
        return "needs bubblewrap"
    return None


def _local_class() -> type[BaseEnvironment]:
    from backends.sandbox.local import LocalSandbox

    return LocalSandbox


def _skypilot_available() -> str | None:
    from backends.sandbox import skysdk
    from backends.sandbox.errors import HostPrerequisiteError

    try:
        skysdk.load()
        skysdk.require_api_server()
    except HostPrerequisiteError as exc:
        return str(exc)
    return _local_available()  # the fake SDK runs its pods as local sandboxes


def _skypilot_class() -> type[BaseEnvironment]:
    from backends.sandbox.skypilot import SkyPilotSandbox

    return SkyPilotSandbox


PROVIDERS = [
    Provider(name="local-sandbox", available=_local_available, environment_class=_local_class()),
    # Against the fake SDK in tests/skyfake (real commands in local sandboxes underneath), or
    # the real Platform SDK when one is installed and configured.
    Provider(
        name="skypilot",
        available=_skypilot_available,
        environment_class=_skypilot_class(),
        local_internals=False,
    ),
]
