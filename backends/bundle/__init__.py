"""Rollout bundles: a rollout project and its dependencies, shipped into sandboxes offline.

``build_bundle`` packs a project (main.py + pyproject.toml) with this package and every
dependency as wheels for the sandbox's platform; ``ensure_environment`` installs it offline,
once, into an environment cached by (image, Python, bundle); ``backends.bundle.runner`` runs
the workflow inside; ``backends.bundle.agent`` is the Harbor agent that drives it.
"""

from backends.bundle.build import Bundle, BundleError, build_bundle
from backends.bundle.models import BundleManifest, RunnerInput, RunnerOutput

__all__ = [
    "Bundle",
    "BundleError",
    "BundleManifest",
    "RunnerInput",
    "RunnerOutput",
    "build_bundle",
]
