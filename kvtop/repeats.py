"""Policy comparisons with error bars: N perturbed replicas of a trace, run on every core.

Replica 0 is the trace as it is. Replica r >= 1 shifts each session's arrivals by one offset
drawn uniformly from [-jitter, +jitter] seconds (a generator seeded with r, so every policy
sees the same N traces): each session keeps its own turn order and gaps, while which sessions
overlap, and so the load each decision meets, changes as it would between two real runs.
A config with ``path_jitter_s`` (``kvtop simulate --path-jitter``) also varies each request's
path time in replica r >= 1 (kvtop/simulate.py ``SimConfig``; seeded with r): the noise one
live run of the same traffic has against another, where ``jitter`` asks what slightly
different traffic would give (docs/simulator.md, "Agreement with live runs").
Every (policy, replica) pair is one offline simulation (a ``Task``; ``kvtop sweep`` adds
traces, knob settings and loads); they run in forked worker processes that share the trace,
or on a Ray cluster (kvtop/ray_runner.py), and the rows are the same wherever they ran.

Per policy and metric the report gives the mean over replicas and a 95% confidence interval
(Student's t, n-1 degrees of freedom). Between the best policy on a metric and each other one,
the difference is paired by replica (same trace, same perturbation), and called significant
when its own 95% interval excludes zero.
"""

from __future__ import annotations

import gc
import math
import os
import random
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
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


@dataclass(frozen=True)
class Task:
    """One offline simulation: a trace (by name), a policy and its config, a replica, a load.

    ``rate_scale`` multiplies the arrival rate (arrival times divided by it; a session's think
    times shrink with them); ``tag`` is the caller's label, returned with the row."""

    trace: str
    policy: str
    config: Any
    replica: int = 0
    jitter_s: float = 0.0
    rate_scale: float = 1.0
    tag: Any = None
    #: also return the records' SHA-256 (``records_digest``) in the row, as ``sha256``
    fingerprint: bool = False


#: The traces and the simulate function of the current run, set before the worker processes
#: are forked (so a 10,000-request trace is not pickled once per task) or, on Ray, once per actor.
_SHARED: dict[str, Any] = {}


def _setup(simulate: Callable[..., Any], traces: dict[str, Sequence[Any]]) -> None:
    _SHARED["simulate"] = simulate
    _SHARED["traces"] = traces


def scale_rate(requests: Sequence[Any], scale: float) -> list[Any]:
    """The trace with its arrival rate times ``scale``: every arrival (and think time) / scale."""
    if scale == 1.0:
        return list(requests)
    return [replace(r, arrival=r.arrival / scale,
                    think_time=None if r.think_time is None else r.think_time / scale) for r in requests]


def run_task(task: Task, simulate: Callable[..., Any] | None = None,
             traces: dict[str, Sequence[Any]] | None = None) -> tuple[Task, dict[str, Any]]:
    """Run one task; its seed-table row (the METRICS, APC, errors, requests)."""
    from kvtop.seedtable import seed_row

    simulate = simulate or _SHARED["simulate"]
    requests = (traces or _SHARED["traces"])[task.trace]
    requests = perturb(scale_rate(requests, task.rate_scale), task.replica, task.jitter_s)
    cfg = task.config
    if getattr(cfg, "path_jitter_s", 0):
        cfg = replace(cfg, path_seed=task.replica)   # replica 0 keeps the noise-free path
    records = simulate(requests, task.policy, cfg)
    from kvtop.fleet_events import instance_names  # the starting instances and any fleet event added

    row = seed_row(records, instances=instance_names(task.config.instances, getattr(cfg, "fleet_events", ())))
    out = {k: row[k] for k, _ in METRICS} | {"apc": row["apc"], "errors": row["errors"], "requests": len(records)}
    if task.fingerprint:
        out["sha256"] = records_digest(records)
    return task, out


def records_digest(records: Sequence[dict[str, Any]]) -> str:
    """One simulation's records as a SHA-256 of their JSON (16 hex digits), as
    ``benchmarks/bench_sim_server.py fingerprint`` prints it: equal on two versions of the code
    when they simulate the same thing (same decisions, same numbers)."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()[:16]


def fingerprints(runs: dict[str, list[dict[str, Any]]]) -> dict[str, str]:
    """{policy: SHA-256 of its replicas' record digests, in replica order} for rows run with
    ``fingerprint``: one line per policy that changes when any record of any replica does."""
    import hashlib

    return {pol: hashlib.sha256(" ".join(r["sha256"] for r in rows).encode()).hexdigest()[:16]
            for pol, rows in runs.items()}


def _run_indexed(item: tuple[int, Task]) -> tuple[int, dict[str, Any]]:
    k, task = item
    return k, run_task(task)[1]


def run_tasks(simulate: Callable[..., Any], traces: dict[str, Sequence[Any]], tasks: Sequence[Task],
              workers: int | None = None, ray_address: str | None = None,
              progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    """Every task's row, in the order of ``tasks``: in this process (``workers`` 1), in forked
    worker processes (default one per core), or on a Ray cluster (``ray_address``, see
    kvtop/ray_runner.py). The simulation is deterministic, so the rows do not depend on where
    a task ran. ``progress(done, total)`` is called as tasks finish."""
    total = len(tasks)
    rows: list[dict[str, Any] | None] = [None] * total
    done = 0
    if ray_address is not None:
        from kvtop.ray_runner import run_on_ray

        for k, row in run_on_ray(ray_address, _setup, _run_indexed, (simulate, traces), list(enumerate(tasks)),
                                 workers):
            rows[k] = row
            done += 1
            if progress:
                progress(done, total)
        return rows  # type: ignore[return-value]
    workers = max(1, min(workers or os.cpu_count() or 1, total))
    if workers == 1:
        for k, task in enumerate(tasks):
            rows[k] = run_task(task, simulate, traces)[1]
            done += 1
            if progress:
                progress(done, total)
        return rows  # type: ignore[return-value]
    import multiprocessing

    _setup(simulate, traces)   # inherited by forked workers; spawned ones get it as initargs
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    # What is alive now (the traces above all) is frozen before the fork, so the workers' full
    # collections neither traverse it nor touch its pages (which would copy them); thawed after.
    frozen = method == "fork" and gc.get_freeze_count() == 0
    if frozen:
        gc.freeze()
    ctx = multiprocessing.get_context(method)
    init = (None, ()) if method == "fork" else (_setup, (simulate, traces))
    try:
        with ProcessPoolExecutor(workers, mp_context=ctx, initializer=init[0], initargs=init[1]) as pool:
            futures = [pool.submit(_run_indexed, (k, task)) for k, task in enumerate(tasks)]
            for fut in as_completed(futures):
                k, row = fut.result()
                rows[k] = row
                done += 1
                if progress:
                    progress(done, total)
    finally:
        _SHARED.clear()
        if frozen:
            gc.unfreeze()
    return rows  # type: ignore[return-value]


def run_replicas(simulate: Callable[..., list[dict[str, Any]]], requests: Sequence[Any],
                 configs: dict[str, Any], repeats: int, jitter_s: float,
                 workers: int | None = None, ray_address: str | None = None,
                 progress: Callable[[int, int], None] | None = None,
                 fingerprint: bool = False) -> dict[str, list[dict[str, Any]]]:
    """{policy: [row of replica 0, 1, ...]} for ``configs`` ({policy: SimConfig}); ``simulate`` is
    kvtop.simulate.simulate (passed in: that module imports this one). ``fingerprint``: each row
    also holds its records' ``sha256`` (see ``fingerprints``)."""
    tasks = [Task("trace", pol, cfg, r, jitter_s, fingerprint=fingerprint)
             for pol, cfg in configs.items() for r in range(repeats)]
    rows = run_tasks(simulate, {"trace": requests}, tasks, workers, ray_address, progress)
    out: dict[str, list[dict[str, Any]]] = {pol: [] for pol in configs}
    for task, row in zip(tasks, rows):
        out[task.policy].append(row)
    return out


class task_progress:
    """A progress bar with an ETA on stderr while tasks run, only when stderr is a terminal;
    ``with task_progress(n, "simulating") as advance:`` gives the ``progress`` callback."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.bar = total, label, None

    def __enter__(self) -> Callable[[int, int], None]:
        import sys

        if not sys.stderr.isatty() or self.total < 2:
            return lambda done, total: None
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)

        self.bar = Progress(TextColumn(self.label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            TextColumn("ETA"), TimeRemainingColumn(), console=Console(file=sys.stderr),
                            transient=True)
        self.bar.__enter__()
        task = self.bar.add_task(self.label, total=self.total)
        return lambda done, total: self.bar.update(task, completed=done)

    def __exit__(self, *exc):
        if self.bar is not None:
            return self.bar.__exit__(*exc)
        return None


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


def format_report(runs: dict[str, list[dict[str, Any]]], repeats: int, jitter_s: float, fmt: str = "text",
                  path_jitter_s: float = 0.0, ceiling: float | None = None) -> str:
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
    if ceiling:  # ``ceiling``: the trace's prefix ceiling (kvtop/ceiling.py)
        headers.append(f"APC / ceiling {ceiling * 100:.1f}%")
    lines = []
    for pol, s in summary.items():
        apc = s["apc"]
        lines.append([pol] + [cell(k, s[k]) for k, _ in METRICS]
                     + ["-" if apc is None else f"{apc[0] * 100:.1f}% ± {apc[1] * 100:.1f}"])
        if ceiling:
            lines[-1].append("-" if apc is None else f"{apc[0] / ceiling * 100:.1f}%")
    table = _csv(headers, lines) if fmt == "csv" else _grid(headers, lines, fmt)
    path = (f" and each request's path time varied by up to ±{path_jitter_s / 2:g} s around the profile's "
            f"frontend time, never before its send" if path_jitter_s else "")
    out = [f"{repeats} replicas per policy (replica 0 as traced, the others with sessions shifted "
           f"by up to ±{jitter_s:g} s{path}); mean ± 95% confidence interval", table]
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


#: The metrics drawn in the terminal (the agentic ones: the slow turns' TTFT, the tail's E2E).
PLOT_METRICS = (("ttft_p90_ms", "TTFT p90 s"), ("e2e_p99_ms", "E2E p99 s"))


def _scale(key: str) -> tuple[float, str]:
    return (1.0, "ms") if key == "tpot_p90_ms" else (1000.0, "s")


def terminal_plot(runs: dict[str, list[dict[str, Any]]], metrics: Sequence[tuple[str, str]] = PLOT_METRICS,
                  width: int = 100) -> str:
    """One forest plot per metric (plotext): each policy's mean as a dot, its 95% interval as
    a bar through it, the policies top to bottom in the order given."""
    import plotext as plt

    summary = summarize(runs)
    charts = []
    for key, label in metrics:
        scale, _ = _scale(key)
        pols = [p for p in runs if summary[p][key] is not None]
        if not pols:
            continue
        means = [summary[p][key][0] / scale for p in pols]
        halves = [summary[p][key][1] / scale for p in pols]
        ys = list(range(len(pols), 0, -1))
        plt.clf()
        plt.plotsize(width, 3 * len(pols) + 6)
        plt.theme("clear")
        plt.error(means, ys, xerr=halves)
        plt.scatter(means, ys, marker="●")
        plt.yticks(ys, pols)
        plt.ylim(0.5, len(pols) + 0.5)
        plt.xlim(0, max(m + h for m, h in zip(means, halves)) * 1.05 or 1.0)
        plt.title(f"{label}: mean and 95% interval over {len(next(iter(runs.values())))} replicas")
        charts.append(plt.build())
    return "\n".join(charts)


def svg_ticks(top: float) -> list[float]:
    """Round tick values from 0 to at least ``top`` (1, 2 or 5 times a power of ten apart)."""
    import math

    if not top > 0:
        return [0.0, 1.0]
    raw = top / 4
    mag = 10 ** math.floor(math.log10(raw))
    step = next(k * mag for k in (1, 2, 5, 10) if k * mag >= raw)
    return [k * step for k in range(int(math.ceil(top / step - 1e-9)) + 1)]


def svg_axis(x0: float, width: float, ticks: list[float], scale: float, unit: str, y: float) -> list[str]:
    """An x axis under a chart's rows: a baseline, a tick and a label per value, the unit at the end.
    Drawn as paths, so the <line> elements stay the intervals."""
    from html import escape

    top = ticks[-1] or 1.0
    parts = [f'<path d="M{x0:.1f} {y:.1f} H{x0 + width:.1f}" stroke="#555"/>']
    for t in ticks:
        x = x0 + width * t / top
        parts.append(f'<path d="M{x:.1f} {y:.1f} v4" stroke="#555"/>')
        parts.append(f'<text x="{x:.1f}" y="{y + 15:.1f}" font-size="10" text-anchor="middle">'
                     f'{t / scale:g}</text>')
    parts.append(f'<text x="{x0 + width + 8:.1f}" y="{y + 15:.1f}" font-size="10">{escape(unit)}</text>')
    return parts


def svg_clipped_marker(x: float, y: float) -> str:
    """A left-pointing mark where an interval runs below 0 and is cut at the axis."""
    return f'<path d="M{x + 5:.1f} {y - 4:.1f} L{x:.1f} {y:.1f} L{x + 5:.1f} {y + 4:.1f}" fill="none" stroke="#c0392b"/>'


def write_svg(path: str, runs: dict[str, list[dict[str, Any]]], title: str) -> None:
    """Every metric of the report as a horizontal bar chart with an x axis: each policy's mean
    with its 95% interval, the best in bold, a policy whose paired difference from the best is
    not significant marked as tied with it; an interval that reaches below 0 is cut at the axis
    and marked (◂). Plain SVG, no plotting library."""
    from html import escape
    from pathlib import Path

    summary = summarize(runs)
    label_w, bar_w, row_h, pad = 200, 420, 16, 8
    # the title and its key on two lines of their own, the first chart below them
    parts, y = [], 58
    for key, label in METRICS:
        scale, unit = _scale(key)
        pols = [p for p in runs if summary[p][key] is not None]
        if not pols:
            continue
        best, diffs = paired(runs, key)
        tied = {p for p, _, _, sig in diffs if not sig}
        ticks = svg_ticks(max(summary[p][key][0] + summary[p][key][1] for p in pols))
        top = ticks[-1] or 1.0
        parts.append(f'<text x="{pad}" y="{y}" font-weight="bold">{escape(label)}</text>')
        y += 8
        for p in pols:
            m, h = summary[p][key]
            note = " (best)" if p == best else " (tied with best)" if p in tied else ""
            clipped = m - h < 0
            weight = ' font-weight="bold"' if p == best else ""
            parts.append(f'<text x="{pad}" y="{y + row_h - 4}"{weight}>{escape(p)}</text>')
            w = bar_w * m / top
            x0, x1 = label_w + bar_w * max(0.0, m - h) / top, label_w + bar_w * (m + h) / top
            parts.append(f'<rect x="{label_w}" y="{y + 2}" width="{w:.1f}" height="{row_h - 4}" '
                         f'fill="{"#3b6ea5" if p == best or p in tied else "#9aa9b8"}">'
                         f'<title>{escape(p)}: {m / scale:.3f} ± {h / scale:.3f} {unit}{note}'
                         f'{" (the interval reaches below 0: cut at the axis)" if clipped else ""}</title></rect>')
            parts.append(f'<line x1="{x0:.1f}" x2="{x1:.1f}" y1="{y + row_h / 2}" y2="{y + row_h / 2}" stroke="black"/>')
            if clipped:
                parts.append(svg_clipped_marker(label_w, y + row_h / 2))
            parts.append(f'<text x="{x1 + 6:.1f}" y="{y + row_h - 4}" font-size="10">'
                         f'{m / scale:.3f} ± {h / scale:.3f} {unit}{note}</text>')
            y += row_h
        parts += svg_axis(label_w, bar_w, ticks, scale, unit, y + 4)
        y += 46
    width = label_w + bar_w + 260
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y}" font-family="sans-serif" '
           f'font-size="12"><rect width="100%" height="100%" fill="white"/>'
           f'<text x="{pad}" y="16" font-size="12" font-weight="bold">{escape(title)}</text>'
           f'<text x="{pad}" y="34" font-size="11">bars = mean, lines = 95% interval (◂: cut at 0); dark = best, '
           f'or not significantly worse (paired by replica)</text>{"".join(parts)}</svg>\n')
    Path(path).write_text(svg)
