"""A run's numbers from its result lines: rewards, pass@k, groups, failures, time, tokens.

A failed rollout has no reward and counts in none of the reward statistics (infrastructure
failure is never a reward of 0); pass@k takes, per row, the attempts that were graded.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Iterable

from backends.cli.runfiles import (
    GroupStats,
    GroupSummary,
    ResultRecord,
    RunManifest,
    RunMetrics,
    Slot,
    TimeStats,
    TokenTotals,
)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from ``n`` attempts of which ``c`` passed:
    ``1 - C(n - c, k) / C(n, k)`` (Chen et al., 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def k_values(attempts: int) -> list[int]:
    """The k reported for ``attempts`` per row: 1, powers of 2, multiples of 5, and ``attempts``."""
    ks = {1, attempts}
    k = 2
    while k <= attempts:
        ks.add(k)
        k *= 2
    ks.update(range(5, attempts + 1, 5))
    return sorted(ks)


def compute_metrics(
    manifest: RunManifest, records: dict[Slot, ResultRecord], *, now: float | None = None
) -> RunMetrics:
    """``metrics.json`` for the current try of each slot."""
    current = list(records.values())
    counts = Counter(r.status for r in current)
    rewards = [r.reward for r in current if r.reward is not None]
    planned = manifest.rows * manifest.attempts
    by_row: dict[int, list[ResultRecord]] = defaultdict(list)
    for record in current:
        by_row[record.row].append(record)
    pass_k, pass_rows = _pass_at_k(by_row.values(), manifest.attempts)
    groups = [_group(row, by_row[row]) for row in sorted(by_row)]
    failures: dict[str, Counter[str]] = defaultdict(Counter)
    for record in current:
        if record.failure is not None:
            failures[str(record.failure.phase)][str(record.failure.category)] += 1
    by_category: Counter[str] = Counter()
    for per_phase in failures.values():
        by_category.update(per_phase)
    tokens = [r.tokens for r in current]
    now = now or time.time()
    wall = _wall(manifest, current, now)
    finished = sum(s.finished for s in manifest.sessions)
    return RunMetrics(
        run_id=manifest.run_id,
        updated_at=now,
        complete=len(current) == planned and not counts.get("cancelled"),
        planned=planned,
        counts={
            "success": counts.get("success", 0),
            "failure": counts.get("failure", 0),
            "cancelled": counts.get("cancelled", 0),
            "not_run": planned - len(current),
        },
        graded=len(rewards),
        mean_reward=statistics.fmean(rewards) if rewards else None,
        reward_std=statistics.pstdev(rewards) if rewards else None,
        reward_min=min(rewards) if rewards else None,
        reward_max=max(rewards) if rewards else None,
        success_threshold=manifest.success_threshold,
        pass_at_k=pass_k,
        pass_at_k_rows=pass_rows,
        groups=groups,
        group_summary=_group_summary(groups),
        failures_by_phase={phase: dict(cats) for phase, cats in sorted(failures.items())},
        failures_by_category=dict(by_category),
        time_per_phase=_time_per_phase(current),
        tokens=TokenTotals(
            prompt=sum(t.prompt for t in tokens),
            completion=sum(t.completion for t in tokens),
            mean_prompt=statistics.fmean(t.prompt for t in tokens) if tokens else None,
            mean_completion=statistics.fmean(t.completion for t in tokens) if tokens else None,
        ),
        policy_calls=sum(r.policy_calls for r in current),
        wall_sec=wall,
        rollouts_per_sec=finished / wall if wall > 0 else None,
    )


def _wall(manifest: RunManifest, current: list[ResultRecord], now: float) -> float:
    """Seconds the sessions ran: the last one until now; an earlier one that never ended (it
    was killed) until the last result it wrote."""
    last_seen: dict[int, float] = {}
    for record in current:
        last_seen[record.session] = max(last_seen.get(record.session, 0.0), record.finished_at)
    wall = 0.0
    for number, session in enumerate(manifest.sessions, 1):
        end = session.ended_at
        if end is None:
            end = now if number == len(manifest.sessions) else last_seen.get(number)
        if end is not None:
            wall += max(0.0, end - session.started_at)
    return wall


def _pass_at_k(
    rows: Iterable[list[ResultRecord]], attempts: int
) -> tuple[dict[str, float], dict[str, int]]:
    # Per row: n graded attempts, c of them passed. Failed attempts are left out, not failed.
    graded = [
        (len(ok), sum(1 for r in ok if r.passed))
        for ok in ([r for r in row if r.passed is not None] for row in rows)
        if ok
    ]
    values: dict[str, float] = {}
    used: dict[str, int] = {}
    for k in k_values(attempts):
        eligible = [(n, c) for n, c in graded if n >= k]
        if eligible:
            values[str(k)] = statistics.fmean(pass_at_k(n, c, k) for n, c in eligible)
            used[str(k)] = len(eligible)
    return values, used


def _group(row: int, records: list[ResultRecord]) -> GroupStats:
    rewards = [r.reward for r in records if r.reward is not None]
    first = records[0]
    return GroupStats(
        row=row,
        task=first.task,
        prompt=first.prompt,
        attempts=len(records),
        graded=len(rewards),
        failed=sum(1 for r in records if r.status != "success"),
        passed=sum(1 for r in records if r.passed),
        mean_reward=statistics.fmean(rewards) if rewards else None,
        reward_std=statistics.pstdev(rewards) if rewards else None,
        reward_min=min(rewards) if rewards else None,
        reward_max=max(rewards) if rewards else None,
    )


def _group_summary(groups: list[GroupStats]) -> GroupSummary:
    stds = [g.reward_std for g in groups if g.reward_std is not None and g.graded >= 2]
    return GroupSummary(
        groups=len(groups),
        zero_variance=sum(1 for g in groups if g.graded >= 2 and g.reward_std == 0),
        all_passed=sum(1 for g in groups if g.graded and g.passed == g.attempts),
        none_passed=sum(1 for g in groups if g.graded and g.passed == 0),
        mean_reward_std=statistics.fmean(stds) if stds else None,
    )


def _time_per_phase(records: list[ResultRecord]) -> dict[str, TimeStats]:
    samples: dict[str, list[float]] = defaultdict(list)
    for record in records:
        for key, seconds in record.timings.items():
            if math.isfinite(seconds):
                samples[key].append(seconds)
    return {key: _time_stats(values) for key, values in sorted(samples.items())}


def _time_stats(values: list[float]) -> TimeStats:
    ordered = sorted(values)
    return TimeStats(
        count=len(ordered),
        mean=statistics.fmean(ordered),
        p50=_quantile(ordered, 0.5),
        p90=_quantile(ordered, 0.9),
        max=ordered[-1],
        total=math.fsum(ordered),
    )


def _quantile(ordered: list[float], q: float) -> float:
    # Nearest rank: a value that occurred, readable for small counts.
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
