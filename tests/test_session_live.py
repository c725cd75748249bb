"""Session metrics, live (issue 39): the cluster keeps each session's completion, fleet and
client time in O(1) per request, the same union store/sessions.py computes from the log, and
GET /kvtop/v1/sessions shows them with a summary over every session held."""

from __future__ import annotations

import pytest

from router import session_metrics
from router.cluster import Cluster
from store import sessions as store_sessions


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _start(c: Cluster, sid: str, arrival: float | None = None):
    t = c.dispatch(0, 10, 0, [], session_id=sid)
    c.bind_session(sid, 0, 10, 0, arrival=arrival)
    return t


def test_overlapping_requests_then_a_gap_then_one_more():
    clock = Clock()
    c = Cluster(["a"], clock=clock)
    a = _start(c, "s")                      # [100, 103]
    clock.t = 101.0
    b = _start(c, "s")                      # [101, 104]: overlaps a, counted once
    clock.t = 102.0
    assert c.sessions["s"].figures(clock.t) == (2.0, 2.0, 0.0)  # in flight: to now
    clock.t = 103.0
    c.finish(a)
    clock.t = 104.0
    c.finish(b)
    clock.t = 110.0                         # the client's own time: 6 s
    s = c.sessions["s"]
    assert s.figures(clock.t) == (4.0, 4.0, 0.0)  # idle: nothing grows
    d = _start(c, "s", arrival=109.5)       # received at 109.5, dispatched at 110 (admission)
    clock.t = 112.0
    c.finish(d)
    clock.t = 200.0
    completion, fleet, client = s.figures(clock.t)
    assert (completion, fleet, client) == (12.0, 6.5, 5.5)
    want = store_sessions.sessions([("s", 100.0, 103.0, True), ("s", 101.0, 104.0, True),
                                    ("s", 109.5, 112.0, True)])[0]
    assert (want.completion_s, want.fleet_s, want.client_s) == (completion, fleet, client)


def test_a_request_queued_behind_its_sessions_own_counts_from_the_last_end():
    """Received while its session's previous request was in flight, dispatched after it ended:
    the union continues from that end (never counting the overlap twice)."""
    clock = Clock()
    c = Cluster(["a"], clock=clock)
    a = _start(c, "s")                      # [100, 105]
    clock.t = 105.0
    c.finish(a)
    clock.t = 106.0
    b = _start(c, "s", arrival=103.0)       # [103, 108], waited in admission until 106
    clock.t = 108.0
    c.finish(b)
    assert c.sessions["s"].figures(clock.t) == (8.0, 8.0, 0.0)


def test_summary_over_sessions_matches_the_stores_summary():
    clock = Clock()
    c = Cluster(["a"], clock=clock)
    spans = [("x", 100.0, 102.0), ("y", 101.0, 105.0), ("x", 104.0, 106.0), ("z", 106.0, 116.0)]
    tickets = {}
    events = sorted([(lo, 1, k) for k, (_, lo, _) in enumerate(spans)]
                    + [(hi, 0, k) for k, (_, _, hi) in enumerate(spans)])
    for t, kind, k in events:
        clock.t = t
        if kind:
            tickets[k] = _start(c, spans[k][0])
        else:
            c.finish(tickets[k])
    got = session_metrics.summary(c.sessions.values(), clock.t)
    want = store_sessions.summarize(store_sessions.sessions([(s, lo, hi, True) for s, lo, hi in spans]))
    assert got["sessions"] == want["sessions"] == 3
    for fig in session_metrics.FIGURES:
        for stat in ("mean", "p50", "p90", "max"):
            assert got[fig][stat] == pytest.approx(want[fig][stat]), (fig, stat)
    assert session_metrics.summary([], 0.0)["completion_s"]["mean"] is None


async def test_sessions_endpoint_agrees_with_the_log(router_client, fake_backends, tmp_path):
    """A router over a fake engine: session A (a turn, a pause, then two turns together, as an
    agent's sub-agents) and session B (one turn during A's first). GET sessions's figures are
    store/sessions.py's from the same run's log, to the millisecond."""
    import asyncio

    from router.app import STATE, Backend, RouterConfig, create_app
    from store.logs import open_logs

    fakes = await fake_backends(2, token_delay=0.01)
    cfg = RouterConfig(backends=[Backend(f"i{k}", u) for k, (_, u) in enumerate(fakes)],
                       db=str(tmp_path / "kvtop.db"), state_dir=str(tmp_path / "state"))
    client = await router_client(create_app(cfg))
    state = client.server.app[STATE]

    async def turn(session: str, n: int, out: int) -> None:
        body = {"prompt": list(range(n)), "max_tokens": out, "stream": True}
        r = await client.post("/v1/completions", json=body, headers={"X-Session-ID": session})
        assert r.status == 200
        await r.read()

    await asyncio.gather(turn("A", 600, 8), turn("B", 300, 4))
    await asyncio.sleep(0.15)  # A's tool call
    await asyncio.gather(turn("A", 900, 6), turn("A", 700, 12))
    body = await (await client.get("/kvtop/v1/sessions?sort=completion")).json()
    live = {s["session"]: s for s in body["sessions"]}
    assert [s["session"] for s in body["sessions"]] == ["A", "B"]  # the longest first
    assert all(s["in_flight"] == 0 for s in body["sessions"])

    state.writer.flush()
    db = open_logs(cfg.db)
    (logged,) = store_sessions.from_db(db, state.run_id).values()
    assert {s.session for s in logged} == {"A", "B"}
    for s in logged:
        row = live[s.session]
        for fig in session_metrics.FIGURES:
            assert row[fig] == pytest.approx(getattr(s, fig), abs=0.003), (s.session, fig)
    a = live["A"]
    assert a["client_s"] >= 0.14 and a["fleet_s"] > 0.1  # the pause is the client's
    want = store_sessions.summarize(logged)
    assert body["summary"]["sessions"] == 2
    for fig in session_metrics.FIGURES:
        for stat in ("mean", "p50", "p90", "max"):
            assert body["summary"][fig][stat] == pytest.approx(want[fig][stat], abs=0.003), (fig, stat)
    bad = await client.get("/kvtop/v1/sessions?sort=nope")
    assert bad.status == 400 and "completion" in (await bad.json())["error"]["message"]
