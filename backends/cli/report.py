"""``backends report RUN_DIR``: write the run's HTML report and print where it is."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def report_command(
    run_dir: Annotated[
        Path, typer.Argument(help="A run directory written by `backends run`.", show_default=False)
    ],
) -> None:
    """Write RUN_DIR/report.html (summary, charts, every rollout) and a page per rollout under
    RUN_DIR/report/; the files open from disk, with no network."""
    # Imported here: the report reads the run files through backends.cli's own models.
    from backends.report import ReportError, write_report

    if not run_dir.is_dir():
        raise typer.BadParameter(f"{run_dir} is not a directory", param_hint="RUN_DIR")
    try:
        summary = write_report(run_dir)
    except ReportError as exc:
        raise typer.BadParameter(str(exc), param_hint="RUN_DIR") from None
    typer.echo(
        f"report: {summary.path} ({summary.rollouts} rollouts, {summary.pages} rollout pages, "
        f"{summary.bytes / 1024:.0f} KiB, {summary.seconds:.1f} s)"
    )
