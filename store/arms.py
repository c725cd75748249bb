"""The report contract: what ``kvtop report --db`` reads from a decision log.

``arms_from_db`` gives one ``Arm`` per policy segment of a run, its requests in the replay
results format (one record per request, its final attempt), and a ``SegmentColumns`` that
answers every seed-table figure (kvtop/seedtable.py's ``RequestColumns``) from SQL without
building a record per request.
"""

from __future__ import annotations

import bisect
import gc
import json
import math
import sqlite3
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from operator import itemgetter
from pathlib import Path
from typing import Any, Callable

import sqlite_utils

from store.logs import CANCELLED, CANCELLED_SQL, as_db, each_run, is_flat, run_filter, scope
from store.reads import segments

_RECORD_STATUS = {1: "ok", 0: "error", 2: "cancelled", None: None}


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


def arms_from_db(db_path: str | Path | sqlite_utils.Database, run_id: str | None = None) -> list[Arm]:
    """One Arm per policy segment of the run (the latest when None), in time order.

    A record is a request's final attempt (a retry replaces its first try) joined with that
    attempt's outcome; ``status`` is ``ok`` or ``error`` (every other outcome status but
    ``client_gone``: a request its client cut off did not fail; it is left out of the records
    and counted in ``Arm.cancelled``).
    ``apc``: token-weighted, as the engines count it: the growth of the engines' prefix-cache
    counters (hits over queries, summed over instances) across the segment's samples when the
    router sampled them (``engine_counters``), else sum(delivered) / sum(input) over requests
    whose engine reported cached tokens (``delivered_cached_tokens``), else, for a log older
    than schema 6 with neither, the mean of the sampled hit rates (``engine_rate_mean``: a
    time average, not a share of tokens), else None.

    When every outcome of the run carries its decision's columns, each Arm's ``columns``
    computes the seed table from grouped counts and the latency columns, loaded in index
    order when first asked, and ``records`` waits until asked;
    older files (and outcomes without a route class) build the records at once.
    """
    db = as_db(db_path)
    db, run_id = scope(db, run_id)
    conn = db.conn
    run_clause = run_filter(db, run_id)
    # Few requests are retried: find them once (a plain scan; grouping would walk the
    # request_id index in random order), then drop their superseded attempts.
    last_attempt: dict[str, int] = {}
    for rid, attempt in conn.execute(
            f"SELECT request_id, attempt FROM decisions d WHERE {run_clause} AND attempt > 1", (run_id,)):
        if attempt > last_attempt.get(rid, 0):
            last_attempt[rid] = attempt
    has_samples = db["samples"].exists()
    segs = segments(db, run_id)
    parts = [(d.conn, rid) for d, rid in each_run(db, run_id)]
    columns = _segment_columns(parts, last_attempt) if is_flat(db, run_id) else None
    arms = []
    for k, seg in enumerate(segs):
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
            arm.columns = columns.get(key) or SegmentColumns(parts, key)
            arm._load = lambda load=load: load()[0]
            arm.cancelled = columns.cancelled[key]
            arm.missing_outcomes = (seg["decisions"] - columns.superseded_decisions[key]
                                    - arm.columns.counts()[0] - arm.cancelled)
            delivered, inputs = arm.columns.delivered_tokens
        # the engines' counters belong to this segment until the next one starts (its last
        # requests' prefills run after its last decision); overlapping segments share them
        until = segs[k + 1]["start_ts"] if k + 1 < len(segs) else math.inf
        counters = has_samples and until >= seg["end_ts"]
        arm.apc = _apc(conn, run_id, seg, delivered, inputs, has_samples, counters, until)
        arms.append(arm)
    return arms


def _records(conn: sqlite3.Connection, run_id: str, run_clause: str, seg: dict,
             last_attempt: dict[str, int]) -> tuple[list[dict], int, int]:
    """The segment's records, how many final attempts have no outcome, and how many were
    cut off by their client (left out of the records)."""
    label = seg["label"]
    cursor = conn.execute(
        f"""SELECT d.request_id, d.attempt, d.session_id, d.turn, d.input_tokens, o.output_tokens,
            CASE WHEN o.status = 'ok' THEN 1 WHEN o.status IN {CANCELLED_SQL} THEN 2
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
        # when the attempt has no outcome row (status None here, dropped below). The records
        # are store.results.RequestResult's, its RECORD_KEYS in order, built as dict literals:
        # a RequestResult and its as_record() per request would double the cost (a test checks
        # the keys).
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
         has_samples: bool, use_counters: bool = True, until: float = math.inf) -> dict | None:
    counters = _counter_growth(conn, run_id, seg["start_ts"], until) if use_counters else None
    if counters is not None:
        queries, hits = counters
        return {"value": hits / queries, "source": "engine_counters", "queries": queries, "hits": hits}
    if inputs:
        return {"value": delivered / inputs, "source": "delivered_cached_tokens"}
    if has_samples:
        mean, n = conn.execute(
            "SELECT avg(engine_hit_rate), count(engine_hit_rate) FROM samples "
            "WHERE run_id = ? AND ts BETWEEN ? AND ?", (run_id, seg["start_ts"], seg["end_ts"])).fetchone()
        if n:
            return {"value": mean, "source": "engine_rate_mean"}
    return None


def _counter_growth(conn: sqlite3.Connection, run_id: str, start: float, until: float
                    ) -> tuple[float, float] | None:
    """(queries, hits) the engines counted from ``start`` until ``until``: per instance, from its
    last sample before ``start`` (or its first after) to its last before ``until``, summing each
    step's growth; a
    counter that went down restarted with its engine, and its new value is the growth. None
    when the samples carry no counters (a log older than schema 6, or engines without them)."""
    cols = {r[1] for r in conn.execute("PRAGMA table_info(samples)")}
    if "engine_prefix_queries" not in cols:
        return None
    rows = conn.execute(
        "SELECT instance, engine_prefix_queries, engine_prefix_hits FROM samples "
        "WHERE run_id = ? AND engine_prefix_queries IS NOT NULL AND ts < ? AND ts >= "
        "coalesce((SELECT max(ts) FROM samples WHERE run_id = ? AND ts < ?), ?) ORDER BY ts, id",
        (run_id, until if until != math.inf else 1e300, run_id, start, start)).fetchall()
    last: dict[str, tuple[float, float]] = {}
    queries = hits = 0.0
    for inst, q, h in rows:
        h = h or 0.0
        prev = last.get(inst)
        if prev is not None:
            dq, dh = q - prev[0], h - prev[1]
            if dq < 0 or dh < 0:  # the engine restarted: its counters began again from zero
                dq, dh = q, h
            queries += dq
            hits += dh
        last[inst] = (q, h)
    return (queries, hits) if queries > 0 else None


# -- the seed table straight from SQL ----------------------------------------------------
# A segment's records are its outcomes minus the few attempts a retry superseded (and rows
# with no status, which the records' join drops too). Counts come from one grouped pass per
# covering index, with the superseded rows subtracted. A latency column is loaded when the
# seed table first asks for it: the index that orders it hands its values over already
# sorted (a million floats is 8 MB), the superseded values are stepped over, and the mean
# and percentiles are computed on the list as on the records (math.fsum, store.stats).

#: The columns whose superseded values the grouped passes collect, so ``ok_values`` can drop them.
VALUE_COLUMNS = ("ttft_ms", "e2e_ms", "tpot_ms")


class LoadedValues:
    """``seedtable.Values`` of one column over a segment's final ok attempts: the values, sorted."""

    def __init__(self, data: list[float]):
        self.data = data

    @property
    def n(self) -> int:
        return len(self.data)

    def total(self) -> float:
        return math.fsum(self.data)

    def kth(self, k: int) -> float:
        return self.data[k]


def _without(data: list[float], superseded: list[float]) -> list[float]:
    """Sorted ``data`` minus one occurrence of each of ``superseded`` (all of them in it)."""
    if not superseded:
        return data
    drop, lo = [], 0
    for value in sorted(superseded):
        lo = bisect.bisect_left(data, value, lo)  # the next equal one after a dropped duplicate
        drop.append(lo)
        lo += 1
    out, start = [], 0
    for i in drop:
        out += data[start:i]
        start = i + 1
    out += data[start:]
    return out


class SegmentColumns:
    """``kvtop.seedtable.RequestColumns`` of one policy segment, read from the decision log."""

    def __init__(self, parts: list[tuple[sqlite3.Connection, str]], segment: tuple[str, int | None]):
        self._parts, self._segment = parts, segment
        self.requests = self.ok = 0
        self.classes: dict[str, list[int]] = {}  # class -> [ok with ttft, failed, requests]
        self.instances: Counter[str] = Counter()
        self.usage = [0, 0]  # Σ delivered, Σ input over ok requests that report delivered
        self.delivered_tokens = (0, 0)  # the same over every request (the log's APC)
        #: (column, class or None) -> the values of superseded ok attempts, to step over
        self.superseded: dict[tuple[str, str | None], list[float]] = {}
        self._values: dict[tuple[str, str | None], LoadedValues] = {}

    def counts(self) -> tuple[int, int]:
        return self.requests, self.ok

    def ok_values(self, column: str, route_class: str | None = None) -> LoadedValues:
        if column not in VALUE_COLUMNS:
            raise ValueError(f"no ok values of {column!r} in the log's seed table (one of {VALUE_COLUMNS})")
        key = (column, route_class)
        if key not in self._values and column == "ttft_ms" and route_class is None:
            # The per-class lists (class_rows reads them too) merged: one read of the column.
            # Every ok row has a class here (_segment_columns gives up otherwise).
            data = [v for cls in self.classes for v in self.ok_values(column, cls).data]
            data.sort()  # sorted runs, merged
            self._values[key] = LoadedValues(data)
        if key not in self._values:
            where = "run_id = ? AND policy IS ? AND policy_version IS ? AND status = 'ok'"
            params: tuple = tuple(self._segment)
            if route_class is not None:
                where += " AND route_class = ?"
                params += (route_class,)
            data: list[float] = []
            for conn, run_id in self._parts:
                data += [v for (v,) in conn.execute(
                    f"SELECT {column} FROM outcomes WHERE {where} AND {column} IS NOT NULL ORDER BY {column}",
                    (run_id, *params))]
            if len(self._parts) > 1:
                data.sort()  # the files' sorted runs, merged
            self._values[key] = LoadedValues(_without(data, self.superseded.get(key, [])))
        return self._values[key]

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


def _segment_columns(parts: list[tuple[sqlite3.Connection, str]],
                     last_attempt: dict[str, int]) -> _Columns | None:
    """Every segment's SegmentColumns from two grouped passes over covering indexes, or
    None when the outcomes cannot answer alone (a row without its route class, which the
    records would then derive from the input length). ``parts``: where the run's rows are,
    each (connection, its run id); on several logs each file for its own run, the counts
    adding up."""
    out = _Columns()
    out.superseded_decisions = Counter()
    out.cancelled = Counter()
    not_cancelled = f"status IS NOT NULL AND status NOT IN {CANCELLED_SQL}"

    def seg(pol: str, ver: int | None) -> SegmentColumns:
        if (pol, ver) not in out:
            out[(pol, ver)] = SegmentColumns(parts, (pol, ver))
        return out[(pol, ver)]

    # Status and class counts (and so per segment).
    for pol, ver, status, cls, n, n_ttft in _each_part(parts,
            f"""SELECT policy, policy_version, status, route_class, count(*), count(ttft_ms)
            FROM outcomes WHERE run_id = ? AND {not_cancelled}
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
        else:
            counts[1] += n
    delivered: dict[tuple, list[int]] = {}
    for pol, ver, instance, ok, n, hit, inp in _each_part(parts,
            f"""SELECT policy, policy_version, instance, status = 'ok', count(*),
            sum(CASE WHEN delivered_hit_tokens IS NOT NULL AND input_tokens THEN delivered_hit_tokens END),
            sum(CASE WHEN delivered_hit_tokens IS NOT NULL AND input_tokens THEN input_tokens END)
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
    for pol, ver, n in _each_part(parts,
            f"""SELECT policy, policy_version, count(*) FROM outcomes
            WHERE run_id = ? AND status IN {CANCELLED_SQL} GROUP BY policy, policy_version"""):
        out.cancelled[(pol, ver)] += n
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
                    s.superseded.setdefault(key, []).append(value)
            if ttft is not None:
                s.classes[cls][0] -= 1
    for key, s in out.items():
        s.delivered_tokens = tuple(delivered.get(key, (0, 0)))
    return out


def _each_part(parts: list[tuple[sqlite3.Connection, str]], sql: str, *before: Any):
    """The rows of ``sql`` on each part in turn, binding ``before`` then the part's run id."""
    for conn, run_id in parts:
        yield from conn.execute(sql, (*before, run_id))
