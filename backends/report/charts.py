"""Small inline SVG charts: a histogram and horizontal bars. Every label is escaped here."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from markupsafe import Markup, escape

PALETTE = ["#3b6fd8", "#e0823d", "#c2413b", "#8a5cc2", "#2f9e74", "#b8a31f", "#5a6473", "#d45d9a"]


@dataclass(frozen=True)
class Bar:
    label: str
    value: float  # the bar's length, against the chart's maximum
    text: str  # shown at its end
    marker: float | None = None  # a tick further along (p90 beside a p50, say)


@dataclass(frozen=True)
class Segment:
    label: str  # a legend entry
    value: int


def _fmt(value: float) -> str:
    return f"{value:.3g}"


def histogram(values: Sequence[float], *, width: int = 520, height: int = 200) -> Markup:
    """Counts of ``values``: one bar per value when there are few distinct ones (0/1 rewards),
    else ten equal bins from the smallest to the largest."""
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return Markup('<p class="empty">no graded rollouts</p>')
    distinct = sorted(set(values))
    if len(distinct) <= 12:
        counts = Counter(values)
        if set(distinct) <= {0.0, 1.0}:
            distinct = [0.0, 1.0]  # pass/fail rewards: show both, even when one is empty
        bins = [(_fmt(v), counts[v]) for v in distinct]
    else:
        low, high = distinct[0], distinct[-1]
        step = (high - low) / 10
        tally = [0] * 10
        for v in values:
            tally[min(int((v - low) / step), 9)] += 1
        bins = [
            (f"{_fmt(low + i * step)}\u2013{_fmt(low + (i + 1) * step)}", n)
            for i, n in enumerate(tally)
        ]
    top = max(n for _, n in bins) or 1
    pad_left, pad_bottom, pad_top = 8, 34, 18
    slot = (width - pad_left * 2) / len(bins)
    bar_w = min(max(slot * 0.72, 2), 90)
    plot_h = height - pad_bottom - pad_top
    parts = [
        f'<svg class="chart" role="img" aria-label="reward histogram" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">'
    ]
    for i, (label, n) in enumerate(bins):
        h = plot_h * n / top
        x = pad_left + i * slot + (slot - bar_w) / 2
        y = pad_top + plot_h - h
        cx = x + bar_w / 2
        parts.append(
            f'<g class="bin"><title>{escape(label)}: {n}</title>'
            f'<rect class="bar" x="{x:.1f}" y="{y:.1f}" width="{bar_w:.1f}" height="{h:.1f}" rx="3"/>'
            f'<text class="count" x="{cx:.1f}" y="{y - 4:.1f}" text-anchor="middle">{n}</text>'
            f'<text class="tick" x="{cx:.1f}" y="{height - pad_bottom + 16}" '
            f'text-anchor="middle">{escape(label)}</text></g>'
        )
    parts.append(
        f'<line class="axis" x1="{pad_left}" x2="{width - pad_left}" '
        f'y1="{pad_top + plot_h}" y2="{pad_top + plot_h}"/>'
    )
    parts.append("</svg>")
    return Markup("".join(parts))


def bars(rows: Sequence[Bar], *, scale: float | None = None, width: int = 520) -> Markup:
    """One horizontal bar per row, longest = ``scale`` (default: the largest value)."""
    if not rows:
        return Markup('<p class="empty">nothing to show</p>')
    top = scale or max(max(r.value, r.marker or 0) for r in rows) or 1
    label_w, text_w, row_h = 175, 140, 26
    plot_w = width - label_w - text_w
    height = row_h * len(rows) + 6
    parts = [
        f'<svg class="chart" role="img" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" xmlns="http://www.w3.org/2000/svg">'
    ]
    for i, row in enumerate(rows):
        y = 4 + i * row_h
        w = max(plot_w * min(row.value / top, 1), 1 if row.value else 0)
        parts.append(
            f'<g class="row"><title>{escape(row.label)}: {escape(row.text)}</title>'
            f'<text class="label" x="{label_w - 8}" y="{y + 15}" text-anchor="end">'
            f"{escape(_short(row.label, 26))}</text>"
            f'<rect class="track" x="{label_w}" y="{y + 3}" width="{plot_w}" height="16" rx="3"/>'
            f'<rect class="bar" x="{label_w}" y="{y + 3}" width="{w:.1f}" height="16" rx="3"/>'
        )
        if row.marker is not None:
            mx = label_w + plot_w * min(row.marker / top, 1)
            parts.append(
                f'<line class="marker" x1="{mx:.1f}" x2="{mx:.1f}" y1="{y}" y2="{y + 22}"/>'
            )
        parts.append(
            f'<text class="value" x="{label_w + plot_w + 8}" y="{y + 15}">{escape(row.text)}</text></g>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))


def stacked(
    rows: Sequence[tuple[str, Sequence[Segment]]], colors: dict[str, str], *, width: int = 520
) -> Markup:
    """One horizontal bar per row, split into coloured segments (a legend follows)."""
    if not rows:
        return Markup('<p class="empty">no failures</p>')
    top = max(sum(s.value for s in segs) for _, segs in rows) or 1
    label_w, text_w, row_h = 90, 50, 26
    plot_w = width - label_w - text_w
    height = row_h * len(rows) + 6
    parts = [
        f'<svg class="chart" role="img" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" xmlns="http://www.w3.org/2000/svg">'
    ]
    for i, (label, segments) in enumerate(rows):
        y = 4 + i * row_h
        parts.append(
            f'<g class="row"><text class="label" x="{label_w - 8}" y="{y + 15}" '
            f'text-anchor="end">{escape(_short(label, 12))}</text>'
        )
        x = float(label_w)
        for seg in segments:
            w = plot_w * seg.value / top
            parts.append(
                f'<rect x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="16" '
                f'fill="{colors[seg.label]}"><title>{escape(label)} / {escape(seg.label)}: '
                f"{seg.value}</title></rect>"
            )
            x += w
        total = sum(s.value for s in segments)
        parts.append(f'<text class="value" x="{x + 8:.1f}" y="{y + 15}">{total}</text></g>')
    parts.append("</svg>")
    legend = "".join(
        f'<span class="key"><svg width="10" height="10" xmlns="http://www.w3.org/2000/svg">'
        f'<rect width="10" height="10" rx="2" fill="{color}"/></svg> {escape(name)}</span>'
        for name, color in colors.items()
    )
    return Markup("".join(parts) + f'<div class="legend">{legend}</div>')


def colors_for(names: Sequence[str]) -> dict[str, str]:
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(names)}


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
