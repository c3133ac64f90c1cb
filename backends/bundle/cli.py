"""``backends bundle build PATH`` and ``backends bundle inspect BUNDLE``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from backends.bundle.build import Bundle, BundleError, build_bundle, bundles_dir

bundle_app = typer.Typer(
    help="Rollout bundles: a project and its dependencies, for sandboxes.",
    no_args_is_help=True,
)


def _describe(bundle: Bundle, as_json: bool) -> None:
    manifest = bundle.manifest
    if as_json:
        typer.echo(json.dumps({"path": str(bundle.path), **manifest.model_dump(mode="json")}))
        return
    typer.echo(f"bundle   {manifest.key}  ({manifest.name})")
    typer.echo(f"path     {bundle.path}")
    typer.echo(f"target   Python {manifest.python}, {manifest.platform}")
    typer.echo(f"size     {manifest.size_bytes / 1024 / 1024:.1f} MiB")
    typer.echo(f"files    {', '.join(manifest.files)}")
    typer.echo(f"deps     {len(manifest.dependencies)}")
    for dep in manifest.dependencies:
        typer.echo(f"  {dep}")


@bundle_app.command("build")
def build_command(
    path: Annotated[Path, typer.Argument(help="The rollout project: main.py + pyproject.toml.")],
    entrypoint: Annotated[
        str | None, typer.Option(help="A workflow to check imports, e.g. main.py:Workflow.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON.")] = False,
) -> None:
    """Build PATH's bundle (or find it already built) and describe it."""
    try:
        bundle = build_bundle(path, entrypoint=entrypoint)
    except BundleError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    _describe(bundle, as_json)


@bundle_app.command("inspect")
def inspect_command(
    bundle: Annotated[str, typer.Argument(help="A bundle's folder or its key.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON.")] = False,
) -> None:
    """Describe a built bundle: what ships, its hash, its size, its dependencies."""
    folder = Path(bundle)
    if not folder.is_dir() and "/" not in bundle:
        folder = bundles_dir() / bundle
    try:
        _describe(Bundle.open(folder), as_json)
    except BundleError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
