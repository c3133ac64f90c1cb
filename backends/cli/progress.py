"""Live progress of a run: done, running, failed by phase, mean reward, rollouts/s, ETA.

On a terminal it is a rich progress bar that redraws in place (on stderr, so stdout keeps the
table and the summary line for scripts); elsewhere (a pipe, a CI log) it is one plain line
every ``interval`` seconds and one at the end.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)


@dataclass
class Tally:
    """What this session has done so far (counts of tries, not of the run's slots)."""

    total: int  # tries this session runs
    done: int = 0
    running: int = 0
    failed: Counter[str] = field(default_factory=Counter)  # by phase
    cancelled: int = 0
    reward_sum: float = 0.0
    graded: int = 0
    started: float = field(default_factory=time.monotonic)
    note: str | None = None  # what happens before the first rollout (the backend starting)

    def begin(self) -> None:
        """The rollouts start now: the rate and the ETA count from here."""
        self.started = time.monotonic()
        self.note = None

    def line(self) -> str:
        if self.note is not None:
            return f"{self.note} ({time.monotonic() - self.started:.0f}s)"
        elapsed = time.monotonic() - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = self.total - self.done
        eta = f"{left / rate:.0f}s" if rate > 0 and left else ("0s" if not left else "?")
        failed = " ".join(f"{p} {n}" for p, n in sorted(self.failed.items())) or "0"
        mean = f"{self.reward_sum / self.graded:.3f}" if self.graded else "-"
        parts = [
            f"done {self.done}/{self.total}",
            f"running {self.running}",
            f"failed {failed}",
        ]
        if self.cancelled:
            parts.append(f"cancelled {self.cancelled}")
        parts += [f"mean reward {mean}", f"{rate:.2f} rollouts/s", f"ETA {eta}"]
        return " | ".join(parts)


class ProgressDisplay:
    """``with ProgressDisplay(tally) as show: ... show.update()`` after each change."""

    def __init__(
        self, tally: Tally, *, console: Console | None = None, interval: float = 10.0
    ) -> None:
        self.tally = tally
        self.console = console or Console(stderr=True)
        self.interval = interval
        self.live = self.console.is_terminal and not self.console.is_dumb_terminal
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._last_line = 0.0

    def __enter__(self) -> ProgressDisplay:
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]rollouts"),
                BarColumn(bar_width=24),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                console=self.console,
                transient=False,
            )
            self._task = self._progress.add_task("run", total=self.tally.total, status="")
            self._progress.start()
        self._last_line = time.monotonic()
        return self

    def update(self) -> None:
        if self._progress is not None and self._task is not None:
            line = self.tally.line()
            status = line.split(" | ", 1)[-1]  # the bar shows done/total itself
            self._progress.update(self._task, completed=self.tally.done, status=status)
        elif time.monotonic() - self._last_line >= self.interval:
            self._print_line()

    def _print_line(self) -> None:
        self._last_line = time.monotonic()
        print(f"progress: {self.tally.line()}", file=sys.stderr, flush=True)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self.update()
            self._progress.stop()
        else:
            self._print_line()
