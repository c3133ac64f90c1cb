"""``backends report RUN_DIR``: one self-contained HTML page for a run, and a page per rollout.

``RUN_DIR/report.html`` holds the summary, the charts (inline SVG), pass@k, time per phase,
failures by phase and every rollout's row (a small inline script pages, sorts and filters
them); ``RUN_DIR/report/<rollout id>.html`` shows one try: its failure, timings, metrics, its
ATIF trajectory as steps and its artifacts. Nothing is fetched from a network.

Everything a rollout wrote is hostile text: templates escape it all, the rows reach the
script as JSON that cannot close its element and are put on the page as text only, and each
page's Content-Security-Policy lets no script run but the page's own (the rollout pages run
none), so even a missed escape could not run an adversary's script.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape
from markupsafe import Markup

from backends.cli.metrics import compute_metrics
from backends.cli.runfiles import (
    REPORT_FILE,
    ResultRecord,
    RunFileError,
    RunManifest,
    read_manifest,
    read_records,
)
from backends.report import charts
from backends.report.rollout_pages import RolloutPages
from backends.trajectory.save import write_atomic

PHASES = ("setup", "agent", "grading")
# The columns of the rows the page's script shows (arrays, not objects: 10,000 rows stay small).
ROW_FIELDS = (
    "id", "row", "attempt", "what", "status", "reward", "phase", "failure",
    "answer", "seconds", "tokens", "page", "artifacts", "tries",
)  # fmt: skip


class ReportError(Exception):
    """The directory is not a run directory this version can read; the message says why."""


@dataclass(frozen=True)
class ReportSummary:
    path: Path
    rollouts: int
    pages: int
    rewritten: int  # rollout pages written this time (the others had not changed)
    bytes: int
    seconds: float


def _environment() -> Environment:
    env = Environment(
        loader=PackageLoader("backends.report", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["num"] = _num
    env.filters["secs"] = _secs
    return env


def _asset(name: str) -> str:
    return (resources.files("backends.report") / "templates" / name).read_text()


def _csp(script: str | None, style: str) -> str:
    """No network, no plugins, no forms; only this page's own style and script (by hash)."""

    def digest(text: str) -> str:
        return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"

    scripts = digest(script) if script is not None else "'none'"
    return (
        f"default-src 'none'; style-src {digest(style)}; script-src {scripts}; img-src data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )


def write_report(run_dir: Path) -> ReportSummary:
    """Write ``RUN_DIR/report.html`` and the rollout pages under ``RUN_DIR/report/``; raise
    ``ReportError`` for a directory that is not a run of this version."""
    started = time.perf_counter()
    run_dir = run_dir.resolve()
    try:
        manifest = read_manifest(run_dir)
        if manifest is None:
            raise ReportError(
                f"{run_dir} has no run.json: not a run directory written by `backends run`"
            )
        records = [_finite_numbers(r) for r in read_records(run_dir)]
    except RunFileError as exc:
        raise ReportError(str(exc)) from None
    current: dict[tuple[int, int], ResultRecord] = {}
    tries: dict[tuple[int, int], list[ResultRecord]] = defaultdict(list)
    for record in records:
        current[record.slot] = record
        tries[record.slot].append(record)
    metrics = compute_metrics(manifest, current)

    env = _environment()
    style = _asset("report.css")
    pages = RolloutPages(run_dir, env.get_template("rollout.html.j2"), style, _csp(None, style))
    written = pages.write(records, tries, manifest.run_id)

    rows = [
        _row(
            r,
            pages.hrefs.get(r.rollout_id),
            pages.artifacts.get(r.rollout_id, 0),
            len(tries[slot]),
            manifest.run_id,
        )
        for slot, r in sorted(current.items())
    ]
    script = _asset("report.js")
    target = run_dir / REPORT_FILE
    main = env.get_template("report.html.j2").render(
        manifest=manifest,
        metrics=metrics,
        inputs=_inputs(manifest),
        charts=_charts(metrics, [r.reward for r in current.values() if r.reward is not None]),
        rows_json=Markup(_script_json({"fields": ROW_FIELDS, "rows": rows})),
        style=Markup(style),
        script=Markup(script),
        csp=_csp(script, style),
        generated=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    )
    write_atomic(target, main.encode())
    return ReportSummary(
        path=target,
        rollouts=len(rows),
        pages=len(pages.hrefs),
        rewritten=written,
        bytes=len(main.encode()),
        seconds=time.perf_counter() - started,
    )


def _finite_numbers(record: ResultRecord) -> ResultRecord:
    """The record without NaN or infinite numbers (JSON has none; a line edited by hand or by
    an adversary may): such a reward is no reward, such a timing or metric is left out."""
    numbers = [record.reward, *record.timings.values(), *record.metrics.values()]
    if all(math.isfinite(v) for v in numbers if v is not None):
        return record
    return record.model_copy(
        update={
            "reward": _finite(record.reward),
            "passed": record.passed if _finite(record.reward) is not None else None,
            "timings": {k: v for k, v in record.timings.items() if math.isfinite(v)},
            "metrics": {k: v for k, v in record.metrics.items() if math.isfinite(v)},
        }
    )


def _script_json(data: Any) -> str:
    """JSON to embed in a <script type="application/json">: no '<' can close the element,
    no '&' or line separator can confuse a parser (all become \\u escapes)."""
    text = json.dumps(data, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _row(r: ResultRecord, page: str | None, artifacts: int, tries: int, run_id: str) -> list[Any]:
    failure = f"{r.failure.category}: {r.failure.message[:300]}" if r.failure else ""
    return [
        r.rollout_id.removeprefix(f"{run_id}."),
        r.row,
        r.attempt,
        (r.task or r.prompt)[:160],
        r.status,
        _finite(r.reward),
        r.failed_phase or "",
        failure,
        r.answer[:160],
        round(sum(v for k, v in r.timings.items() if k in _TOP_TIMINGS), 3),
        r.tokens.prompt + r.tokens.completion,
        page,
        artifacts,
        tries,
    ]


_TOP_TIMINGS = frozenset({"queued_sec", "setup_sec", "agent_sec", "grader_sec"})


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _inputs(manifest: RunManifest) -> list[tuple[str, str]]:
    """What was run, as ``backends run`` chose to show it (its own inputs if it did not)."""
    if manifest.display:
        return list(manifest.display.items())
    return [(k, str(v)) for k, v in manifest.inputs.items() if v is not None]


def _charts(metrics: Any, rewards: list[float]) -> dict[str, Markup]:
    pass_k = [
        charts.Bar(
            f"pass@{k}",
            value,
            f"{value:.3f}  ({metrics.pass_at_k_rows.get(k, 0)} rows)",
        )
        for k, value in sorted(metrics.pass_at_k.items(), key=lambda kv: int(kv[0]))
    ]
    times = [
        charts.Bar(name.removesuffix("_sec"), t.p50, f"{_secs(t.p50)} · p90 {_secs(t.p90)}", t.p90)
        for name, t in sorted(metrics.time_per_phase.items(), key=_phase_order)
    ]
    categories = sorted({c for per in metrics.failures_by_phase.values() for c in per})
    colors = charts.colors_for(categories)
    failures = [
        (
            phase,
            [charts.Segment(c, n) for c, n in sorted(metrics.failures_by_phase[phase].items())],
        )
        for phase in [*PHASES, *sorted(set(metrics.failures_by_phase) - set(PHASES))]
        if metrics.failures_by_phase.get(phase)
    ]
    return {
        "histogram": charts.histogram(rewards),
        "pass_at_k": charts.bars(pass_k, scale=1.0),
        "time_per_phase": charts.bars(times),
        "failures": charts.stacked(failures, colors),
    }


_PIPELINE = ["queued_sec", "setup_sec", "agent_sec", "grader_sec"]


def _phase_order(item: tuple[str, Any]) -> tuple[int, str]:
    """The rollout's own phases in the order they run, then the rest (Harbor's) by name."""
    name = item[0]
    return (_PIPELINE.index(name), "") if name in _PIPELINE else (len(_PIPELINE), name)


def _num(value: float | None, digits: int = 3) -> str:
    if value is None or not math.isfinite(value):
        return "\u2013"
    return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"


def _secs(value: float | None) -> str:
    if value is None:
        return "\u2013"
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 120:
        return f"{value:.1f} s"
    return f"{value / 60:.1f} min"
