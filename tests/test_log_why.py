"""kvtop log from an operator's terminal: `log why REQUEST_ID`, and `| head` as normal use."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import sqlite_utils


@pytest.fixture
def big_log(tmp_path):
    """A decision log with more rows than a pipe buffer holds, so the writer meets a closed pipe."""
    path = tmp_path / "kvtop.db"
    db = sqlite_utils.Database(path)
    db["runs"].insert({"run_id": "r1", "started_at": 0.0})
    db["decisions"].insert_all({"ts": float(k), "request_id": f"req-{k:06d}", "session_id": "s" * 40,
                                "reason": "argmin"} for k in range(20_000))
    db["outcomes"].insert({"request_id": "req-000000", "status": "ok"})
    db.close()
    return path


@pytest.mark.parametrize("argv", [
    ["export", "--table", "decisions"],                     # caught as OSError: "cannot write None"
    ["export", "--table", "decisions", "--format", "jsonl"],
    ["sql", "SELECT * FROM decisions", "--format", "csv"],  # the shared BrokenPipe path
])
def test_log_into_head_exits_0_quietly(big_log, argv):
    cmd = [sys.executable, "-m", "kvtop.cli", "log", "--db", str(big_log), *argv]
    shell = " ".join(f"'{a}'" for a in cmd) + " | head -1; exit ${PIPESTATUS[0]}"
    r = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert r.stdout.count("\n") == 1


# -- kvtop log why ---------------------------------------------------------------------------

T0 = 1_700_000_000.0
TERMS = [{"instance": "i0", "hit": 0, "new": 16600, "P": 11776, "BS": 3, "D": 1536, "score": 16600.0 * 3},
         {"instance": "i1", "hit": 15000, "new": 1600, "P": 0, "BS": 1, "D": 0, "score": 1600.0},
         {"instance": "i2", "hit": 0, "new": 16600, "P": 0, "BS": 0, "D": 0, "score": 0.0523}]


@pytest.fixture
def why_log(tmp_path, monkeypatch):
    """One request with a retry (attempt 1 failed on i0, attempt 2 went to i1), one in two runs."""
    from store.schema import ensure_schema

    monkeypatch.setenv("TZ", "UTC")
    import time
    time.tzset()
    path = tmp_path / "kvtop.db"
    db = sqlite_utils.Database(path)
    ensure_schema(db)
    db["runs"].insert_all([{"run_id": "run-a", "started_at": T0 - 100}, {"run_id": "run-b", "started_at": T0}])
    base = {"session_id": "agent-7", "turn": 4, "policy": "unified", "policy_version": 3, "route_class": "MEDIUM",
            "input_tokens": 16600, "token_source": "tokenizer", "best_hit_tokens": 15000,
            "best_hit_instance": "i1", "decision_us": 41.5, "index_source": "exact"}
    db["decisions"].insert_all([
        {**base, "run_id": "run-b", "ts": T0 + 0.001, "request_id": "req-retry-1", "attempt": 1,
         "instance": "i0", "reason": "overload_break", "est_hit_tokens": 0, "new_prefill_tokens": 16600,
         "t_proxy_recv": T0, "scores": json.dumps(TERMS)},
        {**base, "run_id": "run-b", "ts": T0 + 0.5, "request_id": "req-retry-1", "attempt": 2,
         "instance": "i1", "reason": "retry", "est_hit_tokens": 15000, "new_prefill_tokens": 1600,
         "t_proxy_recv": T0, "scores": json.dumps(TERMS[1:])},
        {**base, "run_id": "run-a", "ts": T0 - 50, "request_id": "req-both", "attempt": 1, "instance": "i2",
         "reason": "argmin", "scores": "[]"},
        {**base, "run_id": "run-b", "ts": T0 + 5, "request_id": "req-both", "attempt": 1, "instance": "i1",
         "reason": "argmin", "scores": json.dumps(TERMS)},
        {**base, "run_id": "run-b", "ts": T0 + 6, "request_id": "req-both-2", "attempt": 1, "instance": "i1",
         "reason": "argmin", "scores": "[]"},
    ])
    db["outcomes"].insert_all([
        {"run_id": "run-b", "request_id": "req-retry-1", "attempt": 1, "status": "upstream_error",
         "http_status": 502, "error": "i0 closed the connection"},
        {"run_id": "run-b", "request_id": "req-retry-1", "attempt": 2, "status": "ok", "ttft_ms": 812.25,
         "e2e_ms": 12345.6, "output_tokens": 120, "delivered_hit_tokens": 14848,
         "t_first_token": T0 + 0.81225, "t_done": T0 + 12.3456},
    ])
    db.close()
    yield path
    time.tzset()


def _kvtop(capsys, *argv):
    from kvtop.cli import main

    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_why_shows_every_attempt_and_every_candidate(why_log, capsys):
    rc, out, err = _kvtop(capsys, "log", "--db", str(why_log), "why", "req-retry-1")
    assert rc == 0, err
    lines = out.splitlines()
    # both attempts, the failed one's error and the retry's outcome
    assert "request req-retry-1  attempt 1  policy unified@3  run run-b" in lines
    assert any(l.startswith("request req-retry-1  attempt 2") for l in lines)
    assert "outcome upstream_error  HTTP 502" in out and "error: i0 closed the connection" in out
    assert "→ i0  reason overload_break (session's instance over the overload bound" in out
    # every candidate of attempt 1, the chosen one marked, one number format (no 1.66e+04) and
    # one precision a column: the score column's 0.0523 sets its decimals
    table = lines[lines.index("candidates (3; ▶ chosen)") + 1:][:4]
    assert table[0].split() == ["instance", "hit", "new", "P", "BS", "D", "score"]
    assert table[1].split() == ["▶", "i0", "0", "16,600", "11,776", "3", "1,536", "49,800.0000"]
    assert table[2].split() == ["i1", "15,000", "1,600", "0", "1", "0", "1,600.0000"]
    assert table[3].split()[-1] == "0.0523"
    assert "e+" not in out
    # times in local time with milliseconds from the receipt, never raw epoch seconds
    assert "received 22:13:20.000 · decided +1.0 ms" in out
    assert "first token +812.2 ms · done +12,346 ms" in out
    assert "1700000000" not in out
    assert "TTFT 812.2 ms  E2E 12,346 ms" in out and "engine cached 14,848 tok" in out


@pytest.mark.parametrize("argv, message", [
    (["why", "nope"], "no decision for request 'nope' in this log"),            # unknown id
    (["why", "req-b"], "request 'req-b' is ambiguous: req-both, req-both-2"),   # prefix of two
    (["why", "req-retry-1", "--run", "run-a"], "request 'req-retry-1' is not in run run-a"),
])
def test_why_errors_are_one_line_and_exit_2(why_log, capsys, argv, message):
    rc, out, err = _kvtop(capsys, "log", "--db", str(why_log), *argv)
    assert rc == 2 and out == ""
    assert err.startswith(f"kvtop log: {message}") and err.count("\n") == 1


def test_why_without_a_database_is_one_line(tmp_path, capsys):
    rc, out, err = _kvtop(capsys, "log", "--db", str(tmp_path / "missing.db"), "why", "req-1")
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("kvtop log: no database at")


def test_why_takes_a_unique_prefix_and_the_latest_run(why_log, capsys):
    rc, out, _ = _kvtop(capsys, "log", "--db", str(why_log), "why", "req-r")
    assert rc == 0 and "request req-retry-1" in out
    rc, out, _ = _kvtop(capsys, "log", "--db", str(why_log), "why", "req-both")  # exact beats prefix
    assert rc == 0 and "run run-b" in out and "also in run run-a: --run picks one" in out
    rc, out, _ = _kvtop(capsys, "log", "--db", str(why_log), "why", "req-both", "--run", "run-a")
    assert rc == 0 and "→ i2" in out and "candidates: none recorded" in out
    assert "outcome: none recorded" in out


def test_why_json_has_rows_with_parsed_scores(why_log, capsys):
    rc, out, _ = _kvtop(capsys, "log", "--db", str(why_log), "why", "req-retry-1", "--format", "json")
    body = json.loads(out)
    assert rc == 0 and [a["decision"]["attempt"] for a in body["attempts"]] == [1, 2]
    assert body["attempts"][0]["decision"]["scores"] == TERMS
    assert body["attempts"][1]["outcome"]["status"] == "ok"


@pytest.mark.parametrize("value, text", [
    (1536, "1,536"), (11776, "11,776"),     # integers: thousands separators
    (16600.0, "16,600"),                     # an integral float reads as the integer it is
    (16612.7, "16,613"),                     # big floats: no decimals, never 1.66e+04
    (123.456, "123.5"), (2.5, "2.50"),
    (0.0523, "0.0523"), (2.5e-06, "0.0000025"),  # small ones: no exponent either
    (None, "–"), (True, "True"), ("i0", "i0"),
])
def test_receipt_number_format(value, text):
    from kvtop.receipt import fmt_num

    assert fmt_num(value) == text


# -- a run stopped mid-way: cut-off requests are cancelled, not errors ------------------------

@pytest.mark.parametrize("flat", [True, False])  # outcomes carrying their decision's columns, or joined
def test_cut_off_requests_are_cancelled_not_errors(tmp_path, capsys, flat):
    """Issue 20: quitting the demo mid-run turned cut-off requests into errors in
    `log summary` and `report --db` while the dashboard said 0."""
    from store.arms import arms_from_db
    from store.summary import summary
    from store.schema import ensure_schema

    path = tmp_path / "kvtop.db"
    db = sqlite_utils.Database(path)
    ensure_schema(db)
    db["runs"].insert({"run_id": "r", "started_at": T0})
    statuses = ["ok", "ok", "ok", "upstream_error", "client_gone", "client_gone"]
    seg = {"policy": "unified", "policy_version": 1, "route_class": "MEDIUM", "input_tokens": 1000,
           "session_id": "s", "turn": 1, "est_hit_tokens": 0}
    db["decisions"].insert_all({**seg, "run_id": "r", "ts": T0 + k, "request_id": f"q{k}", "attempt": 1,
                                "instance": f"i{k % 2}", "reason": "argmin"} for k in range(len(statuses)))
    db["outcomes"].insert_all({**(seg if flat else {}), "run_id": "r", "ts": T0 + k + 1, "request_id": f"q{k}",
                               "attempt": 1, "instance": f"i{k % 2}", "status": st,
                               "ttft_ms": 100.0 + k if st == "ok" else None,
                               "e2e_ms": 500.0 + k if st == "ok" else None} for k, st in enumerate(statuses))
    db.close()
    seg_summary = summary(str(path))["segments"][0]
    assert seg_summary["errors"] == 1 and seg_summary["cancelled"] == 2
    (arm,) = arms_from_db(str(path))
    assert arm.cancelled == 2 and arm.missing_outcomes == 0
    assert sorted(r["status"] for r in arm.records) == ["error", "ok", "ok", "ok"]
    if arm.columns is not None:
        assert arm.columns.counts() == (4, 3)
    rc, out, _ = _kvtop(capsys, "log", "--db", str(path), "summary")
    assert rc == 0 and "errors 1  cancelled 2 (client gone, cut off)" in out
    rc, out, _ = _kvtop(capsys, "report", "--db", str(path))
    assert rc == 0 and "not counted as requests or errors): unified@1 2" in out
    row = next(line.split() for line in out.splitlines() if line.startswith("unified@1"))
    assert row[1:4] == ["4", "3", "1"]  # requests, ok, errors
