"""The seed table and per-class TTFT, one row per arm, from replay results or a decision log.

Each results file (``kvtop replay --out``) is one arm, labelled by its header's ``arm`` or its
file name; ``--db`` adds one arm per policy segment of a run in the decision log. Several
``--db`` (one log per router in front of the same fleet) are read as one log: each log's
latest run merged, so every figure is over the routers' requests together. The arithmetic
lives in ``kvtop.seedtable``.

  kvtop report lmetric.jsonl unified.jsonl --format md --plot
  kvtop report --db router1.db --db router2.db
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtop import seedtable

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="*", metavar="RESULTS",
                   help="results files written by kvtop replay (one arm each)")
    p.add_argument("--db", metavar="FILE", action="append",
                   help="also report the arms of a decision log (kvtop.db); repeat it for several routers' "
                        "logs, read as one")
    p.add_argument("--run", metavar="RUN_ID",
                   help="with --db: this run (default: the latest; with several logs, each log's latest "
                        "merged, or the runs named here, comma-separated)")
    p.add_argument("--format", choices=("text", "md", "csv"), default="text",
                   help="table format (default text)")
    p.add_argument("--plot", action="store_true",
                   help="draw TTFT CDFs per arm in the terminal (after the tables)")
    p.add_argument("--out", metavar="FILE", help="write the tables to FILE instead of stdout")
    p.add_argument("--kv-tokens", metavar="N", type=int,
                   help="the fleet's KV cache in tokens, all instances together, for the capacity ceiling "
                        "(default: from a kvtop simulate results header, instances x the profile's KV)")


@dataclass
class Arm:
    """One arm: its figures come from ``columns``; ``records`` are read only to plot."""

    label: str
    columns: seedtable.RequestColumns
    apc: dict[str, Any] | None = None  # engine counters {queries, hits} or {value, source}
    load_records: Callable[[], Sequence[Mapping[str, Any]]] | None = None
    #: requests cut off by their client (a decision log's ``client_gone``), not in the figures
    cancelled: int = 0
    #: the arm's agent sessions (store.sessions), for the session table; None: not known
    sessions: list | None = None
    #: the prefix ceiling of its traffic (kvtop/ceiling.py), for the APC column; None: not known
    ceiling: float | None = None
    #: results files: the header and the trace's requests they replayed (the gap table), if known
    header: dict[str, Any] | None = None
    trace: Sequence[Any] | None = None
    #: decision-log arms: (log path, run id, policy) for the gap table (kvtop/cachegap.py)
    log: tuple[str, str | None, str] | None = None

    @property
    def requests(self) -> int:
        return self.columns.counts()[0]

    @property
    def records(self) -> Sequence[Mapping[str, Any]]:
        if isinstance(self.columns, seedtable.RecordColumns):
            return self.columns.records
        return self.load_records() if self.load_records else []


def load_results(path: str) -> Arm:
    """One arm from a results file; raises CliError on a missing or foreign file."""
    from kvtop.cli import CliError

    if not os.path.exists(path):
        raise CliError(f"results file not found: {path}")
    records: list[dict[str, Any]] = []
    header: dict[str, Any] | None = None
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError:
                    raise CliError(f"{path}:{lineno}: not JSON") from None
                if header is None:
                    if not isinstance(obj, dict) or "kvtop_results" not in obj:
                        raise CliError(f"{path} is not a kvtop results file "
                                       "(no kvtop_results header; write it with kvtop replay)")
                    header = obj
                    continue
                if isinstance(obj, dict):
                    records.append(obj)
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {path}: {exc}") from None
    if header is None:
        raise CliError(f"{path} is empty")
    base = os.path.basename(path)
    label = header.get("arm") or (base[:-6] if base.endswith(".jsonl") else base)
    from store import sessions

    from kvtop import ceiling

    return Arm(str(label), seedtable.RecordColumns(records), header.get("engine_prefix_cache"),
               sessions=sessions.from_records(records),
               ceiling=ceiling.of_trace_file(header.get("trace"), len(records)), header=header,
               trace=ceiling.trace_requests(header.get("trace"), len(records)))


def fleet_kv_tokens(header: Mapping[str, Any] | None) -> int | None:
    """The fleet's KV tokens a ``kvtop simulate`` results header implies (its instances x its
    profile's KV); None for other producers or an unknown profile."""
    if not header:
        return None
    target, n = header.get("target"), header.get("instances")
    if not isinstance(target, str) or not target.startswith("simulate:") or not isinstance(n, int):
        return None
    from kvtop.sim.profiles import get_profile

    try:
        return n * get_profile(target.split(":", 1)[1]).kv_capacity_tokens
    except (KeyError, ValueError, OSError):
        return None


def gap_table(arms: Sequence[Arm], fmt: str, kv_tokens: int | None = None) -> str:
    """Where each results-file arm's gap to the ceiling went (kvtop/cachegap.py), with APC
    against the capacity ceiling too; empty when no arm's trace and instances are known."""
    from kvtop import cachegap

    rows = []
    cap = None
    ceil = kv = None
    logs: dict[tuple[str, str | None], tuple] = {}
    for a in arms:
        if a.log is not None:   # a decision log's policy segment: its run split once, per policy
            path, run, policy = a.log
            if (path, run) not in logs:
                logs[(path, run)] = cachegap.log_gaps(path, run, kv_tokens)
            gaps, log_ceiling, cap = logs[(path, run)]
            if policy in gaps:
                kv = kv_tokens
                rows.append((a.label, gaps[policy], cap))
                ceil = log_ceiling
            continue
        if a.trace is None or not any(r.get("instance") for r in a.records):
            continue
        kv = kv_tokens or fleet_kv_tokens(a.header)
        cap = cachegap.timed_capacity_ceiling(a.trace, a.records, kv) if kv else None
        rows.append((a.label, cachegap.decompose(a.trace, a.records), cap))
        ceil = a.ceiling
    if not rows:
        return ""
    return cachegap.format_gaps(rows, ceil, kv, fmt)


def load_db_arms(db_paths: str | Sequence[str], run_id: str | None) -> list[Arm]:
    """The arms of one decision log, or of several read as one (``store.logs.open_logs``)."""
    import sqlite3

    from kvtop.cli import CliError

    paths = [db_paths] if isinstance(db_paths, str) else list(db_paths)
    for path in paths:
        if not os.path.exists(path):
            raise CliError(f"database not found: {path}")
    try:
        from store.arms import arms_from_db
    except ImportError:
        raise CliError("--db needs store.arms.arms_from_db, which this build lacks; "
                       "report from results files instead") from None
    db = None
    try:
        if len(paths) == 1:
            arms = arms_from_db(paths[0], run_id)
        else:
            from store.logs import open_logs

            db = open_logs(paths)
            for again, kept in getattr(db, "duplicates", ()):
                print(f"kvtop report: {again} is the same file as {kept}; read once", file=sys.stderr)
            arms = arms_from_db(db, run_id)
            from store.logs import knob_notes

            for note in knob_notes(db):
                print(f"kvtop report: {note}", file=sys.stderr)
        by_segment = _db_sessions(db if db is not None else paths[0], arms)
    except LookupError as exc:  # e.g. an unknown run id, a damaged or locked file
        raise CliError(str(exc).strip("'\"")) from None
    except sqlite3.DatabaseError as exc:  # damaged past the pages opening it reads
        bad = db.damaged() if hasattr(db, "damaged") else paths
        raise CliError(f"{', '.join(bad) or ', '.join(paths)} damaged or unreadable: {exc}") from None
    # The prefix ceiling per policy, from one log's block chains (several logs: not merged here).
    from kvtop import ceiling

    ceilings = ceiling.of_log(paths[0], run_id) if len(paths) == 1 else {}
    # A log's arm answers the seed table from SQL (``columns``); its records, a dict per
    # request, are built only if --plot asks. Stand-ins without ``columns`` give records.
    return [Arm(a.label, getattr(a, "columns", None) or seedtable.RecordColumns(a.records), a.apc,
                lambda a=a: a.records, getattr(a, "cancelled", 0),
                by_segment.get((getattr(a, "run_id", None), getattr(a, "policy", None),
                                getattr(a, "policy_version", None))),
                ceilings.get(getattr(a, "policy", None)),
                log=(paths[0], run_id, a.policy) if len(paths) == 1 and getattr(a, "policy", None) else None)
            for a in arms]


def logged_gaps(pairs: Sequence[tuple[str, str]], kv_tokens: int | None, fmt: str = "text") -> str:
    """The gap table of live arms, placement from their decision logs: ``pairs`` of (results
    file, decision log) of kvtop arms (``benchmarks/peers/run.py`` writes both per arm)."""
    from kvtop import cachegap

    rows = []
    ceiling = None
    for results, db in pairs:
        arm = load_results(results)
        if arm.trace is None:
            continue
        records = arm.records
        cap = cachegap.timed_capacity_ceiling(arm.trace, records, kv_tokens) if kv_tokens else None
        rows.append((arm.label, cachegap.decompose(arm.trace, records, cachegap.decision_rows(db)), cap))
        ceiling = arm.ceiling
    return cachegap.format_gaps(rows, ceiling, kv_tokens, fmt) if rows else ""


def _db_sessions(db: Any, arms: Sequence[Any]) -> dict[tuple, list]:
    """Each db arm's sessions, keyed by (run, policy, version); empty for arms without a run.
    ``db``: the merged logs the arms came from (scoped to their run), or the one log's path."""
    from store import sessions

    runs = {a.run_id for a in arms if getattr(a, "run_id", None)}
    if not runs:
        return {}
    if not hasattr(db, "conn"):
        from store.logs import open_logs

        db = open_logs(db)
    out: dict[tuple, list] = {}
    for run_id in runs:
        for (policy, version), items in sessions.from_db(db, run_id).items():
            out[(run_id, policy, version)] = items
    return out


def _unique_labels(arms: list[Arm]) -> None:
    seen: dict[str, int] = {}
    for arm in arms:
        n = seen.get(arm.label, 0)
        seen[arm.label] = n + 1
        if n:
            arm.label = f"{arm.label}#{n + 1}"


def render(arms: Sequence[Arm], fmt: str = "text", kv_tokens: int | None = None) -> str:
    """The seed table, the per-class TTFT table, then (when known) the session table and where
    the gap to the ceiling went, in ``fmt``."""
    from store.sessions import summarize

    seed = [(a.label, seedtable.seed_row(a.columns, a.apc, ceiling=a.ceiling)) for a in arms]
    classes = [(a.label, seedtable.class_rows(a.columns)) for a in arms]
    seed_text = seedtable.format_seed_table(seed, fmt)
    class_text = seedtable.format_class_table(classes, fmt)
    ses = [(a.label, summarize(a.sessions)) for a in arms if a.sessions]
    ses_text = seedtable.format_session_table(ses, fmt) if ses else ""
    gap_text = gap_table(arms, fmt, kv_tokens)
    if fmt == "csv":  # two (three, four) CSV tables, separated by a blank line
        return (seed_text + "\n\n" + class_text + "\n" + (f"\n{ses_text}\n" if ses_text else "")
                + (f"\n{gap_text}\n" if gap_text else ""))
    cut = [f"{a.label} {a.cancelled:,}" for a in arms if a.cancelled]
    note = ("\n\ncancelled (cut off by their client, e.g. a run stopped mid-way; not counted as "
            "requests or errors): " + ", ".join(cut)) if cut else ""
    if fmt == "md":
        tail = f"\n## Sessions (first arrival to last answer)\n\n{ses_text}\n" if ses_text else ""
        if gap_text:
            tail += f"\n## Where the gap to the prefix ceiling went\n\n{gap_text}\n"
        return f"## Seed table\n\n{seed_text}{note}\n\n## TTFT by route class\n\n{class_text}\n{tail}"
    tail = f"\nSessions (first arrival to last answer; fleet: a request in flight; client: between turns)\n{ses_text}\n" \
        if ses_text else ""
    if gap_text:
        tail += f"\nWhere the gap to the prefix ceiling went (share of input tokens)\n{gap_text}\n"
    return f"{seed_text}{note}\n\nTTFT by route class\n{class_text}\n{tail}"


def cdf_points(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """Sorted values and their empirical CDF (i / n), for plotting."""
    xs = sorted(values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def plot_ttft_cdfs(arms: Sequence[Arm]) -> str:
    """TTFT CDFs per arm as terminal text (plotext); seconds on a log axis when they span 100x."""
    import plotext as plt

    plt.clear_figure()
    tty = sys.stdout.isatty()
    if not tty:
        plt.theme("clear")  # no escape codes in files and pipes
    # Colour is not the only signal: without a TTY each arm gets its own marker character.
    markers = ["braille"] if tty else ["dot", "x", "+", "o", "*", "#", "@", "%"]
    lo, hi = float("inf"), 0.0
    drawn = 0
    for i, arm in enumerate(arms):
        ttft = [r["ttft_ms"] / 1000 for r in arm.records
                if r.get("status") == "ok" and r.get("ttft_ms") is not None]
        if not ttft:
            continue
        xs, ys = cdf_points(ttft)
        lo, hi = min(lo, xs[0]), max(hi, xs[-1])
        plt.plot(xs, ys, label=arm.label, marker=markers[i % len(markers)])
        drawn += 1
    if not drawn:
        return "(no TTFT to plot)\n"
    if lo > 0 and hi / lo >= 100:
        plt.xscale("log")
    plt.title("TTFT CDF")
    plt.xlabel("TTFT (s)")
    plt.ylabel("fraction of requests")
    plt.ylim(0, 1)
    width = min(os.get_terminal_size(sys.stdout.fileno()).columns, 120) if tty else 100
    plt.plotsize(width, 24)
    text = plt.build()
    if not tty:  # plotext still ends lines with a reset code
        text = "\n".join(line.rstrip() for line in _ANSI.sub("", text).splitlines())
    return text + "\n"


def run(args: argparse.Namespace) -> int:
    from kvtop.cli import CliError

    if args.run and not args.db:
        raise CliError("--run needs --db")
    if not args.results and not args.db:
        raise CliError("give one or more results files, or --db FILE")
    arms = [load_results(path) for path in args.results]
    if args.db:
        arms += load_db_arms(args.db, args.run)
    empty = [a.label for a in arms if not a.requests]
    arms = [a for a in arms if a.requests]
    if not arms:
        sources = ", ".join(args.results + (args.db or []))
        raise CliError(f"no request records in {sources}: nothing to report")
    if empty:
        print(f"kvtop report: no request records for {', '.join(empty)}; left out",
              file=sys.stderr)
    _unique_labels(arms)
    if args.kv_tokens is not None and args.kv_tokens < 1:
        raise CliError("--kv-tokens must be at least 1")
    text = render(arms, args.format, args.kv_tokens)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    if args.plot:
        sys.stdout.write("\n" + plot_ttft_cdfs(arms))
    return 0
