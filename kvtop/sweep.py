"""``kvtop sweep SPEC``: policies x knob grids x traces x loads, chosen on train traces and
checked on validate traces.

A spec is a small TOML file (docs/sweep-example.toml is one, with every key explained): the
policies and, per policy, a grid of knob values (each combination is one *setting*); the
loads (instance counts and arrival-rate scales); the train and validate traces; replicas and
jitter as in ``kvtop simulate --repeats``; the metric that ranks the settings. Every
(setting, load, trace, replica) is one offline simulation, run by kvtop/repeats.py's task
runner (worker processes sharing the traces, or ``--ray ADDRESS``).

Per load, each setting's score on a split is its metric averaged over that split's traces,
per replica, then over replicas (mean and 95% interval). The best setting on the train
traces is reported with its score and rank on the validate traces, and every setting whose
rank changes between the splits is flagged: a knob tuned on one trace that does not transfer
shows up here. Every row goes to SQLite (``sweeps``, ``sweep_results``, ``sweep_ranks``;
``kvtop log sql --db FILE``), the ranks to a terminal plot and, with ``--plot FILE.svg``, an
SVG chart.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtop.cli import CliError

#: Spec keys at the top level, and what they default to.
_TOP = {"name": None, "metric": "ttft_p90_ms", "repeats": 3, "jitter": 2.0, "path_jitter": 0.0, "profile": "h20",
        "mode": "open", "limit": None, "knobs": {}, "loads": {}, "traces": {}, "policies": []}


@dataclass
class Setting:
    policy: str
    knobs: dict[str, Any]

    @property
    def label(self) -> str:
        return " ".join([self.policy] + [f"{k}={v}" for k, v in self.knobs.items()])


@dataclass
class TraceSpec:
    name: str
    path: Path
    part: tuple[int, int] | None = None   # (k, n): the sessions whose first-seen order is k-1 mod n
    limit: int | None = None


@dataclass
class Spec:
    name: str
    path: Path
    metric: str
    repeats: int
    jitter: float
    path_jitter: float
    profile: str
    mode: str
    limit: int | None
    knobs: dict[str, Any]
    instances: list[int]
    rate_scales: list[float]
    train: list[TraceSpec]
    validate: list[TraceSpec]
    settings: list[Setting] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)


#: Bounds on a spec, each checked before anything is built or read: what a sweep on one host (or
#: a Ray cluster) can run, far past any study so far (issue 26's sweep: 72 simulations).
MAX_SIMULATIONS = 100_000        # settings x loads x traces x replicas
MAX_SETTINGS = 10_000            # knob combinations over all policies
MAX_REPEATS = 10_000
MAX_INSTANCES = 1024             # each simulated instance holds its block pool (~0.5 MB at h20's size)
RATE_SCALE_RANGE = (1e-3, 1e3)   # an arrival-rate scale outside it is not a load anyone studies
MAX_JITTER_S = 86_400.0
MAX_SPEC_BYTES = 1 << 20


def _fail(path: Path, msg: str) -> CliError:
    return CliError(f"{path}: {msg}")


def load_spec(path: str | Path) -> Spec:
    """Read and check a sweep spec; every problem is one line naming the file and key."""
    from kvtop.repeats import METRICS
    from router.config import KnobError
    from router.features import FEATURE_KNOBS
    from router.policies import POLICIES, build_policy, policy_class

    path = Path(path)
    try:
        if path.exists() and not path.is_file():
            raise _fail(path, "not a regular file")
        with open(path, "rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)
        if len(data) > MAX_SPEC_BYTES:
            raise _fail(path, f"over {MAX_SPEC_BYTES:,} bytes: not a sweep spec")
        raw = tomllib.loads(data.decode("utf-8"))
    except FileNotFoundError:
        raise CliError(f"sweep spec not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise _fail(path, f"not valid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses once per level of nested arrays and tables
        raise _fail(path, "nests too deep to read") from None
    unknown = set(raw) - set(_TOP)
    if unknown:
        raise _fail(path, f"unknown key {sorted(unknown)[0]!r} (known: {', '.join(sorted(_TOP))})")
    get = {**_TOP, **raw}
    metrics = [k for k, _ in METRICS]
    if get["metric"] not in metrics:
        raise _fail(path, f"metric must be one of {', '.join(metrics)}")
    for key, lo, hi in (("repeats", 1, MAX_REPEATS), ("limit", 1, None)):
        v = get[key]
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < lo):
            raise _fail(path, f"{key} must be an integer of at least {lo}")
        if v is not None and hi is not None and v > hi:
            raise _fail(path, f"{key} must be at most {hi:,}, got {v:,}")
    for key in ("jitter", "path_jitter"):
        v = get[key]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= MAX_JITTER_S:
            raise _fail(path, f"{key} must be a finite number in [0, {MAX_JITTER_S:g}] seconds")
    if get["path_jitter"] and get["repeats"] < 2:
        raise _fail(path, "path_jitter varies replicas 1 and on: give repeats 2 or more")
    if get["mode"] not in ("open", "closed"):
        raise _fail(path, "mode must be open or closed")
    from kvtop.sim.profiles import get_profile

    try:
        get_profile(get["profile"])
    except KeyError as exc:
        raise _fail(path, f"profile: {exc.args[0]}") from None

    loads = get["loads"]
    if not isinstance(loads, dict) or set(loads) - {"instances", "rate_scale"}:
        raise _fail(path, "[loads] takes instances = [...] and rate_scale = [...]")
    instances = loads.get("instances", [8])
    scales = loads.get("rate_scale", [1.0])
    if not (isinstance(instances, list) and instances and all(isinstance(i, int) and not isinstance(i, bool)
                                                               and 1 <= i <= MAX_INSTANCES for i in instances)):
        raise _fail(path, f"loads.instances must be a non-empty list of integers in [1, {MAX_INSTANCES}]")
    lo, hi = RATE_SCALE_RANGE
    if not (isinstance(scales, list) and scales and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                        and lo <= x <= hi for x in scales)):  # NaN, inf fail
        raise _fail(path, f"loads.rate_scale must be a non-empty list of numbers in [{lo:g}, {hi:g}]")

    traces = get["traces"]
    if not isinstance(traces, dict) or set(traces) != {"train", "validate"}:
        raise _fail(path, "[traces] needs train = [...] and validate = [...]")
    splits = {}
    for split in ("train", "validate"):
        entries = traces[split]
        if not isinstance(entries, list) or not entries:
            raise _fail(path, f"traces.{split} must be a non-empty list")
        splits[split] = [_trace_spec(path, split, k, e) for k, e in enumerate(entries)]
    names = [t.name for ts in splits.values() for t in ts]
    if len(set(names)) != len(names):
        raise _fail(path, "two traces have the same name: give each a name = \"...\"")

    knobs = get["knobs"]
    if not isinstance(knobs, dict):
        raise _fail(path, "[knobs] must be a table of router-level knobs")
    try:
        FEATURE_KNOBS.validate({k: v for k, v in knobs.items()})
    except KnobError as exc:
        raise _fail(path, f"knobs.{exc.field}: {exc.message}") from None

    if not isinstance(get["policies"], list) or not get["policies"]:
        raise _fail(path, "needs at least one [[policies]] table")
    settings = []
    for k, pol in enumerate(get["policies"]):
        where = f"policies[{k}]"
        if not isinstance(pol, dict) or "name" not in pol or set(pol) - {"name", "grid", "knobs"}:
            raise _fail(path, f"{where} takes name = \"...\", optional grid = {{knob = [values]}} and knobs = {{...}}")
        name = pol["name"]
        if not isinstance(name, str) or name not in POLICIES:
            raise _fail(path, f"{where}.name: unknown policy {name!r} (known: {', '.join(POLICIES)})")
        grid = pol.get("grid", {})
        fixed = pol.get("knobs", {})
        if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
            raise _fail(path, f"{where}.grid: each knob takes a non-empty list of values")
        schema = set(policy_class(name).schema.names())
        if not isinstance(fixed, dict):
            raise _fail(path, f"{where}.knobs must be a table of knob = value")
        for key in list(grid) + list(fixed):
            if key not in schema:
                raise _fail(path, f"{where}: {name} has no knob {key!r} (its knobs: {', '.join(sorted(schema)) or 'none'})")
        keys = list(grid)
        combos = math.prod(len(grid[k]) for k in keys)
        if len(settings) + combos > MAX_SETTINGS:
            raise _fail(path, f"{where}.grid makes {combos:,} settings; a sweep takes at most {MAX_SETTINGS:,}")
        for values in itertools.product(*(grid[k] for k in keys)) if keys else [()]:
            s = Setting(name, {**fixed, **dict(zip(keys, values))})
            try:
                build_policy(name, {k: str(v) for k, v in s.knobs.items()})
            except KnobError as exc:
                raise _fail(path, f"{where}: {exc.field}: {exc.message}") from None
            settings.append(s)
    labels = [s.label for s in settings]
    if len(set(labels)) != len(labels):
        raise _fail(path, "two policies give the same setting")
    n_sim = (len(settings) * len(instances) * len(scales) * (len(splits["train"]) + len(splits["validate"]))
             * get["repeats"])
    if n_sim > MAX_SIMULATIONS:
        raise _fail(path, f"the sweep is {n_sim:,} simulations ({len(settings)} settings x "
                          f"{len(instances) * len(scales)} loads x {len(names)} traces x {get['repeats']} "
                          f"replicas); at most {MAX_SIMULATIONS:,}: fewer repeats, settings, loads or traces")
    return Spec(name=get["name"] or path.stem, path=path, metric=get["metric"], repeats=get["repeats"],
                jitter=float(get["jitter"]), path_jitter=float(get["path_jitter"]), profile=get["profile"], mode=get["mode"], limit=get["limit"],
                knobs=knobs, instances=instances, rate_scales=[float(x) for x in scales],
                train=splits["train"], validate=splits["validate"], settings=settings, raw=raw)


def _trace_spec(spec_path: Path, split: str, k: int, entry: Any) -> TraceSpec:
    where = f"traces.{split}[{k}]"
    if isinstance(entry, str):
        entry = {"path": entry}
    if not isinstance(entry, dict) or "path" not in entry or set(entry) - {"path", "name", "part", "limit"}:
        raise _fail(spec_path, f"{where}: a path, or {{path = \"...\", name, part = \"k/n\", limit}}")
    if not isinstance(entry["path"], str) or not entry["path"]:
        raise _fail(spec_path, f"{where}.path must be a string")
    p = Path(entry["path"])
    if not p.is_absolute():
        p = spec_path.parent / p   # relative to the spec, so a spec and its traces travel together
    part = None
    if "part" in entry:
        try:
            a, b = (int(x) for x in str(entry["part"]).split("/"))
            if not 1 <= a <= b:
                raise ValueError
        except ValueError:
            raise _fail(spec_path, f"{where}.part must be \"k/n\" with 1 <= k <= n") from None
        part = (a, b)
    limit = entry.get("limit")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise _fail(spec_path, f"{where}.limit must be an integer of at least 1")
    name = entry.get("name") or (p.name.split(".")[0] + (f"[{part[0]}/{part[1]}]" if part else ""))
    return TraceSpec(name=str(name), path=p, part=part, limit=limit)


def load_traces(spec: Spec) -> dict[str, list[Any]]:
    from kvtop.traces.loader import dense_ids, iter_trace

    out: dict[str, list[Any]] = {}
    cache: dict[Path, list[Any]] = {}
    for t in spec.train + spec.validate:
        if t.path not in cache:
            cache[t.path] = dense_ids(iter_trace(t.path))   # the same results, cheaper to simulate
        reqs = cache[t.path]
        if t.part is not None:
            order: dict[str, int] = {}
            for r in reqs:
                order.setdefault(r.session, len(order))
            k, n = t.part
            reqs = [r for r in reqs if order[r.session] % n == k - 1]
        limit = t.limit or spec.limit
        if limit is not None:
            reqs = reqs[:limit]
        if not reqs:
            raise CliError(f"{spec.path}: trace {t.name} has no requests")
        out[t.name] = reqs
    return out


# -- running ---------------------------------------------------------------------------

def plan(spec: Spec) -> list[Any]:
    """Every task of the sweep, in a fixed order (the SQLite rows follow it)."""
    from kvtop.repeats import Task
    from kvtop.simulate import SimConfig
    from router.features import FEATURE_KNOBS

    features = {k: v for k, v in spec.knobs.items() if k in FEATURE_KNOBS.names()}
    tasks = []
    for n, scale in itertools.product(spec.instances, spec.rate_scales):
        for si, s in enumerate(spec.settings):
            cfg = SimConfig(instances=n, profile=spec.profile, mode=spec.mode,
                            knobs={k: str(v) for k, v in s.knobs.items()}, features=features,
                            path_jitter_s=spec.path_jitter)
            for split, traces in (("train", spec.train), ("validate", spec.validate)):
                for t in traces:
                    for r in range(spec.repeats):
                        tasks.append(Task(t.name, s.policy, cfg, r, spec.jitter, scale,
                                          tag=(si, split, n, scale)))
    return tasks


def rank(spec: Spec, tasks: list[Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per load and setting: train and validate score (mean, 95% half-width over replicas of
    the metric averaged over the split's traces), ranks, best on train, and what the noise
    allows to say: ``rank_moved`` (the ranks differ), ``rank_changed`` (they differ because of
    a swap that is significant on both splits: some other setting is better on one split and
    worse on the other, each by a paired difference across replicas whose 95% interval
    excludes zero), ``train_ties`` / ``validate_ties`` (the settings it cannot be told apart
    from on that split) and ``wide`` (an interval wider than its mean)."""
    from kvtop.repeats import interval

    metric = spec.metric
    cell: dict[tuple, dict[int, list[float]]] = {}   # (si, split, n, scale) -> replica -> values
    for task, row in zip(tasks, rows):
        v = row.get(metric)
        cell.setdefault(task.tag, {}).setdefault(task.replica, []).append(math.inf if v is None else v)
    out = []
    for n, scale in itertools.product(spec.instances, spec.rate_scales):
        load_rows = []
        replicas: dict[tuple[int, str], list[float]] = {}
        for si, s in enumerate(spec.settings):
            entry = {"instances": n, "rate_scale": scale, "setting": s.label, "policy": s.policy,
                     "knobs": json.dumps(s.knobs, sort_keys=True)}
            for split in ("train", "validate"):
                per_replica = [sum(vs) / len(vs) for _, vs in sorted(cell[(si, split, n, scale)].items())]
                replicas[(si, split)] = per_replica
                m, h = interval(per_replica)
                entry[f"{split}_mean"], entry[f"{split}_half"] = m, h
            entry["wide"] = int(any(entry[f"{sp}_half"] > abs(entry[f"{sp}_mean"]) for sp in ("train", "validate")
                                    if math.isfinite(entry[f"{sp}_mean"])))
            load_rows.append(entry)
        for split in ("train", "validate"):
            order = sorted(range(len(load_rows)), key=lambda k: (load_rows[k][f"{split}_mean"], k))
            for pos, k in enumerate(order):
                load_rows[k][f"{split}_rank"] = pos + 1
        # -1 / +1: i significantly better / worse than j on the split; 0: cannot tell
        sign = {(i, j, sp): _paired_sign(replicas[(i, sp)], replicas[(j, sp)])
                for i in range(len(load_rows)) for j in range(len(load_rows)) if i != j
                for sp in ("train", "validate")}
        for i, e in enumerate(load_rows):
            others = [j for j in range(len(load_rows)) if j != i]
            e["best_on_train"] = int(e["train_rank"] == 1)
            e["rank_moved"] = int(e["train_rank"] != e["validate_rank"])
            e["rank_changed"] = int(e["rank_moved"] and any(
                sign[(i, j, "train")] and sign[(i, j, "train")] == -sign[(i, j, "validate")] for j in others))
            for sp in ("train", "validate"):
                e[f"{sp}_ties"] = json.dumps([load_rows[j]["setting"] for j in others if not sign[(i, j, sp)]])
        out.extend(load_rows)
    return out


def _paired_sign(a: list[float], b: list[float]) -> int:
    """-1 when ``a`` is lower than ``b`` (better), +1 when higher, by a paired difference across
    replicas whose 95% interval excludes zero; 0 when the replicas cannot tell them apart (one
    replica never can)."""
    from kvtop.repeats import interval

    diffs = [x - y for x, y in zip(a, b)]
    if len(diffs) < 2 or not all(math.isfinite(d) for d in diffs):
        return 0
    m, h = interval(diffs)
    if m - h > 0:
        return 1
    if m + h < 0:
        return -1
    return 0


def write_db(path: str, spec: Spec, tasks: list[Any], rows: list[dict[str, Any]], ranks: list[dict[str, Any]],
             started: float, wall_s: float, where: str) -> int:
    """The sweep, every task's row and the ranks, in a kvtop database; returns the sweep id."""
    import sqlite_utils

    from store.schema import ensure_schema

    db = sqlite_utils.Database(path)
    ensure_schema(db)   # a kvtop database, so kvtop log sql (and the router's file) take it
    sweeps = db["sweeps"]
    sweeps.insert({"name": spec.name, "spec_path": str(spec.path), "spec": json.dumps(spec.raw),
                   "metric": spec.metric, "started": started, "wall_s": wall_s, "tasks": len(tasks),
                   "settings": len(spec.settings), "ran_on": where}, pk="id")
    sid = sweeps.last_pk
    split_of = {t.name: "train" for t in spec.train} | {t.name: "validate" for t in spec.validate}
    db["sweep_results"].insert_all(
        ({"sweep_id": sid, "setting": spec.settings[t.tag[0]].label, "policy": t.policy,
          "knobs": json.dumps(spec.settings[t.tag[0]].knobs, sort_keys=True), "trace": t.trace,
          "split": split_of[t.trace], "instances": t.config.instances, "rate_scale": t.rate_scale,
          "replica": t.replica, **row} for t, row in zip(tasks, rows)), alter=True)
    db["sweep_ranks"].insert_all(({"sweep_id": sid, **r} for r in ranks), alter=True)
    db.conn.commit()
    db.close()
    return sid


# -- reporting -------------------------------------------------------------------------

def _fmt(metric: str, m: float, h: float) -> str:
    if math.isinf(m):
        return "-"
    wide = " (wide)" if h > abs(m) else ""  # an interval wider than its mean says little
    return (f"{m:.1f} ± {h:.1f}" if metric == "tpot_p90_ms" else f"{m / 1000:.3f} ± {h / 1000:.3f}") + wide


def format_report(spec: Spec, ranks: list[dict[str, Any]], fmt: str = "text") -> str:
    from kvtop.repeats import METRICS
    from kvtop.seedtable import _csv, _grid

    label = dict(METRICS)[spec.metric]
    headers = ["setting", f"train {label}", "rank", f"validate {label}", "rank", "flag"]
    path = f", path ±{spec.path_jitter / 2:g} s" if spec.path_jitter else ""
    out = [f"sweep {spec.name}: {len(spec.settings)} settings, {spec.repeats} replicas (jitter ±{spec.jitter:g} s{path}), "
           f"train {', '.join(t.name for t in spec.train)}; validate {', '.join(t.name for t in spec.validate)}; "
           f"lower {label} is better; ! = rank changes between train and validate (a paired difference "
           f"significant on both), ~ = ranks differ within the noise; (wide) = interval wider than the mean"]
    for n, scale in itertools.product(spec.instances, spec.rate_scales):
        rows = sorted((r for r in ranks if r["instances"] == n and r["rate_scale"] == scale),
                      key=lambda r: r["train_rank"])
        lines = [[r["setting"], _fmt(spec.metric, r["train_mean"], r["train_half"]), str(r["train_rank"]),
                  _fmt(spec.metric, r["validate_mean"], r["validate_half"]), str(r["validate_rank"]),
                  "!" if r["rank_changed"] else ("~" if r["rank_moved"] else "")] for r in rows]
        out.append(f"\n{n} instances, arrival rate x{scale:g}")
        out.append(_csv(headers, lines) if fmt == "csv" else _grid(headers, lines, fmt))
        best = rows[0]
        verdict = ("also best on validate" if best["validate_rank"] == 1
                   else f"rank {best['validate_rank']} of {len(rows)} on validate")
        changed = sum(r["rank_changed"] for r in rows)
        noise = sum(r["rank_moved"] and not r["rank_changed"] for r in rows)
        tie_set = set(json.loads(best["train_ties"]))
        ties = [r["setting"] for r in rows if r["setting"] in tie_set]  # in train-rank order
        tied = (f"; indistinguishable from it on train: {', '.join(ties)}" if ties else "")
        caveat = " (its train interval is wider than its mean)" if best["train_half"] > abs(best["train_mean"]) else ""
        out.append(f"best on train: {best['setting']}{caveat} ({verdict}){tied}; {changed} of {len(rows)} settings "
                   f"change rank significantly" + (f", {noise} more within the noise" if noise else "")
                   + ("" if spec.repeats >= 2 else " (one replica: no difference can be called significant)"))
    return "\n".join(out)


def terminal_plot(spec: Spec, ranks: list[dict[str, Any]], width: int = 100) -> str:
    """Train and validate score of every setting, one bar chart per load (plotext)."""
    import plotext as plt

    from kvtop.repeats import METRICS

    scale_s = 1.0 if spec.metric == "tpot_p90_ms" else 1000.0
    charts = []
    for n, scale in itertools.product(spec.instances, spec.rate_scales):
        rows = [r for r in ranks if r["instances"] == n and r["rate_scale"] == scale]
        plt.clf()
        plt.plotsize(width, max(8, 3 * len(rows) + 6))
        plt.theme("clear")
        vals = [[0.0 if math.isinf(r[f"{s}_mean"]) else r[f"{s}_mean"] / scale_s for r in rows]
                for s in ("train", "validate")]
        plt.simple_multiple_bar([r["setting"] for r in rows], vals, labels=["train", "validate"], width=width,
                                title=f"{dict(METRICS)[spec.metric]}, {n} instances, rate x{scale:g}")
        charts.append(plt.build())
    return "\n".join(charts)


def write_svg(path: str, spec: Spec, ranks: list[dict[str, Any]]) -> None:
    """A horizontal bar chart per load, with an x axis: each setting's train and validate score
    with its 95% interval, best-on-train in bold, rank changes marked; an interval that reaches
    below 0 is cut at the axis and marked (◂). Plain SVG, no plotting library."""
    from html import escape

    from kvtop.repeats import METRICS, svg_axis, svg_clipped_marker, svg_ticks

    scale_s = 1.0 if spec.metric == "tpot_p90_ms" else 1000.0
    unit = "ms" if spec.metric == "tpot_p90_ms" else "s"
    label_w, bar_w, row_h, pad = 330, 420, 16, 8
    colours = {"train": "#3b6ea5", "validate": "#e08a2c"}
    # title, then its key with the legend on a line of their own: nothing drawn over anything
    parts, y = [], 62
    for n, scale in itertools.product(spec.instances, spec.rate_scales):
        rows = sorted((r for r in ranks if r["instances"] == n and r["rate_scale"] == scale),
                      key=lambda r: r["train_rank"])
        ticks = svg_ticks(max((r[f"{s}_mean"] + r[f"{s}_half"] for r in rows for s in colours
                               if not math.isinf(r[f"{s}_mean"])), default=1.0))
        top = ticks[-1] or 1.0
        parts.append(f'<text x="{pad}" y="{y}" font-weight="bold">{escape(dict(METRICS)[spec.metric])} ({unit}), '
                     f'{n} instances, arrival rate x{scale:g}</text>')
        y += 10
        for r in rows:
            name = ("▲ " if r["rank_changed"] else "") + r["setting"]
            weight = ' font-weight="bold"' if r["best_on_train"] else ""
            parts.append(f'<text x="{pad}" y="{y + 2 * row_h - 4}"{weight}>{escape(name)}</text>')
            for k, s in enumerate(colours):
                m, h = r[f"{s}_mean"], r[f"{s}_half"]
                yy = y + k * row_h + 2
                if math.isinf(m):
                    continue
                w = bar_w * m / top
                x0 = label_w + bar_w * max(0.0, m - h) / top
                x1 = label_w + bar_w * (m + h) / top
                parts.append(f'<rect x="{label_w}" y="{yy}" width="{w:.1f}" height="{row_h - 4}" fill="{colours[s]}">'
                             f'<title>{s}: {m / scale_s:.3f} ± {h / scale_s:.3f} {unit}, rank {r[f"{s}_rank"]}'
                             f'{" (the interval reaches below 0: cut at the axis)" if m - h < 0 else ""}'
                             f'</title></rect>')
                parts.append(f'<line x1="{x0:.1f}" x2="{x1:.1f}" y1="{yy + row_h / 2 - 2}" y2="{yy + row_h / 2 - 2}" '
                             f'stroke="black"/>')
                if m - h < 0:
                    parts.append(svg_clipped_marker(label_w, yy + row_h / 2 - 2))
                parts.append(f'<text x="{max(label_w + w, x1) + 6:.1f}" y="{yy + row_h - 6}" font-size="10">'
                             f'{m / scale_s:.3f} (#{r[f"{s}_rank"]})</text>')
            y += 2 * row_h + pad
        parts += svg_axis(label_w, bar_w, ticks, scale_s, unit, y)
        y += 46
    legend = "".join(f'<rect x="{pad + 120 * k}" y="40" width="10" height="10" fill="{c}"/>'
                     f'<text x="{pad + 120 * k + 14}" y="49" font-size="11">{s}</text>'
                     for k, (s, c) in enumerate(colours.items()))
    width = label_w + bar_w + 160
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y}" font-family="sans-serif" '
           f'font-size="12"><rect width="100%" height="100%" fill="white"/>'
           f'<text x="{pad}" y="16" font-size="12" font-weight="bold">sweep {escape(spec.name)}</text>'
           f'<text x="{pad}" y="32" font-size="11">bold = best on train, ▲ = rank changes; bars = mean, '
           f'lines = 95% interval (◂: cut at 0)</text>{legend}{"".join(parts)}</svg>\n')
    Path(path).write_text(svg)


# -- CLI -------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="sweep spec, a TOML file (docs/sweep-example.toml)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="worker processes (default: one per core; with --ray, one actor per CPU of the cluster)")
    p.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="run the tasks on a Ray cluster (host:port of its head, 'auto', or 'local'); needs "
                        "pip install 'kvtop[ray]'. Same results as local")
    p.add_argument("--db", default="kvtop.db", metavar="PATH",
                   help="write the sweep to this kvtop database (tables sweeps, sweep_results, sweep_ranks; "
                        "default kvtop.db; 'none' to skip); read it with kvtop log sql --db PATH")
    p.add_argument("--plot", default=None, metavar="FILE.svg", help="also draw the ranks as an SVG chart")
    p.add_argument("--terminal-plot", choices=("auto", "always", "never"), default="auto",
                   help="bar charts in the terminal (plotext): auto = when stdout is a terminal")
    p.add_argument("--format", choices=("text", "md", "csv"), default="text")
    p.add_argument("--dry-run", action="store_true", help="check the spec and print the plan; run nothing")


def run(args: argparse.Namespace) -> int:
    from kvtop.repeats import run_tasks, task_progress
    from kvtop.simulate import simulate

    if args.workers is not None and args.workers < 1:
        raise CliError("--workers must be at least 1")
    spec = load_spec(args.spec)
    tasks = plan(spec)
    loads = len(spec.instances) * len(spec.rate_scales)
    traces_n = len(spec.train) + len(spec.validate)
    summary = (f"{len(spec.settings)} settings x {loads} loads x {traces_n} traces x {spec.repeats} replicas "
               f"= {len(tasks)} simulations")
    if args.dry_run:
        print(summary)
        for s in spec.settings:
            print(f"  {s.label}")
        return 0
    print(f"sweep {spec.name}: {summary}", file=sys.stderr)   # what it will do, before reading the traces
    traces = load_traces(spec)
    started = time.time()
    try:
        with task_progress(len(tasks), "sweeping") as progress:
            rows = run_tasks(simulate, traces, tasks, args.workers, args.ray, progress)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    wall = time.time() - started
    print(f"simulated {len(tasks)} tasks in {wall:.1f} s wall", file=sys.stderr)
    ranks = rank(spec, tasks, rows)
    print(format_report(spec, ranks, args.format))
    if args.terminal_plot == "always" or (args.terminal_plot == "auto" and sys.stdout.isatty()):
        print(terminal_plot(spec, ranks))
    if args.plot:
        try:
            write_svg(args.plot, spec, ranks)
        except OSError as exc:
            raise CliError(f"cannot write --plot {args.plot}: {exc.strerror or exc}") from None
        print(f"plot: {args.plot}", file=sys.stderr)
    if args.db and args.db != "none":
        sid = write_db(args.db, spec, tasks, rows, ranks, started, wall, args.ray or "local")
        print(f"results: {args.db} (sweep {sid}); e.g. kvtop log sql --db {args.db} "
              f"\"SELECT setting, instances, rate_scale, train_rank, validate_rank FROM sweep_ranks "
              f"WHERE sweep_id = {sid}\"", file=sys.stderr)
    return 0
