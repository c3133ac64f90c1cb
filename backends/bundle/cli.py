"""``backends bundle build PATH``, ``backends bundle inspect BUNDLE``, ``backends bundle prune``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from backends.bundle import cache
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


@bundle_app.command("prune")
def prune_command(
    max_size: Annotated[
        str | None,
        typer.Option(help="Keep the cache at most this big, e.g. 20G (default: the bound)."),
    ] = None,
    older_than: Annotated[
        str | None, typer.Option(help="Remove what was not used for this long, e.g. 7d.")
    ] = None,
    everything: Annotated[
        bool, typer.Option("--all", help="Remove every bundle and environment not in use.")
    ] = False,
    dry_run: Annotated[bool, typer.Option(help="Say what would go; remove nothing.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Remove cached bundles, environments and wheels that no running backend uses.

    Least recently used first. Without options, down to the cache's bound
    (BACKENDS_BUNDLE_CACHE_MAX, default 20G). What a backend holds is never removed.
    """
    try:
        limit = cache.parse_size(max_size) if max_size else None
        age = cache.parse_age(older_than) if older_than else None
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if limit is None and age is None and not everything:
        limit = cache.configured_max_bytes()
    report = cache.prune(
        max_bytes=limit, older_than_sec=age, everything=everything, dry_run=dry_run
    )
    if as_json:
        doc = {
            "dry_run": dry_run,
            "removed": [e.describe() for e in report.removed],
            "in_use": [e.describe() for e in report.in_use],
            "freed_bytes": report.freed_bytes,
            "kept_bytes": report.kept_bytes,
        }
        typer.echo(json.dumps(doc))
        return
    verb = "would remove" if dry_run else "removed"
    for entry in report.removed:
        typer.echo(f"{verb} {entry.kind:11s} {entry.size_bytes / 1024**2:9.1f} MiB  {entry.path}")
    for entry in report.in_use:
        typer.echo(f"in use      {entry.kind:11s} {entry.path}")
    typer.echo(
        f"{verb} {len(report.removed)} entries, {report.freed_bytes / 1024**2:.1f} MiB; "
        f"the cache keeps {report.kept_bytes / 1024**2:.1f} MiB"
    )
