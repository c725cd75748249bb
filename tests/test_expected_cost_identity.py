"""expected_cost's per-request cost was cut (issue 37: tuples instead of per-candidate dicts,
the odds and queue helpers inline, no call per zero term); its decisions must not change. Every
decision of randomised runs is taken twice on the same view, by the policy and by its readable
form as it was (tests/ref_expected_cost.py): the same instance, reason, round-robin use, and
decision record, compared as JSON text (key order, and every float to the bit)."""

from __future__ import annotations

import json
import random

import pytest

from router.calibration import Calibration
from router.cluster import Cluster
from router.policies import build_policy
from router.policies.expected_cost import ExpectedCost

from ref_expected_cost import RefCalibration, RefExpectedCost, ref_wait_s

BS = 512


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def same(got, want, where) -> None:
    assert (got.index, got.reason, got.uses_rr, got.migrated_from) == \
        (want.index, want.reason, want.uses_rr, want.migrated_from), where
    assert json.dumps(got.terms) == json.dumps(want.terms), where


def same_terms(view, where) -> int:
    """Every candidate's terms before rounding (the record shows 4 places), to the bit: today's,
    and the next turns' wherever the pick computed them. Returns the candidates compared."""
    la = view.lookahead
    turn = view.session_turn
    p_next = turn / (turn + 1.0)
    today, lower, scales = ExpectedCost._today(view.candidates, la)
    odds_of: dict = {}
    for k, c in enumerate(view.candidates):
        ref_today = RefExpectedCost._today(c, la)
        assert repr(today[k]) == repr(tuple(ref_today.values())), where
        assert repr(lower[k]) == repr(sum(ref_today.values())), where
        if la is not None:
            ref = RefExpectedCost._future(c, la, p_next, view.input_tokens, ref_today, {})
            got = ExpectedCost._next_turns(c.index, la, scales[k], p_next, view.input_tokens, today[k], odds_of)
            assert repr(got) == repr(tuple(ref.values())), where
    return len(view.candidates)


def _run(seed: int, steps: int) -> dict[str, int]:
    """Sessions that return (or not) with growing contexts on 1-5 instances of small caches,
    requests left in flight, first tokens observed at per-instance speeds (the calibration
    separates them), instances going unhealthy and back, retries that exclude one, and views
    without a lookahead (a shadow's). Returns counts of what the run exercised."""
    rng = random.Random(seed)
    n = rng.choice((1, 2, 3, 5))
    clock = Clock()
    c = Cluster([f"i{i}" for i in range(n)], block_size=BS, capacity_blocks=rng.choice((40, 120, 518)),
                clock=clock)
    slow = [rng.choice((1.0, 1.0, 2.5)) for _ in range(n)]
    pol, ref = ExpectedCost(), RefExpectedCost()
    sessions = rng.choice((6, 30, 200))
    returning = rng.choice((0.0, 0.5, 0.9))
    size = {s: rng.randrange(1, 60) for s in range(sessions)}
    turns = dict.fromkeys(range(sessions), 0)
    fresh = 0
    in_flight: list = []
    seen = {"resized": 0, "queued": 0, "bound": 0, "evict": 0, "queue": 0, "tie_rr": 0, "lost": 0, "no_lookahead": 0, "moved": 0}
    for step in range(steps):
        clock.t += rng.expovariate(1.0) * rng.choice((0.1, 2.0))
        for t in list(in_flight):
            if t.phase == "prefill" and rng.random() < 0.05:  # counted later than routed (Cluster.amend)
                c.amend(t, t.input_tokens + BS, [], session_id=t.session_id, cache_blocks=False)
                seen["resized"] += 1
            elif t.phase == "prefill" and rng.random() < 0.03:  # its KV came from elsewhere (router/pipeline.py)
                c.instances[t.instance].pending_prefill_tokens -= t.new_prefill
                t.new_prefill = 0
                seen["resized"] += 1
            if rng.random() < 0.35:
                if t.phase == "prefill":
                    clock.t += slow[t.instance] * t.new_prefill / 5000 * rng.uniform(0.8, 1.2)
                    c.first_token(t, observed=rng.random() < 0.8)
                c.finish(t, error=rng.random() < 0.03)
                in_flight.remove(t)
        if n > 1 and rng.random() < 0.05:  # an instance goes unhealthy, or comes back
            i = rng.randrange(n)
            c.set_healthy(i, not c.instances[i].healthy)
            if not any(s.healthy for s in c.instances):
                c.set_healthy(i, True)
        if any(turns.values()) and rng.random() < returning:
            s = rng.choice([k for k, v in turns.items() if v])
        else:
            s = fresh % sessions
            fresh += 1
        sid = f"s{s}"
        turns[s] += 1
        blocks = [s * 1_000_000 + k for k in range(size[s] + 3 * turns[s])]
        inp = len(blocks) * BS - rng.randrange(BS)
        lookahead = rng.random() < 0.9
        view = c.view(blocks, inp, sid, lookahead=lookahead)
        healthy = list(view.candidates)
        if n > 1 and rng.random() < 0.1 and len(view.candidates) > 1:  # a retry: one instance excluded
            view.candidates = view.candidates[1:]
        got, want = pol.pick(None, view), ref.pick(None, view)
        same(got, want, (seed, step))
        same_terms(view, (seed, step))
        if lookahead:  # the queued seconds the view computed, to the bit
            la = view.lookahead
            assert repr(la.wait_s) == repr(ref_wait_s(c, healthy, la.now)), (seed, step)
            assert la.capacity_tokens == [n * BS for n in c.index.capacity]
            seen["queued"] += any(la.wait_s.values())
        seen["no_lookahead"] += not lookahead
        seen["bound"] += any(t.get("bound") for t in got.terms)
        seen["evict"] += any(t.get("evict_s", 0) > 0 for t in got.terms)
        seen["queue"] += any(t.get("queue_s", 0) > 0 for t in got.terms)
        seen["tie_rr"] += got.uses_rr
        seen["lost"] += got.reason == "affinity_lost"
        if got.uses_rr:
            c.rr_counter += 1
        sess = c.sessions.get(sid)
        seen["moved"] += sess is not None and sess.instance != got.index
        t = c.dispatch(got.index, inp, view.hits[got.index], blocks, session_id=sid)
        c.bind_session(sid, got.index, inp, view.hits[got.index])
        in_flight.append(t)
    for t in in_flight:
        c.finish(t)
    assert c.counters_zero()
    return seen


@pytest.mark.parametrize("seed", range(16))
def test_decisions_and_records_equal_the_readable_form(seed):
    _run(seed, 150)


def test_the_runs_exercise_every_branch():
    """The seeds above price returning turns, evictions, lower bounds, ties, lost instances
    and views without a lookahead (so the comparison covers each branch of the pick)."""
    total: dict[str, int] = {}
    for seed in range(16):
        for k, v in _run(seed, 150).items():
            total[k] = total.get(k, 0) + v
    assert all(v > 0 for v in total.values()), total


@pytest.mark.parametrize("seed", range(8))
def test_the_calibrations_estimate_equals_the_old_one(seed):
    """The estimate (``Calibration._refresh``, run once per streamed first token) rewritten in
    one pass: every instance's scale, rate and weight equal the old code's, to the bit, through
    samples on instances of one speed (the fleet's value) and of several (each its own), a
    restart (forget) and a new instance."""
    rng = random.Random(seed)
    n = rng.choice((1, 2, 3, 8))
    speed = [rng.choice((1.0, 1.0, 1.7, 3.0)) for _ in range(n + 1)]
    new, ref = Calibration(n), RefCalibration(n)
    t = 0.0
    own = 0
    for step in range(120):
        op = rng.random()
        if op < 0.03:
            i = rng.randrange(len(new._inst))
            new.forget(i)
            ref.forget(i)
        elif op < 0.05 and len(new._inst) < len(speed):
            new.add_instance()
            ref.add_instance()
        else:
            i = rng.randrange(len(new._inst))
            q, h = rng.randrange(0, 4000), rng.randrange(0, 20000)
            t += rng.random()
            first = t + speed[i] * (q + 1) / 5000 * rng.uniform(0.7, 1.3)
            assert new.observe(i, q, h, t, first) == ref.observe(i, q, h, t, first)
        if rng.random() < 0.5:
            assert new.measured == ref.measured
            for i in range(len(new._inst)):
                got = (new.scale(i), new.tps(i), new.own_weight(i), new.rates()[0][i], new.rates()[1][i])
                want = (ref.scale(i), ref.tps(i), ref.own_weight(i), ref.scale(i), ref.tps(i))
                assert repr(got) == repr(want), (seed, step, i)
                own += got[2] > 0
    assert own or n == 1 or len(set(speed)) == 1, "no instance separated from the fleet"


def test_measured_counts_the_samples_held():
    """``Calibration.measured`` (read per decision) is a count kept as samples come and go."""
    c = Cluster(["a", "b"], block_size=BS)
    cal = c.calibration
    assert not cal.measured
    cal.observe(0, 1000, 0, 0.0, 0.5)
    cal.observe(1, 1000, 0, 0.0, 0.5)
    assert cal.measured
    cal.forget(0)
    assert cal.measured
    cal.forget(1)
    assert not cal.measured
    cal.observe(1, 0, 512, 1.0, 1.5)  # nothing to prefill: not a sample
    assert not cal.measured
    cal.add_instance()
    cal.observe(2, 1000, 0, 2.0, 2.5)
    assert cal.measured and cal.samples(2) == 1


def test_the_record_rounds_as_before_and_skips_no_nonzero_term():
    """Zeros skip round() (round(0.0, 4) is 0.0, and -0.0 stays -0.0); every other term is
    rounded to 4 places and the rate to 1, as the record always showed them."""
    c = Cluster(["a", "b"], block_size=BS, capacity_blocks=8)
    for k in range(6):
        blocks = [k * 100 + j for j in range(3)]
        view = c.view(blocks, 3 * BS, f"s{k}", lookahead=True)
        pick = build_policy("expected_cost").pick(None, view)
        same(pick, RefExpectedCost().pick(None, view), k)
        for term in pick.terms:
            for key in ("score", "wait_s", "own_s", "interf_s", "queue_s", "evict_s", "keep_s"):
                if key in term:
                    assert term[key] == round(term[key], 4)
            assert term["tps"] == round(term["tps"], 1)
        t = c.dispatch(pick.index, 3 * BS, view.hits[pick.index], blocks, session_id=f"s{k}")
        c.bind_session(f"s{k}", pick.index, 3 * BS, view.hits[pick.index])
        c.finish(t)
    assert isinstance(build_policy("expected_cost"), ExpectedCost)
