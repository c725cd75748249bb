"""expected_cost at scale (issue 37): the lookahead's cost is bounded by the fleet, not by the
sessions the router holds, and its picks are those of the walk over every bound session that
it replaced (copied below as the reference) wherever that walk priced at most
``LOOKAHEAD_IDLE`` idle sessions per instance."""

from __future__ import annotations

import random

import pytest

from router.cluster import Cluster
from router.lookahead import AGE_OUT_PER_WALK, IDLE_GAPS, LOOKAHEAD_IDLE
from router.policies.base import AFFINITY_LOST, AFFINITY_NEW, AFFINITY_STICK, argmin_with_ties, terms_of
from router.policies.expected_cost import ExpectedCost, queued_behind_s, session_odds

BS = 512


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# -- the reference: the code this replaced, as it was (router/cluster.py Lookahead.bound and
# router/policies/expected_cost.py pick/_future before issue 37), over its own bound sets ------

class RefBound:
    """The old ``Cluster._bound`` (every session id ever bound to an instance, dropped when
    found moved, forgotten or idle over 14 mean gaps) and ``Lookahead.bound`` over it."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.ids: list[set[str]] = [set() for _ in cluster.instances]
        bind = cluster.bind_session

        def bind_and_record(session_id, instance, *a, **kw):
            s = bind(session_id, instance, *a, **kw)
            self.ids[instance].add(session_id)
            return s

        cluster.bind_session = bind_and_record

    def bound(self, la, i: int) -> list:
        got = []
        cl = self.cluster
        ids = self.ids[i]
        for sid in list(ids):
            other = cl.sessions.get(sid)
            if other is None or other.instance != i:
                ids.discard(sid)
                continue
            g = other.gap_sum / other.gaps if other.gaps else la.fleet_gap_s
            if g and other.idle_s(la.now) > 14 * g:
                ids.discard(sid)
                continue
            if sid != la._session_id:
                got.append(other)
        return got


def ref_pick(ref: RefBound, view):
    cands = view.candidates
    la = view.lookahead
    turn = view.session_turn
    p_next = turn / (turn + 1.0)
    length = view.input_tokens
    memo: dict[int, list] = {}

    def bound(i):
        if i not in memo:
            memo[i] = ref.bound(la, i)
        return memo[i]

    def today(c):
        own = la.calibration.seconds(c.index, c.new, c.hit)
        return {"wait_s": la.wait_s.get(c.index, 0.0), "own_s": own, "interf_s": c.num_requests * own}

    def future(c, today):
        cal = la.calibration
        i = c.index
        queue = 0.0
        own = today["own_s"]
        if own > 0:
            for s in bound(i):
                g = s.gap_sum / s.gaps if s.gaps else la.fleet_gap_s
                if g:
                    held = queued_behind_s(today["wait_s"], own, g)
                    queue += session_odds(s, la) * min(held, cal.seconds(i, s.last_input_tokens, 0))
        evict = 0.0
        for s, lost in la.victims(i):
            ctx = s.last_input_tokens
            lost = min(lost, ctx)
            evict += session_odds(s, la) * cal.seconds(i, lost, ctx - lost)
        keep = 0.0
        if p_next > 0:
            demand = sum(session_odds(s, la) * s.last_input_tokens for s in bound(i))
            lost = min(length, max(0, int(demand + length - la.capacity_tokens[i])))
            if lost:
                keep = p_next * cal.seconds(i, lost, length - lost)
        return {"queue_s": queue, "evict_s": evict, "keep_s": keep}

    parts = [today(c) for c in cands]
    lower = [sum(p.values()) for p in parts]
    best = float("inf")
    for k in sorted(range(len(cands)), key=lower.__getitem__):
        if lower[k] > best:
            break
        parts[k].update(future(cands[k], parts[k]))
        best = min(best, sum(parts[k].values()))
    scores = []
    terms = []
    for c, part in zip(cands, parts):
        score = sum(part.values())
        complete = "evict_s" in part
        scores.append(score if complete else float("inf"))
        t = terms_of(c, score)
        t.update(part)
        terms.append(t)
    k, reason, _ = argmin_with_ties(cands, scores, (lambda c: c.new, lambda c: c.num_requests), view.rr_counter)
    chosen = cands[k]
    if view.session_instance is None:
        reason = AFFINITY_NEW
    elif chosen.index == view.session_instance:
        reason = AFFINITY_STICK
    elif view.candidate(view.session_instance) is None:
        reason = AFFINITY_LOST
    return chosen.index, reason, terms


# -- the differential test ------------------------------------------------------------------------

def chain(session: int, n: int) -> list[int]:
    return [session * 1_000_000 + k for k in range(n)]


def _run(seed: int, *, sessions: int, steps: int, returning: float, think: float, late: int = 0) -> int:
    """Route ``steps`` requests of ``sessions`` sessions (from step ``late`` on, a share
    ``returning`` of them come back, after about ``think`` seconds) through expected_cost, each
    decision compared with the reference on the same view; some requests stay in flight for a
    while. ``sessions`` at most ``LOOKAHEAD_IDLE``, or none returning: the old walk never
    priced more idle sessions on one instance than the new one lists. Returns the decisions
    compared."""
    assert sessions <= LOOKAHEAD_IDLE or not returning
    rng = random.Random(seed)
    n = rng.choice((2, 3, 4))
    clock = Clock()
    c = Cluster([f"i{i}" for i in range(n)], block_size=BS, capacity_blocks=rng.choice((60, 200, 1000)),
                clock=clock)
    ref = RefBound(c)
    pol = ExpectedCost()
    size = {s: rng.randrange(2, 120) for s in range(sessions)}
    turns = {s: 0 for s in range(sessions)}
    open_tickets: list = []
    fresh = 0
    compared = 0
    for step in range(steps):
        clock.t += rng.expovariate(1.0) * think / 10
        # end some requests in flight (first token, then done)
        for t in list(open_tickets):
            if rng.random() < 0.4:
                c.first_token(t)
                c.finish(t, error=rng.random() < 0.05)
                open_tickets.remove(t)
        if step >= late and rng.random() < returning and any(turns.values()):
            s = rng.choice([k for k, v in turns.items() if v])
        else:
            s = fresh % sessions
            fresh += 1
        sid = f"s{s}"
        turns[s] += 1
        blocks = chain(s, size[s] + 2 * turns[s])
        inp = len(blocks) * BS - rng.randrange(BS)
        view = c.view(blocks, inp, sid, lookahead=True)
        want_index, want_reason, want_terms = ref_pick(ref, view)
        got = pol.pick(None, view)
        assert (got.index, got.reason) == (want_index, want_reason), (seed, compared)
        for g, w in zip(got.terms, want_terms):
            assert ("bound" in g) == ("queue_s" not in w)
            for key in ("wait_s", "own_s", "interf_s", "queue_s", "evict_s", "keep_s"):
                if key in w:
                    assert g[key] == pytest.approx(w[key], rel=1e-6, abs=1e-4), (seed, compared, key)
        compared += 1
        if got.uses_rr:
            c.rr_counter += 1
        t = c.dispatch(got.index, inp, view.hits[got.index], blocks, session_id=sid)
        c.bind_session(sid, got.index, inp, view.hits[got.index])
        open_tickets.append(t)
    for t in open_tickets:
        c.finish(t)
    assert c.counters_zero()
    return compared


@pytest.mark.parametrize("seed", range(12))
def test_picks_equal_the_old_walk_with_returning_sessions(seed):
    """Sessions return after a few seconds of think time, so the fleet's mean gap exists and
    odds decay with idle time; some sessions age out (idle over 14 gaps) and come back."""
    assert _run(seed, sessions=LOOKAHEAD_IDLE, steps=200, returning=0.6, think=5.0) == 200


@pytest.mark.parametrize("seed", range(6))
def test_picks_equal_the_old_walk_before_any_session_returns(seed):
    """A new session per request: no gap anywhere, every session's odds are its prior, and the
    old walk summed them all; the per-instance sums give the same figures without a walk."""
    assert _run(100 + seed, sessions=400, steps=400, returning=0.0, think=1.0) == 400


@pytest.mark.parametrize("seed", range(6))
def test_picks_equal_the_old_walk_when_the_first_session_returns_late(seed):
    """One-turn sessions first, then returns: the switch from the sums to the walk is exact."""
    assert _run(200 + seed, sessions=LOOKAHEAD_IDLE, steps=300, returning=0.3, think=20.0, late=60) == 300


# -- the bound --------------------------------------------------------------------------------------

def _hold(c: Cluster, clock: Clock, count: int, *, instance: int = 0, tokens: int = 4096,
          step: float = 0.01) -> None:
    for k in range(count):
        sid = f"h{k}"
        t = c.dispatch(instance, tokens, 0, [], session_id=sid, cache_blocks=False)
        c.bind_session(sid, instance, tokens, 0)
        clock.t += step
        c.first_token(t)
        c.finish(t)


def _returned_once(c: Cluster, clock: Clock, gap: float) -> None:
    """One session returns after ``gap`` seconds: the fleet has a mean gap from now on."""
    for _ in range(2):
        t = c.dispatch(1, 1024, 0, [], session_id="back", cache_blocks=False)
        c.bind_session("back", 1, 1024, 0)
        c.finish(t)
        clock.t += gap


def test_without_returns_nothing_is_walked_and_the_sum_is_the_walks():
    """20,000 one-turn sessions held on i0: none listed, their prior-weighted contexts one sum."""
    clock = Clock()
    c = Cluster(["i0", "i1"], block_size=BS, clock=clock)
    _hold(c, clock, 20_000, tokens=3000)
    la = c.view(chain(7, 4), 4 * BS, "new", lookahead=True).lookahead
    assert la.bound(0) == []
    assert la.settled(0) == 0.5 * 3000 * 20_000  # each at odds 1/2, exactly as the walk summed
    assert la.settled(1) == 0.0
    # the session's own record is not one of the others
    la = c.view(chain(7, 4), 4 * BS, "h5", lookahead=True).lookahead
    assert la.settled(0) == 0.5 * 3000 * 19_999


def test_the_walk_lists_at_most_the_sessions_in_flight_and_the_most_recent_idle():
    """20,000 idle sessions within their 14 gaps: the walk lists LOOKAHEAD_IDLE of them, the
    most recently active, plus every session in flight on the instance (the old walk listed all
    20,000: 3 walks of them a candidate, per request)."""
    clock = Clock()
    c = Cluster(["i0", "i1"], block_size=BS, clock=clock)
    _hold(c, clock, 20_000, step=0.001)
    _returned_once(c, clock, gap=100.0)  # every one-turn session is within 14 x 100 s
    busy = []
    for k in range(5):
        busy.append(c.dispatch(0, 100, 0, [], session_id=f"b{k}", cache_blocks=False))
        c.bind_session(f"b{k}", 0, 100, 0)
    la = c.view(chain(7, 4), 4 * BS, "new", lookahead=True).lookahead
    listed = la.bound(0)
    assert len(listed) == 5 + LOOKAHEAD_IDLE
    assert {s.session_id for s in listed[:5]} == {f"b{k}" for k in range(5)}
    assert [s.session_id for s in listed[5:]] == [f"h{k}" for k in range(19_999, 19_999 - LOOKAHEAD_IDLE, -1)]
    assert la.settled(0) == 0.0  # a fleet gap exists: the odds decay, every one is priced in the walk
    for t in busy:
        c.finish(t)
    assert c.counters_zero()


def test_idle_sessions_age_out_of_the_lookahead_and_come_back_on_their_next_turn():
    clock = Clock()
    c = Cluster(["i0", "i1"], block_size=BS, clock=clock)
    _hold(c, clock, 10)
    _returned_once(c, clock, gap=1.0)  # the fleet's mean gap: 1 s
    clock.t += IDLE_GAPS * 1.0 + 1
    la = c.view(chain(7, 4), 4 * BS, "new", lookahead=True).lookahead
    assert la.bound(0) == []
    assert len(c._idle[0]) == 0 and len(c.sessions) == 11  # aged out of the lookahead, still held
    assert c.lookahead_held() == 1  # "back", idle on i1
    t = c.dispatch(0, 100, 0, [], session_id="h3", cache_blocks=False)
    c.bind_session("h3", 0, 100, 0)
    la = c.view(chain(7, 4), 4 * BS, "new", lookahead=True).lookahead
    assert [s.session_id for s in la.bound(0)] == ["h3"]
    c.finish(t)


def test_forgotten_and_moved_sessions_leave_every_sum():
    clock = Clock()
    c = Cluster(["i0", "i1"], block_size=BS, clock=clock, max_sessions=3)
    for k in range(5):
        c.bind_session(f"s{k}", 0, 1000, 0)
    assert [i.sessions for i in c.instances] == [3, 0]
    assert c._prior_tokens[0] == {1: 3000}
    c.bind_session("s4", 1, 2000, 0)  # moves, second turn
    assert [i.sessions for i in c.instances] == [2, 1]
    assert c._prior_tokens == [{1: 2000}, {2: 2000}]
    assert (c.session_moves, c.moved_sessions) == (1, 1)
    assert set(c._busy[0]) == {"s2", "s3"} and set(c._busy[1]) == {"s4"}
    c.forget_session("s4")
    assert c._prior_tokens == [{1: 2000}, {}]
    assert (c.session_moves, c.moved_sessions, c.instances[1].sessions) == (0, 0, 0)
    assert not c._busy[1]


def test_a_walk_ages_out_a_bounded_number_of_sessions():
    """The fleet's first gap comes after 5,000 one-turn sessions went idle long ago: one walk
    ages out at most AGE_OUT_PER_WALK of them, the next walks the rest, a bounded share each."""
    clock = Clock()
    c = Cluster(["i0", "i1"], block_size=BS, clock=clock)
    _hold(c, clock, 5000, step=0.001)
    clock.t += 1000.0
    _returned_once(c, clock, gap=1.0)  # now every one-turn session is idle over 14 x 1 s
    walks = 0
    while c._idle[0]:
        before = len(c._idle[0])
        la = c.view(chain(7, 4), 4 * BS, "new", lookahead=True).lookahead
        assert la.bound(0) == []
        assert before - len(c._idle[0]) <= AGE_OUT_PER_WALK
        walks += 1
    assert walks == -(-5000 // AGE_OUT_PER_WALK)
