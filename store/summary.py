"""Per policy segment of a run: counts by reason, route class and outcome status, latency
percentiles, the three-way hit accounting and KV-event drift (``kvtop log summary``).

Percentiles are ``store.stats``'s, the one every kvtop figure uses.
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import sqlite_utils

from store import merge
from store.logs import (CANCELLED, SEP, as_db, db_file, each_run, fetch_dicts, gathered, is_flat, is_merged,
                        knob_notes, open_readonly, run_filter, scope, segment_label)
from store.stats import ranked_percentile

PERCENTILES = (50, 90, 99)


def _dist(values: list[float]) -> dict:
    values.sort()
    out = {"n": len(values)}
    for q in PERCENTILES:
        out[f"p{q}"] = ranked_percentile(len(values), q, lambda lo, hi: (values[lo], values[hi]))
    return out


def _counts(concat: str | None, total: int) -> dict[str, int]:
    counts = Counter(concat.split(SEP)) if concat else Counter()
    missing = total - sum(counts.values())
    if missing:
        counts["(none)"] = missing
    return dict(counts.most_common())


def _done(value: Any) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def _mean(total: float | None, n: int) -> float | None:
    return None if not n or total is None else total / n

def _ranked_dist(conn: sqlite3.Connection, col: str, run_id: str, policy: str, version: int | None,
                 n: int | None) -> dict:
    """``_dist`` of a segment's ok ``col`` values without fetching them: each percentile reads
    its two neighbouring ranks from the (run, policy, version, status, col) index, walking in
    from the nearer end. ``store.stats.ranked_percentile``, as ``_dist``: the same numbers exactly."""
    where = (f"FROM outcomes WHERE run_id = ? AND policy IS ? AND policy_version IS ? "
             f"AND status = 'ok' AND {col} IS NOT NULL ORDER BY {col}")
    if n is None:  # count them on the index
        n = conn.execute(f"SELECT count(*) {where}", (run_id, policy, version)).fetchone()[0]

    def ranks(lo: int, hi: int) -> tuple[float, float]:
        params = (run_id, policy, version, hi - lo + 1)
        if lo < n - 1 - hi:
            got = [v for (v,) in conn.execute(f"SELECT {col} {where} LIMIT ? OFFSET ?", (*params, lo))]
        else:
            got = [v for (v,) in conn.execute(f"SELECT {col} {where} DESC LIMIT ? OFFSET ?",
                                              (*params, n - 1 - hi))][::-1]
        return got[0], got[-1]

    out: dict = {"n": n}
    for q in PERCENTILES:
        out[f"p{q}"] = ranked_percentile(n, q, ranks)
    return out

def summary(db: sqlite_utils.Database | str | Path, run_id: str | None = None, *,
            instances: bool = False) -> dict:
    """Per policy segment of a run (latest when None): counts by reason, route class and
    outcome status; TTFT and E2E p50/p90/p99 of ``ok`` attempts; three-way hit accounting.

    Hit accounting, per decision: routing regret = best - est (cache the router left on
    another instance); estimate error = est - delivered, over decisions whose engine reported
    ``delivered_hit_tokens`` (NULL ones are left out of both sides).
    """
    db = as_db(db)
    db, run_id = scope(db, run_id)
    # Two ordered passes over the run, both in policy-index order so GROUP BY needs no sort:
    # the decisions alone, and decisions joined with outcomes. They run at once on two
    # connections (SQLite lets go of the GIL). Categorical counts come back as
    # separator-joined text and latencies as JSON arrays, so Python counts and sorts in C.
    # Each statement is built for one file and its run (``gathered``: on several logs, each
    # file answers for its own run through its own indexes, and the groups add up).
    clauses: dict[tuple[int, str], str] = {}

    def clause(d: sqlite_utils.Database, rid: str, alias: str = "d") -> str:  # once per file and run
        if (id(d), rid) not in clauses:
            clauses[(id(d), rid)] = run_filter(d, rid)
        return clauses[(id(d), rid)].replace("d.", f"{alias}.")
    def decision_sql(d: sqlite_utils.Database, rid: str) -> str:
        return f"""SELECT d.policy, d.policy_version, count(*) AS decisions,
        sum(d.attempt = 1) AS requests, min(d.ts) AS start_ts, max(d.ts) AS end_ts,
        group_concat(d.reason, char(31)) AS reasons, group_concat(d.route_class, char(31)) AS classes,
        sum(d.input_tokens) AS input_tokens, sum(d.est_hit_tokens) AS est, sum(d.best_hit_tokens) AS best,
        count(d.est_hit_tokens) AS n_est, count(d.best_hit_tokens) AS n_best,
        sum(d.best_hit_tokens - d.est_hit_tokens) AS regret,
        count(d.best_hit_tokens - d.est_hit_tokens) AS n_regret
        , {_kv_sql(d, "d.")}
        FROM decisions d WHERE {clause(d, rid)} GROUP BY d.policy, d.policy_version"""
    flat = is_flat(db, run_id)
    if flat:  # every outcome knows its segment and its decision's estimate: no join
        def outcome_sql(d: sqlite_utils.Database, rid: str) -> str:
            return """SELECT policy, policy_version, count(*) AS n_outcomes, sum(status = 'ok') AS n_ok,
            sum(delivered_hit_tokens) AS delivered, count(delivered_hit_tokens) AS n_delivered,
            sum(est_hit_tokens - delivered_hit_tokens) AS est_error,
            count(est_hit_tokens - delivered_hit_tokens) AS n_est_error,
            sum(status = 'ok' AND ttft_ms IS NOT NULL) AS ttft, NULL AS e2e
            FROM outcomes o WHERE run_id = ? GROUP BY policy, policy_version"""  # one covering-index pass

        def failure_sql(d: sqlite_utils.Database, rid: str) -> str:
            return f"""SELECT policy, policy_version, status, count(*) AS n FROM outcomes o
            WHERE {clause(d, rid, "o")} AND status IS NOT 'ok' GROUP BY policy, policy_version, status"""
    else:
        def outcome_sql(d: sqlite_utils.Database, rid: str) -> str:
            return f"""SELECT d.policy, d.policy_version, count(*) AS n_outcomes, sum(o.status = 'ok') AS n_ok,
            sum(o.delivered_hit_tokens) AS delivered, count(o.delivered_hit_tokens) AS n_delivered,
            sum(d.est_hit_tokens - o.delivered_hit_tokens) AS est_error,
            count(d.est_hit_tokens - o.delivered_hit_tokens) AS n_est_error
            FROM decisions d JOIN outcomes o
              ON o.request_id = d.request_id AND o.attempt = d.attempt AND +o.run_id = d.run_id
            WHERE {clause(d, rid)} GROUP BY d.policy, d.policy_version"""

        # Latencies fetched as numbers (JSON text would round them to 15 digits), sorted in Python.
        def latency_sql(d: sqlite_utils.Database, rid: str) -> str:
            return f"""SELECT d.policy, d.policy_version, o.ttft_ms, o.e2e_ms
            FROM decisions d JOIN outcomes o
              ON o.request_id = d.request_id AND o.attempt = d.attempt AND +o.run_id = d.run_id
            WHERE {clause(d, rid)} AND o.status = 'ok'"""

        # Failures are few: count them from the outcomes side, joining only those rows
        # (CROSS JOIN keeps SQLite from putting decisions on the outside).
        def failure_sql(d: sqlite_utils.Database, rid: str) -> str:
            return f"""SELECT d.policy, d.policy_version, o.status, count(*) AS n
            FROM outcomes o CROSS JOIN decisions d
              ON d.request_id = o.request_id AND d.attempt = o.attempt AND +d.run_id = o.run_id
            WHERE {clause(d, rid, "o")} AND o.status IS NOT 'ok'
            GROUP BY d.policy, d.policy_version, o.status"""

    def decision_side() -> dict:
        path = db_file(db)
        own = open_readonly(path) if path else db
        try:
            out = {}
            for r in gathered(own, run_id, decision_sql, ("policy", "policy_version")):
                r["reasons"] = _counts(r["reasons"], r["decisions"])
                r["classes"] = _counts(r["classes"], r["decisions"])
                out[(r["policy"], r["policy_version"])] = r
            return out
        finally:
            if own is not db:
                own.conn.close()

    with ThreadPoolExecutor(1) as pool:
        # In memory there is one connection to share: read the decisions first.
        future = pool.submit(decision_side) if db_file(db) else _done(decision_side())
        by_segment = {}
        latencies: dict[tuple, tuple[list, list]] = {}
        if not flat:
            for d, rid in each_run(db, run_id):
                for pol, ver, ttft, e2e in d.conn.execute(latency_sql(d, rid), (rid,)):
                    ttfts, e2es = latencies.setdefault((pol, ver), ([], []))
                    if ttft is not None:
                        ttfts.append(ttft)
                    if e2e is not None:
                        e2es.append(e2e)
        for r in gathered(db, run_id, outcome_sql, ("policy", "policy_version")):
            key = (r["policy"], r["policy_version"])
            if flat:  # r[col] is the count; the index gives the ranks
                if is_merged(db):  # count on each file's index, not by walking the union
                    r["e2e"] = sum(d.conn.execute(
                        "SELECT count(*) FROM outcomes WHERE run_id = ? AND policy IS ? AND policy_version IS ? "
                        "AND status = 'ok' AND e2e_ms IS NOT NULL", (rid, *key)).fetchone()[0]
                        for d, rid in each_run(db, run_id))
                # Ranks through the views of several logs: SQLite merges the files' index orders.
                for col in ("ttft", "e2e"):
                    r[col] = _ranked_dist(db.conn, f"{col}_ms", run_id, *key, r[col])
            else:
                ttfts, e2es = latencies.get(key, ([], []))
                r["ttft"], r["e2e"] = _dist(ttfts), _dist(e2es)
            r["statuses"] = {}
            by_segment[key] = r
        for r in gathered(db, run_id, failure_sql, ("policy", "policy_version", "status")):
            seg = by_segment.get((r["policy"], r["policy_version"]))
            if seg is not None:
                seg["statuses"][r["status"] or "(none)"] = r["n"]
        dec = future.result()
    empty = {"n_outcomes": 0, "n_ok": 0, "delivered": None, "n_delivered": 0, "est_error": None, "n_est_error": 0,
             "ttft": _dist([]), "e2e": _dist([]), "statuses": {}}
    segs = []
    for key, r in dec.items():
        o = by_segment.get(key, empty)
        n = r["decisions"]
        counts = Counter({"ok": o["n_ok"] or 0, **o["statuses"], "no_outcome": n - o["n_outcomes"]})
        statuses = {k: v for k, v in counts.most_common() if v}
        segs.append({
            "label": segment_label(db, r["policy"], r["policy_version"]),
            "policy": r["policy"], "policy_version": r["policy_version"],
            "start_ts": r["start_ts"], "end_ts": r["end_ts"],
            "decisions": n, "requests": r["requests"],
            "reasons": r["reasons"],
            "route_classes": r["classes"],
            "statuses": statuses,
            # A request whose client went away (an agent's Esc, a replay or demo stopped
            # mid-run) was cut off, not failed: counted apart, as kvtop attach counts it.
            "errors": sum(v for k, v in statuses.items() if k not in ("ok", "no_outcome", *CANCELLED)),
            "cancelled": sum(statuses.get(k, 0) for k in CANCELLED),
            "ttft_ms": o["ttft"],
            "e2e_ms": o["e2e"],
            "hits": {
                "input_tokens": r["input_tokens"],
                "est_hit_tokens": r["est"], "best_hit_tokens": r["best"],
                "delivered_hit_tokens": o["delivered"], "delivered_reported": o["n_delivered"],
                "mean_est_hit_tokens": _mean(r["est"], r["n_est"]),
                "mean_best_hit_tokens": _mean(r["best"], r["n_best"]),
                "mean_delivered_hit_tokens": _mean(o["delivered"], o["n_delivered"]),
                "routing_regret": r["regret"],
                "mean_routing_regret": _mean(r["regret"], r["n_regret"]),
                "estimate_error": o["est_error"],
                "mean_estimate_error": _mean(o["est_error"], o["n_est_error"]),
            },
            "kv": _kv_figures(n, *(r[c] for c in _KV_COLUMNS), **_kv_has(db)),
        })
    if instances:  # a second pass, grouped by instance too: about 1 s per million decisions
        kv = kv_drift(db, run_id)
        for seg in segs:
            seg["kv"]["instances"] = kv.get((seg["policy"], seg["policy_version"]), {}).get("instances", [])
    segs.sort(key=lambda s: (s["start_ts"], s["policy_version"] or 0))
    out = {"run_id": run_id, "segments": segs, "incomplete": log_gaps(db, run_id)}
    if is_merged(db):
        out["sources"] = [{"source": source, "run_id": r} for source, r in db.runs]
        out["notes"] = knob_notes(db)
        out["predate_index_source"] = db.lacking("decisions", "index_source")
    return out


def log_gaps(db: sqlite_utils.Database, run_id: str) -> list[dict]:
    """Where the run's log is known to miss rows: spans in which the router's writer dropped
    rows because its queue was full (``config_events`` kind ``log_drop``, store/writer.py), and
    a run that never ended cleanly (no ``ended_at``: killed, rows still queued were lost)."""
    out: list[dict] = []
    for d, rid in each_run(db, run_id):
        if "config_events" in d.table_names():
            for ts, after in d.conn.execute(
                    "SELECT ts, after FROM config_events WHERE run_id = ? AND kind = 'log_drop' ORDER BY ts", (rid,)):
                try:
                    a = json.loads(after) if isinstance(after, str) else (after or {})
                except ValueError:
                    a = {}
                out.append({"kind": "dropped", "run_id": rid, "from": a.get("from", ts), "to": a.get("to", ts),
                            "rows": a.get("rows_dropped"), "by_table": a.get("by_table") or {}})
        if "runs" in d.table_names():
            row = d.conn.execute("SELECT ended_at FROM runs WHERE run_id = ?", (rid,)).fetchone()
            last = d.conn.execute("SELECT max(ts) FROM decisions WHERE run_id = ?", (rid,)).fetchone()
            if row is not None and row[0] is None:
                out.append({"kind": "unclean_end", "run_id": rid, "from": last[0] if last else None, "to": None,
                            "rows": None, "by_table": {}})
    return out


_KV_COLUMNS = ("kv_exact", "kv_n", "kv_input", "kv_over", "kv_under", "kv_recorded")


def _kv_has(db: sqlite_utils.Database) -> dict[str, bool]:
    cols = db["decisions"].columns_dict
    return {"has_source": "index_source" in cols, "has_estimate": "estimate_hit_tokens" in cols}


def _kv_sql(db: sqlite_utils.Database, prefix: str = "") -> str:
    """The KV-drift aggregates of a group of decisions, as ``_KV_COLUMNS``: exact decisions,
    and over those with ``estimate_hit_tokens`` (NULL unless the hit was exact, by the
    column's contract) their count, input tokens and the estimate's excess and shortfall.
    Plain arithmetic, no CASE: NULL drops a row out of every sum at once. Zeros where the
    file lacks the columns."""
    has = _kv_has(db)
    exact = f"sum({prefix}index_source = 'exact')" if has["has_source"] else "0"
    recorded = f"count({prefix}index_source) AS kv_recorded" if has["has_source"] else "0 AS kv_recorded"
    if not has["has_estimate"]:
        return f"{exact} AS kv_exact, 0 AS kv_n, 0 AS kv_input, 0 AS kv_over, 0 AS kv_under, {recorded}"
    diff = f"({prefix}estimate_hit_tokens - {prefix}est_hit_tokens)"
    return (f"{exact} AS kv_exact, count({diff}) AS kv_n, sum({prefix}input_tokens * ({diff} IS NOT NULL)) AS kv_input, "
            f"sum(max({diff}, 0)) AS kv_over, sum(max(-{diff}, 0)) AS kv_under, {recorded}")


def _kv_figures(decisions: int, exact: int | None, n: int | None, inp: int | None, over: int | None,
                under: int | None, recorded: int | None = None, *, has_source: bool, has_estimate: bool) -> dict:
    """One row of KV drift: decisions whose chosen hit came from the instance's KV events
    (None: the log predates ``index_source``), their share of the decisions with a recorded
    ``index_source`` (``recorded``; on several logs an older file's rows have none and are
    left out, not counted as estimates), and over those with the estimate recorded, how far
    it was: drift = (over + under) / their input tokens."""
    inp = inp or 0
    recorded = recorded or 0
    drift = None if not has_estimate or not n or not inp else ((over or 0) + (under or 0)) / inp
    return {"decisions": decisions, "exact": (exact or 0) if has_source else None,
            "recorded": recorded if has_source else None,
            "exact_share": (exact or 0) / recorded if has_source and recorded else None,
            "drift_decisions": (n or 0) if has_estimate else None,
            "drift_input_tokens": inp if has_estimate else None,
            "over_tokens": (over or 0) if has_estimate else None,
            "under_tokens": (under or 0) if has_estimate else None,
            "drift": drift,
            "over": None if drift is None else (over or 0) / inp,
            "under": None if drift is None else (under or 0) / inp}


def kv_drift(db: sqlite_utils.Database | str | Path, run_id: str | None = None) -> dict[tuple, dict]:
    """Per policy segment and chosen instance: decisions whose hit came from the instance's
    KV events (``index_source = 'exact'``), their share, and the estimate's drift over them:
    sum(|estimate_hit_tokens - est_hit_tokens|) / sum(input_tokens), split into over (the
    estimate believed more was cached) and under. Keys (policy, version); each value has the
    segment's figures (``summary`` has the same from its own pass) and ``instances``, a list
    of the same per instance. On several logs an instance is its backend URL (each file's
    ``runs.backends``; the name where the file has none), with ``names``, the names the
    routers gave it: the automatic names follow each router's order of --backend.

    A log without ``index_source`` has exact None; one without ``estimate_hit_tokens``
    (written before it existed) has exact counts but drift None. On several logs, a file
    without the column adds nothing to the drift.
    """
    db = as_db(db)
    db, run_id = scope(db, run_id)
    has = _kv_has(db)
    merged = is_merged(db)
    by = "source, " if merged else ""
    rows = fetch_dicts(db, f"""SELECT {by}policy, policy_version, instance, count(*) AS n, {_kv_sql(db)}
        FROM decisions d WHERE {run_filter(db, run_id)} GROUP BY {by}policy, policy_version, instance""",
                 (run_id,))
    urls = _backend_urls(db) if merged else {}
    out: dict[tuple, dict] = {}
    totals: dict[tuple, list[int]] = {}  # n and _KV_COLUMNS
    per_instance: dict[tuple, list[int]] = {}
    names: dict[tuple, set[str]] = {}  # a URL's instance names in the routers' logs
    for r in rows:
        key = (r["policy"], r["policy_version"])
        figures = [r[c] for c in _KV_COLUMNS]
        # Several routers name the same backend differently (i0, i1 follow the order of
        # --backend): their rows meet on the backend's URL, as kvtop attach merges them.
        name = urls.get((r["source"], r["instance"]), r["instance"]) if merged else r["instance"]
        if name != r["instance"]:
            names.setdefault((*key, name), set()).add(r["instance"])
        for acc in (per_instance.setdefault((*key, name), [0] * 7), totals.setdefault(key, [0] * 7)):
            for i, v in enumerate((r["n"], *figures)):
                acc[i] += v or 0
    for (policy, version, name), figures in per_instance.items():
        seg = out.setdefault((policy, version), {"instances": []})
        seg["instances"].append({"instance": name, **_kv_figures(*figures, **has)})
        if (policy, version, name) in names:
            seg["instances"][-1]["names"] = sorted(names[(policy, version, name)])
    for key, seg in out.items():
        seg.update(_kv_figures(*totals[key], **has))
        seg["instances"].sort(key=lambda x: str(x["instance"]))
    return out


def _backend_urls(db: merge.MergedLog) -> dict[tuple[str, str], str]:
    """{(source, instance name): backend URL} of the merged run, from each file's
    ``runs.backends``; a name mapped to two URLs in one file's runs is left out."""
    out: dict[tuple[str, str], str] = {}
    bad = set()
    own = {s.label: s.db for s in db.sources}
    for source, run_id in db.runs:
        row = own[source].conn.execute("SELECT backends FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        try:
            backends = json.loads(row[0]) if row and row[0] else []
        except ValueError:
            continue
        for b in backends if isinstance(backends, list) else []:
            if not isinstance(b, dict) or not b.get("name") or not b.get("url"):
                continue
            key = (source, b["name"])
            if out.get(key, b["url"]) != b["url"]:
                bad.add(key)
            out[key] = b["url"]
    return {k: v for k, v in out.items() if k not in bad}
