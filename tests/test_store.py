"""Decision-log queries and the `kvtop log` verb on small hand-built databases.

Every database is a real file written by store.writer.Writer, so the tests read what the
router writes. The numbers in the expectations are computed by hand from the rows below.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3

import pytest

from kvtop.cli import main
from store.arms import arms_from_db
from store.errors import QueryError
from store.export import export
from store.logs import is_flat, open_readonly, parse_time, resolve_run
from store.reads import decisions, segments
from store.results import RECORD_KEYS
from store.sandbox import run_sql
from store.summary import summary
from store.writer import Writer

# Run r1: lmetric@1 for four requests, then a live swap to unified@2 (one request retried).
# (ts, request_id, attempt, session, turn, policy, version, instance, reason, class,
#  input, est, best) + outcome (status, ttft_ms, e2e_ms, output_tokens, delivered)
R1 = [
    (100.0, "q1", 1, "s1", 1, "lmetric", 1, "a", "argmin", "WARM", 1000, 0, 0, ("ok", 100.0, 1000.0, 10, 0)),
    (101.0, "q2", 1, "s1", 2, "lmetric", 1, "a", "argmin", "WARM", 2000, 900, 1000, ("ok", 200.0, 2000.0, 20, 800)),
    (102.0, "q3", 1, "s2", 1, "lmetric", 1, "b", "tie_rr", "MEDIUM", 6000, 0, 500, ("ok", 300.0, 3000.0, 30, None)),
    (103.0, "q4", 1, "s2", 2, "lmetric", 1, "b", "argmin", "MEDIUM", 7000, 5000, 6000, ("error", None, 50.0, 0, None)),
    (200.0, "q5", 1, "s1", 3, "unified", 2, "a", "affinity_stick", "WARM", 3000, 2000, 2000,
     ("upstream_error", None, 10.0, 0, None)),
    (201.0, "q5", 2, "s1", 3, "unified", 2, "b", "retry", "WARM", 3000, 0, 2000, ("ok", 400.0, 4000.0, 40, 0)),
    (202.0, "q6", 1, "s3", 1, "unified", 2, "a", "affinity_new", "HEAVY", 30000, 0, 0, ("ok", 1000.0, 5000.0, 50, 0)),
]
# Run r2, started later: the latest run.
R2 = [
    (1001.0, "p1", 1, "t1", 1, "lmetric", 1, "a", "argmin", "WARM", 500, 0, 0, ("ok", 50.0, 500.0, 5, 0)),
    (1002.0, "p2", 1, "t1", 2, "lmetric", 1, "b", "argmin", "WARM", 600, 400, 500, ("timeout", None, 9000.0, 0, None)),
]


def _write(path, runs: dict[str, tuple[float, list]], samples: list[dict] = (), *, flat: bool = True) -> str:
    """``flat``: outcomes carry their decision's columns, as the router writes them; False: as
    an older router wrote them (NULL there), which the queries answer with a join."""
    w = Writer(str(path), flush_interval=0.01).start()
    for run_id, (started, rows) in runs.items():
        w.put("runs", {"run_id": run_id, "started_at": started, "policy": rows[0][5], "backends": [{"name": "a"}]})
        for ts, rid, att, ses, turn, pol, ver, inst, reason, rc, inp, est, best, out in rows:
            w.put("decisions", {"run_id": run_id, "ts": ts, "request_id": rid, "attempt": att, "session_id": ses,
                                "turn": turn, "policy": pol, "policy_version": ver, "instance": inst,
                                "reason": reason, "route_class": rc, "input_tokens": inp, "est_hit_tokens": est,
                                "best_hit_tokens": best, "new_prefill_tokens": inp - est,
                                "scores": [{"instance": inst, "score": 1.0}]})
            if out is None:  # still in flight when the router stopped
                continue
            status, ttft, e2e, out_toks, delivered = out
            w.put("outcomes", {"run_id": run_id, "ts": ts + 1, "request_id": rid, "attempt": att, "instance": inst,
                               "status": status, "ttft_ms": ttft, "e2e_ms": e2e, "tpot_ms": 5.0 if ttft else None,
                               "output_tokens": out_toks, "delivered_hit_tokens": delivered,
                               **({"session_id": ses, "turn": turn, "policy": pol, "policy_version": ver,
                                   "route_class": rc, "input_tokens": inp, "est_hit_tokens": est} if flat else {})})
    for s in samples:
        w.put("samples", s)
    w.close()
    return str(path)


@pytest.fixture(params=[True, False], ids=["flat", "joined"])
def db_path(tmp_path, request):
    # Every query must answer the same from both layouts.
    return _write(tmp_path / "kvtop.db", {"r1": (99.0, R1), "r2": (1000.0, R2)}, flat=request.param)


@pytest.fixture
def db(db_path):
    return open_readonly(db_path)


# -- decisions filters ------------------------------------------------------------------
@pytest.mark.parametrize("filters, expected", [
    ({"run": "r1"}, ["q6", "q5", "q5", "q4", "q3", "q2", "q1"]),  # newest first, retry included
    ({"session": "s1"}, ["q5", "q5", "q2", "q1"]),  # every run
    ({"instance": "b"}, ["p2", "q5", "q4", "q3"]),
    ({"reason": "retry"}, ["q5"]),
    ({"policy": "unified"}, ["q6", "q5", "q5"]),
    ({"policy": "lmetric@1", "run": "r1"}, ["q4", "q3", "q2", "q1"]),
    ({"policy": "unified@9"}, []),  # no such version
    ({"route_class": "MEDIUM"}, ["q4", "q3"]),
    ({"run": "r1", "since": 200}, ["q6", "q5", "q5"]),
    ({"run": "r1", "until": "101"}, ["q2", "q1"]),  # a numeric string is unix seconds
    ({"run": "r1", "since": 101, "until": 102}, ["q3", "q2"]),  # both ends inclusive
    ({"run": "r1", "instance": "a", "policy": "unified"}, ["q6", "q5"]),
    ({"limit": 2}, ["p2", "p1"]),
    ({"run": "r", "limit": 1}, None),  # "r" prefixes both runs: ambiguous
    ({"run": "r9"}, None),  # unknown run
])
def test_decisions_filters(db, filters, expected):
    if expected is None:
        with pytest.raises(QueryError):
            decisions(db, **filters)
        return
    assert [r["request_id"] for r in decisions(db, **filters)] == expected


def test_decision_carries_its_attempts_outcome(db):
    first, retry = sorted(decisions(db, run="r1", session="s1", since=200), key=lambda r: r["attempt"])
    # Joined on (request_id, attempt): the first try failed upstream, the retry succeeded.
    assert (first["status"], first["ttft_ms"]) == ("upstream_error", None)
    assert (retry["status"], retry["ttft_ms"], retry["instance"]) == ("ok", 400.0, "b")
    assert json.loads(retry["scores"]) == [{"instance": "b", "score": 1.0}]


def test_run_prefix_resolves_when_unique(tmp_path):
    path = _write(tmp_path / "p.db", {"run-abc123": (1.0, R2)})
    assert resolve_run(open_readonly(path), "run-abc") == "run-abc123"


# -- segments and summary ---------------------------------------------------------------
def test_segments_split_at_the_policy_swap(db):
    segs = segments(db, "r1")
    assert [(s["label"], s["decisions"], s["requests"], s["start_ts"], s["end_ts"]) for s in segs] == [
        ("lmetric@1", 4, 4, 100.0, 103.0),
        ("unified@2", 3, 2, 200.0, 202.0),  # the retry is a decision, not a request
    ]
    # No run given: the latest run (r2), one segment.
    assert [s["label"] for s in segments(db)] == ["lmetric@1"] and segments(db)[0]["run_id"] == "r2"


def test_summary_counts_percentiles_and_regrets(db):
    lm, un = summary(db, "r1")["segments"]
    assert lm["reasons"] == {"argmin": 3, "tie_rr": 1}
    assert lm["route_classes"] == {"WARM": 2, "MEDIUM": 2}
    assert lm["statuses"] == {"ok": 3, "error": 1} and lm["errors"] == 1
    # ok TTFTs 100, 200, 300: p50 is the middle one; p90 sits at rank 1.8 -> 200 + 0.8 * 100.
    assert lm["ttft_ms"] == pytest.approx({"n": 3, "p50": 200.0, "p90": 280.0, "p99": 298.0})
    assert lm["e2e_ms"] == pytest.approx({"n": 3, "p50": 2000.0, "p90": 2800.0, "p99": 2980.0})
    h = lm["hits"]
    # est 0+900+0+5000, best 0+1000+500+6000; regret = best - est = 1600 over 4 decisions.
    assert (h["est_hit_tokens"], h["best_hit_tokens"], h["routing_regret"]) == (5900, 7500, 1600)
    assert h["mean_routing_regret"] == 400.0 and h["mean_est_hit_tokens"] == 1475.0
    # Delivered is reported for q1 (0) and q2 (800) only; the estimate error compares est on
    # those same two: (0 + 900) - (0 + 800) = 100, mean 50. q3's NULL is not a zero.
    assert (h["delivered_hit_tokens"], h["delivered_reported"]) == (800, 2)
    assert (h["estimate_error"], h["mean_estimate_error"]) == (100, 50.0)
    assert h["input_tokens"] == 16000

    assert un["reasons"] == {"affinity_stick": 1, "retry": 1, "affinity_new": 1}
    assert un["statuses"] == {"ok": 2, "upstream_error": 1} and un["errors"] == 1
    # ok TTFTs 400 (the retry) and 1000: p50 halfway = 700, p90 = 400 + 0.9 * 600.
    assert un["ttft_ms"] == pytest.approx({"n": 2, "p50": 700.0, "p90": 940.0, "p99": 994.0})
    # regret: q5 try 1 (2000-2000) + retry on b (2000-0) + q6 (0-0) = 2000 over 3 decisions.
    assert un["hits"]["routing_regret"] == 2000
    assert un["hits"]["mean_routing_regret"] == pytest.approx(2000 / 3)


def test_summary_of_a_segment_without_ok_outcomes(tmp_path):
    rows = [R2[1]]  # a single timeout
    s = summary(open_readonly(_write(tmp_path / "t.db", {"x": (1.0, rows)})))["segments"][0]
    assert s["ttft_ms"] == {"n": 0, "p50": None, "p90": None, "p99": None}
    assert s["statuses"] == {"timeout": 1} and s["hits"]["mean_estimate_error"] is None


def _random_run(n: int, seed: int) -> list:
    """n requests over three segments with ties, NULL latencies, failures and retries."""
    import random
    rnd = random.Random(seed)
    rows = []
    for i in range(n):
        pol, ver = [("lmetric", 1), ("unified", 2), ("unified", 3)][i * 3 // n]
        ok = rnd.random() < 0.8
        ttft = float(rnd.choice([5, 7, 7, 100])) * rnd.randrange(1, 50) if ok and rnd.random() < 0.95 else None
        out = ("ok" if ok else rnd.choice(["error", "timeout"]), ttft, rnd.random() * 1e4, 3,
               rnd.choice([None, 0, 64]))
        rows.append((float(i), f"x{i}", 1, f"s{i % 7}", 1, pol, ver, "ab"[i % 2], "argmin", "WARM",
                     1000, 64, 128, out))
        if not ok and rnd.random() < 0.3:  # a retry, sometimes never answered
            rows.append((i + 0.5, f"x{i}", 2, f"s{i % 7}", 1, pol, ver, "b", "retry", "WARM", 1000, 0, 128,
                         ("ok", 9.0, 90.0, 3, None) if rnd.random() < 0.7 else None))
    return rows


@pytest.mark.parametrize("n, seed", [(1, 0), (2, 1), (3, 2), (57, 3), (400, 4)])
def test_flat_and_joined_layouts_agree_exactly(tmp_path, n, seed):
    # The index-walk percentiles and the outcome-only sums must equal the joined, sorted ones
    # bit for bit, at every size (1 and 2 values are the edge ranks).
    rows = _random_run(n, seed)
    flat = open_readonly(_write(tmp_path / "f.db", {"r": (0.0, rows)}, flat=True))
    joined = open_readonly(_write(tmp_path / "j.db", {"r": (0.0, rows)}, flat=False))
    assert is_flat(flat, "r") and not is_flat(joined, "r")
    assert summary(flat) == summary(joined)
    a, b = arms_from_db(flat), arms_from_db(joined)
    assert [(x.label, x.records, x.apc, x.missing_outcomes) for x in a] == \
        [(x.label, x.records, x.apc, x.missing_outcomes) for x in b]


def _random_report_run(n: int, seed: int, tiny: bool) -> list:
    """n requests for the seed table: three segments, several classes and instances, fractional
    latencies with ties, failures, and retries of ok attempts too (so the superseded values
    sit among the ranks). ``tiny``: some sub-millisecond TTFTs among them."""
    import random
    rnd = random.Random(seed)
    rows = []
    for i in range(n):
        pol, ver = [("lmetric", 1), ("unified", 2), ("unified", 3)][i * 3 // n]
        cls, inst = rnd.choice(["WARM", "MEDIUM", "HEAVY_P2P"]), rnd.choice("abc")
        ok = rnd.random() < 0.85
        ttft = rnd.choice([rnd.uniform(1, 5000), 7.25, 0.3 if tiny else 3.5]) if ok and rnd.random() < 0.9 else None
        out = ("ok" if ok else "timeout", ttft, rnd.uniform(1, 9e4), 3, rnd.choice([None, 0, 64]))
        rows.append((float(i), f"x{i}", 1, "s", 1, pol, ver, inst, "argmin", cls, rnd.choice([0, 100, 1000]),
                     64, 128, out))
        if rnd.random() < 0.1:  # retried, failed first or not; the retry sometimes unanswered
            rows.append((i + 0.5, f"x{i}", 2, "s", 1, pol, ver, "c", "retry", cls, 1000, 0, 128,
                         ("ok", rnd.uniform(1, 50), 90.5, 3, 8) if rnd.random() < 0.8 else None))
    return rows


@pytest.mark.parametrize("n, seed, tiny", [(1, 0, False), (2, 1, False), (5, 2, True), (60, 3, False),
                                           (500, 4, False), (500, 5, True)])
def test_report_columns_equal_the_records(tmp_path, n, seed, tiny):
    # kvtop report --db computes from SQL counts and each latency column loaded in index
    # order; every figure must equal the records' bit for bit (means too), with superseded
    # attempts and unanswered retries.
    from kvtop import seedtable
    arms = arms_from_db(_write(tmp_path / "r.db", {"r": (0.0, _random_report_run(n, seed, tiny))}))
    assert arms
    for arm in arms:
        assert arm.columns is not None and arm._records is None  # no records built yet
        assert seedtable.seed_row(arm.columns, arm.apc) == seedtable.seed_row(arm.records, arm.apc)
        assert seedtable.class_rows(arm.columns) == seedtable.class_rows(arm.records)
        assert arm.columns.delivered_tokens == (
            sum(r["cached_tokens"] for r in arm.records if r["cached_tokens"] is not None and r["input_tokens"]),
            sum(r["input_tokens"] for r in arm.records if r["cached_tokens"] is not None and r["input_tokens"]))
    joined = arms_from_db(_write(tmp_path / "j.db", {"r": (0.0, _random_report_run(n, seed, tiny))}, flat=False))
    assert [(a.label, a.records, a.apc, a.missing_outcomes) for a in joined] == \
        [(a.label, a.records, a.apc, a.missing_outcomes) for a in arms]


def test_old_rows_in_a_new_file_fall_back_to_the_join(tmp_path):
    # An older router wrote r1 (NULL copies); a newer one opened the file and wrote r2.
    path = tmp_path / "mixed.db"
    _write(path, {"r1": (99.0, R1)}, flat=False)
    _write(path, {"r2": (1000.0, R2)}, flat=True)
    db = open_readonly(path)
    assert not is_flat(db, "r1") and is_flat(db, "r2")
    lm, un = summary(db, "r1")["segments"]
    assert lm["statuses"] == {"ok": 3, "error": 1} and un["ttft_ms"]["p50"] == 700.0


# -- arms for kvtop report --db ------------------------------------------------------------
def test_arms_from_db_records_are_final_attempts(db_path):
    arms = arms_from_db(db_path, "r1")
    assert [a.label for a in arms] == ["lmetric@1", "unified@2"]
    lm, un = arms
    assert [r["request_id"] for r in lm.records] == ["q1", "q2", "q3", "q4"]
    assert lm.records[3]["status"] == "error"  # outcome 'error' stays an error
    # q5's upstream_error is superseded by its retry: one record, from the retry.
    assert [r["request_id"] for r in un.records] == ["q5", "q6"]
    assert un.records[0] == {"request_id": "q5", "session": "s1", "turn": 3, "input_tokens": 3000,
                             "output_tokens": 40, "status": "ok", "ttft_ms": 400.0, "e2e_ms": 4000.0,
                             "tpot_ms": 5.0, "cached_tokens": 0, "instance": "b", "route_class": "WARM",
                             "arm": "unified@2"}
    # store.results.RequestResult's core fields, in its order (built by hand for speed: checked here)
    assert list(lm.records[0]) == list(RECORD_KEYS)
    # No samples: APC = delivered / input over requests that report it: (0+800)/(1000+2000).
    assert lm.apc == {"value": pytest.approx(800 / 3000), "source": "delivered_cached_tokens"}
    assert un.apc == {"value": 0.0, "source": "delivered_cached_tokens"}
    # Default: the latest run.
    assert [len(a.records) for a in arms_from_db(db_path)] == [2]


def test_arms_apc_is_the_engines_counter_growth_token_weighted(tmp_path):
    def sample(ts, inst, q, h, rate):
        return {"run_id": "r1", "ts": ts, "instance": inst, "engine_hit_rate": rate,
                "engine_prefix_queries": q, "engine_prefix_hits": h}
    samples = [sample(99.5, "a", 1000.0, 400.0, 0.4), sample(99.5, "b", 500.0, 0.0, 0.0),  # the baseline
               sample(101.5, "a", 3000.0, 1400.0, 0.5), sample(101.5, "b", 1500.0, 900.0, 0.9),
               sample(103.0, "b", 200.0, 100.0, 0.5),  # b's engine restarted: 200 queries since
               sample(150.0, "a", 3500.0, 1400.0, 0.0),  # q4's prefill, after the last decision
               sample(250.0, "a", 9000.0, 1400.0, 0.0)]  # unified@2's: not lmetric's
    arms = arms_from_db(_write(tmp_path / "s.db", {"r1": (99.0, R1)}, samples))
    # lmetric@1 (100-103, until unified@2 starts at 200): a +2000/+1000 then +500/0, b +1000/+900
    # then +200/+100: 2000 / 3700 tokens; the mean of the sampled rates would weigh a
    # 200-token interval like a 2000-token one.
    assert arms[0].apc == {"value": pytest.approx(2000 / 3700), "source": "engine_counters",
                           "queries": 3700.0, "hits": 2000.0}
    # unified@2 (200-): a +5500/0 from its last sample before the segment
    assert arms[1].apc == {"value": 0.0, "source": "engine_counters", "queries": 5500.0, "hits": 0.0}


def test_arms_apc_from_rates_alone_is_labelled_a_time_mean(tmp_path):
    rows = [r[:-1] + (r[-1][:-1] + (None,),) for r in R1]  # no request reported cached tokens
    samples = [{"run_id": "r1", "ts": 101.0, "instance": "a", "engine_hit_rate": 0.4},
               {"run_id": "r1", "ts": 102.0, "instance": "b", "engine_hit_rate": 0.6},
               {"run_id": "r1", "ts": 102.5, "instance": "b", "engine_hit_rate": None}]  # not reported
    arms = arms_from_db(_write(tmp_path / "s.db", {"r1": (99.0, rows)}, samples))
    assert arms[0].apc == {"value": pytest.approx(0.5), "source": "engine_rate_mean"}
    assert arms[1].apc is None


def test_decisions_without_outcomes_are_counted_not_dropped(tmp_path):
    rows = R2 + [(1003.0, "p3", 1, "t1", 3, "lmetric", 1, "a", "argmin", "WARM", 700, 600, 600, None)]
    path = _write(tmp_path / "n.db", {"r2": (1000.0, rows)})
    seg = summary(open_readonly(path))["segments"][0]
    assert seg["statuses"] == {"ok": 1, "timeout": 1, "no_outcome": 1} and seg["errors"] == 1
    assert seg["hits"]["routing_regret"] == 100 + 0  # p2 500-400, p3 600-600: decisions count
    (arm,) = arms_from_db(path)
    assert [r["request_id"] for r in arm.records] == ["p1", "p2"] and arm.missing_outcomes == 1


def test_arms_unknown_run_is_a_lookup_error(db_path):
    with pytest.raises(LookupError, match="no run"):  # what kvtop report --db catches
        arms_from_db(db_path, "nope")


# -- read-only guarantee and bad files ------------------------------------------------------
def _digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.mark.parametrize("sql, message", [
    ("UPDATE runs SET port = 1", "only read-only"),
    ("DELETE FROM decisions", "only read-only"),
    ("WITH x AS (SELECT 1) DELETE FROM decisions", "not read-only"),  # caught by the authorizer
    ("PRAGMA journal_mode = DELETE", "PRAGMA assignments"),
    ("ATTACH DATABASE 'x.db' AS x", "only read-only"),
    ("SELECT 1; DELETE FROM runs", "one statement"),
    ("SELECT * FROM nope", "no such table: nope"),  # SQLite's own message, one line
])
def test_run_sql_refuses_writes_and_reports_errors(db_path, sql, message):
    before = _digest(db_path)
    with pytest.raises(QueryError, match=message):
        run_sql(open_readonly(db_path), sql)
    assert _digest(db_path) == before


def test_readonly_connection_cannot_write(db_path):
    before = _digest(db_path)
    db = open_readonly(db_path)
    with pytest.raises(sqlite3.OperationalError):  # the connection itself, no checks in between
        db.conn.execute("UPDATE runs SET port = 1")
    assert _digest(db_path) == before


def test_run_sql_reads(db):
    cols, rows = run_sql(db, "-- by reason\nSELECT reason, count(*) AS n FROM decisions "
                               "WHERE run_id = ? GROUP BY reason ORDER BY n DESC, reason", ["r1"])
    assert cols == ["reason", "n"] and rows[0] == ("argmin", 3)
    assert run_sql(db, "PRAGMA table_info(runs)")[1][0][1] == "run_id"


@pytest.mark.parametrize("content, message", [
    (None, "no database"),
    (b"hello, not sqlite at all, just some bytes" * 50, "not a kvtop database"),
    ("other-sqlite", "not a kvtop database"),
])
def test_bad_files_are_clear_errors(tmp_path, content, message):
    path = tmp_path / "x.db"
    if content == "other-sqlite":
        sqlite3.connect(path).execute("CREATE TABLE t (a)").connection.commit()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(QueryError, match=message):
        open_readonly(path)


@pytest.mark.parametrize("text, expected", [
    ("10m", 1000.0 - 600), ("2h", 1000.0 - 7200), ("1.5s", 998.5),
    ("1700000000", 1.7e9), ("2024-01-01T00:00:00+00:00", 1704067200.0),
])
def test_parse_time(text, expected):
    assert parse_time(text, now=1000.0) == expected


def test_parse_time_rejects_garbage():
    with pytest.raises(QueryError, match="cannot read time"):
        parse_time("yesterday-ish")


# -- export --------------------------------------------------------------------------
def test_export_table_and_query(db, tmp_path):
    out = tmp_path / "o.csv"
    assert export(db, "outcomes", "csv", out) == 9
    lines = out.read_text().splitlines()
    assert lines[0].startswith("id,run_id,ts,request_id") and len(lines) == 10
    out2 = tmp_path / "o.jsonl"
    assert export(db, "SELECT request_id, status FROM outcomes WHERE status != 'ok' ORDER BY id",
                    "jsonl", out2) == 3  # q4 error, q5 upstream_error, p2 timeout
    assert json.loads(out2.read_text().splitlines()[0]) == {"request_id": "q4", "status": "error"}
    with pytest.raises(QueryError, match="no table"):
        export(db, "nope", "csv", tmp_path / "n.csv")


# -- the CLI ---------------------------------------------------------------------------
def test_cli_summary_and_runs(db_path, capsys):
    assert main(["log", "summary", "--db", db_path, "--run", "r1"]) == 0
    out = capsys.readouterr().out
    assert "== lmetric@1" in out and "== unified@2" in out
    assert "p50 200.0  p90 280.0  p99 298.0" in out
    assert "routing (best-est) 1,600 (mean 400)" in out
    assert main(["log", "--db", db_path, "runs"]) == 0  # --db before the command works too
    out = capsys.readouterr().out
    assert "r1" in out and "lmetric@1 -> unified@2" in out
    assert main(["log", "summary", "--db", db_path, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["run_id"] == "r2"


def test_cli_decisions_sql_export(db_path, capsys, tmp_path):
    assert main(["log", "decisions", "--db", db_path, "--reason", "retry", "--format", "jsonl"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["request_id"] == "q5" and row["scores"] == [{"instance": "b", "score": 1.0}]
    assert main(["log", "decisions", "--db", db_path, "--class", "MEDIUM"]) == 0
    assert capsys.readouterr().out.count("lmetric@1") == 2
    assert main(["log", "sql", "SELECT count(*) AS n FROM decisions", "--db", db_path, "--format", "csv"]) == 0
    assert capsys.readouterr().out.split() == ["n", "9"]
    out = tmp_path / "d.jsonl"
    assert main(["log", "export", "--db", db_path, "--table", "decisions", "--format", "jsonl",
                 "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 9


@pytest.mark.parametrize("argv, message", [
    (["log", "runs", "--db", "{tmp}/missing.db"], "no database at"),
    (["log", "sql", "UPDATE runs SET port = 2", "--db", "{db}"], "only read-only"),
    (["log", "sql", "SELEC 1", "--db", "{db}"], "only read-only"),
    (["log", "sql", "SELECT nope FROM runs", "--db", "{db}"], "no such column: nope"),
    (["log", "decisions", "--since", "whenever", "--db", "{db}"], "cannot read time"),
    # was a FileNotFoundError traceback
    (["log", "export", "--table", "runs", "--out", "{tmp}/nodir/x.csv", "--db", "{db}"], "cannot write"),
])
def test_cli_user_errors_are_one_line(db_path, tmp_path, capsys, argv, message):
    argv = [a.format(tmp=tmp_path, db=db_path) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cli_decisions_negative_limit_is_refused(db_path, capsys):
    assert main(["log", "decisions", "--db", db_path, "--limit", "-1"]) == 2
    assert "--limit must be >= 0" in capsys.readouterr().err
