"""``backends sandbox ls`` and ``backends sandbox reap``: find and remove leaked sandboxes.

Local sandboxes die with the process that owns them; what a killed owner leaves (cgroups,
scratch directories) is reaped here or at the next start. SkyPilot sandboxes outlive a killed
orchestrator: their names carry the run's prefix, and runs recorded on this host whose owner
is gone have their sandboxes terminated here or at the next start.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from backends.sandbox.errors import HostPrerequisiteError

sandbox_app = typer.Typer(
    help="List and reap sandboxes (local and SkyPilot) left by killed runs.",
    no_args_is_help=True,
)

Provider = Annotated[
    str,
    typer.Option("--provider", "-p", help="local, skypilot, or all (skypilot when configured)."),
]


def _providers(provider: str) -> tuple[bool, bool]:
    if provider not in ("local", "skypilot", "all"):
        raise typer.BadParameter(f"provider must be local, skypilot or all, not {provider!r}")
    return provider in ("local", "all"), provider in ("skypilot", "all")


def _sky(required: bool):  # type: ignore[no-untyped-def]
    """The SkyPilot SDK, or None when not configured and not asked for by name."""
    from backends.sandbox import skysdk

    try:
        sdk = skysdk.load()
        skysdk.require_api_server()
    except HostPrerequisiteError as exc:
        if required:
            raise typer.BadParameter(str(exc)) from exc
        return None
    return sdk


@sandbox_app.command("ls")
def ls_command(provider: Provider = "all") -> None:
    """List sandboxes with the state of their owner: alive, or dead (leaked: reap them)."""
    local, sky = _providers(provider)
    table = Table("provider", "name", "run", "owner")
    if local:
        from backends.sandbox.runtime import list_sandboxes

        for name, alive in list_sandboxes():
            table.add_row("local", name, "", "alive" if alive else "dead")
    sdk = _sky(required=provider == "skypilot") if sky else None
    if sdk is not None:
        from backends.sandbox import skyruns

        for row in skyruns.listing(sdk):
            table.add_row("skypilot", row["name"], row["run"] or "", row["owner"])
    Console(width=200).print(table)


@sandbox_app.command("reap")
def reap_command(
    provider: Provider = "all",
    run: Annotated[
        list[str] | None,
        typer.Option(help="Terminate this SkyPilot run's sandboxes, whatever its owner's state."),
    ] = None,
) -> None:
    """Remove the sandboxes of dead owners (local) and of dead runs (SkyPilot)."""
    local, sky = _providers(provider)
    removed: list[str] = []
    if local and not run:
        from backends.sandbox.runtime import reap_orphans

        removed += reap_orphans()
    sdk = _sky(required=provider == "skypilot" or bool(run)) if sky else None
    if sdk is not None:
        from backends.sandbox import skyruns

        removed += skyruns.reap(sdk, set(run) if run else None)
    for name in removed:
        typer.echo(f"reaped {name}")
    typer.echo(f"{len(removed)} sandbox(es) reaped")
