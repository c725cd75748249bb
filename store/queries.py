"""Read-only questions to the decision log: runs, decisions, policy segments, summaries.

Every function reads through a ``mode=ro`` connection (``open_readonly``), so no query here
can change the file. ``arms_from_db`` is the contract ``kvtop report --db`` builds on: one
arm per policy segment, its requests in the replay results format.

A *policy segment* is the set of a run's decisions made under one ``policy@version``. The
router bumps ``policy_version`` on every policy or knob change, so a segment is one
contiguous time range (its edges can overlap by a request's admission wait).
"""

from __future__ import annotations

import bisect
import csv
import gc
import json
import math
import os
import re
import sqlite3
import sys
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from fractions import Fraction
from functools import partial
from operator import itemgetter
from pathlib import Path
from typing import IO, Any, Callable, Sequence
from urllib.parse import quote

import sqlite_utils

from store import merge
from store.schema import JSON_COLUMNS, TABLES
from store.stats import ranked_percentile

#: Outcome columns that ``decisions()`` adds to each decision (the rest repeat the decision's).
OUTCOME_COLUMNS = ("status", "http_status", "error", "ttft_ms", "e2e_ms", "tpot_ms", "output_tokens",
                   "delivered_hit_tokens", "t_first_token", "t_done")
STATUSES = ("ok", "error", "upstream_error", "client_gone", "timeout")
#: Outcome statuses of requests cut off by their client, not failed (``summary`` counts them apart).
CANCELLED = ("client_gone",)
_CANCELLED_SQL = "(" + ", ".join(f"'{c}'" for c in CANCELLED) + ")"
_RECORD_STATUS = {1: "ok", 0: "error", 2: "cancelled", None: None}
PERCENTILES = (50, 90, 99)
_SEP = "\x1f"  # unit separator: cannot appear in a reason, class or status
#: How long a read waits for a writer's exclusive lock before the file is reported locked.
BUSY_TIMEOUT_S = 5.0


class QueryError(LookupError):
    """A question the log cannot answer as asked (missing file, unknown run, bad SQL).

    A LookupError, so callers such as ``kvtop report --db`` can catch it without importing us.
    """


# -- opening ------------------------------------------------------------------------
def open_readonly(path: str | Path) -> sqlite_utils.Database:
    """Open a kvtop database read-only: ``file:...?mode=ro`` plus ``query_only``.

    Raises QueryError for a missing file or one that is not a kvtop decision log.
    """
    p = Path(path)
    if not p.exists():
        raise QueryError(f"no database at {path} (pass --db PATH; the router writes kvtop.db by default)")
    if not p.is_file():
        raise QueryError(f"{path} is not a file")
    uri = "file:" + quote(str(p.resolve())) + "?mode=ro"
    try:
        try:
            conn = sqlite3.connect(uri, uri=True, check_same_thread=False, timeout=BUSY_TIMEOUT_S)
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        except sqlite3.OperationalError as exc:
            # A WAL-mode file needs its -shm beside it, even to read; on a read-only mount
            # (an archived log, a CI artefact) SQLite cannot create one. With no -wal content
            # to miss, read the file as immutable: no locks and no -shm, valid while nobody
            # writes the file, which a read-only mount promises.
            if "unable to open" not in str(exc) or not _wal_mode(p) or _has_wal_content(p):
                raise
            uri += "&immutable=1"
            conn = sqlite3.connect(uri, uri=True, check_same_thread=False, timeout=BUSY_TIMEOUT_S)
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as exc:
        if "unable to open" in str(exc):  # e.g. a live WAL file in a directory we cannot write
            hint = (f"; its {p.name}-wal holds rows not yet in the file: copy both somewhere writable"
                    if _has_wal_content(p) else "")
            raise QueryError(f"cannot open {path} read-only: {exc}{hint}") from None
        if "malformed" in str(exc):
            raise QueryError(f"{path} is damaged ({exc})") from None
        if "locked" in str(exc):  # another process holds an exclusive lock past BUSY_TIMEOUT_S
            raise QueryError(f"{path} is locked by another process ({exc}); try again when it lets go") from None
        raise QueryError(f"{path} is not a kvtop database ({exc})") from None
    missing = {"runs", "decisions", "outcomes"} - tables
    if missing:
        conn.close()
        hint = ""
        if _wal_mode(p) and not _has_wal_content(p):  # a WAL-mode file without its -wal
            hint = ("; if it is a copy of a live router's log, its rows may still be in the original's -wal "
                    "file: copy with sqlite3 SRC \".backup DST\", or copy SRC-wal beside it too")
        raise QueryError(f"{path} is not a kvtop database (no {', '.join(sorted(missing))} table){hint}")
    conn.execute("PRAGMA query_only = ON")
    # Reads of a big log are scans: map the file and keep a generous page cache.
    conn.execute("PRAGMA mmap_size = 4294967296")
    conn.execute("PRAGMA cache_size = -262144")
    db = sqlite_utils.Database(conn)
    db.ro_uri = uri  # store.merge attaches the file the same way
    return db


def _wal_mode(p: Path) -> bool:
    """The file's header says WAL (bytes 18 and 19 are 2: SQLite's file format, 1.3)."""
    try:
        with open(p, "rb") as f:
            head = f.read(20)
    except OSError:
        return False
    return head[:16] == b"SQLite format 3\x00" and head[18:20] == b"\x02\x02"


def _has_wal_content(p: Path) -> bool:
    try:
        return os.path.getsize(str(p) + "-wal") > 0
    except OSError:
        return False


def open_logs(paths: str | Path | Sequence[str | Path]) -> sqlite_utils.Database:
    """One log read-only (``open_readonly``), or several read as one (``store.merge``): the
    tables become views over every file, with a ``source`` column naming each row's file.

    The same file given twice is read once (``db.duplicates`` says so); a run id in two
    different files, a missing, foreign, corrupt or locked file raise QueryError.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise QueryError("no database given")
    distinct: list[str | Path] = []
    for p in paths:
        if not any(_same_file(p, q) for q in distinct):
            distinct.append(p)
    if len(distinct) == 1:
        db = open_readonly(distinct[0])
        db.duplicates = [(str(p), str(distinct[0])) for p in paths[1:]]  # type: ignore[attr-defined]
        return db
    return merge.open_merged(paths, open_one=open_readonly, error=QueryError)


def _same_file(a: str | Path, b: str | Path) -> bool:
    try:
        return Path(a).samefile(b)
    except OSError:  # a missing file: open_readonly says so
        return str(a) == str(b)


def is_merged(db: sqlite_utils.Database) -> bool:
    return isinstance(db, merge.MergedLog)


def _scope(db: sqlite_utils.Database, run: str | None) -> tuple[sqlite_utils.Database, str]:
    """The run a run-scoped question is about. On several logs, the chosen runs (``run``:
    ids or prefixes joined by commas; None: every log's latest run) become one run."""
    if not is_merged(db):
        return db, resolve_run(db, run)
    wanted = [r.strip() for r in run.split(",") if r.strip()] if run and run != "latest" else None
    if db.runs and (run is None or run == "+".join(r for _, r in db.runs)):
        return db, "+".join(r for _, r in db.runs)
    return db, merge.merge_runs(db, wanted, resolve=resolve_run, error=QueryError)


def _db(db: sqlite_utils.Database | str | Path) -> sqlite_utils.Database:
    return db if isinstance(db, sqlite_utils.Database) else open_readonly(db)


def _db_file(db: sqlite_utils.Database) -> str | None:
    """The file behind a connection, to open a second one on it (None: in memory)."""
    for _seq, name, file in db.conn.execute("PRAGMA database_list"):
        if name == "main" and file:
            return file
    return None


def segment_label(db: sqlite_utils.Database, policy: str | None, version: int | None) -> str:
    """``policy@version``; on several logs, a version the routers ran with different knobs
    is a segment per file, ``policy@version (file)`` (``merge.segment_names``: each router
    numbers its versions on its own)."""
    return getattr(db, "segment_names", {}).get((policy, version)) or f"{policy}@{version}"


def knob_notes(db: sqlite_utils.Database) -> list[str]:
    """One line per segment whose routers' knobs differ (several logs), saying how."""
    return [f"{policy}@{version} ran with different settings on these routers ({text}): "
            "one segment per file"
            for (policy, version), text in getattr(db, "knob_conflicts", {}).items()]


def _rows(db: sqlite_utils.Database, sql: str, params: Sequence | dict = ()) -> list[dict]:
    cur = db.conn.execute(sql, params)
    cols = [c[0] for c in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


# -- times and runs -----------------------------------------------------------------
_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)\s*$", re.I)
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_time(value: str | float | int | None, *, now: float | None = None) -> float | None:
    """Unix seconds from ``1700000000``, ``2024-05-01T12:00:00`` (local unless it has an
    offset) or a relative ``30s``/``10m``/``2h``/``1d`` meaning that long before ``now``."""
    if value is None or isinstance(value, (int, float)):
        return None if value is None else float(value)
    text = value.strip()
    m = _RELATIVE.match(text)
    if m:
        return (time.time() if now is None else now) - float(m.group(1)) * _UNIT_S[m.group(2).lower()]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise QueryError(f"cannot read time {value!r}: use unix seconds, ISO 8601, or 30s/10m/2h/1d ago") from None


def resolve_run(db: sqlite_utils.Database, run: str | None) -> str:
    """The run id for ``run``: exact id, unique prefix, or the latest run when None."""
    conn = db.conn
    if run is None or run == "latest":
        row = conn.execute("SELECT run_id FROM runs ORDER BY started_at DESC LIMIT 1").fetchone()
        if row is None:  # decisions without a runs row (a crashed start): latest decision's run
            row = conn.execute("SELECT run_id FROM decisions ORDER BY ts DESC LIMIT 1").fetchone()
        if row is None:
            raise QueryError("the database has no runs yet")
        return row[0]
    if conn.execute("SELECT 1 FROM runs WHERE run_id = ?", (run,)).fetchone() or \
            conn.execute("SELECT 1 FROM decisions WHERE run_id = ? LIMIT 1", (run,)).fetchone():
        return run
    like = run.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    found = [r[0] for r in conn.execute(
        "SELECT run_id FROM runs WHERE run_id LIKE ? ESCAPE '\\' LIMIT 3", (like,))]
    if len(found) == 1:
        return found[0]
    if found:
        raise QueryError(f"run {run!r} is ambiguous: {', '.join(found)}, ...")
    raise QueryError(f"no run {run!r} (kvtop log runs lists them)")


def _run_clause(db: sqlite_utils.Database, run_id: str, alias: str = "d") -> str:
    """``run_id = ?`` shaped for the planner: when the run is most of the table a scan in
    rowid order beats 1M look-ups through the (run_id, ts) index, so hide the index."""
    prefix = f"{alias}." if alias else ""
    if is_merged(db):  # the views' run_id is a constant: each file's own filter picks the plan
        return f"{prefix}run_id = ?"
    conn = db.conn
    total = conn.execute("SELECT max(id) FROM decisions").fetchone()[0] or 0
    mine = conn.execute("SELECT count(*) FROM decisions WHERE run_id = ?", (run_id,)).fetchone()[0]
    return f"+{prefix}run_id = ?" if mine * 3 > total else f"{prefix}run_id = ?"


def runs(db: sqlite_utils.Database | str | Path) -> list[dict]:
    """Every run, newest first, with its decision count, time span and policies used; on
    several logs, every file's runs, each with the ``source`` file it came from."""
    db = _db(db)
    if is_merged(db):
        merged = [{**r, "source": s.label} for s in db.sources for r in runs(s.db)]
        return sorted(merged, key=lambda r: -(r["started_at"] or r["first_ts"] or 0))
    out = {r["run_id"]: {**r, "decisions": 0, "first_ts": None, "last_ts": None, "policies": []}
           for r in _rows(db, "SELECT run_id, started_at, ended_at, host, port, policy, argv, "
                              "kvtop_version FROM runs")}
    # Per (policy, version, run) through the policy index: one ordered pass, no sort of the table.
    for r in _rows(db, "SELECT policy, policy_version, run_id, count(*) AS n, min(ts) AS t0, "
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
    db = _db(db)
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
    return _rows(db, sql, params)


def request_attempts(db: sqlite_utils.Database | str | Path, request_id: str, *,
                     run: str | None = None) -> dict:
    """Every attempt of one request, for ``kvtop log why``: its decision rows (``scores``
    parsed) each with its outcome row or None, first attempt first.

    ``request_id`` is an exact id or a unique prefix. Replaying one trace twice repeats its
    ids, so an id can be in several runs: the latest of them is answered (``run`` picks
    another) and ``other_runs`` names the rest. Raises QueryError for an unknown or
    ambiguous id. Index look-ups only: constant time in the size of the log.
    """
    db = _db(db)
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
    rows = _rows(db, "SELECT * FROM decisions WHERE request_id = ? AND +run_id = ? ORDER BY attempt, id",
                 (rid, run_id))
    outcomes = {r["attempt"]: r for r in _rows(
        db, "SELECT * FROM outcomes WHERE request_id = ? AND +run_id = ? ORDER BY id", (rid, run_id))}
    attempts = [{"decision": decode_json_columns("decisions", d), "outcome": outcomes.get(d["attempt"])}
                for d in rows]
    found = {"request_id": rid, "run_id": run_id, "attempts": attempts,
             "other_runs": [r for r in runs_of if r != run_id]}
    if rows and "source" in rows[0]:  # several logs: the file (router) that holds it
        found["source"] = rows[0]["source"]
    return found


# -- segments and summaries -----------------------------------------------------------
def segments(db: sqlite_utils.Database | str | Path, run_id: str | None = None) -> list[dict]:
    """The run's policy segments in time order: label ``policy@version``, first and last
    decision time, decisions and requests (first attempts) in each."""
    db = _db(db)
    db, run_id = _scope(db, run_id)
    rows = _gathered(db, run_id, lambda d, rid: f"""SELECT policy, policy_version, count(*) AS decisions,
        sum(attempt = 1) AS requests, min(ts) AS start_ts, max(ts) AS end_ts
        FROM decisions d WHERE {_run_clause(d, rid)} GROUP BY policy, policy_version""", ("policy", "policy_version"))
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
    db = _db(db)
    db, run_id = _scope(db, run_id)
    if "shadows" not in db["decisions"].columns_dict:
        return []
    where = f"{_run_clause(db, run_id)} AND d.shadows IS NOT NULL"
    rows = _rows(db, f"""SELECT d.policy AS policy, d.policy_version AS policy_version,
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
    by_class = _rows(db, f"""SELECT d.policy AS policy, d.policy_version AS policy_version,
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


def _dist(values: list[float]) -> dict:
    values.sort()
    out = {"n": len(values)}
    for q in PERCENTILES:
        out[f"p{q}"] = ranked_percentile(len(values), q, lambda lo, hi: (values[lo], values[hi]))
    return out


def _counts(concat: str | None, total: int) -> dict[str, int]:
    counts = Counter(concat.split(_SEP)) if concat else Counter()
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


def _flat(db: sqlite_utils.Database, run_id: str) -> bool:
    """True when every outcome of the run carries its decision's policy (and the other columns
    copied from it), so segment questions can read ``outcomes`` alone. Files written before
    those columns existed, and rows an older router wrote into a newer file, have NULL there:
    then the queries join each outcome to its decision instead. One index seek."""
    if "policy" not in db["outcomes"].columns_dict:
        return False
    return db.conn.execute("SELECT 1 FROM outcomes WHERE run_id = ? AND policy IS NULL LIMIT 1",
                           (run_id,)).fetchone() is None


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


def _each_run(db: sqlite_utils.Database, run_id: str) -> list[tuple[sqlite_utils.Database, str]]:
    """Where the run's rows are: (db, run_id) itself, or on several logs (``merge_runs``)
    each file's own connection with each of its runs that make up the merged one."""
    if not is_merged(db):
        return [(db, run_id)]
    if db.segment_names:  # segments split per file: only the views read them so
        return [(db, run_id)]
    own = {s.label: s.db for s in db.sources}
    return [(own[source], rid) for source, rid in db.runs]


_MIN_COLUMNS, _MAX_COLUMNS, _TEXT_COLUMNS = ("start_ts",), ("end_ts",), ("reasons", "classes")


def _gathered(db: sqlite_utils.Database, run_id: str, sql: Callable[[sqlite_utils.Database, str], str],
              group: tuple[str, ...]) -> list[dict]:
    """The rows of a grouped query over the run, ``sql(db, run_id)`` binding the run id as
    its one parameter. On several logs each file answers for its own run(s) through its own
    indexes (a GROUP BY over the union's views would sort every row), and rows of the same
    ``group`` combine: ``start_ts`` min, ``end_ts`` max, separator-joined text joins, every
    other column (counts and sums) adds, None where every part is None."""
    parts = [r for d, rid in _each_run(db, run_id) for r in _rows(d, sql(d, rid), (rid,))]
    if not is_merged(db):
        return parts
    out: dict[tuple, dict] = {}
    for r in parts:
        key = tuple(r[c] for c in group)
        have = out.get(key)
        if have is None:
            out[key] = dict(r)
            continue
        for c, v in r.items():
            if c in group or v is None:
                continue
            old = have[c]
            if old is None:
                have[c] = v
            elif c in _MIN_COLUMNS:
                have[c] = min(old, v)
            elif c in _MAX_COLUMNS:
                have[c] = max(old, v)
            elif c in _TEXT_COLUMNS:
                have[c] = old + _SEP + v
            else:
                have[c] = old + v
    return list(out.values())


def summary(db: sqlite_utils.Database | str | Path, run_id: str | None = None, *,
            instances: bool = False) -> dict:
    """Per policy segment of a run (latest when None): counts by reason, route class and
    outcome status; TTFT and E2E p50/p90/p99 of ``ok`` attempts; three-way hit accounting.

    Hit accounting, per decision: routing regret = best - est (cache the router left on
    another instance); estimate error = est - delivered, over decisions whose engine reported
    ``delivered_hit_tokens`` (NULL ones are left out of both sides).
    """
    db = _db(db)
    db, run_id = _scope(db, run_id)
    # Two ordered passes over the run, both in policy-index order so GROUP BY needs no sort:
    # the decisions alone, and decisions joined with outcomes. They run at once on two
    # connections (SQLite lets go of the GIL). Categorical counts come back as
    # separator-joined text and latencies as JSON arrays, so Python counts and sorts in C.
    # Each statement is built for one file and its run (``_gathered``: on several logs, each
    # file answers for its own run through its own indexes, and the groups add up).
    clauses: dict[tuple[int, str], str] = {}

    def clause(d: sqlite_utils.Database, rid: str, alias: str = "d") -> str:  # once per file and run
        if (id(d), rid) not in clauses:
            clauses[(id(d), rid)] = _run_clause(d, rid)
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
    flat = _flat(db, run_id)
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
        path = _db_file(db)
        own = open_readonly(path) if path else db
        try:
            out = {}
            for r in _gathered(own, run_id, decision_sql, ("policy", "policy_version")):
                r["reasons"] = _counts(r["reasons"], r["decisions"])
                r["classes"] = _counts(r["classes"], r["decisions"])
                out[(r["policy"], r["policy_version"])] = r
            return out
        finally:
            if own is not db:
                own.conn.close()

    with ThreadPoolExecutor(1) as pool:
        # In memory there is one connection to share: read the decisions first.
        future = pool.submit(decision_side) if _db_file(db) else _done(decision_side())
        by_segment = {}
        latencies: dict[tuple, tuple[list, list]] = {}
        if not flat:
            for d, rid in _each_run(db, run_id):
                for pol, ver, ttft, e2e in d.conn.execute(latency_sql(d, rid), (rid,)):
                    ttfts, e2es = latencies.setdefault((pol, ver), ([], []))
                    if ttft is not None:
                        ttfts.append(ttft)
                    if e2e is not None:
                        e2es.append(e2e)
        for r in _gathered(db, run_id, outcome_sql, ("policy", "policy_version")):
            key = (r["policy"], r["policy_version"])
            if flat:  # r[col] is the count; the index gives the ranks
                if is_merged(db):  # count on each file's index, not by walking the union
                    r["e2e"] = sum(d.conn.execute(
                        "SELECT count(*) FROM outcomes WHERE run_id = ? AND policy IS ? AND policy_version IS ? "
                        "AND status = 'ok' AND e2e_ms IS NOT NULL", (rid, *key)).fetchone()[0]
                        for d, rid in _each_run(db, run_id))
                # Ranks through the views of several logs: SQLite merges the files' index orders.
                for col in ("ttft", "e2e"):
                    r[col] = _ranked_dist(db.conn, f"{col}_ms", run_id, *key, r[col])
            else:
                ttfts, e2es = latencies.get(key, ([], []))
                r["ttft"], r["e2e"] = _dist(ttfts), _dist(e2es)
            r["statuses"] = {}
            by_segment[key] = r
        for r in _gathered(db, run_id, failure_sql, ("policy", "policy_version", "status")):
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
    for d, rid in _each_run(db, run_id):
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
    db = _db(db)
    db, run_id = _scope(db, run_id)
    has = _kv_has(db)
    merged = is_merged(db)
    by = "source, " if merged else ""
    rows = _rows(db, f"""SELECT {by}policy, policy_version, instance, count(*) AS n, {_kv_sql(db)}
        FROM decisions d WHERE {_run_clause(db, run_id)} GROUP BY {by}policy, policy_version, instance""",
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


# -- arbitrary read-only SQL and export -------------------------------------------------
_READ_KEYWORDS = ("select", "with", "explain", "pragma", "values")
# PRAGMAs that take an argument yet only read.
_READ_PRAGMAS_WITH_ARG = {"table_info", "table_xinfo", "index_list", "index_info", "index_xinfo",
                          "foreign_key_list", "table_list", "pragma_list", "function_list"}
_LEADING_COMMENTS = re.compile(r"^(\s+|--[^\n]*\n?|/\*.*?\*/)*", re.S)


def _authorizer(action: int, arg1, arg2, db_name, trigger) -> int:
    if action in (sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
                  getattr(sqlite3, "SQLITE_RECURSIVE", 33)):
        return sqlite3.SQLITE_OK
    if action == sqlite3.SQLITE_PRAGMA and (arg2 is None or (arg1 or "").lower() in _READ_PRAGMAS_WITH_ARG):
        return sqlite3.SQLITE_OK
    return sqlite3.SQLITE_DENY


def _check_read_only(sql: str) -> None:
    body = _LEADING_COMMENTS.sub("", sql, count=1)
    first = re.match(r"[A-Za-z]+", body)
    keyword = first.group(0).lower() if first else ""
    if keyword not in _READ_KEYWORDS:
        raise QueryError("only read-only statements are allowed (SELECT, WITH, EXPLAIN, PRAGMA reads); "
                         f"got {keyword.upper() or repr(sql[:20])}")
    if keyword == "pragma" and "=" in body:
        raise QueryError("PRAGMA assignments are not allowed: the log is opened read-only")


def _execute(db: sqlite_utils.Database, sql: str, params: Sequence | dict) -> sqlite3.Cursor:
    _check_read_only(sql)
    conn = db.conn
    conn.set_authorizer(_authorizer)
    try:
        return conn.execute(sql, params)
    except sqlite3.DatabaseError as exc:
        msg = str(exc)
        if "not authorized" in msg:
            msg = "statement is not read-only (not authorized)"
        raise QueryError(f"SQL error: {msg}") from None
    except (sqlite3.ProgrammingError, sqlite3.Warning) as exc:  # e.g. two statements
        raise QueryError(f"SQL error: {exc}") from None
    finally:
        conn.set_authorizer(None)


def run_sql(db: sqlite_utils.Database | str | Path, sql: str,
            params: Sequence | dict = ()) -> tuple[list[str], list[tuple]]:
    """Run one read-only statement; returns (column names, rows).

    Refuses anything but a single SELECT / WITH / EXPLAIN / PRAGMA read with a QueryError.
    The keyword check gives the clear message, an authorizer denies writes hidden inside a
    WITH, and the ``mode=ro`` connection is the guarantee behind both.
    """
    db = _db(db)
    cur = _execute(db, sql, params)
    try:
        rows = cur.fetchall()
    except sqlite3.DatabaseError as exc:
        raise QueryError(f"SQL error: {exc}") from None
    return [c[0] for c in cur.description or ()], rows


def export(db: sqlite_utils.Database | str | Path, table_or_query: str, fmt: str = "csv",
           out: str | Path | IO[str] | None = None, params: Sequence | dict = ()) -> int:
    """Write a table (by name) or a read-only query's rows as CSV or JSON lines to ``out``
    (a path, an open text file, or stdout when None). Streams rows; returns how many."""
    db = _db(db)
    if fmt not in ("csv", "jsonl"):
        raise QueryError(f"unknown export format {fmt!r} (csv or jsonl)")
    name = table_or_query.strip()
    if re.fullmatch(r"\w+", name):
        if not db[name].exists():
            raise QueryError(f"no table {name!r} (tables: {', '.join(db.table_names())})")
        sql = f"SELECT * FROM [{name}]"
    else:
        sql = table_or_query
    cur = _execute(db, sql, params)
    cols = [c[0] for c in cur.description or ()]
    close = False
    if out is None:
        fh: IO[str] = sys.stdout
    elif isinstance(out, (str, Path)):
        fh = open(out, "w", newline="", encoding="utf-8")
        close = True
    else:
        fh = out
    n = 0
    try:
        if fmt == "csv":
            w = csv.writer(fh)
            w.writerow(cols)
            for n, row in enumerate(cur, 1):
                w.writerow(row)
        else:
            for n, row in enumerate(cur, 1):
                fh.write(json.dumps(dict(zip(cols, row)), default=_json_default) + "\n")
    except sqlite3.DatabaseError as exc:
        raise QueryError(f"SQL error: {exc}") from None
    finally:
        if close:
            fh.close()
    return n


def _json_default(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.hex()
    return str(v)


def decode_json_columns(table: str, row: dict) -> dict:
    """A copy of ``row`` with the table's JSON text columns parsed (bad JSON stays text)."""
    out = dict(row)
    for col in JSON_COLUMNS.get(table, ()):
        v = out.get(col)
        if isinstance(v, str):
            try:
                out[col] = json.loads(v)
            except ValueError:
                pass
    return out


# -- the report contract --------------------------------------------------------------
@dataclass
class Arm:
    """One policy segment of a run as ``kvtop report`` sees it.

    ``records`` are in the replay results format, one per request (its final attempt); on a
    big log they are built only when first read (``kvtop report --plot``), since ``columns``
    answers every seed-table figure from SQL. ``apc`` is the automatic prefix cache hit rate
    and where it came from, or None.
    """

    label: str
    apc: dict | None
    run_id: str = ""
    policy: str = ""
    policy_version: int | None = None
    start_ts: float | None = None
    end_ts: float | None = None
    #: requests whose final attempt has no outcome row (still in flight, or lost in a crash)
    missing_outcomes: int = 0
    #: requests cut off by their client (``client_gone``: a run stopped mid-way): left out of
    #: the records and the seed table's requests and errors, counted here
    cancelled: int = 0
    #: the segment as a ``kvtop.seedtable.RequestColumns``; None: read ``records`` instead
    columns: SegmentColumns | None = None
    _records: list[dict] | None = field(default=None, repr=False)
    _load: Callable[[], list[dict]] | None = field(default=None, repr=False, compare=False)

    @property
    def records(self) -> list[dict]:
        if self._records is None:
            self._records = self._load() if self._load else []
        return self._records


RECORD_KEYS = ("request_id", "session", "turn", "input_tokens", "output_tokens", "status", "ttft_ms",
               "e2e_ms", "tpot_ms", "cached_tokens", "instance", "route_class", "arm")


def arms_from_db(db_path: str | Path | sqlite_utils.Database, run_id: str | None = None) -> list[Arm]:
    """One Arm per policy segment of the run (the latest when None), in time order.

    A record is a request's final attempt (a retry replaces its first try) joined with that
    attempt's outcome; ``status`` is ``ok`` or ``error`` (every other outcome status but
    ``client_gone``: a request its client cut off did not fail; it is left out of the records
    and counted in ``Arm.cancelled``).
    ``apc``: the mean ``engine_hit_rate`` of the segment's samples when the router sampled
    engine counters, else sum(delivered) / sum(input) over requests whose engine reported
    cached tokens (``delivered_cached_tokens``), else None.

    When every outcome of the run carries its decision's columns, each Arm's ``columns``
    computes the seed table from aggregates and index ranks and ``records`` waits until asked;
    older files (and outcomes without a route class) build the records at once.
    """
    db = _db(db_path)
    db, run_id = _scope(db, run_id)
    conn = db.conn
    run_clause = _run_clause(db, run_id)
    # Few requests are retried: find them once (a plain scan; grouping would walk the
    # request_id index in random order), then drop their superseded attempts.
    last_attempt: dict[str, int] = {}
    for rid, attempt in conn.execute(
            f"SELECT request_id, attempt FROM decisions d WHERE {run_clause} AND attempt > 1", (run_id,)):
        if attempt > last_attempt.get(rid, 0):
            last_attempt[rid] = attempt
    has_samples = db["samples"].exists()
    segs = segments(db, run_id)
    parts = [(d.conn, rid) for d, rid in _each_run(db, run_id)]
    columns = _segment_columns(conn, run_id, last_attempt, parts) if _flat(db, run_id) else None
    arms = []
    for seg in segs:
        key = (seg["policy"], seg["policy_version"])
        load = partial(_records, conn, run_id, run_clause, seg, last_attempt)
        arm = Arm(label=seg["label"], apc=None, run_id=run_id, policy=seg["policy"],
                  policy_version=seg["policy_version"], start_ts=seg["start_ts"], end_ts=seg["end_ts"])
        if columns is None:
            arm._records, arm.missing_outcomes, arm.cancelled = load()
            delivered = inputs = 0
            for r in arm._records:
                c = r["cached_tokens"]
                if c is not None and r["input_tokens"]:
                    delivered += c
                    inputs += r["input_tokens"]
        else:
            arm.columns = columns.get(key) or SegmentColumns(conn, run_id, key)
            arm._load = lambda load=load: load()[0]
            arm.cancelled = columns.cancelled[key]
            arm.missing_outcomes = (seg["decisions"] - columns.superseded_decisions[key]
                                    - arm.columns.counts()[0] - arm.cancelled)
            delivered, inputs = arm.columns.delivered_tokens
        arm.apc = _apc(conn, run_id, seg, delivered, inputs, has_samples)
        arms.append(arm)
    return arms


def _records(conn: sqlite3.Connection, run_id: str, run_clause: str, seg: dict,
             last_attempt: dict[str, int]) -> tuple[list[dict], int, int]:
    """The segment's records, how many final attempts have no outcome, and how many were
    cut off by their client (left out of the records)."""
    label = seg["label"]
    cursor = conn.execute(
        f"""SELECT d.request_id, d.attempt, d.session_id, d.turn, d.input_tokens, o.output_tokens,
            CASE WHEN o.status = 'ok' THEN 1 WHEN o.status IN {_CANCELLED_SQL} THEN 2
                 WHEN o.status IS NULL THEN NULL ELSE 0 END, o.ttft_ms, o.e2e_ms, o.tpot_ms, o.delivered_hit_tokens, d.instance, d.route_class
        FROM decisions d LEFT JOIN outcomes o
          ON o.request_id = d.request_id AND o.attempt = d.attempt AND +o.run_id = d.run_id
        WHERE {run_clause} AND d.policy = ? AND d.policy_version IS ? ORDER BY d.id""",
        (run_id, seg["policy"], seg["policy_version"]))
    # Fetching and building a million small objects is the whole cost here; the cyclic
    # collector would only rescan them (none of them forms a cycle).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        # Streamed from the cursor: no million-tuple list in between. ok is 1 or 0, and NULL
        # when the attempt has no outcome row (status None here, dropped below).
        records = [
            {"request_id": rid, "session": ses, "turn": turn, "input_tokens": inp,
             "output_tokens": out, "status": _RECORD_STATUS[ok],
             "ttft_ms": ttft, "e2e_ms": e2e, "tpot_ms": tpot, "cached_tokens": cached, "instance": inst,
             "route_class": rc, "arm": label}
            for rid, att, ses, turn, inp, out, ok, ttft, e2e, tpot, cached, inst, rc in cursor
            if rid not in last_attempt or att == last_attempt[rid]]
    finally:
        if gc_was_enabled:
            gc.enable()
    missing = len(records) - sum(map(bool, map(itemgetter("status"), records)))
    cancelled = sum(1 for r in records if r["status"] == "cancelled")
    if missing or cancelled:
        records = [r for r in records if r["status"] is not None and r["status"] != "cancelled"]
    return records, missing, cancelled


def _apc(conn: sqlite3.Connection, run_id: str, seg: dict, delivered: int, inputs: int,
         has_samples: bool) -> dict | None:
    if has_samples:
        mean, n = conn.execute(
            "SELECT avg(engine_hit_rate), count(engine_hit_rate) FROM samples "
            "WHERE run_id = ? AND ts BETWEEN ? AND ?", (run_id, seg["start_ts"], seg["end_ts"])).fetchone()
        if n:
            return {"value": mean, "source": "engine_counters"}
    if inputs:
        return {"value": delivered / inputs, "source": "delivered_cached_tokens"}
    return None


# -- the seed table straight from SQL ----------------------------------------------------
# A segment's records are its outcomes minus the few attempts a retry superseded (and rows
# with no status, which the records' join drops too). Counts and sums come from one grouped
# pass per covering index, with the superseded rows subtracted; the k-th smallest value is a
# LIMIT 1 OFFSET k walk on the index that orders the column.

_SCALE = 67108864  # 2**26: a latency splits exactly into integer, 26 and 26 fraction bits


def _exact_sum_sql(col: str) -> str:
    """Three integer aggregates from which ``_exact_total`` rebuilds Σ col exactly: SQLite's
    float sum() rounds in scan order, and the seed table's means must equal ``math.fsum``'s
    on the records bit for bit. Each x splits into trunc(x), its next 26 bits and the 26
    after: exact for 1 <= |x| < 2**37 ms, which ``_RankedValues.total`` checks on the index's
    two ends (anything else is summed from fetched values)."""
    whole = f"CAST({col} AS INTEGER)"
    scaled = f"{col} * {_SCALE}.0"
    mid = f"CAST({scaled} AS INTEGER)"
    # mid % 2**26 is mid - whole * 2**26 for x >= 1, the only x whose split is used.
    return (f"sum({whole}), sum({mid} % {_SCALE}), "
            f"sum(CAST(({scaled} - {mid}) * {_SCALE}.0 AS INTEGER))")


def _exact_total(whole: int | None, mid: int | None, low: int | None) -> Fraction:
    return Fraction((whole or 0) * _SCALE * _SCALE + (mid or 0) * _SCALE + (low or 0), _SCALE * _SCALE)


class _RankedValues:
    """``seedtable.Values`` of one column over a segment's final ok attempts (of one route
    class, or all): rank look-ups on the index, with the superseded attempts' values (few,
    held here) stepped over."""

    def __init__(self, conn: sqlite3.Connection, column: str, where: str, params: tuple,
                 n_rows: int, total: Fraction | None, superseded: list[float]):
        self._conn, self._column, self._params = conn, column, params
        self._from = f"FROM outcomes WHERE {where} AND {column} IS NOT NULL ORDER BY {column}"
        self._n_rows = n_rows  # index entries, superseded ones included
        self._total = total
        self._superseded = sorted(superseded)
        self.n = n_rows - len(superseded)

    def total(self) -> float:
        if self._total is not None and self._n_rows and not (
                1.0 <= self._rank(0) and self._rank(self._n_rows - 1) < 137438953472.0):
            self._total = None  # values the integer split cannot hold exactly (sub-ms, absurd)
        if self._total is None:
            values = Counter(v for (v,) in self._conn.execute(f"SELECT {self._column} {self._from}",
                                                              self._params))
            values.subtract(self._superseded)
            return math.fsum(values.elements())
        return float(self._total - sum(map(Fraction, self._superseded), Fraction(0)))

    def kth(self, k: int) -> float:
        # The k-th of (index values - superseded) is index rank j for the least j with
        # j = k + #{superseded <= value at j}; from j = k upward that is a fixed point, and
        # j <= k + #superseded, so one read of that window finds it.
        window = self._ranks(k, min(k + len(self._superseded), self._n_rows - 1))
        j = k
        while True:
            value = window[j - k]
            nxt = k + bisect.bisect_right(self._superseded, value)
            if nxt == j:
                return value
            j = nxt

    def _ranks(self, first: int, last: int) -> list[float]:
        """Index ranks first..last, walking in from the nearer end of the index."""
        params = (*self._params, last - first + 1)
        if first <= self._n_rows - 1 - last:
            sql = f"SELECT {self._column} {self._from} LIMIT ? OFFSET ?"
            return [v for (v,) in self._conn.execute(sql, (*params, first))]
        sql = f"SELECT {self._column} {self._from} DESC LIMIT ? OFFSET ?"
        return [v for (v,) in self._conn.execute(sql, (*params, self._n_rows - 1 - last))][::-1]

    def _rank(self, j: int) -> float:
        return self._ranks(j, j)[0]


class SegmentColumns:
    """``kvtop.seedtable.RequestColumns`` of one policy segment, read from the decision log."""

    def __init__(self, conn: sqlite3.Connection, run_id: str, segment: tuple[str, int | None]):
        self._conn, self._run_id, self._segment = conn, run_id, segment
        self.requests = self.ok = 0
        self.classes: dict[str, list[int]] = {}  # class -> [ok with ttft, failed, requests]
        self.instances: Counter[str] = Counter()
        self.usage = [0, 0]  # Σ delivered, Σ input over ok requests that report delivered
        self.delivered_tokens = (0, 0)  # the same over every request (the log's APC)
        #: (column, class or None) -> [index entries, exact Σ or None, superseded values]
        self.values: dict[tuple[str, str | None], list] = {}

    def counts(self) -> tuple[int, int]:
        return self.requests, self.ok

    def ok_values(self, column: str, route_class: str | None = None) -> _RankedValues:
        n_rows, total, superseded = self.values.get((column, route_class), (0, Fraction(0), []))
        where = "run_id = ? AND policy IS ? AND policy_version IS ? AND status = 'ok'"
        params: tuple = (self._run_id, *self._segment)
        if route_class is not None:
            where += " AND route_class = ?"
            params += (route_class,)
        return _RankedValues(self._conn, column, where, params, n_rows, total, superseded)

    def class_counts(self) -> dict[str, tuple[int, int]]:
        # A class whose every request a retry superseded has none left: the records lack it too.
        return {cls: (timed, failed) for cls, (timed, failed, n) in self.classes.items() if n}

    def instance_counts(self) -> dict[str, int]:
        return {name: n for name, n in self.instances.items() if n}

    def usage_tokens(self) -> tuple[int, int]:
        return self.usage[0], self.usage[1]


class _Columns(dict):
    """Per segment key, its SegmentColumns; plus superseded decisions and cancelled
    requests per segment."""

    superseded_decisions: Counter
    cancelled: Counter


def _segment_columns(conn: sqlite3.Connection, run_id: str, last_attempt: dict[str, int],
                     parts: list[tuple[sqlite3.Connection, str]] | None = None) -> _Columns | None:
    """Every segment's SegmentColumns from two grouped passes over covering indexes, or
    None when the outcomes cannot answer alone (a row without its route class, which the
    records would then derive from the input length). ``parts``: where the passes run, each
    (connection, its run id); on several logs each file for its own run, the sums adding up,
    while the SegmentColumns read ranks on ``conn`` (the union) under ``run_id``."""
    parts = parts or [(conn, run_id)]
    out = _Columns()
    out.superseded_decisions = Counter()
    out.cancelled = Counter()
    not_cancelled = f"status IS NOT NULL AND status NOT IN {_CANCELLED_SQL}"

    def seg(pol: str, ver: int | None) -> SegmentColumns:
        if (pol, ver) not in out:
            out[(pol, ver)] = SegmentColumns(conn, run_id, (pol, ver))
        return out[(pol, ver)]

    def add_values(s: SegmentColumns, key: tuple[str, str | None], n: int, total: Fraction | None) -> None:
        entry = s.values.setdefault(key, [0, Fraction(0), []])
        entry[0] += n
        entry[1] = None if entry[1] is None or total is None else entry[1] + total

    try:
        # Status and class counts, TTFT sums per class (and so per segment).
        for pol, ver, status, cls, n, n_ttft, *pieces in _each_part(parts, 
                f"""SELECT policy, policy_version, status, route_class, count(*), count(ttft_ms),
                {_exact_sum_sql('ttft_ms')} FROM outcomes WHERE run_id = ? AND {not_cancelled}
                GROUP BY policy, policy_version, status, route_class"""):
            if not cls:
                return None
            s = seg(pol, ver)
            s.requests += n
            counts = s.classes.setdefault(cls, [0, 0, 0])
            counts[2] += n
            if status == "ok":
                s.ok += n
                counts[0] += n_ttft
                total = _exact_total(*pieces)
                add_values(s, ("ttft_ms", cls), n_ttft, total)
                add_values(s, ("ttft_ms", None), n_ttft, total)
            else:
                counts[1] += n
        delivered: dict[tuple, list[int]] = {}
        for pol, ver, instance, ok, n, hit, inp, n_tpot, n_e2e, *pieces in _each_part(parts, 
                f"""SELECT policy, policy_version, instance, status = 'ok', count(*),
                sum(CASE WHEN delivered_hit_tokens IS NOT NULL AND input_tokens THEN delivered_hit_tokens END),
                sum(CASE WHEN delivered_hit_tokens IS NOT NULL AND input_tokens THEN input_tokens END),
                count(tpot_ms), count(e2e_ms), {_exact_sum_sql('e2e_ms')}
                FROM outcomes WHERE run_id = ? AND {not_cancelled}
                GROUP BY policy, policy_version, instance, status"""):
            s = seg(pol, ver)
            if instance:
                s.instances[str(instance)] += n
            sums = delivered.setdefault((pol, ver), [0, 0])
            sums[0] += hit or 0
            sums[1] += inp or 0
            if ok:
                s.usage[0] += hit or 0
                s.usage[1] += inp or 0
                add_values(s, ("e2e_ms", None), n_e2e, _exact_total(*pieces))
                add_values(s, ("tpot_ms", None), n_tpot, None)  # no TPOT mean: ranks only
        for pol, ver, n in _each_part(parts,
                f"""SELECT policy, policy_version, count(*) FROM outcomes
                WHERE run_id = ? AND status IN {_CANCELLED_SQL} GROUP BY policy, policy_version"""):
            out.cancelled[(pol, ver)] += n
    except sqlite3.OperationalError as exc:  # e.g. integer overflow on absurd latencies
        if "overflow" not in str(exc):
            raise
        return None
    if last_attempt:
        retried = json.dumps(list(last_attempt))
        # Through the request_id index (+run_id: the planner would walk the whole run instead).
        for rid, attempt, pol, ver in _each_part(
                parts, "SELECT request_id, attempt, policy, policy_version FROM decisions "
                "WHERE request_id IN (SELECT value FROM json_each(?)) AND +run_id = ?", retried):
            if attempt != last_attempt[rid]:
                out.superseded_decisions[(pol, ver)] += 1
        for (rid, attempt, pol, ver, status, cls, instance, ttft, e2e, tpot, hit,
             inp) in _each_part(
                parts, "SELECT request_id, attempt, policy, policy_version, status, route_class, instance, "
                "ttft_ms, e2e_ms, tpot_ms, delivered_hit_tokens, input_tokens FROM outcomes "
                "WHERE request_id IN (SELECT value FROM json_each(?)) AND +run_id = ? AND status IS NOT NULL",
                retried):
            if attempt == last_attempt[rid]:
                continue
            if status in CANCELLED:  # counted among the cancelled, not the requests
                out.cancelled[(pol, ver)] -= 1
                continue
            s = seg(pol, ver)  # a superseded attempt: take it back out of every figure
            s.requests -= 1
            if instance:
                s.instances[str(instance)] -= 1
            counted_hit = hit is not None and bool(inp)
            sums = delivered.setdefault((pol, ver), [0, 0])
            if counted_hit:
                sums[0] -= hit
                sums[1] -= inp
            s.classes[cls][2] -= 1
            if status != "ok":
                s.classes[cls][1] -= 1
                continue
            s.ok -= 1
            if counted_hit:
                s.usage[0] -= hit
                s.usage[1] -= inp
            for key, value in ((("ttft_ms", cls), ttft), (("ttft_ms", None), ttft),
                               (("e2e_ms", None), e2e), (("tpot_ms", None), tpot)):
                if value is not None:
                    s.values[key][2].append(value)
            if ttft is not None:
                s.classes[cls][0] -= 1
    for key, s in out.items():
        s.delivered_tokens = tuple(delivered.get(key, (0, 0)))
    return out



def _each_part(parts: list[tuple[sqlite3.Connection, str]], sql: str, *before: Any):
    """The rows of ``sql`` on each part in turn, binding ``before`` then the part's run id."""
    for conn, run_id in parts:
        yield from conn.execute(sql, (*before, run_id))


def table_names(db: sqlite_utils.Database) -> list[str]:
    """The kvtop tables present in this file, in schema order."""
    present = set(db.table_names())
    return [t for t in TABLES if t in present]


__all__ = ["Arm", "QueryError", "SegmentColumns", "arms_from_db", "decisions", "decode_json_columns", "export",
           "is_merged", "kv_drift", "open_logs", "open_readonly", "parse_time", "request_attempts", "resolve_run",
           "run_sql", "runs", "segments",
           "summary", "table_names"]
