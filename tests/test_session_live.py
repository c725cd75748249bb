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


def _body(summary: bool) -> dict:
    rows = [{"session": "agent-1", "instance": "vllm-0", "turns": 3, "tokens": 1200, "est_hit_rate": 0.5,
             "bound_for_s": 10.0, "idle_s": 1.0, "moves": 0, "completion_s": 75.0, "fleet_s": 42.5,
             "client_s": 32.5, "in_flight": 0},
            {"session": "agent-2", "instance": "vllm-1", "turns": 1, "tokens": 900, "est_hit_rate": None,
             "bound_for_s": 1.0, "idle_s": 0.0, "moves": 0, "completion_s": 0.4, "fleet_s": 0.4,
             "client_s": 0.0, "in_flight": 1}]
    body = {"total": 2, "sort": "last_seen", "sessions": rows}
    if summary:
        body["summary"] = {"sessions": 2, "completion_s": {"mean": 37.7, "p50": 37.7, "p90": 67.54, "max": 75.0},
                           "fleet_s": {"mean": 21.45, "p50": 21.45, "p90": 38.29, "max": 42.5},
                           "client_s": {"mean": 16.25, "p50": 16.25, "p90": 29.25, "max": 32.5}}
    return body


@pytest.mark.parametrize("summary", [True, False])
async def test_the_sessions_tab_shows_the_session_times(summary):
    from test_tui import make_app, settle, wait_group

    app, feed = make_app(steps=2, decisions=3)
    feed.sessions_body = _body(summary)
    async with app.run_test(size=(140, 42)) as pilot:
        await settle(pilot, app)
        await pilot.press("3")
        app._fetch_sessions()
        await wait_group(app, "sessions")
        await settle(pilot, app)
        line = str(app.query_one("#session-summary").render())
        if summary:
            assert line == ("sessions 2  completion mean 37s p90 1m07s max 1m15s  "
                            "fleet mean 21s  client mean 16s")
        else:  # a router from before issue 39: said, not a row of dashes
            assert line == "session times: not reported by this router"
        table = app.query_one("#session-table")
        labels = [str(c.label) for c in table.columns.values()]
        assert labels[-3:] == ["completion", "fleet", "client"]
        cells = {str(table.get_row_at(i)[0]): [str(v) for v in table.get_row_at(i)[-3:]]
                 for i in range(table.row_count)}
        assert cells == {"agent-1": ["1m15s", "42s", "32s"], "agent-2": ["0.4s", "0.4s", "0.0s"]}
