"""``backends runtime build [NAME...]`` and ``backends runtime list``: agent runtimes ahead of use.

HarborBackend builds an agent's runtime at its first start on a host; ``build`` does it ahead
(in an image build or a machine's set-up step), so no run pays it.
"""

from __future__ import annotations

import json
from typing import Annotated

import anyio
import typer

from backends.runtimes.build import MANIFEST, ensure_runtime, runtime_key, runtimes_dir
from backends.runtimes.recipes import RUNTIMES, RuntimeBuildError

runtime_app = typer.Typer(
    help="Agent runtimes: Harbor's installed agents prepared once on this host.",
    no_args_is_help=True,
)


@runtime_app.command("build")
def build_command(
    names: Annotated[
        list[str] | None, typer.Argument(help="Agents to prepare (default: every recipe).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the manifests as JSON.")] = False,
) -> None:
    """Build each agent's runtime (or find it built) and describe it."""
    wanted = names or sorted(RUNTIMES)
    unknown = [n for n in wanted if n not in RUNTIMES]
    if unknown:
        typer.echo(
            f"error: no runtime recipe for {', '.join(unknown)}; known: {', '.join(RUNTIMES)}",
            err=True,
        )
        raise typer.Exit(2)
    for name in wanted:
        try:
            runtime = anyio.run(ensure_runtime, RUNTIMES[name])
        except RuntimeBuildError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        manifest = runtime.manifest
        runtime.release()
        if as_json:
            typer.echo(json.dumps({"path": str(runtime.path), **manifest.model_dump(mode="json")}))
            continue
        typer.echo(
            f"{name} {manifest.version or '?'}  {manifest.size_bytes / 1024**2:.0f} MiB, "
            f"{len(manifest.packages)} packages, built in {manifest.build_sec:.1f} s  "
            f"{runtime.path}"
        )


@runtime_app.command("list")
def list_command() -> None:
    """Each recipe, and whether its runtime is built on this host."""
    for name, recipe in sorted(RUNTIMES.items()):
        path = runtimes_dir() / f"{name}-{runtime_key(recipe)}"
        state = str(path) if (path / MANIFEST).is_file() else "not built"
        typer.echo(f"{name:16s} {recipe.kind:8s} {state}")
