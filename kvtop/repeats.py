"""Policy comparisons with error bars: N perturbed replicas of a trace, run on every core.

Replica 0 is the trace as it is. Replica r >= 1 shifts each session's arrivals by one offset
drawn uniformly from [-jitter, +jitter] seconds (a generator seeded with r, so every policy
sees the same N traces): each session keeps its own turn order and gaps, while which sessions
overlap, and so the load each decision meets, changes as it would between two real runs.
Every (policy, replica) pair is one offline simulation; they run in parallel processes.

Per policy and metric the report gives the mean over replicas and a 95% confidence interval
(Student's t, n-1 degrees of freedom). Between the best policy on a metric and each other one,
the difference is paired by replica (same trace, same perturbation), and called significant
when its own 95% interval excludes zero.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any

#: Two-sided 95% Student's t quantiles by degrees of freedom (1-30); past 30, 1.96 is close.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042)

#: The seed-table metrics compared across replicas (lower is better for every one).
METRICS = (("ttft_mean_ms", "TTFT mean s"), ("ttft_p90_ms", "TTFT p90 s"), ("e2e_mean_ms", "E2E mean s"),
           ("e2e_p90_ms", "E2E p90 s"), ("e2e_p99_ms", "E2E p99 s"), ("tpot_p90_ms", "TPOT p90 ms"))


def t95(df: int) -> float:
    return _T95[df - 1] if 1 <= df <= len(_T95) else 1.96


def interval(values: Sequence[float]) -> tuple[float, float]:
    """(mean, 95% half-width); the half-width is 0 for a single value."""
    n = len(values)
    m = math.fsum(values) / n
    if n < 2:
        return m, 0.0
    sd = math.sqrt(math.fsum((v - m) ** 2 for v in values) / (n - 1))
    return m, t95(n - 1) * sd / math.sqrt(n)


def perturb(requests: Sequence[Any], replica: int, jitter_s: float) -> list[Any]:
    """Replica ``replica`` of the trace: each session shifted by one seeded offset."""
    if replica == 0 or jitter_s <= 0:
        return list(requests)
    rng = random.Random(replica)
    offsets: dict[str, float] = {}
    out = []
    for r in requests:
        off = offsets.get(r.session)
        if off is None:
            off = offsets[r.session] = rng.uniform(-jitter_s, jitter_s)
        out.append(replace(r, arrival=max(0.0, r.arrival + off)))
    out.sort(key=lambda r: r.arrival)
    return out


def _one(task: tuple[Any, ...]) -> tuple[str, int, dict[str, Any]]:
    from kvtop.seedtable import seed_row

    simulate, requests, policy, cfg, replica, jitter_s = task
    records = simulate(perturb(requests, replica, jitter_s), policy, cfg)
    row = seed_row(records, instances=[f"i{i}" for i in range(cfg.instances)])
    return policy, replica, {k: row[k] for k, _ in METRICS} | {"apc": row["apc"], "errors": row["errors"]}


def run_replicas(simulate: Callable[..., list[dict[str, Any]]], requests: Sequence[Any],
                 configs: dict[str, Any], repeats: int, jitter_s: float,
                 workers: int | None = None) -> dict[str, list[dict[str, Any]]]:
    """{policy: [row of replica 0, 1, ...]} for ``configs`` ({policy: SimConfig}); ``simulate`` is
    kvtop.simulate.simulate (passed in: that module imports this one)."""
    tasks = [(simulate, list(requests), pol, cfg, r, jitter_s) for pol, cfg in configs.items() for r in range(repeats)]
    out: dict[str, list[dict[str, Any] | None]] = {pol: [None] * repeats for pol in configs}
    workers = max(1, min(workers or os.cpu_count() or 1, len(tasks)))
    if workers == 1:
        results = map(_one, tasks)
    else:
        pool = ProcessPoolExecutor(workers)
        results = pool.map(_one, tasks)
    try:
        for pol, r, row in results:
            out[pol][r] = row
    finally:
        if workers > 1:
            pool.shutdown()
    return out  # type: ignore[return-value]


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, tuple[float, float] | None]]:
    """{policy: {metric: (mean, half-width) or None when a replica had no value}}."""
    out: dict[str, dict[str, tuple[float, float] | None]] = {}
    for pol, rows in runs.items():
        out[pol] = {}
        for key, _ in METRICS + (("apc", "APC"),):
            vals = [r[key] for r in rows]
            out[pol][key] = None if any(v is None for v in vals) else interval(vals)
    return out


def paired(runs: dict[str, list[dict[str, Any]]], metric: str) -> tuple[str, list[tuple[str, float, float, bool]]]:
    """The best policy on ``metric`` (lowest mean) and, for each other policy, its mean paired
    difference from the best, the 95% half-width, and whether the difference is significant."""
    means = {pol: interval([r[metric] for r in rows])[0] for pol, rows in runs.items()
             if all(r[metric] is not None for r in rows)}
    if not means:
        return "", []
    best = min(means, key=means.get)
    rows = []
    for pol in means:
        if pol == best:
            continue
        diffs = [a[metric] - b[metric] for a, b in zip(runs[pol], runs[best])]
        m, h = interval(diffs)
        rows.append((pol, m, h, len(diffs) > 1 and m - h > 0))
    return best, rows


def format_report(runs: dict[str, list[dict[str, Any]]], repeats: int, jitter_s: float, fmt: str = "text") -> str:
    from kvtop.seedtable import _csv, _grid

    summary = summarize(runs)

    def cell(key: str, v: tuple[float, float] | None) -> str:
        if v is None:
            return "-"
        m, h = v
        if key == "tpot_p90_ms":
            return f"{m:.1f} ± {h:.1f}"
        return f"{m / 1000:.3f} ± {h / 1000:.3f}"

    headers = ["policy"] + [label for _, label in METRICS] + ["APC"]
    lines = []
    for pol, s in summary.items():
        apc = s["apc"]
        lines.append([pol] + [cell(k, s[k]) for k, _ in METRICS]
                     + ["-" if apc is None else f"{apc[0] * 100:.1f}% ± {apc[1] * 100:.1f}"])
    table = _csv(headers, lines) if fmt == "csv" else _grid(headers, lines, fmt)
    out = [f"{repeats} replicas per policy (replica 0 as traced, the others with sessions shifted "
           f"by up to ±{jitter_s:g} s); mean ± 95% confidence interval", table]
    if repeats > 1 and len(runs) > 1:
        out.append("\npaired by replica, against the best policy on each metric "
                   "(difference, 95% interval; * = significant):")
        for key, label in METRICS:
            best, diffs = paired(runs, key)
            if not best:
                continue
            scale, unit = (1.0, "ms") if key == "tpot_p90_ms" else (1000.0, "s")
            parts = [f"{pol} +{m / scale:.3f} ± {h / scale:.3f} {unit}{' *' if sig else ''}"
                     for pol, m, h, sig in sorted(diffs, key=lambda d: d[1])]
            out.append(f"  {label}: best {best}; " + "; ".join(parts))
    return "\n".join(out)
