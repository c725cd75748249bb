"""The decision log's rows as an operator asks for them: runs, decisions joined with their
outcomes, one request's attempts (``kvtop log why``), a run's policy segments and what its
shadow policies would have picked. Summaries per segment are store/summary.py's.
"""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path

import sqlite_utils

from store.errors import QueryError
from store.logs import (as_db, decode_json_columns, fetch_dicts, gathered, is_merged, open_readonly, parse_time,
                        resolve_run, run_filter, scope, segment_label)

#: Outcome columns that ``decisions()`` adds to each decision (the rest repeat the decision's).
OUTCOME_COLUMNS = ("status", "http_status", "error", "ttft_ms", "e2e_ms", "tpot_ms", "output_tokens",
                   "delivered_hit_tokens", "t_first_token", "t_done")


def policy_changes(db: sqlite_utils.Database | str | Path) -> dict[str, list[tuple[float, str]]]:
    """run id -> [(ts, policy@version)] of every policy and knob change the log recorded,
    traffic or not (``config_events``); {} for a log without the table."""
    import json

    from store.sandbox import run_sql

    try:
        _, rows = run_sql(db, "SELECT run_id, ts, after FROM config_events "
                              "WHERE kind IN ('run', 'policy', 'knobs') ORDER BY ts")
    except Exception:  # noqa: BLE001 - an older log without config_events: decisions alone
        return {}
    out: dict[str, list[tuple[float, str]]] = {}
    for run_id, ts, after in rows:
        try:
            a = json.loads(after) if isinstance(after, str) else after
        except ValueError:
            continue
        if isinstance(a, dict) and a.get("policy") and a.get("version") is not None:
            out.setdefault(str(run_id), []).append((float(ts or 0), f"{a['policy']}@{a['version']}"))
    return out


def runs(db: sqlite_utils.Database | str | Path) -> list[dict]:
    """Every run, newest first, with its decision count, time span and policies used; on
    several logs, every file's runs, each with the ``source`` file it came from."""
    db = as_db(db)
    if is_merged(db):
        merged = [{**r, "source": s.label} for s in db.sources for r in runs(s.db)]
        return sorted(merged, key=lambda r: -(r["started_at"] or r["first_ts"] or 0))
    out = {r["run_id"]: {**r, "decisions": 0, "first_ts": None, "last_ts": None, "policies": []}
           for r in fetch_dicts(db, "SELECT run_id, started_at, ended_at, host, port, policy, argv, "
                              "kvtop_version FROM runs")}
    # Per (policy, version, run) through the policy index: one ordered pass, no sort of the table.
    for r in fetch_dicts(db, "SELECT policy, policy_version, run_id, count(*) AS n, min(ts) AS t0, "
                       "max(ts) AS t1 FROM decisions GROUP BY policy, policy_version, run_id"):
        run = out.setdefault(r["run_id"], {"run_id": r["run_id"], "started_at": None, "ended_at": None,
                                           "host": None, "port": None, "policy": None, "argv": None,
                                           "kvtop_version": None, "decisions": 0, "first_ts": None,
                                           "last_ts": None, "policies": []})
        run["decisions"] += r["n"]
        run["first_ts"] = r["t0"] if run["first_ts"] is None else min(run["first_ts"], r["t0"])
        run["last_ts"] = r["t1"] if run["last_ts"] is None else max(run["last_ts"], r["t1"])
        run["policies"].append((r["t0"], f"{r['policy']}@{r['policy_version']}"))
    for run in out.values():
        run["policies"] = [label for _, label in sorted(run["policies"])]
    return sorted(out.values(), key=lambda r: -(r["started_at"] or r["first_ts"] or 0))

# -- decisions ----------------------------------------------------------------------
def decisions(db: sqlite_utils.Database | str | Path, *, run: str | None = None,
              session: str | None = None, instance: str | None = None, reason: str | None = None,
              policy: str | None = None, route_class: str | None = None,
              since: str | float | None = None, until: str | float | None = None,
              limit: int | None = 100) -> list[dict]:
    """Decisions joined with their outcome (same run, request and attempt), newest first.

    ``policy`` is a name or ``name@version``; ``since``/``until`` anything ``parse_time``
    reads; ``run`` an id or unique prefix (None: every run); ``limit`` None for all.
    On several logs, each file answers on its own (its indexes serve the join, which a view
    over every file could not) and the newest ``limit`` of their rows are kept, each with
    its ``source``.
    """
    db = as_db(db)
    if is_merged(db):
        run_id = resolve_run(db, run) if run is not None else None
        owner = None if run_id is None else db.conn.execute(
            "SELECT source FROM runs WHERE run_id = ? UNION ALL SELECT source FROM "
            "(SELECT source FROM decisions WHERE run_id = ? LIMIT 1)", (run_id, run_id)).fetchone()[0]
        found = []
        for src in db.sources:
            if owner is not None and src.label != owner:
                continue
            found += [{**r, "source": src.label} for r in decisions(
                src.db, run=run_id, session=session, instance=instance, reason=reason, policy=policy,
                route_class=route_class, since=since, until=until, limit=limit)]
        found.sort(key=lambda r: (r["ts"] if r["ts"] is not None else -math.inf, r["id"]), reverse=True)
        return found if limit is None else found[:int(limit)]
    where, params = [], []
    if run is not None:
        where.append("d.run_id = ?")
        params.append(resolve_run(db, run))
    for col, val in (("session_id", session), ("instance", instance), ("reason", reason),
                     ("route_class", route_class)):
        if val is not None:
            where.append(f"d.{col} = ?")
            params.append(val)
    if policy is not None:
        name, _, version = policy.partition("@")
        where.append("d.policy = ?")
        params.append(name)
        if version:
            if not version.isdigit():
                raise QueryError(f"policy {policy!r}: the version after @ must be a number")
            where.append("d.policy_version = ?")
            params.append(int(version))
    t0, t1 = parse_time(since), parse_time(until)
    if t0 is not None:
        where.append("d.ts >= ?")
        params.append(t0)
    if t1 is not None:
        where.append("d.ts <= ?")
        params.append(t1)
    outcome_cols = ", ".join(f"o.{c}" for c in OUTCOME_COLUMNS)
    sql = (f"SELECT d.*, {outcome_cols} FROM decisions d LEFT JOIN outcomes o "
           "ON o.request_id = d.request_id AND o.attempt = d.attempt AND +o.run_id = d.run_id"
           + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY d.ts DESC, d.id DESC")
    if limit is not None:
        sql += " LIMIT ?"
        params.append(int(limit))
    return fetch_dicts(db, sql, params)

def request_attempts(db: sqlite_utils.Database | str | Path, request_id: str, *,
                     run: str | None = None) -> dict:
    """Every attempt of one request, for ``kvtop log why``: its decision rows (``scores``
    parsed) each with its outcome row or None, first attempt first.

    ``request_id`` is an exact id or a unique prefix. Replaying one trace twice repeats its
    ids, so an id can be in several runs: the latest of them is answered (``run`` picks
    another) and ``other_runs`` names the rest. Raises QueryError for an unknown or
    ambiguous id. Index look-ups only: constant time in the size of the log.
    """
    db = as_db(db)
    conn = db.conn
    found = [r[0] for r in conn.execute("SELECT 1 FROM decisions WHERE request_id = ? LIMIT 1", (request_id,))]
    rid = request_id
    if not found:
        # A prefix, as a range on the request_id index (LIKE would not use it).
        ids = [r[0] for r in conn.execute(
            "SELECT DISTINCT request_id FROM decisions WHERE request_id >= ? AND request_id < ? "
            "ORDER BY request_id LIMIT 4", (request_id, request_id + "\U0010ffff"))] if request_id else []
        if not ids:
            where = (f"in these logs ({', '.join(s.label for s in db.sources)})" if is_merged(db)
                     else "in this log")
            raise QueryError(f"no decision for request {request_id!r} {where} "
                             "(kvtop log decisions lists the newest)")
        if len(ids) > 1:
            shown = ", ".join(ids[:3]) + (", ..." if len(ids) > 3 else "")
            raise QueryError(f"request {request_id!r} is ambiguous: {shown}")
        rid = ids[0]
    runs_of = [r[0] for r in conn.execute(
        "SELECT run_id FROM decisions WHERE request_id = ? GROUP BY run_id ORDER BY max(ts) DESC", (rid,))]
    if run is not None:
        run_id = resolve_run(db, run)
        if run_id not in runs_of:
            raise QueryError(f"request {rid!r} is not in run {run_id} (it is in {', '.join(runs_of)})")
    else:
        run_id = runs_of[0]
    rows = fetch_dicts(db, "SELECT * FROM decisions WHERE request_id = ? AND +run_id = ? ORDER BY attempt, id",
                 (rid, run_id))
    outcomes = {r["attempt"]: r for r in fetch_dicts(
        db, "SELECT * FROM outcomes WHERE request_id = ? AND +run_id = ? ORDER BY id", (rid, run_id))}
    attempts = [{"decision": decode_json_columns("decisions", d), "outcome": outcomes.get(d["attempt"])}
                for d in rows]
    found = {"request_id": rid, "run_id": run_id, "attempts": attempts,
             "other_runs": [r for r in runs_of if r != run_id]}
    if rows and "source" in rows[0]:  # several logs: the file (router) that holds it
        found["source"] = rows[0]["source"]
    return found

# -- segments and shadows ------------------------------------------------------------
def segments(db: sqlite_utils.Database | str | Path, run_id: str | None = None) -> list[dict]:
    """The run's policy segments in time order: label ``policy@version``, first and last
    decision time, decisions and requests (first attempts) in each."""
    db = as_db(db)
    db, run_id = scope(db, run_id)
    rows = gathered(db, run_id, lambda d, rid: f"""SELECT policy, policy_version, count(*) AS decisions,
        sum(attempt = 1) AS requests, min(ts) AS start_ts, max(ts) AS end_ts
        FROM decisions d WHERE {run_filter(d, rid)} GROUP BY policy, policy_version""", ("policy", "policy_version"))
    rows.sort(key=lambda r: (r["start_ts"], r["policy_version"] or 0))
    for r in rows:
        r["label"] = segment_label(db, r["policy"], r["policy_version"])
        r["run_id"] = run_id
    return rows


def shadow_summary(db: sqlite_utils.Database | str | Path, run_id: str | None = None) -> list[dict]:
    """Per policy segment and shadow policy (router/shadow.py): picks, agreement with the
    active policy, disagreements per route class, the estimated prefill tokens the shadow's
    picks would have saved (< 0: lost) and the mean gap between the real pick's score and the
    shadow's own under the shadow's model. Empty when the run had no shadows."""
    db = as_db(db)
    db, run_id = scope(db, run_id)
    if "shadows" not in db["decisions"].columns_dict:
        return []
    where = f"{run_filter(db, run_id)} AND d.shadows IS NOT NULL"
    rows = fetch_dicts(db, f"""SELECT d.policy AS policy, d.policy_version AS policy_version,
        json_extract(j.value, '$.policy') AS shadow, count(*) AS picks,
        sum(json_extract(j.value, '$.instance') = d.instance) AS agree,
        sum(CASE WHEN json_extract(j.value, '$.instance') != d.instance
                 THEN json_extract(j.value, '$.saved') ELSE 0 END) AS saved_prefill_tokens,
        avg(CASE WHEN json_extract(j.value, '$.instance') != d.instance
                 THEN json_extract(j.value, '$.cost_real') - json_extract(j.value, '$.cost_own') END)
            AS mean_cost_gap,
        avg(json_extract(j.value, '$.us')) AS pick_us_mean, min(d.ts) AS start_ts, max(d.ts) AS end_ts
        FROM decisions d, json_each(d.shadows) j WHERE {where}
        GROUP BY 1, 2, 3 ORDER BY min(d.ts), 3""", (run_id,))
    by_class = fetch_dicts(db, f"""SELECT d.policy AS policy, d.policy_version AS policy_version,
        json_extract(j.value, '$.policy') AS shadow, d.route_class AS route_class, count(*) AS n
        FROM decisions d, json_each(d.shadows) j
        WHERE {where} AND json_extract(j.value, '$.instance') != d.instance
        GROUP BY 1, 2, 3, 4""", (run_id,))
    classes: dict[tuple, dict[str, int]] = {}
    for r in by_class:
        classes.setdefault((r["policy"], r["policy_version"], r["shadow"]), {})[r["route_class"] or "-"] = r["n"]
    for r in rows:
        r["segment"] = segment_label(db, r["policy"], r["policy_version"])
        r["agreement"] = r["agree"] / r["picks"] if r["picks"] else None
        r["disagree_by_class"] = classes.get((r["policy"], r["policy_version"], r["shadow"]), {})
        r["run_id"] = run_id
    return rows


def decision_hits(path: str | Path) -> list[dict]:
    """Every decision's ``request_id``, ``attempt``, ``best_hit_tokens`` and ``est_hit_tokens``
    (all runs: request ids are unique), read only: the placement part of the cache-gap split
    (kvtop/cachegap.py). Empty when the file is missing or not a decision log."""
    try:
        db = open_readonly(path)
    except QueryError:
        return []
    try:
        return fetch_dicts(db, "SELECT request_id, attempt, best_hit_tokens, est_hit_tokens FROM decisions")
    except sqlite3.Error:  # an older log without these columns: no placement rows
        return []
    finally:
        db.close()
