"""expected_cost and the prefill calibration it shares: the formula's terms on crafted clusters,
where its constants come from, and the measurement itself."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

from router.calibration import DEFAULT_PRIOR, Calibration, PrefillPrior
from router.cluster import Cluster
from router.policies import build_policy
from router.policies.expected_cost import ExpectedCost, queued_behind_s, return_odds

ROOT = Path(__file__).resolve().parents[1]
BS = 512


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def chain(session: int, n: int) -> list[int]:
    """n block hashes of one session's prompt (distinct per session)."""
    return [session * 1_000_000 + k for k in range(n)]


def cluster(n: int = 2, capacity_blocks: int = 400) -> tuple[Cluster, Clock]:
    clock = Clock()
    return Cluster([f"i{i}" for i in range(n)], block_size=BS, capacity_blocks=capacity_blocks,
                   clock=clock), clock


def serve(c: Cluster, clock: Clock, instance: int, session: str, blocks: list[int], *,
          prefill_s: float = 1.0, finish: bool = True):
    """Dispatch a request, bind its session, first token after ``prefill_s``, then end it."""
    inp = len(blocks) * BS
    hit = c.hits(blocks, inp)[instance]
    t = c.dispatch(instance, inp, hit, blocks, session_id=session)
    c.bind_session(session, instance, inp, hit)
    clock.t += prefill_s
    c.first_token(t)
    if finish:
        c.finish(t)
    return t


def decide(c: Cluster, blocks: list[int], session: str):
    v = c.view(blocks, len(blocks) * BS, session, lookahead=True)
    p = ExpectedCost().pick(None, v)
    return p, {t["instance"]: t for t in p.terms}


# -- where the constants come from ------------------------------------------------------------

def test_default_prior_is_the_h20_profile():
    """Nothing fitted: the prior is the h20 engine profile's own b and c (kvtop/sim/profiles.py),
    1/b tokens/s and b/2c tokens, the router's default GPU (as its 265k-token capacity is)."""
    from kvtop.sim.profiles import H20

    assert DEFAULT_PRIOR.tokens_per_s == pytest.approx(1 / H20.b)
    assert DEFAULT_PRIOR.attention_tokens == pytest.approx(H20.b / (2 * H20.c))


def test_prior_seconds_is_the_engine_models_prefill():
    """T0(q, h) is b*q + c*(2qh + q^2): the step-time model's linear and attention terms."""
    from kvtop.sim.profiles import H20

    for q, h in ((8192, 0), (2000, 150_000), (100_000, 50_000)):
        assert DEFAULT_PRIOR.seconds(q, h) == pytest.approx(H20.b * q + H20.c * (2 * q * h + q * q))


def _numbers(path: Path) -> set:
    return {n.value for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)) and not isinstance(n.value, bool)}


def test_expected_cost_has_no_tuned_constants():
    """No knobs, and no numbers but structure: 0 and 1 (Laplace's rule, empty sums), 2 (none
    left: the attention factor lives in calibration.py) and 4/1 (rounding of recorded terms)."""
    assert ExpectedCost.schema.names() == []
    assert _numbers(ROOT / "router" / "policies" / "expected_cost.py") <= {0, 0.0, 1, 1.0, 4}
    # calibration.py: the profile's b and c, the formula's 2s, one pseudo-observation (1),
    # the variance's square
    assert _numbers(ROOT / "router" / "calibration.py") <= {0, 1, 1.0, 2, 2.0, 187e-6, 2.8e-9, 0.0}


# -- the calibration -------------------------------------------------------------------------

def test_service_time_is_taken_from_departures():
    """Two requests queued together: the second's service starts at the first's first token."""
    cal = Calibration(1, PrefillPrior(1000.0, 1e12))  # attention negligible: T0 = q / 1000
    assert cal.observe(0, 2000, 0, dispatched=0.0, first_token=4.0) == pytest.approx(4.0)
    assert cal.observe(0, 1000, 0, dispatched=1.0, first_token=6.0) == pytest.approx(2.0)
    assert cal.measured_tps(0) == pytest.approx(3000 / 6.0)
    # an idle gap: the third's service starts at its own dispatch
    assert cal.observe(0, 500, 0, dispatched=10.0, first_token=11.0) == pytest.approx(1.0)
    assert cal.samples(0) == 3


def test_scale_counts_the_prior_as_one_observation():
    cal = Calibration(1, PrefillPrior(1000.0, 1e12))
    assert cal.scale(0) == 1.0 and cal.tps(0) == 1000.0 and cal.measured_tps(0) is None
    cal.observe(0, 1000, 0, 0.0, 10.0)  # 10x slower than the prior says
    assert cal.scale(0) == pytest.approx((1 + 10) / 2)
    for k in range(1, 50):
        cal.observe(0, 1000, 0, 10.0 * k, 10.0 * (k + 1))
    assert cal.scale(0) == pytest.approx((1 + 50 * 10) / 51)  # converges to the measurement
    assert cal.tps(0) == pytest.approx((1000 + 50_000) / (1 + 500))
    assert cal.snapshot(0) == {"prefill_tps_measured": 100.0, "prefill_tps_samples": 50}


def test_identical_instances_share_the_fleets_rate():
    """Noise alone between instances (tau^2 <= 0): every instance, sampled or not, takes the
    fleet's value, so one unlucky sample does not make an instance look 3x slower."""
    cal = Calibration(3, PrefillPrior(1000.0, 1e12))
    noise = [1.0, 0.8, 1.3, 1.3, 0.8, 1.0]
    for k, f in enumerate(noise):  # i0 and i1 alike, each sample off by its own noise
        cal.observe(k % 2, 1000, 0, 100.0 * k, 100.0 * k + f)
    assert cal.scale(0) == cal.scale(1) == cal.scale(2)  # i2 has no sample: the fleet's
    assert cal.own_weight(0) == 0.0


def test_a_really_slower_instance_separates():
    """Steady 3x between instances, small noise within: each weighs its own measurement."""
    cal = Calibration(2, PrefillPrior(1000.0, 1e12))
    for k in range(8):
        f = 1.0 + 0.05 * (k % 3)
        cal.observe(0, 1000, 0, 100.0 * k, 100.0 * k + 3 * f)
        cal.observe(1, 1000, 0, 100.0 * k, 100.0 * k + f)
    assert cal.own_weight(0) > 0.9 and cal.own_weight(1) > 0.9
    assert cal.scale(0) / cal.scale(1) == pytest.approx(3.0, rel=0.1)
    assert cal.tps(1) / cal.tps(0) == pytest.approx(3.0, rel=0.1)


def test_full_hits_and_unobserved_first_tokens_are_not_samples():
    c, clock = cluster(1)
    blocks = chain(1, 10)
    serve(c, clock, 0, "a", blocks)
    assert c.calibration.samples(0) == 1
    serve(c, clock, 0, "a", blocks)  # everything but the last block cached: still q > 0
    t = c.dispatch(0, 10 * BS, 0, blocks)
    clock.t += 5.0
    c.first_token(t, observed=False)  # a non-streamed answer: its first token time is unknown
    c.finish(t)
    assert c.calibration.samples(0) == 2
    assert c.counters_zero()


# -- the policy ------------------------------------------------------------------------------

def test_return_odds_follow_laplace_and_idle_time():
    assert return_odds(1, 0.0, 0, 0.0, None) == pytest.approx(0.5)  # one turn: 1/2
    assert return_odds(7, 60.0, 6, 0.0, None) == pytest.approx(7 / 8)
    fresh, stale = return_odds(7, 60.0, 6, 5.0, None), return_odds(7, 60.0, 6, 100.0, None)
    assert fresh > stale  # idle 10 mean gaps: nearly surely gone
    x = 7 / 8 * math.exp(-10)
    assert stale == pytest.approx(x / (x + 1 / 8))
    assert return_odds(1, 0.0, 0, 30.0, 10.0) < 0.5  # no gap of its own: the fleet's mean


def test_a_session_is_idle_from_its_answers_end_not_its_arrival():
    """An agent sends its next turn after reading the answer: while a request of its own is in
    flight it is not idle at all, its idle time runs from the answer's end, and its gap is
    the think time from that end to the next turn (a 30 s prefill is not a 30 s gap)."""
    c, clock = cluster(2)
    t = c.dispatch(0, 4 * BS, 0, chain(1, 4), session_id="s")
    sess = c.bind_session("s", 0, 4 * BS, 0)
    clock.t = 30.0
    assert sess.in_flight == 1 and sess.idle_s(clock.t) == 0.0  # 30 s after arrival, still served
    c.first_token(t)
    clock.t = 40.0
    c.finish(t)
    assert sess.in_flight == 0 and sess.last_done == 40.0
    assert sess.idle_s(45.0) == pytest.approx(5.0)
    clock.t = 42.0  # next turn 2 s after the answer: a gap of 2 s, not 42
    c.dispatch(0, 5 * BS, 4 * BS, chain(1, 5), session_id="s")
    c.bind_session("s", 0, 5 * BS, 4 * BS)
    assert (sess.gaps, sess.gap_sum, sess.in_flight) == (1, pytest.approx(2.0), 1)
    assert (c.gaps, c.gap_sum) == (1, pytest.approx(2.0))  # the fleet's mean gap, too


def test_a_prefill_only_leg_does_not_end_its_sessions_turn():
    c, clock = cluster(2)
    p = c.dispatch(1, 4 * BS, 0, chain(1, 4), decode=False, session_id="s")  # offload's P leg
    d = c.dispatch(0, 4 * BS, 0, chain(1, 4), session_id="s")
    sess = c.bind_session("s", 0, 4 * BS, 0)
    c.finish(p)
    assert sess.in_flight == 1 and sess.idle_s(clock.t + 10) == 0.0
    c.finish(d)
    assert sess.in_flight == 0


@pytest.mark.parametrize("wait,own,gap,expected", [
    (0.0, 10.0, 10.0, 10 - 10 * (1 - math.exp(-1))),  # arrives during it: e^-u/g-weighted remainder
    (5.0, 10.0, 10.0, 10 - 10 * math.exp(-0.5) * (1 - math.exp(-1))),  # before it starts: all of it
    (0.0, 10.0, 1e-9, 10.0),  # returns at once: waits the whole prefill
    (0.0, 10.0, 1e9, 0.0),  # never returns in time: nothing
    (3.0, 0.0, 10.0, 0.0),  # nothing to prefill: nobody waits
])
def test_queued_behind_is_the_expected_wait_added_to_a_returning_turn(wait, own, gap, expected):
    """By hand: a turn arriving at t ~ Exp(gap) waits own if t < wait, wait + own - t if it
    comes during the prefill, 0 after; E = own - gap e^(-wait/gap) (1 - e^(-own/gap))."""
    assert queued_behind_s(wait, own, gap) == pytest.approx(expected, abs=1e-6)
    # the same by numerical integration over the arrival time
    if 1e-6 < gap < 1e6 and own > 0:
        n = 20_000
        hi = wait + own + 30 * gap
        dt = hi / n
        num = sum((own if x < wait else max(wait + own - x, 0.0)) * math.exp(-x / gap) / gap * dt
                  for x in (dt * (k + 0.5) for k in range(n)))
        assert queued_behind_s(wait, own, gap) == pytest.approx(num, rel=1e-3)


def test_queue_term_prices_the_returning_turns_a_prefill_holds_up():
    """Two idle instances; a session returns to i0 every 2 s (think time). A cold prompt costs
    the same prefill on both, but on i0 the session's next turn may queue behind it: the
    queue term is p_return x queued_behind(0, own, 2 s), by hand, and the prompt goes to i1."""
    c, clock = cluster(2, capacity_blocks=2000)
    r = chain(1, 104)  # a 51k-token context: moving would cost it more than waiting
    for turn in range(3):
        serve(c, clock, 0, "r", r[: 100 + turn], prefill_s=0.5)
        clock.t += 2.0
    sess = c.sessions["r"]
    assert sess.gap_sum / sess.gaps == pytest.approx(2.0)
    p, terms = decide(c, chain(5, 40), "new")
    own = terms["i0"]["own_s"]
    odds = return_odds(3, sess.gap_sum, sess.gaps, 2.0, c.gap_sum / c.gaps)
    assert terms["i0"]["queue_s"] == pytest.approx(odds * queued_behind_s(0.0, own, 2.0), abs=1e-3)
    assert queued_behind_s(0.0, own, 2.0) < c.calibration.seconds(0, sess.last_input_tokens, 0)
    assert terms["i1"]["queue_s"] == 0.0
    assert p.index == 1


def test_a_returning_turn_is_held_up_at_most_its_move():
    """A short session would rather re-prefill its 1k-token context elsewhere than wait out a
    cold 100k prefill: its share of the queue term is capped at T(context, 0)."""
    c, clock = cluster(2, capacity_blocks=2000)
    serve(c, clock, 0, "r", chain(1, 2), prefill_s=0.1)
    clock.t += 1.0
    serve(c, clock, 0, "r", chain(1, 2), prefill_s=0.1)
    p, terms = decide(c, chain(5, 200), "new")
    sess = c.sessions["r"]
    odds = return_odds(sess.turns, sess.gap_sum, sess.gaps, sess.idle_s(clock.t), c.gap_sum / c.gaps)
    move = c.calibration.seconds(0, sess.last_input_tokens, 0)
    assert queued_behind_s(0.0, terms["i0"]["own_s"], 1.0) > move
    assert terms["i0"]["queue_s"] == pytest.approx(odds * move, abs=1e-3)


def test_sticks_while_the_queue_is_shorter_than_the_re_prefill():
    c, clock = cluster(2)
    a = chain(1, 100)  # 51k tokens cached on i0
    serve(c, clock, 0, "s", a)
    nxt = a + chain(9, 4)
    p, terms = decide(c, nxt, "s")
    assert p.index == 0 and p.reason == "affinity_stick"
    assert terms["i0"]["own_s"] < terms["i1"]["own_s"] / 10


def test_moves_when_the_owner_is_queued_longer_than_the_re_prefill():
    c, clock = cluster(2, capacity_blocks=2000)
    a = chain(1, 20)  # a small session on i0 ...
    serve(c, clock, 0, "s", a)
    for k in range(3):  # ... behind three cold 100k prompts still prefilling there
        t = c.dispatch(0, 200 * BS, 0, chain(20 + k, 200), session_id=f"o{k}")
        c.bind_session(f"o{k}", 0, 200 * BS, 0)
    p, terms = decide(c, a + chain(9, 2), "s")
    assert terms["i0"]["wait_s"] > terms["i1"]["own_s"]
    assert p.index == 1 and p.reason == "argmin"


def test_attention_makes_a_long_cold_prefill_dearer_than_its_tokens():
    """The same uncached tokens cost more after a long cached context only by attention; a
    cold 150k prompt costs more than 3x a cold 50k one."""
    cal = Calibration(1)
    assert cal.seconds(0, 150_000, 0) > 3 * cal.seconds(0, 50_000, 0)
    assert cal.seconds(0, 1000, 150_000) > cal.seconds(0, 1000, 0)


def test_a_measured_slow_instance_costs_more():
    c, clock = cluster(2)
    for k in range(6):  # i0 measured steadily 3x slower than i1
        f = 1.0 + 0.05 * (k % 2)
        c.calibration.observe(0, 10_000, 0, clock.t, clock.t + 3 * f * DEFAULT_PRIOR.seconds(10_000, 0))
        c.calibration.observe(1, 10_000, 0, clock.t, clock.t + f * DEFAULT_PRIOR.seconds(10_000, 0))
        clock.t += 100
    p, terms = decide(c, chain(5, 40), "new")
    assert p.index == 1 and p.reason == "affinity_new"
    ratio = c.calibration.scale(0) / c.calibration.scale(1)
    assert ratio > 2.5
    assert terms["i0"]["own_s"] == pytest.approx(terms["i1"]["own_s"] * ratio, rel=1e-3)
    assert terms["i0"]["tps"] < terms["i1"]["tps"]


def test_interference_prefers_the_instance_with_fewer_requests_in_flight():
    c, clock = cluster(2, capacity_blocks=2000)
    for k in range(2):  # two requests decoding on i0
        t = c.dispatch(0, 2 * BS, 0, chain(30 + k, 2), session_id=f"d{k}")
        c.first_token(t)
    p, terms = decide(c, chain(5, 40), "new")
    assert p.index == 1
    assert terms["i0"]["interf_s"] == pytest.approx(2 * terms["i0"]["own_s"], abs=1e-3)


def test_eviction_spares_a_live_session_and_not_a_departed_one():
    """Equal load and no cache for the new prompt anywhere: it goes where its blocks evict a
    session that has stopped coming back, not one that returns every few seconds."""
    c, clock = cluster(2, capacity_blocks=100)
    live, gone = chain(1, 80), chain(2, 80)
    for turn in range(4):  # "live" returns every 2 s on i0; "gone" had 4 turns long ago on i1
        serve(c, clock, 1, "gone", gone[: 60 + turn], prefill_s=0.5)
        clock.t += 1.5
    clock.t += 600
    for turn in range(4):
        serve(c, clock, 0, "live", live[: 60 + turn], prefill_s=0.5)
        clock.t += 1.5
    p, terms = decide(c, chain(5, 60), "new")
    assert terms["i0"]["evict_s"] > terms["i1"]["evict_s"]
    assert p.index == 1


def test_every_candidate_is_recorded_with_the_rate_it_used():
    c, clock = cluster(3)
    p, terms = decide(c, chain(5, 10), "new")
    assert set(terms) == {"i0", "i1", "i2"}
    for t in terms.values():
        assert t["score"] == pytest.approx(t["wait_s"] + t["own_s"] + t["interf_s"] + t.get("queue_s", 0)
                                           + t.get("evict_s", 0) + t.get("keep_s", 0), abs=1e-3)
        assert t["tps"] == pytest.approx(DEFAULT_PRIOR.tokens_per_s, rel=1e-3)


def test_without_lookahead_it_still_picks():
    """As a shadow of a policy that did not ask for the lookahead: today's terms only."""
    c, clock = cluster(2)
    v = c.view(chain(5, 10), 10 * BS, "x")
    assert v.lookahead is None
    p = build_policy("expected_cost").pick(None, v)
    assert p.index in (0, 1)
    assert all(t["evict_s"] == 0 for t in p.terms)


def test_it_is_the_default_of_route_simulate_and_demo():
    import argparse

    from kvtop import demo, simulate
    from router import cli
    from router.policies import DEFAULT_POLICY
    from router.state import RouterConfig

    assert DEFAULT_POLICY == "expected_cost"
    assert RouterConfig(backends=[]).policy == DEFAULT_POLICY
    for mod in (cli, demo):
        p = argparse.ArgumentParser()
        mod.add_arguments(p)
        assert p.get_default("policy") == DEFAULT_POLICY
    p = argparse.ArgumentParser()
    simulate.add_arguments(p)
    assert p.get_default("policies") is None  # None: DEFAULT_POLICY (run() says so in --help)


def test_simulate_without_policies_runs_the_default(tmp_path, capsys):
    import json

    from kvtop.cli import main

    trace = tmp_path / "t.jsonl"
    with open(trace, "w") as f:
        for k in range(6):
            f.write(json.dumps({"request_id": f"r{k}", "session": f"s{k % 2}", "turn": k // 2 + 1,
                                "arrival": float(k), "input_tokens": 2048 * (k // 2 + 1), "output_tokens": 8,
                                "hash_ids": list(range(4 * (k // 2 + 1))), "block_size": 512}) + "\n")
    assert main(["simulate", str(trace), "--instances", "2"]) == 0
    assert "expected_cost" in capsys.readouterr().out


@pytest.mark.parametrize("seed", range(20))
def test_skipping_candidates_that_cannot_win_changes_nothing(seed):
    """The future terms are computed only where today's terms do not already exceed the best
    full cost; a full evaluation of every candidate picks the same instance."""
    import random

    from router.policies.base import argmin_with_ties

    rng = random.Random(seed)
    c, clock = cluster(4, capacity_blocks=120)
    for k in range(30):  # sessions of various sizes come and go on random instances
        sess = rng.randrange(8)
        blocks = chain(sess, rng.randrange(5, 90))
        t = serve(c, clock, rng.randrange(4), f"s{sess}", blocks, prefill_s=rng.random(), finish=rng.random() < 0.7)
        clock.t += rng.random() * 3
    blocks = chain(rng.randrange(8), rng.randrange(5, 110))
    sid = f"s{rng.randrange(8)}"
    v = c.view(blocks, len(blocks) * BS, sid, lookahead=True)
    from ref_expected_cost import RefExpectedCost  # the readable form of the terms

    got = ExpectedCost().pick(None, v)
    turn = v.session_turn
    today = [RefExpectedCost._today(x, v.lookahead) for x in v.candidates]
    full = [sum({**d, **RefExpectedCost._future(x, v.lookahead, turn / (turn + 1.0), v.input_tokens, d)}.values())
            for x, d in zip(v.candidates, today)]
    k, _, _ = argmin_with_ties(v.candidates, full, (lambda x: x.new, lambda x: x.num_requests), v.rr_counter)
    assert got.index == v.candidates[k].index
    for t, f in zip(got.terms, full):
        if t.get("bound"):
            assert t["score"] <= f + 1e-3 and f > min(full)  # a lower bound, of a loser


def test_identical_samples_leave_no_negative_variance():
    """Two instances measuring exactly alike: the within-instance variance is 0, not the
    rounding error's negative value, which once made the shrinkage divide by zero (at the 60th
    pair of samples) or weigh an instance past 1."""
    cal = Calibration(2)
    t = 0.0
    for _ in range(200):
        for i in range(2):
            cal.observe(i, 1000, 0, t, t + 0.2)
        t += 1.0
        assert 0.0 <= cal.own_weight(0) <= 1.0 and cal.scale(0) == cal.scale(1) > 0
