"""Query the decision log after (or during) a run. The file is opened read-only.

Several routers' logs read as one: repeat --db (``kvtop log --db r1.db --db r2.db summary``,
or ``kvtop log summary --db r1.db r2.db``). Rows then carry a ``source`` column naming their
file; run-scoped verbs (summary, shadow) merge every file's latest run (--run picks others).

  kvtop log runs                        runs with decision counts, policies and time span
  kvtop log decisions --reason retry    decisions joined with outcomes, newest first
  kvtop log summary [--run RUN]         per policy segment: reasons, classes, latency, hits, KV drift
  kvtop log why REQUEST_ID              one request's receipt: every candidate's terms, outcome
  kvtop log sql "SELECT ..."            any read-only SQL
  kvtop log export --table decisions    a table or query as CSV / JSON lines

Times (--since/--until) take unix seconds, ISO 8601, or 30s / 10m / 2h / 1d ago.
Tables and columns: docs/decision-log.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from typing import Any, Sequence

from kvtop.cli import CliError

DEFAULT_DB = "kvtop.db"
# Columns ``log decisions`` shows as a table (jsonl and csv carry every column).
DECISION_TABLE_COLUMNS = ("ts", "request_id", "attempt", "session_id", "turn", "policy", "instance",
                          "reason", "route_class", "input_tokens", "est_hit_tokens", "best_hit_tokens",
                          "index_source", "delivered_hit_tokens", "status", "ttft_ms", "e2e_ms")
_CELL_MAX = 48
_RUN_HELP = ("run id or unique prefix (default: the latest run); on several logs, each log's latest run "
             "merged as one, or the runs named here, comma-separated")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    db_help = (f"decision log to read (default {DEFAULT_DB}); repeat it, or give several paths after "
               "the command, to read several routers' logs as one")
    # --db works before or after the command: `kvtop log --db X runs` and `kvtop log runs --db X`.
    # Before it, one path per --db (more would swallow the command's name).
    parser.add_argument("--db", dest="parent_db", metavar="PATH", action="append", help=db_help)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--db", metavar="PATH", nargs="+", action="extend", help=db_help)
    sub = parser.add_subparsers(dest="log_cmd", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("runs", parents=[common], help="list runs with decision counts and policies")
    p.add_argument("--format", choices=("table", "jsonl", "csv"), default="table")

    p = sub.add_parser("decisions", parents=[common], help="decisions joined with their outcomes")
    p.add_argument("--run", help="run id or unique prefix, in whichever log holds it (default: every run)")
    p.add_argument("--session", help="session id")
    p.add_argument("--instance", help="chosen instance")
    p.add_argument("--reason", help="reason code, e.g. argmin, retry (docs/policies.md)")
    p.add_argument("--policy", help="policy name or name@version")
    p.add_argument("--class", dest="route_class", help="route class: WARM MEDIUM HEAVY HEAVY+ ...")
    p.add_argument("--since", help="from this time (unix s, ISO 8601, or 10m / 2h ago)")
    p.add_argument("--until", help="up to this time")
    p.add_argument("--limit", type=int, default=100, help="most recent N (default 100; 0: all)")
    p.add_argument("--format", choices=("table", "jsonl", "csv"), default="table")

    p = sub.add_parser("summary", parents=[common], help="per policy segment: reasons, latency, hits, KV drift")
    p.add_argument("--run", help=_RUN_HELP)
    p.add_argument("--instances", action="store_true",
                   help="also each chosen instance's exact share and KV drift (one more pass over the decisions); "
                        "on several logs an instance is its backend URL")
    p.add_argument("--format", choices=("text", "json"), default="text")

    p = sub.add_parser("why", parents=[common], help="why one request went where it did (its receipt)",
                       description="The receipt of one request: each attempt's policy, reason and every "
                                   "candidate's terms, its timeline and its outcome.")
    p.add_argument("request_id", metavar="REQUEST_ID", help="request id or a unique prefix of one")
    p.add_argument("--run", help="run id or unique prefix (default: the latest run with this request, "
                   "in whichever log holds it)")
    p.add_argument("--format", choices=("text", "json"), default="text")

    p = sub.add_parser("shadow", parents=[common], help="per shadow policy and segment: agreement, "
                       "disagreements by class, est. prefill tokens saved or lost",
                       description="What each shadow policy (kvtop route --shadow) would have picked, "
                                   "against the active policy, per policy segment of a run.")
    p.add_argument("--run", help=_RUN_HELP)
    p.add_argument("--format", choices=("table", "jsonl", "csv"), default="table")

    p = sub.add_parser("sql", parents=[common], help="run one read-only SQL statement",
                       description="One read-only statement. On several logs each table name is a view "
                                   "over every file's rows, with a source column naming the file.")
    p.add_argument("query", metavar="SQL", help='e.g. "SELECT reason, count(*) FROM decisions GROUP BY 1"')
    p.add_argument("--param", action="append", default=[], metavar="VALUE",
                   help="bind a ? placeholder (repeat in order)")
    p.add_argument("--format", choices=("table", "jsonl", "csv"), default="table")

    p = sub.add_parser("export", parents=[common], help="write a table or query as CSV or JSON lines")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--table", help="runs, decisions, outcomes, config_events or samples")
    what.add_argument("--query", metavar="SQL", help="a read-only query")
    p.add_argument("--format", choices=("csv", "jsonl"), default="csv")
    p.add_argument("--out", metavar="FILE", help="write here (default stdout)")


def run(args: argparse.Namespace) -> int:
    import sqlite3

    from store import logs
    from store.errors import QueryError

    db = None
    try:
        db = logs.open_logs((args.parent_db or []) + (args.db or []) or [DEFAULT_DB])
        for again, kept in getattr(db, "duplicates", ()):
            print(f"kvtop log: {again} is the same file as {kept}; read once", file=sys.stderr)
        return _COMMANDS[args.log_cmd](db, args)
    except QueryError as exc:
        raise CliError(str(exc)) from None
    except sqlite3.DatabaseError as exc:  # e.g. a file damaged past its first page
        raise CliError(_damaged(db, exc)) from None
    except BrokenPipeError:  # `kvtop log ... | head`: the reader has what it wanted
        # Point stdout at /dev/null so the interpreter's last flush does not fail again (the
        # recipe in Python's signal docs); exit 0 without a word.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _damaged(db, exc: Exception) -> str:
    from store.logs import is_merged

    if db is not None and is_merged(db):
        bad = db.damaged()
        where = (", ".join(bad) + (" is" if len(bad) == 1 else " are")) if bad else "one of the logs is"
        return f"{where} damaged: {exc} (PRAGMA quick_check says more)"
    return f"the log is damaged or unreadable: {exc} (PRAGMA quick_check says more)"


# -- commands -----------------------------------------------------------------------
def _run_policies(run: dict, changes: list[tuple[float, str]]) -> str:
    """The run's policies in version order: the ones that routed, and the ones set without
    traffic, marked (a change made while idle was missing from the list)."""
    routed = set(run["policies"])
    labels = set(routed) | {label for _, label in changes}

    def version(label: str) -> tuple[int, str]:
        head, _, v = label.rpartition("@")
        return (int(v), head) if v.isdigit() else (0, label)

    return " -> ".join(label if label in routed else f"{label} (no traffic)" for label in sorted(labels, key=version))


def _runs(db, args) -> int:
    from store import reads

    rows = reads.runs(db)
    changes = reads.policy_changes(db)
    if args.format != "table":
        for r in rows:
            r["policies_set"] = [label for _, label in changes.get(r["run_id"], [])]
        _emit(rows, args.format)
        return 0
    table = [{
        "run_id": r["run_id"],
        "started": _fmt_ts(r["started_at"] or r["first_ts"]),
        "span": _fmt_span(r["first_ts"], r["last_ts"]),
        "decisions": r["decisions"],
        "policies": _run_policies(r, changes.get(r["run_id"], [])) or r.get("policy") or "",
        **({"source": _tail(r["source"], 200)} if "source" in r else {}),
    } for r in rows]
    if not table:
        print("no runs yet")
        return 0
    print(_table(table, width=200))
    return 0


def _decisions(db, args) -> int:
    from store import logs, reads

    if args.limit < 0:
        raise CliError("--limit must be >= 0 (0: all)")
    rows = reads.decisions(db, run=args.run, session=args.session, instance=args.instance,
                           reason=args.reason, policy=args.policy, route_class=args.route_class,
                           since=args.since, until=args.until, limit=args.limit or None)
    if args.format == "jsonl":
        _emit([logs.decode_json_columns("decisions", r) for r in rows], "jsonl")
        return 0
    if args.format == "csv":
        _emit(rows, "csv")
        return 0
    if not rows:
        print("no decisions match")
        return 0
    shown = []
    for r in rows:
        row = {c: r.get(c) for c in DECISION_TABLE_COLUMNS}
        if "source" in r:  # several logs: the file's name, which its end tells best
            row["source"] = _tail(r["source"])
        row["ts"] = _fmt_ts(r["ts"], millis=True)
        row["policy"] = f"{r['policy']}@{r['policy_version']}"
        shown.append(row)
    print(_table(shown))
    return 0


def _summary(db, args) -> int:
    from store import sessions, summary

    result = summary.summary(db, args.run, instances=args.instances)
    by_segment = sessions.from_db(db, result["run_id"])
    for s in result["segments"]:
        s["sessions"] = sessions.summarize(by_segment.get((s["policy"], s["policy_version"]), []))
    if args.format == "json":
        print(json.dumps(result, indent=2))
        return 0
    print(format_summary(result))
    return 0


def _why(db, args) -> int:
    from kvtop import receipt
    from store import reads

    found = reads.request_attempts(db, args.request_id, run=args.run)
    if args.format == "json":
        print(json.dumps(found, indent=2, default=str))
        return 0
    blocks = []
    for a in found["attempts"]:
        row = {k: v for k, v in a["decision"].items() if k not in ("blocks", "blocks_parent", "source")}
        ev = receipt.from_row(row, a["outcome"])
        blocks.append(receipt.render_text(ev, a["outcome"]))
    if found.get("source"):
        blocks.insert(0, f"from {found['source']} (run {found['run_id']})")
    if found["other_runs"]:
        blocks.append(f"(this request id is also in run {', '.join(found['other_runs'])}: --run picks one)")
    print("\n\n".join(blocks))
    return 0


def _shadow(db, args) -> int:
    from store import logs, reads

    rows = reads.shadow_summary(db, args.run)
    if not rows:
        print("no shadow picks in this run (start the router with --shadow P1,P2, or PUT /kvtop/v1/shadows)")
        return 0
    if args.format != "table":
        _emit(rows, args.format)
        return 0
    out = []
    for r in rows:
        classes = ", ".join(f"{k} {v}" for k, v in sorted(r["disagree_by_class"].items(), key=lambda kv: -kv[1]))
        gap = r["mean_cost_gap"]
        out.append({"segment": r["segment"], "shadow": r["shadow"], "picks": r["picks"],
                    "agreement": _pct(r["agree"], r["picks"]), "disagree by class": classes or "-",
                    "est. prefill saved": f"{r['saved_prefill_tokens'] or 0:+,} tok",
                    "mean score gap": _gap(gap),
                    "pick us": "-" if r["pick_us_mean"] is None else f"{r['pick_us_mean']:.1f}"})
    print(_table(out))
    print("\nest. prefill saved: the shadow's picks' estimated cached tokens minus the real picks', "
          "summed over disagreements (< 0: it would have prefilled more). mean score gap: the real "
          "pick's score minus the shadow's own, in the shadow's units, over disagreements.")
    for note in logs.knob_notes(db):
        print(f"note: {note}")
    return 0


def _gap(gap: float | None) -> str:
    """A score gap in one format down the column: grouped digits, the same decimals whatever
    the size (``5,571.0`` and ``14,280.0``, not ``5571`` beside ``1.428e+04``)."""
    if gap is None:
        return "-"
    return f"{gap:,.1f}" if abs(gap) >= 1 else f"{gap:,.4f}"


def _sql(db, args) -> int:
    from store import sandbox

    cols, rows = sandbox.run_sql(db, args.query, args.param)
    dict_rows = [dict(zip(cols, r)) for r in rows]
    if args.format != "table":
        _emit(dict_rows, args.format, cols)
        return 0
    print(_table(dict_rows, cols) if cols else "ok")
    return 0


def _export(db, args) -> int:
    from store import export

    try:
        n = export.export(db, args.table or args.query, args.format, args.out)
    except BrokenPipeError:
        raise  # stdout's reader went away (`| head`): run() ends quietly
    except OSError as exc:
        raise CliError(f"cannot write {args.out}: {exc.strerror or exc}") from None
    if args.out:
        print(f"wrote {n} rows to {args.out}", file=sys.stderr)
    return 0


_COMMANDS = {"runs": _runs, "decisions": _decisions, "summary": _summary, "why": _why, "shadow": _shadow, "sql": _sql,
             "export": _export}


# -- text ---------------------------------------------------------------------------
def format_summary(result: dict) -> str:
    """The readable report of ``store.summary.summary``: one block per policy segment."""
    lines = [f"run {result['run_id']}: {len(result['segments'])} policy segment(s)"]
    if result.get("sources"):
        n = len(result["sources"])
        what = "routers' logs" if n > 1 else "router's log"
        lines.append(f"  {n} {what} merged: "
                     + ", ".join(f"{s['source']} (run {s['run_id']})" for s in result["sources"]))
    for note in result.get("notes", ()):
        lines.append(f"  note: {note}")
    for gap in result.get("incomplete", ()):
        lines.append("  INCOMPLETE: " + _gap_text(gap))
    if not result["segments"]:
        lines.append("  no decisions in this run")
    for s in result["segments"]:
        n = s["decisions"]
        lines += ["", f"== {s['label']}  {_fmt_ts(s['start_ts'])} .. {_fmt_ts(s['end_ts'])} "
                      f"({_fmt_span(s['start_ts'], s['end_ts'])})",
                  f"  decisions {n:,}  requests {s['requests']:,}  errors {s['errors']:,}"
                  + (f"  cancelled {s['cancelled']:,} (client gone, cut off)" if s.get("cancelled") else "")]
        lines.append("  reasons      " + _shares(s["reasons"], n))
        lines.append("  classes      " + _shares(s["route_classes"], n))
        lines.append("  outcomes     " + _shares(s["statuses"], n))
        for key, name in (("ttft_ms", "TTFT"), ("e2e_ms", "E2E")):
            d = s[key]
            if d["n"]:
                lines.append(f"  {name:<4} ms     p50 {d['p50']:,.1f}  p90 {d['p90']:,.1f}  "
                             f"p99 {d['p99']:,.1f}  (n={d['n']:,} ok)")
            else:
                lines.append(f"  {name:<4} ms     no ok outcomes")
        h = s["hits"]
        lines.append("  hit tokens   " + "  ".join(
            f"{label} {_num(h[total])} (mean {_num(h[mean])})" for label, total, mean in (
                ("est", "est_hit_tokens", "mean_est_hit_tokens"),
                ("best", "best_hit_tokens", "mean_best_hit_tokens"),
                ("delivered", "delivered_hit_tokens", "mean_delivered_hit_tokens"))))
        if h["input_tokens"]:
            lines.append(f"               est/input {_pct(h['est_hit_tokens'], h['input_tokens'])}  "
                         f"best/input {_pct(h['best_hit_tokens'], h['input_tokens'])}  "
                         f"delivered reported for {h['delivered_reported']:,} of {n:,} decisions")
        lines.append(f"  regret       routing (best-est) {_num(h['routing_regret'])} "
                     f"(mean {_num(h['mean_routing_regret'])})  "
                     f"estimate error (est-delivered) {_num(h['estimate_error'])} "
                     f"(mean {_num(h['mean_estimate_error'])})")
        ses = s.get("sessions")
        if ses and ses["sessions"]:
            def sec(fig: str, stat: str) -> str:
                v = ses[fig][stat]
                return "-" if v is None else f"{v:,.1f}"
            lines.append(f"  sessions     {ses['sessions']:,} ({ses['requests']:,} requests), first arrival to "
                         f"last answer: mean {sec('completion_s', 'mean')} p50 {sec('completion_s', 'p50')} "
                         f"p90 {sec('completion_s', 'p90')} max {sec('completion_s', 'max')} s")
            lines.append(f"               in the fleet mean {sec('fleet_s', 'mean')} p90 {sec('fleet_s', 'p90')} s  "
                         f"client's own (between turns) mean {sec('client_s', 'mean')} p90 {sec('client_s', 'p90')} s")
        if "kv" in s:
            lines += _kv_lines(s["kv"], result.get("predate_index_source") or [])
    return "\n".join(lines)


def _gap_text(gap: dict) -> str:
    """One span the log is known to miss rows in (store/summary.py ``log_gaps``)."""
    if gap["kind"] == "dropped":
        tables = ", ".join(f"{k:,} {t}" for t, k in gap["by_table"].items())
        return (f"{gap['rows']:,} rows dropped between {_fmt_ts(gap['from'])} and {_fmt_ts(gap['to'])} "
                f"({_fmt_span(gap['from'], gap['to'])}; {tables}): the writer's queue was full, "
                f"figures over that span miss them")
    return (f"run {gap['run_id']} has no recorded end (still running, or killed): after a kill the rows "
            f"still queued are lost, so requests answered shortly before its last decision "
            f"({_fmt_ts(gap.get('from'))}) may have no row (docs/reliability.md bounds how many)")


def _kv_lines(kv: dict, older: Sequence[str] = ()) -> list[str]:
    """Exact (KV-event) hits and the estimate's drift from them, per segment and instance.
    ``older``: on several logs, the files that predate index_source (their decisions have no
    recorded source and are left out of the exact share)."""
    if kv["exact"] is None:
        return ["  KV drift     n/a (this log predates index_source)"]
    if kv["recorded"] == kv["decisions"]:
        lines = [f"  index        exact {kv['exact']:,} of {kv['decisions']:,} decisions "
                 f"({_pct(kv['exact'], kv['decisions'])})"]
    else:
        unknown = kv["decisions"] - kv["recorded"]
        why = f"from {', '.join(older)}, which predate{'s' if len(older) == 1 else ''} index_source" if older \
            else "with no index_source"
        lines = [f"  index        exact {kv['exact']:,} of {kv['recorded']:,} decisions with a recorded source "
                 f"({_pct(kv['exact'], kv['recorded'])}; {unknown:,} {why})"]
    lines.append("  KV drift     " + _drift_text(kv))
    if kv.get("instances"):  # --instances
        shown = [str(r["instance"]) + (f" ({', '.join(r['names'])})" if r.get("names") else "")
                 for r in kv["instances"]]
        width = max(len(n) for n in shown)
        for name, r in zip(shown, kv["instances"]):
            lines.append(f"    {name:<{width}}  exact {r['exact']:,}/{r['recorded']:,} "
                         f"({_pct(r['exact'], r['recorded'])})  drift {_drift_text(r)}")
    return lines


def _drift_text(kv: dict) -> str:
    if kv["drift_decisions"] is None:
        return "n/a (this log has no estimate_hit_tokens column)"
    if kv["drift"] is None:
        return "n/a (no exact decision with the estimate recorded)"
    return (f"{100 * kv['drift']:.2f}% of input tokens (over {100 * kv['over']:.2f}%, "
            f"under {100 * kv['under']:.2f}%) over {kv['drift_decisions']:,} exact decisions")


def _shares(counts: dict[str, int], total: int) -> str:
    if not counts:
        return "-"
    return "  ".join(f"{k} {v:,} ({100 * v / total:.1f}%)" if total else f"{k} {v:,}"
                     for k, v in counts.items())


def _num(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not v.is_integer():
        return f"{v:,.1f}"
    return f"{int(v):,}"


def _pct(a: Any, b: Any) -> str:
    return "-" if a is None or not b else f"{100 * a / b:.1f}%"


def _fmt_ts(ts: float | None, millis: bool = False) -> str:
    if ts is None:
        return "-"
    text = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
    return f"{text}.{int(ts % 1 * 1000):03d}" if millis else text


def _fmt_span(t0: float | None, t1: float | None) -> str:
    if t0 is None or t1 is None:
        return "-"
    s = max(0.0, t1 - t0)
    if s < 120:
        return f"{s:.1f}s"
    if s < 7200:
        return f"{s / 60:.1f}m"
    return f"{s / 3600:.1f}h"


def _tail(text: str, width: int = _CELL_MAX) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1):]


def _cell(v: Any, width: int = _CELL_MAX) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        text = f"{v:.1f}" if abs(v) < 1e9 else f"{v:.3f}"
    else:
        text = str(v).replace("\n", " ")
    return text if len(text) <= width else text[:width - 1] + "…"


def _table(rows: Sequence[dict], cols: Sequence[str] | None = None, width: int = _CELL_MAX) -> str:
    cols = list(cols or (rows[0].keys() if rows else ()))
    cells = [[_cell(r.get(c), width) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    numeric = [all(isinstance(r.get(c), (int, float)) or r.get(c) is None for r in rows) for c in cols]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [line(cols), line(["-" * w for w in widths])]
    out += [line(row) for row in cells]
    if not rows:
        out.append("(no rows)")
    return "\n".join(out)


def _emit(rows: Sequence[dict], fmt: str, cols: Sequence[str] | None = None) -> None:
    if fmt == "jsonl":
        for r in rows:
            sys.stdout.write(json.dumps(r, default=str) + "\n")
        return
    cols = list(cols or (rows[0].keys() if rows else ()))
    w = csv.writer(sys.stdout)
    w.writerow(cols)
    for r in rows:
        w.writerow([json.dumps(v) if isinstance(v, (list, dict)) else v for v in (r.get(c) for c in cols)])
