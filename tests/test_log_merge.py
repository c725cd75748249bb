"""Several routers' decision logs read as one: `kvtop log --db A --db B ...`, `kvtop report
--db A --db B`, and the KV drift figures of `kvtop log summary`.

Every log is a real file written by store.writer.Writer. The strongest check is an oracle:
two routers' logs merged must answer exactly what one log holding both routers' rows (as one
run) answers, for the summary and the report; and a percentile of the merged rows is checked
against store.stats on the union and against the average of the per-file figures.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import sqlite3

import pytest

from kvtop.cli import main
import store.logs
from store.logs import open_logs, open_readonly
from store.stats import percentile
from store.summary import summary
from store.writer import Writer

# (ts, request_id, attempt, session, policy, version, instance, reason, class, input, est, best,
#  index_source, estimate) + outcome (status, ttft_ms, e2e_ms, delivered) or None (in flight)
ROUTER1 = [
    (100.0, "a-1", 1, "s1", "unified", 1, "i0", "argmin", "WARM", 1000, 0, 0, "exact", 0, ("ok", 100.0, 1000.0, 0)),
    (101.0, "a-2", 1, "s1", "unified", 1, "i0", "affinity_stick", "WARM", 2000, 1000, 1000, "exact", 1500,
     ("ok", 120.0, 1100.0, 1000)),  # the estimate believed 500 more: over
    (102.0, "a-3", 1, "s2", "unified", 1, "i1", "argmin", "MEDIUM", 8000, 4000, 4000, "exact", 3000,
     ("ok", 140.0, 1200.0, 4000)),  # 1,000 less: under
    (103.0, "a-4", 1, "s3", "unified", 1, "i1", "argmin", "WARM", 500, 0, 0, "estimate", None,
     ("error", None, 30.0, None)),
]
ROUTER2 = [
    (100.5, "b-1", 1, "t1", "unified", 1, "i0", "argmin", "WARM", 4000, 2000, 2000, "exact", 2000,
     ("ok", 2000.0, 9000.0, 2000)),  # agreed: no drift
    (101.5, "b-2", 1, "t1", "unified", 1, "i1", "affinity_stick", "MEDIUM", 6000, 3000, 5000, "estimate", None,
     ("ok", 3000.0, 9500.0, 3000)),
    (102.5, "b-3", 1, "t2", "unified", 1, "i1", "argmin", "WARM", 1000, 0, 0, "exact", 0,
     ("ok", 4000.0, 9900.0, 0)),
    (103.5, "b-4", 1, "t3", "unified", 1, "i0", "argmin", "WARM", 1000, 0, 0, "exact", 0,
     ("ok", 5000.0, 10000.0, 0)),
    (104.5, "b-5", 1, "t3", "unified", 1, "i0", "argmin", "WARM", 1000, 0, 0, "exact", 0, None),
]


def _write(path, runs: dict[str, tuple[float, list]], *, flat: bool = True, knobs: dict | None = None,
           backends: list[dict] | None = None) -> str:
    """One router's log, as the router writes it (``flat``: outcomes carry their decision's
    columns; False: as an older router wrote them). ``knobs``: the run's start records its
    policy at version 1 with these knobs (config_events); ``backends``: runs.backends."""
    w = Writer(str(path), flush_interval=0.01).start()
    for run_id, (started, rows) in runs.items():
        w.put("runs", {"run_id": run_id, "started_at": started, "policy": rows[0][4],
                       "backends": backends or [{"name": "i0"}]})
        if knobs is not None:
            w.put("config_events", {"run_id": run_id, "ts": started, "kind": "run", "who": "router",
                                    "policy_version": 1, "before": None,
                                    "after": {"policy": rows[0][4], "version": 1, "knobs": knobs, "features": {}}})
        for ts, rid, att, ses, pol, ver, inst, reason, rc, inp, est, best, source, estimate, out in rows:
            w.put("decisions", {"run_id": run_id, "ts": ts, "request_id": rid, "attempt": att, "session_id": ses,
                                "turn": 1, "policy": pol, "policy_version": ver, "instance": inst, "reason": reason,
                                "route_class": rc, "input_tokens": inp, "est_hit_tokens": est,
                                "best_hit_tokens": best, "new_prefill_tokens": inp - est, "index_source": source,
                                "estimate_hit_tokens": estimate, "scores": [{"instance": inst, "score": 1.0}]})
            if out is None:
                continue
            status, ttft, e2e, delivered = out
            w.put("outcomes", {"run_id": run_id, "ts": ts + 1, "request_id": rid, "attempt": att, "instance": inst,
                               "status": status, "ttft_ms": ttft, "e2e_ms": e2e, "tpot_ms": 5.0 if ttft else None,
                               "output_tokens": 10, "delivered_hit_tokens": delivered,
                               **({"session_id": ses, "turn": 1, "policy": pol, "policy_version": ver,
                                   "route_class": rc, "input_tokens": inp, "est_hit_tokens": est} if flat else {})})
    w.close()
    _ensure_estimate_column(path, [(run_id, r[1], r[2], r[13]) for run_id, (_, rows) in runs.items() for r in rows])
    return str(path)


def _ensure_estimate_column(path, estimates: list[tuple]) -> None:
    """The writer writes estimate_hit_tokens where store/schema.py has it; a schema without
    it gets the column here, filled with the same values, so these tests run either way."""
    conn = sqlite3.connect(path)
    if "estimate_hit_tokens" not in {r[1] for r in conn.execute("PRAGMA table_info(decisions)")}:
        conn.execute("ALTER TABLE decisions ADD COLUMN estimate_hit_tokens INTEGER")
        conn.executemany("UPDATE decisions SET estimate_hit_tokens = ? WHERE run_id = ? AND request_id = ? "
                         "AND attempt = ?", [(e, run, rid, att) for run, rid, att, e in estimates])
        conn.commit()
    conn.close()


def _drop_columns(path, *cols) -> None:
    """An older router's file: the decisions table without ``cols``."""
    conn = sqlite3.connect(path)
    for c in cols:
        conn.execute(f"ALTER TABLE decisions DROP COLUMN {c}")
    conn.commit()
    conn.close()


@pytest.fixture(params=[True, False], ids=["flat", "joined"])
def logs(tmp_path, request):
    """Two routers' logs, and one log holding both routers' rows as one run (the oracle)."""
    a = _write(tmp_path / "router1.db", {"20261126-100000-aaaaaa": (99.0, ROUTER1)}, flat=request.param)
    b = _write(tmp_path / "router2.db", {"20261126-100000-bbbbbb": (99.5, ROUTER2)}, flat=request.param)
    both = _write(tmp_path / "both.db", {"both": (99.0, sorted(ROUTER1 + ROUTER2))}, flat=request.param)
    return a, b, both


def _kvtop(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


# -- merged figures equal one log holding every row -----------------------------------------
def _without_run(summary: dict) -> list:
    return json.loads(json.dumps(summary["segments"]))


def test_merged_summary_equals_one_log_of_both_routers(logs):
    a, b, both = logs
    merged = summary(open_logs([a, b]))
    assert merged["run_id"] == "20261126-100000-aaaaaa+20261126-100000-bbbbbb"
    assert merged["sources"] == [{"source": a, "run_id": "20261126-100000-aaaaaa"},
                                 {"source": b, "run_id": "20261126-100000-bbbbbb"}]
    assert _without_run(merged) == _without_run(summary(open_readonly(both)))
    seg = merged["segments"][0]
    assert seg["decisions"] == 9 and seg["statuses"] == {"ok": 7, "error": 1, "no_outcome": 1}


def test_merged_percentiles_are_over_the_rows_not_averaged(logs):
    a, b, _ = logs
    ttft1 = [r[-1][1] for r in ROUTER1 if r[-1] and r[-1][0] == "ok"]
    ttft2 = [r[-1][1] for r in ROUTER2 if r[-1] and r[-1][0] == "ok"]
    got = summary(open_logs([a, b]))["segments"][0]["ttft_ms"]
    for p in (50, 90, 99):
        assert got[f"p{p}"] == pytest.approx(percentile(ttft1 + ttft2, p))
        # The rows are chosen so that averaging (even weighted by count) gives another number.
        averaged = (percentile(ttft1, p) * len(ttft1) + percentile(ttft2, p) * len(ttft2)) / (len(ttft1) + len(ttft2))
        assert got[f"p{p}"] != pytest.approx(averaged)
    assert got["n"] == len(ttft1) + len(ttft2)


@pytest.mark.parametrize("seed", [1, 2])
def test_merged_report_equals_one_log_of_both_routers(tmp_path, capsys, seed):
    """Three routers, random traffic with a policy swap and retries: `kvtop report --db x3`
    prints exactly what one log of all the rows prints."""
    rng = random.Random(seed)
    per_router, everything = [], []
    for r in range(3):
        rows = []
        for i in range(300):
            ts = 100.0 + i + r / 10
            pol, ver = ("lmetric", 1) if i < 150 else ("unified", 2)
            inp = rng.choice([800, 3000, 9000, 30000, 60000])
            est = rng.randrange(0, inp)
            status = rng.choices(["ok", "error", "client_gone"], [90, 7, 3])[0]
            ttft = rng.lognormvariate(5, 1.5) if status == "ok" else None
            out = (status, ttft, (ttft or 10.0) * 3, rng.choice([None, est]))
            cls = "WARM" if inp < 5000 else "MEDIUM" if inp < 20000 else "HEAVY" if inp < 50000 else "HEAVY+"
            rows.append((ts, f"r{r}-{i}", 1, f"s{r}-{i % 7}", pol, ver, f"i{rng.randrange(4)}", "argmin", cls,
                         inp, est, est, "exact", est + rng.randrange(-200, 200), out))
            if rng.random() < 0.05:  # a retry: the report keeps the final attempt only
                ttft2 = rng.lognormvariate(5, 1.5)
                rows.append((ts + 0.05, f"r{r}-{i}", 2, f"s{r}-{i % 7}", pol, ver, f"i{rng.randrange(4)}", "retry",
                             cls, inp, 0, est, "estimate", None, ("ok", ttft2, ttft2 * 3, 0)))
        per_router.append(_write(tmp_path / f"router{r}.db", {f"run-{r}": (99.0 + r / 10, rows)}))
        everything += rows
    both = _write(tmp_path / "all.db", {"all": (99.0, sorted(everything))})
    rc, merged, _ = _kvtop(capsys, "report", "--db", per_router[0], "--db", per_router[1], "--db", per_router[2])
    assert rc == 0
    rc, single, _ = _kvtop(capsys, "report", "--db", both)
    assert rc == 0 and merged == single and "lmetric@1" in merged and "unified@2" in merged
    # And the summary, this time with --db after the command taking several paths.
    rc, out, _ = _kvtop(capsys, "log", "summary", "--format", "json", "--db", *per_router)
    assert rc == 0
    rc, out_single, _ = _kvtop(capsys, "log", "summary", "--format", "json", "--db", both)
    assert _without_run(json.loads(out)) == _without_run(json.loads(out_single))


# -- the verbs ---------------------------------------------------------------------------
def test_runs_lists_every_files_runs_with_its_source(logs, capsys):
    a, b, _ = logs
    rc, out, _ = _kvtop(capsys, "log", "--db", a, "--db", b, "runs", "--format", "jsonl")
    rows = [json.loads(line) for line in out.splitlines()]
    assert rc == 0 and [(r["run_id"], r["source"], r["decisions"]) for r in rows] == [
        ("20261126-100000-bbbbbb", b, 5), ("20261126-100000-aaaaaa", a, 4)]
    rc, out, _ = _kvtop(capsys, "log", "runs", "--db", a, b)
    assert rc == 0 and "source" in out.splitlines()[0] and a in out and b in out


def test_why_finds_the_request_in_whichever_log_holds_it(logs, capsys):
    a, b, _ = logs
    rc, out, _ = _kvtop(capsys, "log", "--db", a, "--db", b, "why", "b-3")
    assert rc == 0 and out.startswith(f"from {b} (run 20261126-100000-bbbbbb)")
    rc, out, _ = _kvtop(capsys, "log", "--db", a, "--db", b, "why", "a-2", "--format", "json")
    found = json.loads(out)
    assert found["source"] == a and found["attempts"][0]["decision"]["estimate_hit_tokens"] == 1500
    rc, _, err = _kvtop(capsys, "log", "--db", a, "--db", b, "why", "c-1")
    assert rc == 2 and "no decision for request 'c-1'" in err


def test_merged_output_wording(logs, capsys):
    """Words, not column names; plurals that fit; the files named where there are several."""
    a, b, _ = logs
    rc, _, err = _kvtop(capsys, "log", "--db", a, "--db", b, "why", "c-1")
    assert rc == 2 and f"no decision for request 'c-1' in these logs ({a}, {b})" in err
    rc, _, err = _kvtop(capsys, "log", "--db", a, "why", "c-1")
    assert rc == 2 and "no decision for request 'c-1' in this log" in err
    rc, out, _ = _kvtop(capsys, "log", "--db", a, "--db", b, "why", "a-2")
    assert rc == 0 and "est hit 1,000 tok (exact; the estimate said 1,500)" in out
    assert "estimate_hit_tokens" not in out and f"source {a}" not in out
    rc, out, _ = _kvtop(capsys, "log", "--db", a, "--db", b, "summary", "--run", "20261126-100000-bbbbbb")
    assert rc == 0 and f"1 router's log merged: {b}" in out
    rc, out, _ = _kvtop(capsys, "log", "--db", a, "--db", b, "summary")
    assert rc == 0 and "2 routers' logs merged" in out
    rc, out, _ = _kvtop(capsys, "log", "--db", a, "--db", b, "decisions")
    header = out.splitlines()[0].split()
    assert "index_source" in header and out.count(" estimate ") == 2  # a-4 and b-2


def test_decisions_and_sql_see_the_union_with_a_source_column(logs, capsys):
    a, b, _ = logs
    rc, out, _ = _kvtop(capsys, "log", "--db", a, "--db", b, "sql",
                        "SELECT source, count(*) AS n, sum(input_tokens) AS tokens FROM decisions "
                        "GROUP BY source ORDER BY source", "--format", "csv")
    assert rc == 0 and out.split() == ["source,n,tokens", f"{a},4,11500", f"{b},5,13000"]
    # Joins stay inside one router's rows: run ids differ across files, ids do not.
    rc, out, _ = _kvtop(capsys, "log", "--db", a, "--db", b, "sql",
                        "SELECT count(*) FROM decisions d JOIN outcomes o ON o.request_id = d.request_id "
                        "AND o.run_id = d.run_id", "--format", "csv")
    assert out.split()[-1] == "8"
    rc, out, _ = _kvtop(capsys, "log", "--db", a, "--db", b, "decisions", "--instance", "i1", "--format", "jsonl")
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["request_id"], r["source"]) for r in rows] == [("a-4", a), ("b-3", b), ("a-3", a), ("b-2", b)]  # newest first
    rc, out, _ = _kvtop(capsys, "log", "--db", a, "--db", b, "decisions", "--run", "20261126-100000-a")
    assert rc == 0 and "source" in out.splitlines()[0] and "router2.db" not in out and out.count("router1.db") == 4
    rc, out, _ = _kvtop(capsys, "log", "--db", a, "--db", b, "export", "--table", "outcomes", "--format", "jsonl")
    assert rc == 0 and len(out.splitlines()) == 8


def test_run_picks_runs_across_logs(logs, capsys):
    a, b, _ = logs
    rc, out, _ = _kvtop(capsys, "log", "--db", a, "--db", b, "summary", "--run", "20261126-100000-b",
                        "--format", "json")
    got = json.loads(out)
    assert rc == 0 and got["run_id"] == "20261126-100000-bbbbbb" and got["segments"][0]["decisions"] == 5
    rc, _, err = _kvtop(capsys, "log", "--db", a, "--db", b, "summary", "--run", "20261126")
    assert rc == 2 and "ambiguous" in err
    rc, out, _ = _kvtop(capsys, "log", "--db", a, "--db", b, "shadow")
    assert rc == 0 and "no shadow picks" in out


def test_reading_never_writes(logs, capsys):
    a, b, _ = logs
    before = (_digest(a), _digest(b))
    for verb in (["runs"], ["summary"], ["why", "a-1"], ["decisions"], ["shadow"],
                 ["sql", "SELECT * FROM samples"], ["export", "--table", "decisions"]):
        assert _kvtop(capsys, "log", "--db", a, "--db", b, *verb)[0] == 0
    rc, _, err = _kvtop(capsys, "log", "--db", a, "--db", b, "sql", "WITH x AS (SELECT 1) DELETE FROM decisions")
    assert rc == 2 and "SQL error" in err and err.count("\n") == 1
    assert (_digest(a), _digest(b)) == before


# -- KV drift ------------------------------------------------------------------------------
def test_kv_drift_per_segment_and_instance(logs, capsys):
    a, b, _ = logs
    kv = summary(open_logs([a, b]), instances=True)["segments"][0]["kv"]
    # exact: a-1 a-2 a-3 (router 1), b-1 b-3 b-4 b-5 (router 2) = 7 of 9
    assert (kv["decisions"], kv["exact"]) == (9, 7)
    # |estimate - est| over exact: a-2 +500 (over), a-3 -1000 (under); input of the exact ones:
    # 1000 + 2000 + 8000 + 4000 + 1000 + 1000 + 1000 = 18,000
    assert (kv["over_tokens"], kv["under_tokens"], kv["drift_input_tokens"]) == (500, 1000, 18000)
    assert kv["drift"] == pytest.approx(1500 / 18000) and kv["over"] == pytest.approx(500 / 18000)
    by = {r["instance"]: r for r in kv["instances"]}
    # i0: a-1 a-2 b-1 b-4 b-5, all exact, input 9,000, over 500; i1: a-3 b-3 exact of a-3 a-4 b-2 b-3
    assert (by["i0"]["exact"], by["i0"]["decisions"], by["i0"]["drift"]) == (5, 5, pytest.approx(500 / 9000))
    assert (by["i1"]["exact"], by["i1"]["decisions"], by["i1"]["under"]) == (2, 4, pytest.approx(1000 / 9000))
    # The per-instance pass adds up to the segment's own figures, computed in summary's pass.
    segment_only = summary(open_logs([a, b]))["segments"][0]["kv"]
    assert segment_only == {k: v for k, v in kv.items() if k != "instances"}
    rc, out, _ = _kvtop(capsys, "log", "--db", a, "--db", b, "summary", "--instances")
    assert rc == 0 and "exact 7 of 9 decisions (77.8%)" in out
    assert "KV drift     8.33% of input tokens (over 2.78%, under 5.56%) over 7 exact decisions" in out
    assert "i1  exact 2/4 (50.0%)  drift 11.11% of input tokens (over 0.00%, under 11.11%)" in out


def test_logs_of_older_schemas_still_merge(logs, capsys):
    """Router 1 predates estimate_hit_tokens and index_source; router 2 has both."""
    a, b, both = logs
    _drop_columns(a, "estimate_hit_tokens", "index_source")
    rc, out, _ = _kvtop(capsys, "log", "summary", "--db", a)
    assert rc == 0 and "KV drift     n/a (this log predates index_source)" in out
    got = summary(open_logs([a, b]))
    seg = got["segments"][0]
    assert seg["decisions"] == 9  # every row still counted
    kv = seg["kv"]  # router 1's rows read NULL: only router 2's exact decisions count
    assert (kv["exact"], kv["drift_input_tokens"], kv["over_tokens"], kv["under_tokens"]) == (4, 7000, 0, 0)
    assert kv["drift"] == 0.0
    # Router 1's decisions have no recorded source: left out of the exact share, not counted
    # as estimates (4 of 5 recorded, 80%; counted as estimates it would read 4 of 9, 44.4%).
    assert (kv["recorded"], kv["exact_share"]) == (5, 0.8)
    rc, out, _ = _kvtop(capsys, "log", "--db", a, "--db", b, "summary")
    assert rc == 0 and (f"exact 4 of 5 decisions with a recorded source (80.0%; 4 from {a}, "
                        "which predates index_source)") in out
    # The other way round: a file with index_source but no estimate column says drift n/a.
    _drop_columns(b, "estimate_hit_tokens")
    rc, out, _ = _kvtop(capsys, "log", "summary", "--db", b)
    assert rc == 0 and "exact 4 of 5 decisions" in out and "n/a (this log has no estimate_hit_tokens column)" in out
    rc, out, _ = _kvtop(capsys, "report", "--db", a, "--db", b)
    assert rc == 0 and "unified@1" in out


@pytest.mark.parametrize("flat", [True, False], ids=["flat", "joined"])
def test_a_version_routers_ran_with_different_knobs_is_a_segment_per_file(tmp_path, capsys, flat):
    """Each router numbers its versions: unified@1 on router 1 is not unified@1 on router 2
    when their knobs differ. The merged run keeps them apart, one segment per file, each with
    exactly the figures of its own log, and a note names the knobs that differ."""
    a = _write(tmp_path / "r1.db", {"20261126-100000-aaaaaa": (99.0, ROUTER1)}, knobs={"overload_factor": 1.5},
               flat=flat)
    b = _write(tmp_path / "r2.db", {"20261126-100000-bbbbbb": (99.5, ROUTER2)},
               knobs={"overload_factor": 3.0, "cache_ratio_gate": 0.9}, flat=flat)
    got = summary(open_logs([a, b]), instances=True)
    assert [s["label"] for s in got["segments"]] == [f"unified@1 ({a})", f"unified@1 ({b})"]

    def figures(seg):
        return {k: v for k, v in seg.items() if k not in ("label", "policy_version")}
    for seg, path in zip(got["segments"], (a, b)):
        alone = summary(open_logs([path]), instances=True)["segments"]
        assert len(alone) == 1 and figures(seg) == figures(alone[0])
    assert got["notes"] == [f"unified@1 ran with different settings on these routers (cache_ratio_gate - ({a}), "
                            f"0.9 ({b}); overload_factor 1.5 ({a}), 3.0 ({b})): one segment per file"]
    rc, out, _ = _kvtop(capsys, "log", "--db", a, "--db", b, "summary")
    assert rc == 0 and f"== unified@1 ({a})" in out and f"== unified@1 ({b})" in out and "note: unified@1" in out
    rc, out, err = _kvtop(capsys, "report", "--db", a, "--db", b)
    rc1, out1, _ = _kvtop(capsys, "report", "--db", a)
    assert rc == rc1 == 0 and "overload_factor 1.5" in err
    # Router 1's arm in the merged report is router 1's report, row for row.
    row = next(line for line in out.splitlines() if line.startswith(f"unified@1 ({a})"))
    row1 = next(line for line in out1.splitlines() if line.startswith("unified@1"))
    assert row.split()[2:] == row1.split()[1:]
    # The same knobs on both routers: one segment, no note.
    c = _write(tmp_path / "r3.db", {"20261126-100000-cccccc": (99.5, ROUTER2)}, knobs={"overload_factor": 1.5},
               flat=flat)
    rc, out, _ = _kvtop(capsys, "log", "--db", a, "--db", c, "summary")
    assert rc == 0 and "== unified@1  " in out and "note:" not in out


def test_instances_merge_by_backend_url_not_by_name(tmp_path, capsys):
    """Router 2 lists the backends in the other order, so its i0 is router 1's i1: the
    per-instance figures must meet on the URL (as kvtop attach merges), not on the name."""
    u0, u1 = "http://127.0.0.1:25100", "http://127.0.0.1:25101"
    a = _write(tmp_path / "r1.db", {"20261126-100000-aaaaaa": (99.0, ROUTER1)},
               backends=[{"name": "i0", "url": u0}, {"name": "i1", "url": u1}])
    b = _write(tmp_path / "r2.db", {"20261126-100000-bbbbbb": (99.5, ROUTER2)},
               backends=[{"name": "i0", "url": u1}, {"name": "i1", "url": u0}])
    kv = summary(open_logs([a, b]), instances=True)["segments"][0]["kv"]
    by = {r["instance"]: r for r in kv["instances"]}
    # u0: router 1's i0 (a-1 a-2) + router 2's i1 (b-2 b-3); u1: a-3 a-4 + b-1 b-4 b-5
    assert (by[u0]["decisions"], by[u0]["exact"]) == (4, 3)
    assert (by[u1]["decisions"], by[u1]["exact"]) == (5, 4)
    assert by[u0]["names"] == ["i0", "i1"]
    rc, out, _ = _kvtop(capsys, "log", "--db", a, "--db", b, "summary", "--instances")
    assert rc == 0 and f"{u0} (i0, i1)  exact 3/4 (75.0%)" in out


def _read_only_mount(directory) -> str | None:
    """A shell line that bind-mounts ``directory`` read-only onto itself (inside ``unshare
    -m``), or None where this machine cannot (not root, no unshare)."""
    import os
    import subprocess

    if os.geteuid() != 0 or not shutil.which("unshare"):
        return None
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    return None if probe.returncode else f"mount --bind {directory} {directory} && mount -o remount,ro,bind {directory}"


def test_logs_on_a_read_only_mount_are_read_as_immutable(tmp_path):
    """A WAL-mode log needs its -shm file even to be read, and a read-only mount (an archived
    log, a CI artefact) cannot have one created: the files are read with immutable=1."""
    import subprocess
    import sys

    ro = tmp_path / "ro"
    ro.mkdir()
    a = _write(ro / "r1.db", {"20261126-100000-aaaaaa": (99.0, ROUTER1)})
    b = _write(ro / "r2.db", {"20261126-100000-bbbbbb": (99.5, ROUTER2)})
    for p in (a, b):  # checkpointed WAL files with nothing beside them, as archived
        conn = sqlite3.connect(p)
        conn.execute("PRAGMA journal_mode = WAL")
        conn.close()
        assert open(p, "rb").read(20)[18:20] == b"\x02\x02"
        for extra in ("-wal", "-shm"):
            assert not (ro / (p.rsplit("/", 1)[1] + extra)).exists()
    mount = _read_only_mount(ro)
    if mount is None:
        pytest.skip("needs root and unshare -m for a read-only mount")
    kvtop = f"{sys.executable} -m kvtop"
    out = subprocess.run(["unshare", "-m", "sh", "-c", f"{mount} && {kvtop} log --db {a} --db {b} summary "
                          f"&& {kvtop} log --db {a} runs && touch {ro}/x"],
                         capture_output=True, text=True, cwd=str(tmp_path))
    assert "2 routers' logs merged" in out.stdout and "20261126-100000-aaaaaa" in out.stdout, out.stderr
    assert "Read-only file system" in out.stderr  # the mount really was read-only


# -- bad inputs ------------------------------------------------------------------------------
def test_the_same_file_twice_is_read_once(logs, capsys):
    a, b, _ = logs
    rc, twice, err = _kvtop(capsys, "log", "--db", a, "--db", a, "summary", "--format", "json")
    assert rc == 0 and f"{a} is the same file as {a}; read once" in err
    rc, once, _ = _kvtop(capsys, "log", "--db", a, "summary", "--format", "json")
    assert twice == once
    rc, out, err = _kvtop(capsys, "report", "--db", a, "--db", b, "--db", b)
    rc2, out2, _ = _kvtop(capsys, "report", "--db", a, "--db", b)
    assert rc == rc2 == 0 and out == out2 and "read once" in err


def test_a_copy_of_a_log_is_refused(logs, tmp_path, capsys):
    a, b, _ = logs
    copy = tmp_path / "copy.db"
    shutil.copy(a, copy)
    rc, _, err = _kvtop(capsys, "log", "--db", a, "--db", b, "--db", str(copy), "summary")
    assert rc == 2 and "run 20261126-100000-aaaaaa is in both" in err and err.count("\n") == 1


@pytest.mark.parametrize("bad, message", [
    ("missing", "not found"),  # log: "no database at PATH (...)", report: "database not found: PATH"
    ("garbage", "is not a kvtop database"),
    ("foreign", "is not a kvtop database (no decisions, outcomes, runs table)"),
    ("truncated", "is damaged"),
])
@pytest.mark.parametrize("verb", [["log", "summary"], ["log", "runs"], ["report"]])
def test_a_bad_file_among_several_is_a_one_line_error(logs, tmp_path, capsys, bad, message, verb):
    a, b, _ = logs
    path = tmp_path / f"{bad}.db"
    if bad == "garbage":
        path.write_bytes(b"not a database, just bytes " * 200)
    elif bad == "foreign":
        sqlite3.connect(path).execute("CREATE TABLE t (a)").connection.commit()
    elif bad == "truncated":  # a real log cut short: its first pages read, the rest do not
        big = _write(tmp_path / "big.db", {"run-big": (0.0, [
            (float(i), f"x-{i}", 1, "s", "unified", 1, "i0", "argmin", "WARM", 1000, 0, 0, "exact", 0,
             ("ok", 1.0 + i, 2.0 + i, 0)) for i in range(3000)])})
        data = open(big, "rb").read()
        path.write_bytes(data[:len(data) // 3])
    if verb[0] == "report":
        argv = ["report", "--db", a, "--db", b, "--db", str(path)]
    else:
        argv = ["log", "--db", a, "--db", str(path), "--db", b, verb[1]]
    rc, _, err = _kvtop(capsys, *argv)
    if bad == "truncated" and verb == ["log", "runs"]:
        # listing runs can succeed on what is left; if it fails, it fails cleanly
        assert rc in (0, 2) and "Traceback" not in err
        return
    assert rc == 2 and err.count("\n") == 1, err
    assert (message in err or (bad == "missing" and "no database at" in err)) and str(path) in err, err


def test_a_plain_copy_of_a_live_log_gets_a_hint(tmp_path, capsys):
    """``cp`` of a live router's log copies the main file, while the rows are still in its
    -wal: the copy has no tables, and the error says how to copy it instead."""
    live = tmp_path / "live.db"
    conn = sqlite3.connect(live)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA wal_autocheckpoint = 0")  # the router's rows stay in live.db-wal
    for table in ("runs", "decisions", "outcomes"):
        conn.execute(f"CREATE TABLE {table} (run_id TEXT)")
    conn.commit()
    copy = tmp_path / "copy.db"
    shutil.copy(live, copy)  # the main file only, as a plain cp of the main file
    conn.close()
    rc, _, err = _kvtop(capsys, "log", "--db", str(copy), "runs")
    assert rc == 2 and "is not a kvtop database" in err
    assert 'copy with sqlite3 SRC ".backup DST", or copy SRC-wal beside it too' in err
    # A foreign file that is not in WAL mode gets no such hint.
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.close()
    rc, _, err = _kvtop(capsys, "log", "--db", str(other), "runs")
    assert rc == 2 and "is not a kvtop database" in err and ".backup" not in err


def test_a_locked_file_is_a_clear_error(logs, tmp_path, capsys, monkeypatch):
    a, b, _ = logs
    monkeypatch.setattr(store.logs, "BUSY_TIMEOUT_S", 0.1)
    holder = sqlite3.connect(b, isolation_level=None)
    holder.execute("PRAGMA locking_mode = EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    holder.execute("UPDATE runs SET port = 1")
    try:
        rc, _, err = _kvtop(capsys, "log", "--db", a, "--db", b, "summary")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert rc == 2 and f"{b} is locked by another process" in err and err.count("\n") == 1


# -- two real routers in front of one simulated fleet ------------------------------------------
def _closed(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_two_real_routers_logs_merge(tmp_path, capsys):
    """`kvtop sim` (KV events on) and two `kvtop route` processes in front of it, each with its
    own log; each router gets its own sessions. Merged, the logs hold every request, `why`
    finds router 2's request and names its file, and the summary's drift is measured."""
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    from conftest import free_port

    from kvtop.procs import free_port_run

    base = free_port_run(6)  # 2 HTTP + 4 KV ports, below the kernel's range for client sockets
    sim = subprocess.Popen([sys.executable, "-m", "kvtop", "sim", "--instances", "2", "--port-base", str(base),
                            "--speed", "50", "--duration", "120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    routers, dbs, ports = [], [tmp_path / "r1.db", tmp_path / "r2.db"], [free_port(), free_port()]
    try:
        backends = None
        for _ in range(3):
            line = sim.stdout.readline()
            assert line, sim.stderr.read()
            if line.startswith("route with:"):
                backends = line.split("kvtop route ", 1)[1].split()
        assert backends and backends[0] == "--backend"
        for port, db in zip(ports, dbs):
            routers.append(subprocess.Popen(
                [sys.executable, "-m", "kvtop", "route", "--port", str(port), "--db", str(db), "--state-dir",
                 str(tmp_path / f"st{port}"), "--policy", "leastwork", "--block-size", "16", *backends],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        deadline = time.monotonic() + 30
        for port in ports:
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
                    break
                except OSError:
                    assert time.monotonic() < deadline, "router did not start"
                    time.sleep(0.1)
        ids = {0: [], 1: []}
        for turn in range(1, 4):
            for r, port in enumerate(ports):
                for s in range(3):
                    # Token ids (a text prompt cannot match the engine's token-id events); each
                    # turn extends the last.
                    prompt = [1000 + (r * 3 + s) * 5000 + k for k in range(400 * turn)]
                    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 4}).encode()
                    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {
                        "Content-Type": "application/json", "X-Session-ID": f"r{r}-s{s}"})
                    with urllib.request.urlopen(req, timeout=30) as resp:
                        resp.read()
                        ids[r].append(resp.headers["X-Kvtop-Request-Id"])
                time.sleep(0.2)  # let the engine's events reach both routers
    finally:
        for p in routers:
            p.send_signal(signal.SIGTERM)
        for p in routers:
            try:
                p.wait(20)
            finally:
                if p.poll() is None:
                    p.kill()
        sim.kill()
        sim.wait(5)
    assert all(p.returncode == 0 for p in routers), [p.stderr.read().decode()[-1000:] for p in routers]
    a, b = map(str, dbs)
    rc, out, _ = _kvtop(capsys, "log", "--db", a, "--db", b, "summary", "--format", "json", "--instances")
    assert rc == 0
    got = json.loads(out)
    assert sorted(s["source"] for s in got["sources"]) == [a, b]  # in the runs' start order
    seg = got["segments"][0]
    assert seg["decisions"] == 18 and seg["statuses"] == {"ok": 18}
    kv = seg["kv"]
    assert kv["exact"] > 0 and kv["drift"] is not None, kv  # events flowed; the estimate was compared
    assert sorted(i["instance"] for i in kv["instances"]) == sorted({i["instance"] for i in kv["instances"]})
    rc, out, _ = _kvtop(capsys, "log", "--db", a, "--db", b, "why", ids[1][-1])
    assert rc == 0 and out.startswith(f"from {b} (run ")
    rc, out, _ = _kvtop(capsys, "log", "--db", a, "--db", b, "runs", "--format", "jsonl")
    assert sorted(json.loads(line)["source"] for line in out.splitlines()) == [a, b]
