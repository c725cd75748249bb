"""Session metrics (store/sessions.py) against values worked out by hand from a small log."""

from __future__ import annotations

import json

import pytest
import sqlite_utils

from store import sessions

T0 = 1_700_000_000.0

# Session A (lmetric@1): a1 [0, 2]; then, after 3 s of tool time, a2 [5, 6] and a sub-agent's
#   a3 [5.5, 7] in flight together. completion 7, fleet [0,2] u [5,7] = 4, client 3.
# Session B (lmetric@1): b1 failed on its first attempt and was retried: [1, 4] as one
#   request; b2 was cut off by its client (left out); b3 failed at once at 6 (no end: counts
#   as [6, 6]). completion 5, fleet 3, client 2, one error.
# Session C (lmetric@2, after a knob change): c1 [20, 30]. completion 10, fleet 10, client 0.
OUTCOMES = [
    # request, attempt, session, policy version, status, t_recv, t_done, e2e_ms
    ("a1", 1, "A", 1, "ok", 0.0, 2.0, 2000.0),
    ("a2", 1, "A", 1, "ok", 5.0, 6.0, 1000.0),
    ("a3", 1, "A", 1, "ok", 5.5, 7.0, 1500.0),
    ("b1", 1, "B", 1, "upstream_error", 1.0, None, None),
    ("b1", 2, "B", 1, "ok", 1.0, 4.0, 3000.0),
    ("b2", 1, "B", 1, "client_gone", 10.0, 12.0, None),
    ("b3", 1, "B", 1, "error", 6.0, None, None),
    ("c1", 1, "C", 2, "ok", 20.0, 30.0, 10000.0),
]


def _log(path, flat: bool):
    """The log above; ``flat`` False: outcomes as written before they carried their decision's
    session and policy (the query then takes them from the decision)."""
    from store.schema import ensure_schema

    db = sqlite_utils.Database(path)
    ensure_schema(db)
    db["runs"].insert({"run_id": "r", "started_at": T0})
    for rid, att, ses, ver, status, t_recv, t_done, e2e in OUTCOMES:
        seg = {"session_id": ses, "policy": "lmetric", "policy_version": ver}
        db["decisions"].insert({**seg, "run_id": "r", "ts": T0 + t_recv, "request_id": rid, "attempt": att,
                                "turn": 1, "instance": "i0", "reason": "argmin", "route_class": "WARM",
                                "input_tokens": 100, "t_proxy_recv": T0 + t_recv, "scores": json.dumps([])})
        db["outcomes"].insert({**(seg if flat else {}), "run_id": "r", "ts": T0 + t_recv, "request_id": rid,
                               "attempt": att, "status": status, "t_recv": T0 + t_recv,
                               "t_done": None if t_done is None else T0 + t_done, "e2e_ms": e2e,
                               "ttft_ms": e2e})
    db.close()
    return path


@pytest.mark.parametrize("flat", [True, False])
def test_sessions_from_a_recorded_log_match_the_hand_worked_values(tmp_path, flat):
    from store.logs import open_logs

    db = open_logs(_log(tmp_path / "kvtop.db", flat))
    got = sessions.from_db(db, "r")
    assert sorted(got) == [("lmetric", 1), ("lmetric", 2)]
    a, b = got[("lmetric", 1)]  # in order of first arrival
    assert (a.session, a.requests, a.errors) == ("A", 3, 0)
    assert (a.completion_s, a.fleet_s, a.client_s) == pytest.approx((7.0, 4.0, 3.0))
    assert (b.session, b.requests, b.errors) == ("B", 2, 1)   # b1 once (its retry), b2 left out
    assert (b.completion_s, b.fleet_s, b.client_s) == pytest.approx((5.0, 3.0, 2.0))
    (c,) = got[("lmetric", 2)]
    assert (c.completion_s, c.fleet_s, c.client_s) == pytest.approx((10.0, 10.0, 0.0))

    s = sessions.summarize(got[("lmetric", 1)])
    assert (s["sessions"], s["requests"]) == (2, 5)
    # two values 5 and 7: mean 6; p50 the mean of the two; p90 5 + 0.9 x 2 (linear, numpy's)
    assert s["completion_s"] == pytest.approx({"mean": 6.0, "p50": 6.0, "p90": 6.8, "max": 7.0})
    assert s["fleet_s"] == pytest.approx({"mean": 3.5, "p50": 3.5, "p90": 3.9, "max": 4.0})
    assert s["client_s"] == pytest.approx({"mean": 2.5, "p50": 2.5, "p90": 2.9, "max": 3.0})


def test_summary_of_no_sessions_is_empty_not_an_error():
    s = sessions.summarize([])
    assert s["sessions"] == 0 and s["completion_s"] == {"mean": None, "p50": None, "p90": None, "max": None}


def test_records_of_replay_and_simulate():
    replay = [  # replay: start is sent_at (its arrival is the trace's schedule, not the send)
        {"session": "s", "arrival": 0.0, "sent_at": 0.5, "status": "ok", "e2e_ms": 1500.0},
        {"session": "s", "arrival": 3.0, "sent_at": 4.0, "status": "ok", "e2e_ms": 1000.0},
        {"session": "t", "arrival": 1.0, "sent_at": 1.0, "status": "error", "e2e_ms": None},
    ]
    s, t = sessions.from_records(replay)
    assert (s.completion_s, s.fleet_s, s.client_s) == pytest.approx((4.5, 2.5, 2.0))
    assert (t.requests, t.errors, t.completion_s) == (1, 1, 0.0)
    simulate = [{"session": "x", "arrival": 10.0, "status": "ok", "e2e_ms": 2000.0},
                {"session": "x", "arrival": 11.0, "status": "ok", "e2e_ms": 500.0}]   # inside the first
    (x,) = sessions.from_records(simulate)
    assert (x.completion_s, x.fleet_s, x.client_s) == pytest.approx((2.0, 2.0, 0.0))


def test_report_and_log_summary_show_the_session_figures(tmp_path, capsys):
    from kvtop.cli import main

    path = _log(tmp_path / "kvtop.db", True)
    assert main(["report", "--db", str(path), "--format", "csv"]) == 0
    out = capsys.readouterr().out
    table = out.split("\n\n")[-1].strip().splitlines()
    assert table[0].startswith("arm,sessions,requests,completion_s_mean,completion_s_p50,completion_s_p90")
    first = table[1].split(",")
    assert first[:3] == ["lmetric@1", "2", "5"] and float(first[5]) == pytest.approx(6.8)
    assert main(["log", "--db", str(path), "summary"]) == 0
    out = capsys.readouterr().out
    assert "sessions     2 (5 requests), first arrival to last answer: mean 6.0 p50 6.0 p90 6.8 max 7.0 s" in out
    assert "client's own (between turns) mean 2.5 p90 2.9 s" in out
    assert main(["log", "--db", str(path), "summary", "--format", "json"]) == 0
    segs = json.loads(capsys.readouterr().out)["segments"]
    assert segs[1]["sessions"]["completion_s"]["max"] == pytest.approx(10.0)


def test_session_table_for_simulate_and_whatif():
    from kvtop.seedtable import session_table

    recs = [{"session": "x", "arrival": 1.0, "status": "ok", "e2e_ms": 2000.0},
            {"session": "x", "arrival": 5.0, "status": "ok", "e2e_ms": 2000.0}]
    csv_text = session_table([("lmetric", recs), ("empty", [])], "csv").splitlines()
    assert len(csv_text) == 2 and csv_text[1].split(",")[:4] == ["lmetric", "1", "2", "6.0"]
    assert session_table([("empty", [])]) == ""


def test_report_of_replay_results_has_the_session_table(tmp_path, capsys):
    from kvtop.cli import main

    path = tmp_path / "arm.jsonl"
    recs = [{"request_id": f"r{k}", "session": "s", "turn": k + 1, "arrival": 0.0, "sent_at": t, "input_tokens": 100,
             "output_tokens": 2, "status": "ok", "ttft_ms": 100.0, "e2e_ms": e2e, "instance": "i0",
             "route_class": "WARM"} for k, (t, e2e) in enumerate([(0.0, 1000.0), (3.0, 2000.0)])]
    path.write_text("\n".join(json.dumps(x) for x in [{"kvtop_results": 1, "arm": "a"}, *recs]) + "\n")
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    line = out.rstrip().splitlines()[-1].split()
    # one session: 0 to 5 s, 3 s in the fleet, 2 s between its turns
    assert line[:2] == ["a", "1"] and line[2] == "5.0" and line[6] == "3.0" and line[8] == "2.0"
