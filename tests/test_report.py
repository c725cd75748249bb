"""Seed-table arithmetic on hand-computed inputs, its formatting, and the ``kvtop report`` verb."""

from __future__ import annotations

import csv
import io
import json
import math

import pytest

from kvtop import seedtable
from kvtop.cli import main
from kvtop.seedtable import APC_ENGINE, APC_NONE, APC_USAGE, balance, choose_apc, class_rows, seed_row


def _rec(ttft, e2e, tpot, cached, inp, instance, status="ok", out=10, route_class=None):
    r = {"status": status, "ttft_ms": ttft, "e2e_ms": e2e, "tpot_ms": tpot,
         "cached_tokens": cached, "input_tokens": inp, "instance": instance, "output_tokens": out}
    if route_class:
        r["route_class"] = route_class
    return r


# Three ok requests and one error. The error is routed (counts for balance) but has no latency
# and is left out of APC.
RECORDS = [
    _rec(100, 1000, 10, 0, 1000, "i0"),
    _rec(300, 2000, 20, 900, 1000, "i1"),
    _rec(200, 3000, None, 1800, 2000, "i0", out=1),  # one output token: TPOT undefined
    _rec(None, None, None, None, 5000, "i0", status="error"),
]


@pytest.mark.parametrize("key,expected", [
    ("requests", 4), ("ok", 3), ("errors", 1),
    ("ttft_mean_ms", 200.0),  # (100 + 300 + 200) / 3
    ("ttft_p90_ms", 280.0),  # sorted 100,200,300; position 1.8 -> 200 + 0.8 * 100
    ("e2e_mean_ms", 2000.0),
    ("e2e_p90_ms", 2800.0),  # position 1.8 -> 2000 + 0.8 * 1000
    ("e2e_p99_ms", 2980.0),  # position 1.98
    ("tpot_p90_ms", 19.0),  # only 10 and 20 are defined; position 0.9
    ("apc", 0.675),  # (0 + 900 + 1800) / (1000 + 1000 + 2000); the error is not counted
    ("apc_source", APC_USAGE),
    ("balance", 3.0),  # i0 got 3 requests (one failed), i1 got 1
    ("requests_per_instance", {"i0": 3, "i1": 1}),
])
def test_seed_row_hand_computed(key, expected):
    row = seed_row(RECORDS)
    assert row[key] == (pytest.approx(expected) if isinstance(expected, float) else expected)


@pytest.mark.parametrize("apc,records,expected", [
    ({"queries": 1000, "hits": 250}, RECORDS, (0.25, APC_ENGINE)),  # engine counters win
    ({"queries": 0, "hits": 0}, RECORDS, (0.675, APC_USAGE)),  # no engine queries: meaningless
    (None, RECORDS, (0.675, APC_USAGE)),  # no counters scraped
    ({"value": 0.5, "source": "engine"}, RECORDS, (0.5, "engine")),  # precomputed (decision log)
    (None, [_rec(1, 2, None, None, 100, "i0")], (None, APC_NONE)),  # engine never reported cached
])
def test_apc_source_choice(apc, records, expected):
    value, source = choose_apc(records, apc)
    assert source == expected[1]
    assert value == (None if expected[0] is None else pytest.approx(expected[0]))


def test_apc_from_usage_skips_requests_without_cached_tokens():
    # The second request's engine did not report: it counts as unknown, not as a 0% hit.
    records = [_rec(1, 2, None, 500, 1000, "a"), _rec(1, 2, None, None, 3000, "a")]
    assert choose_apc(records) == (pytest.approx(0.5), APC_USAGE)


@pytest.mark.parametrize("records,instances,expected_ratio,note_part", [
    ([_rec(1, 1, 1, 0, 1, "a")] * 2 + [_rec(1, 1, 1, 0, 1, "b")], None, 2.0, ""),
    ([_rec(1, 1, 1, 0, 1, "a")] * 3, ["a", "b"], math.inf, "no requests on b"),  # b starved
    ([_rec(1, 1, 1, 0, 1, None)], None, None, "no instance"),  # straight at an engine
    ([_rec(1, 1, 1, 0, 1, "a"), _rec(1, 1, 1, 0, 1, "b")], ["a", "b"], 1.0, ""),  # even
])
def test_balance(records, instances, expected_ratio, note_part):
    ratio, _, note = balance(records, instances)
    assert ratio == expected_ratio
    assert note_part in note


def test_class_rows_group_by_route_class_in_report_order():
    records = [
        _rec(400, 1, None, 0, 60_000, "a"),  # HEAVY+ (>= 50k)
        _rec(100, 1, None, 0, 1000, "a"),  # WARM
        _rec(300, 1, None, 0, 4999, "a"),  # WARM: the bound 5k is exclusive
        _rec(200, 1, None, 0, 5000, "a"),  # MEDIUM starts at 5k
        _rec(None, None, None, None, 5000, "a", status="error"),  # MEDIUM, failed
        _rec(900, 1, None, 0, 30_000, "a", route_class="HEAVY_P2P"),  # router's class wins
    ]
    rows = class_rows(records)
    assert list(rows) == ["WARM", "MEDIUM", "HEAVY+", "HEAVY_P2P"]
    assert rows["WARM"] == {"count": 2, "errors": 0, "ttft_mean": 200.0, "ttft_p50": 200.0,
                            "ttft_p90": pytest.approx(280.0)}
    assert rows["MEDIUM"]["count"] == 1 and rows["MEDIUM"]["errors"] == 1
    assert rows["HEAVY_P2P"]["ttft_p90"] == 900.0


def test_text_table_is_aligned_and_md_csv_parse():
    rows = [("lmetric@1", seed_row(RECORDS)), ("round_robin", seed_row(RECORDS[:2]))]
    text = seedtable.format_seed_table(rows, "text").splitlines()
    assert text[0].split()[0] == "arm" and text[1].startswith("lmetric@1")
    assert "0.200" in text[1] and "67.5% (usage)" in text[1]  # TTFT mean in seconds, APC in %
    md = seedtable.format_seed_table(rows, "md").splitlines()
    assert md[0].startswith("| arm |") and md[1].startswith("|---|---:|")  # numbers right
    assert len(md) == 4
    parsed = list(csv.DictReader(io.StringIO(seedtable.format_seed_table(rows, "csv"))))
    assert parsed[0]["arm"] == "lmetric@1"
    assert float(parsed[0]["ttft_p90_ms"]) == pytest.approx(280.0)
    assert parsed[0]["apc_source"] == "usage"
    assert parsed[1]["tpot_p90_ms"] == "19.0"  # only 10 and 20: position 0.9


def test_text_table_columns_line_up():
    rows = [("a", seed_row(RECORDS)), ("a-much-longer-label", seed_row(RECORDS[:1]))]
    lines = seedtable.format_seed_table(rows, "text").splitlines()
    # every column ends at the same offset on every line (right-aligned numbers)
    assert lines[1].index("4 ") == lines[0].index("requests") + len("requests") - 1


# --- the verb ---------------------------------------------------------------------------

def _write_results(path, arm, records, engine=None):
    header = {"kvtop_results": 1, "arm": arm, "target": "http://x", "trace": "t", "mode": "open",
              "speed": 1.0, "started_at": 0.0, "ended_at": 1.0, "engine_prefix_cache": engine}
    path.write_text("\n".join(json.dumps(x) for x in [header, *records]) + "\n")
    return str(path)


def test_report_two_arms_csv(tmp_path, capsys):
    a = _write_results(tmp_path / "a.jsonl", "lmetric@1", RECORDS, {"queries": 100, "hits": 40})
    b = _write_results(tmp_path / "b.jsonl", None, RECORDS[:2])  # no arm: file name labels it
    assert main(["report", a, b, "--format", "csv"]) == 0
    seed_csv, class_csv = capsys.readouterr().out.strip().split("\n\n")
    seed = list(csv.DictReader(io.StringIO(seed_csv)))
    assert [r["arm"] for r in seed] == ["lmetric@1", "b"]
    assert float(seed[0]["apc"]) == pytest.approx(0.4) and seed[0]["apc_source"] == "engine"
    classes = list(csv.DictReader(io.StringIO(class_csv)))
    assert {(r["arm"], r["class"]) for r in classes} == {("lmetric@1", "WARM"), ("lmetric@1", "MEDIUM"),
                                                        ("b", "WARM")}


def test_report_text_out_file_and_plot(tmp_path, capsys):
    a = _write_results(tmp_path / "a.jsonl", "x", RECORDS)
    out = tmp_path / "table.txt"
    assert main(["report", a, "--out", str(out), "--plot"]) == 0
    assert "TTFT by route class" in out.read_text()
    plot = capsys.readouterr().out
    assert "TTFT CDF" in plot and "\x1b[" not in plot  # no escape codes off a terminal


@pytest.mark.parametrize("make,args_tail,message", [
    (lambda p: _write_results(p / "e.jsonl", "e", []), [], "no request records"),
    (lambda p: str(p / "missing.jsonl"), [], "results file not found"),
    (lambda p: (p / "t.jsonl").write_text('{"arrival": 0}\n') and str(p / "t.jsonl"), [],
     "not a kvtop results file"),
    (lambda p: _write_results(p / "a.jsonl", "a", RECORDS), ["--run", "r1"], "--run needs --db"),
    (lambda p: _write_results(p / "a.jsonl", "a", RECORDS), ["--db", "/nonexistent/kv.db"],
     "database not found"),
])
def test_report_user_errors_are_one_line(tmp_path, capsys, make, args_tail, message):
    path = make(tmp_path)
    assert main(["report", path, *args_tail]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_report_db_arms_come_from_store_queries(tmp_path, capsys, monkeypatch):
    # store.arms belongs to another module; stand in for its contract here.
    import sys
    import types
    from dataclasses import dataclass

    @dataclass
    class FakeArm:
        label: str
        records: list
        apc: dict | None

    calls = []

    def arms_from_db(db_path, run_id=None):
        calls.append((db_path, run_id))
        return [FakeArm("lmetric@1", RECORDS, {"value": 0.9, "source": "engine"}),
                FakeArm("unified@2", [], None)]  # a segment with no outcomes: left out, said so
    monkeypatch.setitem(sys.modules, "store.arms",
                        types.SimpleNamespace(arms_from_db=arms_from_db))
    db = tmp_path / "kvtop.db"
    db.write_bytes(b"")
    assert main(["report", "--db", str(db), "--run", "r7", "--format", "csv"]) == 0
    captured = capsys.readouterr()
    assert calls == [(str(db), "r7")]
    seed = list(csv.DictReader(io.StringIO(captured.out.split("\n\n")[0])))
    assert [r["arm"] for r in seed] == ["lmetric@1"] and float(seed[0]["apc"]) == 0.9
    assert "unified@2" in captured.err
