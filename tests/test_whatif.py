"""What-if replay (kvtop/whatif.py, ``kvtop simulate --from-db``) on decision logs written by a
real router on 127.0.0.1, and the time-scale fit on a run whose scale is known."""

from __future__ import annotations

import asyncio
import json
import random
import sqlite3

import pytest
import sqlite_utils

from kvtop.cli import main
from kvtop.sim.profiles import get_profile
from kvtop.traces.loader import TraceRequest
from kvtop.whatif import RecordedRun, fit_time, isolated_ttft_s, load_run
from router.app import STATE
from test_control import complete, router  # noqa: F401  (the router fixture)


async def _record(c, turns: int = 4, sessions: int = 3) -> str:
    """Agentic-looking traffic: each session's prompt grows turn by turn."""
    for t in range(turns):
        for s in range(sessions):
            prompt = " ".join(f"s{s}w{k}" for k in range(1000 + 600 * t))
            assert (await complete(c, f"sess-{s}", prompt=prompt))["status"] == 200
    await asyncio.sleep(0.05)
    st = c.server.app[STATE]
    st.writer.flush()
    return st.config.db


async def test_load_run_rebuilds_the_traffic(router):
    c = await router(2, db=True, shadows=["leastwork"])
    db = await _record(c)
    run = load_run(db)
    assert run.total == 12 and len(run.requests) == 12 and not run.skipped
    assert run.policies == ["unified"] and run.shadows == ["leastwork"]
    assert run.instances == ["i0", "i1"] and run.block_size == 512
    arrivals = [r.arrival for r in run.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    by_session: dict[str, list[TraceRequest]] = {}
    for r in run.requests:
        by_session.setdefault(r.session, []).append(r)
    for reqs in by_session.values():
        assert [r.turn for r in reqs] == [1, 2, 3, 4]
        # each turn extends the previous prompt: its chain starts with the previous chain
        for a, b in zip(reqs, reqs[1:]):
            assert len(b.hash_ids) > len(a.hash_ids) and b.hash_ids[:len(a.hash_ids)] == a.hash_ids
            assert b.think_time is not None and b.think_time >= 0
        assert all(r.output_tokens == 2 for r in reqs)  # the fake backend's usage
    # the simulator gets 64-token chains (FineChains) built on the router's 512-token ones
    assert all(r.block_size == 64 and len(r.hash_ids) == r.input_tokens // 64 for r in run.requests)


def test_fine_chains_share_a_whole_previous_prompt_and_only_full_blocks_otherwise():
    from kvtop.whatif import FineChains

    fc = FineChains(512)
    a = fc.chain("s", "a", [11, 12], 1300)  # 2 full coarse blocks + a 276-token tail
    assert len(a) == 20
    b = fc.chain("s", "b", [11, 12, 13, 14], 2100)  # extends a: a's tail is shared too
    assert b[:20] == a and len(b) == 32
    c = fc.chain("s", "c", [11, 99, 98, 97, 96], 2600)  # diverges after one block: 8 fine blocks
    assert c[:8] == b[:8] and c[8] != b[8]
    # another session with the same first block derives the same fine ids (a shared system prompt)
    d = FineChains(512).chain("t", "d", [11], 600)
    assert d[:8] == a[:8] and len(d) == 9


async def test_unreplayable_rows_are_counted_not_guessed(router, tmp_path):
    c = await router(2, db=True)
    db = await _record(c, turns=3, sessions=2)
    conn = sqlite3.connect(db)
    # lose a session's first row (a crash): its later turns cannot be rebuilt
    first = conn.execute("SELECT request_id FROM decisions WHERE session_id='sess-0' ORDER BY id LIMIT 1").fetchone()[0]
    conn.execute("DELETE FROM decisions WHERE request_id=?", (first,))
    conn.execute("UPDATE outcomes SET status='client_gone' WHERE request_id=(SELECT request_id FROM decisions "
                 "WHERE session_id='sess-1' ORDER BY id DESC LIMIT 1)")
    conn.commit()
    conn.close()
    run = load_run(db)
    assert run.total == 5
    assert run.skipped == {"no block chain (a lost parent row)": 2, "not answered (client_gone)": 1}
    assert len(run.requests) == 2


def test_fit_recovers_a_known_time_scale():
    prof = get_profile("h20")
    rng = random.Random(3)
    recorded, requests = [], []
    t = 0.0
    for k in range(40):  # well apart: each alone on its instance
        n = rng.randint(2_000, 120_000)
        cached = rng.choice([0, n // 2, n - 600])
        ttft = 0.002 + 0.015 * n / 1e5 + isolated_ttft_s(prof, n, cached) / 7.5
        ttft += rng.uniform(-0.0005, 0.0005)
        if k % 10 == 3:
            ttft *= 3  # a hiccup: the fit must not follow it
        recorded.append({"request_id": str(k), "instance": f"i{k % 2}", "arrival": t, "t_done": t + ttft + 0.1,
                         "stream": 1, "ttft_ms": ttft * 1000, "input_tokens": n, "cached_tokens": cached,
                         "status": "ok"})
        t += 100
    run = RecordedRun("r", ["unified"], {}, ["i0", "i1"], 512, requests, recorded, [])
    fit = fit_time(run, prof)
    assert fit is not None and abs(fit.speed - 7.5) / 7.5 < 0.02
    assert abs(fit.fixed_s - 0.002) < 0.001
    given = fit_time(run, prof, speed=7.5)
    assert given.speed == 7.5 and abs(given.per_100k_s - 0.015) < 0.003
    # overlapping requests are not used: all at once leaves nothing alone
    for r in recorded:
        r["arrival"], r["t_done"] = 0.0, 1000.0
    assert fit_time(run, prof) is None


async def test_cli_from_db_reports_and_validates(router, tmp_path, capsys):
    c = await router(2, db=True, shadows=["leastwork"])
    db = await _record(c)
    assert main(["simulate", "--from-db", db, "--speed", "1000", "--profile", "h20"]) == 0
    out = capsys.readouterr().out
    assert "what-if replay of run" in out and "12 of 12 requests re-run" in out
    main_table = out.split("\nSessions (")[0]  # the session table below repeats the arm labels
    assert "\nSessions (" in out  # agent sessions' completion times, recorded and simulated
    lines = [ln for ln in main_table.splitlines() if ln.startswith(("recorded ", "sim ")) and ":" not in ln.split()[1]]
    assert [ln.split()[0:2] for ln in lines] == [["recorded", "unified"], ["sim", "unified"], ["sim", "leastwork"]]
    assert "validation (re-simulated unified" in out
    assert main(["simulate", "--from-db", db, "--speed", "1000", "--policies", "round_robin", "--format", "csv"]) == 0
    csv_out = capsys.readouterr().out.splitlines()
    assert csv_out[0].startswith("arm,ok,ttft_p50_ms") and csv_out[2].startswith("sim round_robin,12")


@pytest.mark.parametrize("argv,msg", [
    (["--from-db", "{missing}"], "no such file"),
    (["--from-db", "{old}"], "schema version 1"),
    (["--from-db", "{db}", "--run", "nope"], "--run nope: not in"),
    (["trace.jsonl", "--from-db", "{db}"], "not both"),
    (["--from-db", "{db}", "--limit", "3"], "--from-db takes"),
    (["--from-db", "{db}", "--speed", "0"], "--speed must be positive"),
    (["--from-db", "{db}", "--policies", "nope"], "unknown policy"),
    (["trace.jsonl", "--policies", "unified", "--speed", "3"], "go with --from-db"),
    ([], "a trace is required"),
    # a nan jitter printed intervals of garbage and exited 0
    (["--from-db", "{db}", "--repeats", "2", "--jitter", "nan"], "--jitter finite and at least 0"),
    (["--from-db", "{db}", "--repeats", "2", "--path-jitter", "0.3"], "--from-db takes"),
    (["--from-db", "{db}", "--repeats", "2", "--plot", "x.svg"], "--from-db takes"),   # was ignored
])
def test_cli_from_db_errors_are_one_line(tmp_path, capsys, argv, msg):
    db = tmp_path / "k.db"
    dbx = sqlite_utils.Database(db)
    from store.schema import ensure_schema

    ensure_schema(dbx)
    dbx["runs"].insert({"run_id": "r1", "started_at": 1.0, "backends": json.dumps([{"name": "i0"}]),
                        "config": "{}", "policy": "unified"})
    dbx["decisions"].insert({"run_id": "r1", "request_id": "a", "attempt": 1, "session_id": "s", "turn": 1,
                             "policy": "unified", "instance": "i0", "input_tokens": 600, "t_proxy_recv": 5.0,
                             "blocks": "0:AAAAAAAAAAA"})
    old = tmp_path / "old.db"
    conn = sqlite3.connect(old)
    conn.execute("CREATE TABLE decisions (id INTEGER PRIMARY KEY, request_id TEXT)")
    conn.close()
    argv = [a.format(db=db, old=old, missing=tmp_path / "none.db") for a in argv]
    assert main(["simulate", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0], err


async def test_from_db_reruns_the_recorded_features_and_says_so(router, tmp_path, capsys, monkeypatch):
    """A run recorded with offload and admission on is re-simulated with both on (it was
    re-run with both off and validated as if it were the same setup), and a knob changed
    while the run went is named as not replayed."""
    import kvtop.simulate as sim_mod

    c = await router(2, db=True, knobs={"offload_mode": "simple", "admission": "fifo",
                                        "offload_threshold": "3000"})
    db = await _record(c)
    st = c.server.app[STATE]
    st.set_policy(None, {"admission_budget_tokens": 9000}, "test", merge=True)
    st.writer.flush()
    seen = []
    real = sim_mod.simulate

    def spy(requests, policy, cfg, **kw):
        seen.append(cfg)
        return real(requests, policy, cfg, **kw)

    monkeypatch.setattr(sim_mod, "simulate", spy)
    assert main(["simulate", "--from-db", db, "--speed", "1000", "--profile", "h20"]) == 0
    out = capsys.readouterr().out
    assert seen and all(cfg.features.get("offload_mode") == "simple" and cfg.features.get("admission") == "fifo"
                        and str(cfg.features.get("offload_threshold")) == "3000" for cfg in seen)
    assert "router features, as recorded, in every arm: offload simple (threshold 3000), admission fifo" in out
    assert "changed 1 time(s) while it ran (test)" in out


async def test_a_fleet_change_during_the_run_is_replayed(router, capsys, monkeypatch):
    """What-if replays the fleet changes a run made (kvtop/fleet_events.py): a drain made while
    it ran reaches every arm's simulation as a fleet event at its time, and the report says so."""
    import kvtop.simulate as sim_mod

    from router import fleet_api
    from router.control import CONTROL

    c = await router(2, db=True)
    db = await _record(c)
    st = c.server.app[STATE]
    await fleet_api.change(st, c.server.app[CONTROL].tel, "i1", "drain", "ops")
    st.writer.flush()
    seen = []
    real = sim_mod.simulate

    def spy(requests, policy, cfg, **kw):
        seen.append(cfg)
        return real(requests, policy, cfg, **kw)

    monkeypatch.setattr(sim_mod, "simulate", spy)
    assert main(["simulate", "--from-db", db, "--speed", "1000", "--profile", "h20"]) == 0
    out = capsys.readouterr().out
    assert "fleet changes replayed in every arm at their recorded times: 1 (ops)" in out
    assert "STARTING settings" not in out
    assert seen and all([(e.action, e.instance) for e in cfg.fleet_events] == [("drain", "i1")] for cfg in seen)
