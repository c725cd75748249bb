"""Router replicas share session records (router/replica_sessions.py).

Two replicas that each see every other request of the same sessions, exchanging their
messages, price a turn exactly as one router that saw every request does: the same session
turn and instance, the same bound sessions, gaps and terms. What a peer sends is validated
and bounded; what a lost or restarted peer held in flight is released; a replica's own books
never hold a peer's request.
"""

from __future__ import annotations

import asyncio
import json

from router import replica_sessions as rs
from router import replicas as rp
from router.cluster import Cluster
from router.core import RoutingCore
from router.request import RouteRequest
from router.settings import Settings
from router.supervise import Supervisor
from test_replicas import endpoint, replica_pair, until  # noqa: F401  (replica_pair: a fixture)

URLS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def req(sid: str, tokens: int, n: int = 0) -> RouteRequest:
    # no blocks: every estimated hit is 0 for every router alike, so only load and sessions differ
    return RouteRequest(f"{sid}-{tokens}-{n}", sid, "header", tokens, [], "tokens", "completions", True, 16)


def core_of(cl: Cluster) -> RoutingCore:
    return RoutingCore(cl, Settings.parse("expected_cost", {}).build_policy())


def place(core: RoutingCore, r: RouteRequest, instance: int):
    """Dispatch ``r`` to ``instance`` through the core (its decision overridden)."""
    d = core.decide(r)
    d.instance, d.est_hit_tokens = instance, 0
    return core.dispatch(d)


class Pair:
    """One router S and two replicas A, B (own clusters, no sockets: messages moved by hand)."""

    def __init__(self, share: bool = True):
        self.clock = Clock()
        self.mono = Clock(50.0)
        self.share = share
        self.s = Cluster(["i0", "i1", "i2"], urls=URLS, clock=self.clock, capacity_blocks=80)
        # B lists the engines in another order, under other names: facts match by URL
        self.a = Cluster(["i0", "i1", "i2"], urls=URLS, clock=self.clock, capacity_blocks=80)
        self.b = Cluster(["z", "y", "x"], urls=URLS[::-1], clock=self.clock, capacity_blocks=80)
        self.ea, self.eb = "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"
        self.ra = rp.Replicas(self.a, "A", bind=self.ea, peers=[self.eb], clock=self.mono)
        self.rb = rp.Replicas(self.b, "B", bind=self.eb, peers=[self.ea], clock=self.mono)
        self.cs, self.ca, self.cb = core_of(self.s), core_of(self.a), core_of(self.b)
        self.ca.peers, self.cb.peers = self.ra, self.rb

    def sync(self, drop_sessions: bool = False) -> None:
        """Each replica's load snapshot and pending session facts to the other."""
        for src, dst in ((self.ra, self.rb), (self.rb, self.ra)):
            dst.receive(dst.peers[0], [rp.TOPIC, src.message(src.own_loads())])
            msg = src.share.message() if self.share else None
            if msg is not None and not drop_sessions:
                assert dst.receive(dst.peers[0], [rp.TOPIC, msg])

    def turn(self, via: str, sid: str, tokens: int, instance: int):
        """The request to S and to replica ``via``; returns both tickets."""
        core = self.ca if via == "a" else self.cb
        own = instance if via == "a" else 2 - instance  # B's index of the same engine
        ts = place(self.cs, req(sid, tokens), instance)
        tr = place(core, req(sid, tokens), own)
        self.sync()
        return ts, (self.a if via == "a" else self.b), tr

    def end(self, tickets) -> None:
        ts, cl, tr = tickets
        self.s.finish(ts)
        cl.finish(tr)
        self.sync()


def terms(d) -> dict[str, dict]:
    return {t["instance"]: {k: v for k, v in t.items() if k != "instance"} for t in d.terms}


def scenario(p: Pair):
    """Three sessions, their turns spread over A and B as a round-robin balancer does."""
    t1 = p.turn("a", "s1", 30_000, 0)
    t2 = p.turn("b", "s2", 20_000, 1)
    p.clock.t += 2.0
    p.end(t1)
    p.clock.t += 0.5
    p.end(t2)
    p.clock.t += 4.0
    t3 = p.turn("b", "s1", 33_000, 0)  # s1's second turn, on the other replica
    p.clock.t += 1.5
    p.end(t3)
    p.clock.t += 1.0
    t4 = p.turn("a", "s3", 90_000, 2)  # in flight at the decision below
    p.clock.t += 0.25
    t5 = p.turn("a", "s2", 24_000, 1)  # s2's second turn: B placed its first
    p.clock.t += 3.0
    p.end(t5)
    p.sync()
    return t4


def test_a_replica_prices_a_turn_exactly_as_one_router_would():
    p = Pair()
    t4 = scenario(p)
    # s1's third turn arrives at A: A never saw its second, B never saw s3 or s2's second
    for core, names in ((p.ca, ("i0", "i1", "i2")), (p.cb, ("x", "y", "z"))):
        one = p.cs.decide(req("s1", 36_000, 1), lookahead=True)
        rep = core.decide(req("s1", 36_000, 1), lookahead=True)
        assert (rep.turn, rep.instance_name) == (one.turn, dict(zip(("i0", "i1", "i2"), names))[one.instance_name])
        assert one.turn == 3 and one.reason == rep.reason == "affinity_stick"
        mine, single = terms(rep), terms(one)
        assert [mine[n] for n in names] == [single[n] for n in ("i0", "i1", "i2")]
        assert single["i1"]["keep_s"] > 0 and single["i1"]["queue_s"] > 0  # the session terms are priced
        la_one, la_rep = one.view.lookahead, rep.view.lookahead
        assert la_rep.fleet_gap_s == la_one.fleet_gap_s == (4.5 + 6.75) / 2  # s1 and s2, each gap seen by one replica
    rec_a, rec_s = p.a.sessions["s1"], p.s.sessions["s1"]
    assert (rec_a.turns, rec_a.gaps, rec_a.gap_sum, rec_a.last_input_tokens, rec_a.last_done) == \
        (rec_s.turns, rec_s.gaps, rec_s.gap_sum, rec_s.last_input_tokens, rec_s.last_done)
    assert p.b.sessions["s3"].in_flight == 1 and p.b.sessions["s3"].instance == 0  # B's index of i2
    # the replicas' own books hold only their own requests
    assert p.b.counters_zero() and not p.a.counters_zero()
    p.a.finish(t4[2])
    p.sync()
    assert p.b.sessions["s3"].in_flight == 0 and p.a.counters_zero()


def test_without_session_facts_the_replicas_price_differently():
    p = Pair(share=False)
    scenario(p)
    one = p.cs.decide(req("s1", 36_000, 1), lookahead=True)
    rep = p.ca.decide(req("s1", 36_000, 1), lookahead=True)
    assert rep.turn == 2 != one.turn  # A saw one turn of s1
    assert terms(rep) != terms(one)


def test_facts_travel_as_ages_placed_on_the_receivers_clock():
    p = Pair()
    tk = place(p.ca, req("s9", 10_000), 1)
    p.clock.t += 3.0  # the message leaves 3 s after the dispatch
    p.a.finish(tk)
    p.clock.t += 2.0
    msg = json.loads(p.ra.share.message())
    assert [f[0] for f in msg["facts"]] == ["b", "d", "l"]
    assert msg["facts"][0][7] == 5.0 and msg["facts"][1][2] == 2.0
    p.clock.t += 100.0  # B's clock reads another time altogether: only the ages matter
    p.rb.receive(p.rb.peers[0], [rp.TOPIC, json.dumps(msg).encode()])
    s = p.b.sessions["s9"]
    assert (s.last_seen, s.last_done, s.in_flight, s.instance) == (p.clock.t - 5.0, p.clock.t - 2.0, 0, 1)


def test_a_lost_end_is_reconciled_and_a_lost_peer_releases_what_it_held():
    p = Pair()
    tk = place(p.ca, req("s1", 10_000), 0)
    place(p.ca, req("s2", 10_000), 1)
    p.sync()
    assert p.b.sessions["s1"].in_flight == 1 and p.b.sessions["s2"].in_flight == 1
    p.a.finish(tk)
    p.sync(drop_sessions=True)  # the message with s1's end never arrives
    assert p.b.sessions["s1"].in_flight == 1
    p.mono.t += rs.RECONCILE_S
    p.sync()  # A's list of sessions in flight: s2 only
    assert p.b.sessions["s1"].in_flight == 0 and p.b.sessions["s2"].in_flight == 1
    assert p.rb.share.gaps == 1 and p.rb.share.applied["l"] == 2
    p.mono.t += p.rb.stale_s + 0.1  # A goes quiet: its load is left out, its sessions kept (a stall)
    p.rb.refresh()
    p.rb.expire_peers()
    assert p.rb.mode == rp.OWN and p.b.sessions["s2"].in_flight == 1
    p.mono.t += rp.GONE_STALE * p.rb.stale_s  # A is gone: its requests in flight went with it
    p.rb.expire_peers()
    assert p.b.sessions["s2"].in_flight == 0 and p.b.sessions["s2"].session_id in p.b._idle[1]
    assert p.rb.snapshot()["sessions"]["peer_in_flight"] == {}


def test_bad_facts_are_counted_and_bounded():
    p = Pair()
    share = p.rb.share

    def send(facts, seq, **over):
        msg = {rs.KIND: 1, "replica": "A", "seq": seq, "facts": facts}
        msg.update(over)
        return p.rb.receive(p.rb.peers[0], [rp.TOPIC, json.dumps(msg).encode()])

    good = ["b", "s1", URLS[0], "i0", 1000, 0, 1, 0.0, None]
    assert send([good], 1)
    assert not send([good], 1)  # an old sequence
    assert not send([good], 2, **{rs.KIND: 2})
    assert not send("no", 3)
    assert not send([good], 3, replica="B")  # our own
    assert p.rb.dropped == {"old_seq": 1, "version": 1, "malformed": 1, "self": 1}
    assert send([["b", "s2", "http://elsewhere", "q", 1, 0, 1, 0.0, None],  # an engine we do not route to
                 ["b", "s2", URLS[0], "i0", -1, 0, 1, 0.0, None], ["b", "x" * 600, URLS[0], "i0", 1, 0, 1, 0, None],
                 ["b", "s2", URLS[0], "i0", 1, 0, 1, float("inf"), None], ["d", "s2", 0.0],  # never started
                 ["z", "s2"], [], "x", ["l", [["s1", True]]], ["a", "s1", 1.5]], 4)
    assert share.ignored == {"unknown_instance": 1, "malformed": 8, "untracked": 1}
    assert set(p.b.sessions) == {"s1"} and p.b.counters_zero()
    old = rs.MAX_TRACKED
    rs.MAX_TRACKED = 3
    try:
        assert send([["b", f"t{k}", URLS[0], "i0", 100, 0, 1, 0.0, None] for k in range(5)], 5)
    finally:
        rs.MAX_TRACKED = old
    assert share.ignored["too_many"] == 3 and len(p.b.sessions) == 3
    # a sender with nobody draining it keeps at most MAX_PENDING facts
    old = rs.MAX_PENDING
    rs.MAX_PENDING = 4
    try:
        for k in range(6):
            place(p.ca, req(f"u{k}", 100), 0)
    finally:
        rs.MAX_PENDING = old
    assert len(p.ra.share.pending) == 4 and p.ra.share.lost == 2
    # a replica without --replica-bind publishes no facts
    c = Cluster(["i0"], urls=URLS[:1])
    lone = rp.Replicas(c, "C", bind=None, peers=[p.ea])
    core = core_of(c)
    core.peers = lone
    place(core, req("v", 100), 0)
    assert lone.share.message() is None and c.session_listener is None


async def test_session_facts_cross_real_sockets_and_are_not_echoed():
    a_cl = Cluster(["i0", "i1"], urls=URLS[:2])
    b_cl = Cluster(["i1", "i0"], urls=URLS[1::-1])
    ea, eb = endpoint(), endpoint()
    a = rp.Replicas(a_cl, "A", bind=ea, peers=[eb], interval_s=0.02, stale_s=0.3)
    b = rp.Replicas(b_cl, "B", bind=eb, peers=[ea], interval_s=0.02, stale_s=0.3)
    ca, cb = core_of(a_cl), core_of(b_cl)
    ca.peers, cb.peers = a, b
    for r in (a, b):
        r.open_publisher()
        await r.start(Supervisor())
    try:
        await until(lambda: a.mode == rp.SHARED and b.mode == rp.SHARED, what="both sharing")
        d = ca.route(req("s1", 20_000))
        await asyncio.sleep(0)  # the publish runs at the end of this turn of the loop
        await until(lambda: "s1" in b_cl.sessions, timeout=2.0, what="B hearing of s1")
        assert b_cl.sessions["s1"].instance == 1 - d.instance and b_cl.sessions["s1"].in_flight == 1
        a_cl.finish(d.ticket)
        await until(lambda: b_cl.sessions["s1"].in_flight == 0, timeout=2.0, what="B hearing s1 end")
        d2 = cb.route(req("s1", 21_000))  # the next turn through B: turn 2 on both
        assert d2.turn == 2
        await until(lambda: a_cl.sessions["s1"].turns == 2, timeout=2.0, what="A hearing s1's second turn")
        await asyncio.sleep(0.1)  # heartbeats and reconciliations pass: nothing comes back as a fact
        assert a_cl.sessions["s1"].in_flight == 1 and b_cl.sessions["s1"].in_flight == 1
        assert a.snapshot()["sessions"]["applied"]["b"] == 1
        b_cl.finish(d2.ticket)
        await until(lambda: a_cl.sessions["s1"].in_flight == 0, timeout=2.0, what="A hearing the end")
        assert a_cl.counters_zero() and b_cl.counters_zero()
    finally:
        await a.stop()
        await b.stop()


async def test_two_routers_show_one_sessions_turns_whichever_served_them(replica_pair):
    """Through the whole router: a session's turns spread over two replicas are counted as its
    turns on both, and each replica's state shows the facts it applied."""
    from router.app import STATE
    from test_control import complete
    from test_replicas import state

    a, b = replica_pair
    st_a, st_b = a.server.app[STATE], b.server.app[STATE]
    await until(lambda: st_b.replicas.mode == rp.SHARED and st_a.replicas.mode == rp.SHARED,
                what="both replicas sharing")
    for k, client in enumerate((a, b, a)):
        assert (await complete(client, "s1", prompt="hello " * (40 + 10 * k)))["status"] == 200
        other = st_b if client is a else st_a
        await until(lambda o=other: "s1" in o.cluster.sessions and o.cluster.sessions["s1"].turns == k + 1
                    and o.cluster.sessions["s1"].in_flight == 0, what=f"turn {k + 1} heard")
    for st in (st_a, st_b):
        s1 = st.cluster.sessions["s1"]
        assert (s1.turns, s1.gaps, s1.in_flight) == (3, 2, 0)
        assert st.cluster.counters_zero()
    shared = (await state(b))["replicas"]["sessions"]
    assert shared["applied"]["b"] == 2 and shared["applied"]["d"] == 2 and shared["own_in_flight"] == 0


def test_a_long_list_of_sessions_in_flight_goes_in_parts_and_spares_later_requests():
    """More sessions in flight than one part holds: the list goes in parts, one a message; a
    peer that missed ends releases them once every part arrived, never a request dispatched
    after the list was made, and a lost part waits for the next list."""
    p = Pair()
    old = rs.RECONCILE_PART
    rs.RECONCILE_PART = 4
    try:
        tickets = [place(p.ca, req(f"s{k}", 100), 0) for k in range(10)]
        p.sync()
        while p.ra.share.reconciling:  # the first list (3 parts) goes out whole
            p.sync()
        assert p.rb.share.applied["l"] == 1
        assert sum(s.in_flight for s in p.b.sessions.values()) == 10
        for tk in tickets[:3]:
            p.a.finish(tk)
        p.sync(drop_sessions=True)  # three ends lost
        p.mono.t += rs.RECONCILE_S
        msg = json.loads(p.ra.share.message())  # part 0 of 2 (7 sessions in flight, 4 a part)
        assert msg["facts"][-1][0] == "l" and msg["facts"][-1][3:] == [0, 2]
        assert p.ra.share.reconciling
        p.rb.receive(p.rb.peers[0], [rp.TOPIC, json.dumps(msg).encode()])
        late = place(p.ca, req("late", 100), 1)  # dispatched after part 0 was made: not in the list
        msg = json.loads(p.ra.share.message())
        assert [f[0] for f in msg["facts"]] == ["b", "l"] and msg["facts"][-1][3:] == [1, 2]
        assert not p.ra.share.reconciling
        p.rb.receive(p.rb.peers[0], [rp.TOPIC, json.dumps(msg).encode()])
        held = {sid: s.in_flight for sid, s in p.b.sessions.items() if s.in_flight}
        assert held == {**{f"s{k}": 1 for k in range(3, 10)}, "late": 1}
        assert p.rb.share.applied["l"] == 2
        # a lost part: nothing is released on what arrived of that list
        p.a.finish(late)
        p.a.finish(tickets[3])
        p.sync(drop_sessions=True)
        p.mono.t += rs.RECONCILE_S
        first = p.ra.share.message()  # part 0, lost
        p.rb.receive(p.rb.peers[0], [rp.TOPIC, p.ra.share.message()])
        assert p.rb.share.ignored == {"partial": 1} and p.b.sessions["late"].in_flight == 1
        assert first is not None
        p.mono.t += rs.RECONCILE_S
        p.sync()
        p.sync()
        held = {sid for sid, s in p.b.sessions.items() if s.in_flight}
        assert held == {f"s{k}" for k in range(4, 10)}
    finally:
        rs.RECONCILE_PART = old
