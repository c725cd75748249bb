"""Where the gap to the prefix ceiling went, and the capacity ceiling (issue 38): the parts of
``kvtop.cachegap.decompose`` on hand-built runs, the pooled optimal-eviction bound against
hand-computed values (where LRU would do worse), and the table in ``kvtop report``."""

from __future__ import annotations

import json

import pytest

from kvtop import cachegap
from kvtop.cli import main
from kvtop.traces.loader import TraceRequest, write_trace
from test_control import router  # noqa: F401  (the router fixture)

BS = 64


def req(session: str, turn: int, arrival: float, blocks: list[int], output_tokens: int = 0) -> TraceRequest:
    return TraceRequest(arrival=arrival, session=session, turn=turn, input_tokens=len(blocks) * BS,
                        output_tokens=output_tokens, hash_ids=blocks, block_size=BS)


def rec(r: TraceRequest, instance: str | None, cached: int | None, *, at: float | None = None,
        ttft_s: float = 1.0, e2e_s: float = 2.0, rid: str | None = None) -> dict:
    return {"request_id": rid or f"{r.session}{r.turn}", "session": r.session, "turn": r.turn,
            "arrival": r.arrival if at is None else at, "input_tokens": r.input_tokens, "status": "ok",
            "ttft_ms": ttft_s * 1000, "e2e_ms": e2e_s * 1000, "cached_tokens": cached, "instance": instance}


A = [1, 2, 3, 4]
A2 = A + [5, 6, 7, 8]


def two_turns() -> list[TraceRequest]:
    """Session a: 4 blocks, then the same 4 and 4 more; ceiling hit of turn 2: 4 blocks."""
    return [req("a", 1, 0.0, A), req("a", 2, 10.0, A2)]


@pytest.mark.parametrize("second, decisions, parts", [
    # stayed and got its prefix: no gap
    (("i0", 256), None, {}),
    # stayed, nothing cached any more: evicted on its own instance (capacity)
    (("i0", 0), None, {"evicted": 256}),
    # stayed, half of it left: half evicted
    (("i0", 128), None, {"evicted": 128}),
    # moved: computed on i0 only; without decision rows all of it counts as placement
    (("i1", 0), None, {"placement": 256}),
    # moved, and the router saw i0 still holding 192 tokens of it: placement 192, the rest evicted
    (("i1", 0), [{"request_id": "a2", "best_hit_tokens": 192, "est_hit_tokens": 0}],
     {"placement": 192, "evicted": 64}),
    # moved where the router saw nothing held anywhere (evicted everywhere): all evicted
    (("i1", 0), [{"request_id": "a2", "best_hit_tokens": 0, "est_hit_tokens": 0}], {"evicted": 256}),
    # a retry: its last attempt's row counts
    (("i1", 0), [{"request_id": "a2", "attempt": 1, "best_hit_tokens": 0, "est_hit_tokens": 0},
                 {"request_id": "a2", "attempt": 2, "best_hit_tokens": 256, "est_hit_tokens": 0}],
     {"placement": 256}),
])
def test_decompose_splits_the_lost_prefix(second, decisions, parts):
    t = two_turns()
    got = cachegap.decompose(t, [rec(t[0], "i0", 0), rec(t[1], *second)], decisions)
    assert got.ceiling_tokens == 256 and got.input_tokens == 256 + 512
    assert got.lost_tokens == 256 - second[1]
    assert got.parts == {p: parts.get(p, 0) for p in cachegap.PARTS}
    assert sum(got.parts.values()) == got.lost_tokens  # the parts always sum to the gap
    assert got.moved == (1 if parts.get("placement") else 0)


def test_concurrency_and_first_turns():
    """b1 shares a1's first two blocks (a system prompt) and goes elsewhere: first_turn; a2 is
    dispatched while a1 is still prefilling (open loop): concurrency."""
    t = [req("a", 1, 0.0, A), req("b", 1, 0.5, [1, 2, 9, 10]), req("a", 2, 1.0, A2)]
    records = [rec(t[0], "i0", 0, ttft_s=5.0, e2e_s=6.0), rec(t[1], "i1", 0), rec(t[2], "i0", 0)]
    got = cachegap.decompose(t, records)
    assert got.parts["first_turn"] == 128 and got.parts["concurrency"] == 256
    assert sum(got.parts.values()) == got.lost_tokens == 384


def test_records_without_an_instance_or_cached_tokens_are_left_out():
    t = two_turns()
    got = cachegap.decompose(t, [rec(t[0], None, 0), rec(t[1], "i0", None), {"session": "zz", "input_tokens": 1}])
    assert got.requests == 0 and got.unmatched == 3 and got.input_tokens == 0


def test_capacity_ceiling_infinite_is_the_prefix_ceiling():
    from kvtop.traces.stats import prefix_ceiling

    t = [req("a", 1, 0.0, A), req("b", 1, 1.0, [11, 12, 13, 14, 15, 16, 17, 18]), req("a", 2, 2.0, A2)]
    assert cachegap.capacity_ceiling(t, 10**9) == pytest.approx(prefix_ceiling(t)[1]) == pytest.approx(0.2)
    assert cachegap.capacity_ceiling(t, 0) == 0.0
    assert cachegap.capacity_ceiling([], 100) is None


def test_capacity_ceiling_evicts_optimally():
    """A, B, A, B with room for one of them (4 blocks): keeping A gives A's second turn 4 hits
    (256 of 1,024 tokens); LRU would keep B for A's return and A for B's: 0 hits."""
    a, b = [1, 2, 3, 4], [11, 12, 13, 14]
    t = [req("a", 1, 0.0, a), req("b", 1, 1.0, b), req("a", 2, 2.0, a), req("b", 2, 3.0, b)]
    assert cachegap.capacity_ceiling(t, 4 * BS) == pytest.approx(0.25)
    assert cachegap.capacity_ceiling(t, 8 * BS) == pytest.approx(0.5)


def test_timed_capacity_ceiling_counts_running_requests_holding_their_blocks():
    """Room for 8 blocks. b (8 blocks) runs from t=2 to t=30; a returns at t=20: untimed, the
    optimal cache keeps a (b is never used again); on the timeline b fills the cache while a
    is away, so a's return cannot hit."""
    t = [req("a", 1, 0.0, A), req("b", 1, 1.0, list(range(11, 19))), req("a", 2, 20.0, A)]
    records = [rec(t[0], "i0", 0), rec(t[1], "i1", 0, e2e_s=29.0), rec(t[2], "i0", 0)]
    assert cachegap.capacity_ceiling(t, 8 * BS) == pytest.approx(256 / 1024)
    assert cachegap.timed_capacity_ceiling(t, records, 8 * BS) == 0.0
    # however short b's run, a's blocks must make room for it and are gone when a returns
    records[1] = rec(t[1], "i1", 0, e2e_s=1.5)
    assert cachegap.timed_capacity_ceiling(t, records, 8 * BS) == 0.0
    # b failed before its first token: it never held its blocks, a is kept
    records[1] = {**rec(t[1], "i1", 0), "status": "error", "ttft_ms": None, "e2e_ms": None}
    assert cachegap.timed_capacity_ceiling(t, records, 8 * BS) == pytest.approx(256 / 1024)
    assert cachegap.timed_capacity_ceiling(t, [], 8 * BS) is None


def test_timed_capacity_ceiling_drops_first_what_a_running_request_recomputes():
    """Room for 8 blocks. x (4 blocks) is looked up at t=0 and t=20; h (4 other blocks) runs
    from t=1 to t=2.5; c (4 more) is looked up at t=2, runs from t=3 to t=4, and is looked up
    again at t=15. At t=2 (x, h held, c: 12 blocks) c's blocks are worth nothing until c runs
    (it recomputes them), so they go and x stays: x and c both hit later (8 of 20 blocks).
    Evicting by the farthest lookup alone would drop x (t=20) for c (t=15): 4 of 20."""
    x, h, c = [1, 2, 3, 4], [11, 12, 13, 14], [21, 22, 23, 24]
    t = [req("x", 1, 0.0, x), req("h", 1, 0.5, h), req("c", 1, 2.0, c), req("c", 2, 15.0, c),
         req("x", 2, 20.0, x)]
    failed = {"status": "error", "ttft_ms": None, "e2e_ms": None}
    records = [{**rec(t[0], "i0", 0), **failed}, rec(t[1], "i0", 0, ttft_s=0.5, e2e_s=2.0),
               rec(t[2], "i0", 0, ttft_s=1.0, e2e_s=2.0), {**rec(t[3], "i0", 0), **failed},
               {**rec(t[4], "i0", 0), **failed}]
    assert cachegap.timed_capacity_ceiling(t, records, 8 * BS) == pytest.approx(8 / 20)
    # with room for 12 nothing need go: the same 8 hits; with room for 4, only c's return
    # (its blocks held while it runs, nothing else fits beside them then)
    assert cachegap.timed_capacity_ceiling(t, records, 12 * BS) == pytest.approx(8 / 20)
    assert cachegap.timed_capacity_ceiling(t, records, 4 * BS) == pytest.approx(4 / 20)


def test_report_shows_where_the_gap_went(tmp_path, capsys):
    """kvtop simulate --out, then kvtop report: the gap table with both ceilings (the fleet's
    KV from the simulate header, or --kv-tokens), and a one-line error for a bad --kv-tokens."""
    trace = tmp_path / "t.jsonl"
    reqs = [req(f"s{s}", k + 1, s * 0.5 + k * 5.0, [s * 100 + j for j in range(8 + 4 * k)], output_tokens=4)
            for s in range(4) for k in range(3)]
    write_trace(trace, sorted(reqs, key=lambda r: r.arrival))
    assert main(["simulate", str(trace), "--policies", "round_robin,sticky", "--instances", "2",
                 "--mode", "closed", "--out", str(tmp_path / "res")]) == 0
    capsys.readouterr()
    files = [str(tmp_path / "res" / f"{p}.jsonl") for p in ("round_robin", "sticky")]
    assert main(["report", *files, "--format", "md"]) == 0
    out = capsys.readouterr().out
    assert "## Where the gap to the prefix ceiling went" in out
    table = out.split("## Where the gap to the prefix ceiling went")[1]
    head, *body = [line.strip("| ").split(" | ") for line in table.splitlines() if line.startswith("| ")]
    rows = {cells[0]: dict(zip(head, cells)) for cells in body}
    # round robin moves every session each turn (2 instances): its gap is placement; sticky
    # never moves and, with room for every session, loses nothing
    assert rows["round_robin"]["placement"] != "0.0%" and int(rows["round_robin"]["moved"]) > 0
    assert rows["sticky"]["gap"] == "0.0%" and rows["sticky"]["moved"] == "0"
    assert rows["sticky"]["of ceiling"] == "100.0%" == rows["sticky"]["of capacity ceiling"]
    from kvtop.sim.profiles import get_profile

    assert f"{2 * get_profile('h20').kv_capacity_tokens:,} KV tokens" in out
    assert main(["report", *files, "--kv-tokens", "512"]) == 0
    assert "the fleet's 512 KV tokens" in capsys.readouterr().out
    assert main(["report", *files, "--kv-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert "--kv-tokens must be at least 1" in err and "Traceback" not in err
    # without the trace (moved away), no gap table: nothing to split against
    trace.rename(tmp_path / "gone.jsonl")
    assert main(["report", *files]) == 0
    assert "Where the gap" not in capsys.readouterr().out


def test_logged_gaps_take_placement_from_the_decision_log(tmp_path, capsys):
    """A live arm's results file and its decision log: where the log says the router saw no
    longer prefix elsewhere than on its pick, a move's loss is eviction, not placement."""
    import sqlite3

    trace = tmp_path / "t.jsonl"
    reqs = [req(f"s{s}", k + 1, s * 0.5 + k * 5.0, [s * 100 + j for j in range(8 + 4 * k)], output_tokens=4)
            for s in range(4) for k in range(3)]
    write_trace(trace, sorted(reqs, key=lambda r: r.arrival))
    assert main(["simulate", str(trace), "--policies", "round_robin", "--instances", "2",
                 "--mode", "closed", "--out", str(tmp_path / "res")]) == 0
    capsys.readouterr()
    results = str(tmp_path / "res" / "round_robin.jsonl")
    records = [json.loads(line) for line in open(results)][1:]
    db = tmp_path / "log.db"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE decisions (request_id TEXT, attempt INT, best_hit_tokens INT, est_hit_tokens INT)")
    conn.execute("CREATE TABLE runs (run_id TEXT)")  # what a kvtop log has besides (store/logs.py)
    conn.execute("CREATE TABLE outcomes (request_id TEXT)")
    conn.executemany("INSERT INTO decisions VALUES (?, 1, 0, 0)", [(r["request_id"],) for r in records])
    conn.commit()
    conn.close()
    assert len(cachegap.decision_rows(str(db))) == len(records)
    assert cachegap.decision_rows(str(tmp_path / "res" / "round_robin.jsonl")) == []  # not a log
    from kvtop.report import logged_gaps

    table = logged_gaps([(results, str(db))], 10**7, "md")
    head, *body = [line.strip("| ").split(" | ") for line in table.splitlines() if line.startswith("| ")]
    row = dict(zip(head, body[0]))
    assert row["placement"] == "0.0%" and row["evicted"] == row["gap"] != "0.0%"
    without = cachegap.decompose(cachegap_trace(trace), records)
    assert without.parts["placement"] > 0  # the infinite-cache model blames the moves


def cachegap_trace(path) -> list[TraceRequest]:
    from kvtop.traces.loader import load_trace

    return sorted(load_trace(path), key=lambda r: r.arrival)


async def test_report_db_splits_the_gap_per_policy_segment(router, capsys):  # noqa: F811
    """A decision log (two instances, three sessions of four growing turns): kvtop report --db
    splits its arm's gap from the log's block chains, placement from its decision rows."""
    import asyncio

    from router.app import STATE
    from test_control import complete

    c = await router(2, db=True)
    for t in range(4):
        for s in range(3):
            prompt = " ".join(f"s{s}w{k}" for k in range(1000 + 600 * t))
            assert (await complete(c, f"sess-{s}", prompt=prompt))["status"] == 200
    await asyncio.sleep(0.05)
    st = c.server.app[STATE]
    st.writer.flush()
    gaps, ceil, cap = cachegap.log_gaps(st.config.db, None, 10**7)
    assert set(gaps) == {"unified"} and gaps["unified"].requests == 12 and gaps["unified"].decisions
    g = gaps["unified"]
    assert sum(g.parts.values()) == g.lost_tokens and 0.3 < ceil < 0.9 and cap == pytest.approx(ceil, abs=0.01)
    assert cachegap.log_gaps(str(st.config.db) + ".missing", None, None) == ({}, None, None)
    assert main(["report", "--db", st.config.db, "--format", "md", "--kv-tokens", str(10**7)]) == 0
    out = capsys.readouterr().out
    assert "## Where the gap to the prefix ceiling went" in out and "| unified@" in out.split("went")[1]


def test_a_prefix_that_finished_while_it_queued_is_not_counted_lost():
    """a2 is dispatched while a1 still prefills (concurrency by dispatch time), but its engine
    looked it up after a1's first token and delivered a1's whole prefix: nothing of it was
    lost, so no part claims it and "other" is not left to balance a phantom loss."""
    t = [req("a", 1, 0.0, A), req("a", 2, 1.0, A2)]
    records = [rec(t[0], "i0", 0, ttft_s=5.0, e2e_s=6.0), rec(t[1], "i0", 256)]
    got = cachegap.decompose(t, records)
    assert got.lost_tokens == 0
    assert got.parts == {p: 0 for p in cachegap.PARTS}


def test_a_partial_hit_counts_only_the_missed_positions():
    """a2 moved to i1 (a1's prefix computed on i0 only), yet i1 delivered 128 of the 256 tokens
    (another request brought them there after a2's dispatch): placement is the 128 it missed."""
    t = two_turns()
    got = cachegap.decompose(t, [rec(t[0], "i0", 0), rec(t[1], "i1", 128)])
    assert got.parts == {p: (128 if p == "placement" else 0) for p in cachegap.PARTS}
