"""Prefill admission (router/admission.py): the pure rule, the engine hook and the live gate."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.admission import admit, engine_hook
from router.features import FEATURE_KNOBS


# (queue costs, pending, budget, lookahead, mode, round, force_every, expected, why)
CASES = [
    ([9000, 100, 200], 0, 8192, 8, "fifo", 1, 0, [0], "fifo: oversize head, nothing pending: it goes alone"),
    ([9000, 100, 200], 1000, 8192, 8, "fifo", 1, 0, [], "fifo: oversize head blocks everyone behind it"),
    ([9000, 100, 200], 1000, 8192, 8, "pack", 1, 0, [1, 2], "pack: short prompts pass the oversize head"),
    ([3000, 9000, 2000, 4000], 0, 8192, 8, "pack", 1, 0, [0, 2], "cheapest first (2000, 3000), then 4000 no longer fits; arrival order kept"),
    ([5000, 100, 100, 100], 4000, 8192, 2, "pack", 1, 0, [1], "lookahead 2 sees only 5000 and the first 100"),
    ([9000, 9500, 12000], 0, 8192, 8, "pack", 1, 0, [0], "all oversize, nothing pending: the head goes"),
    ([9000, 9500, 12000], 10, 8192, 8, "pack", 1, 0, [], "all oversize, work pending: wait for it"),
    ([9000, 100, 200], 1000, 8192, 8, "pack", 4, 4, [], "round 4 of force_fifo_every 4 is FIFO: the head holds"),
    ([9000, 100, 200], 0, 8192, 8, "pack", 4, 4, [0], "forced FIFO round with nothing pending admits the head"),
    ([9000, 100, 200], 1000, 8192, 8, "pack", 3, 4, [1, 2], "round 3 is a pack round"),
    ([], 0, 8192, 8, "pack", 1, 4, [], "nothing waiting"),
]


@pytest.mark.parametrize("queue,pending,budget,look,mode,rnd,every,expected,why", CASES,
                         ids=[str(k) for k in range(len(CASES))])
def test_admit_table(queue, pending, budget, look, mode, rnd, every, expected, why):
    assert admit(queue, pending, budget, look, mode, rnd, every) == expected, why


def drive(arrivals, mode, budget, lookahead, every, prefill_steps=2, max_steps=5000):
    """A toy instance: admitted requests finish prefill after ``prefill_steps`` ticks.

    ``arrivals[t]`` is the list of costs arriving at tick t. Returns tick of admission per request.
    """
    waiting: list[tuple[int, int]] = []  # (request id, cost)
    running: list[tuple[int, int, int]] = []  # (done tick, id, cost)
    admitted_at: dict[int, int] = {}
    rid = 0
    rnd = 1
    total = sum(len(a) for a in arrivals)
    for t in range(max_steps):
        if t < len(arrivals):
            for cost in arrivals[t]:
                waiting.append((rid, cost))
                rid += 1
        running = [r for r in running if r[0] > t]
        pending = sum(r[2] for r in running)
        picked = admit([w[1] for w in waiting], pending, budget, lookahead, mode, rnd, every)
        if picked:
            rnd += 1
        assert picked == sorted(picked) and len(set(picked)) == len(picked)
        for k in picked:
            i, cost = waiting[k]
            admitted_at[i] = t
            running.append((t + prefill_steps + cost // 4096, i, cost))
        waiting = [w for k, w in enumerate(waiting) if k not in set(picked)]
        if len(admitted_at) == total and t >= len(arrivals):
            break
    return admitted_at, total


@settings(max_examples=150, deadline=None)
@given(arrivals=st.lists(st.lists(st.integers(1, 40_000), max_size=4), min_size=1, max_size=30),
       mode=st.sampled_from(["fifo", "pack"]), budget=st.integers(1, 20_000),
       lookahead=st.integers(1, 10), every=st.integers(1, 6))
def test_every_request_is_eventually_admitted(arrivals, mode, budget, lookahead, every):
    admitted, total = drive(arrivals, mode, budget, lookahead, every)
    assert len(admitted) == total


def test_forced_fifo_lets_a_long_prompt_through_a_stream_of_short_ones():
    # One 30k prompt, then 3 short ones every tick forever: pack alone would starve it.
    arrivals = [[30_000, 500]] + [[500, 500, 500]] * 200
    admitted, _ = drive(arrivals, "pack", 8192, 8, 4)
    assert 0 in admitted and admitted[0] < 50
    never, _ = drive(arrivals, "pack", 8192, 8, 0, max_steps=200)
    assert 0 not in never, "without forced FIFO rounds the long prompt waits while shorts keep coming"


def test_engine_hook_fifo_is_vllm_order_and_pack_reorders():
    from kvtop.sim.engine import WaitingView

    views = [WaitingView("a", 20_000, 0, 20_000, 0.0), WaitingView("b", 300, 0, 300, 0.1),
             WaitingView("c", 200, 0, 200, 0.2)]
    assert engine_hook("fifo")(views, 8192) == [0, 1, 2]  # vLLM's order; the engine chunks
    assert engine_hook("pack")(views, 8192) == [1, 2]
    hook = engine_hook("pack", {"admission_force_fifo_every": 2, "admission_lookahead": 8})
    assert hook(views, 8192) == [1, 2] and hook(views, 8192) == [0, 1, 2]  # round 2 is FIFO
    with pytest.raises(ValueError):
        engine_hook("lifo")


def test_pipeline_queue_waits_releases_and_forgets_a_request_that_left():
    """The router's admission queue, as the live router and the simulator both drive it."""
    from router.cluster import Cluster
    from router.core import RoutingCore
    from router.features import Features
    from router.pipeline import OK, Pipeline
    from router.policies import build_policy
    from router.request import RouteRequest

    class Sink:
        def __init__(self):
            self.outcomes = []

        def decision(self, d):
            pass

        def outcome(self, d, o):
            self.outcomes.append((d.request.request_id, o.status, o.admission_wait_ms))

    now = [0.0]
    cluster = Cluster(["a"], block_size=16, capacity_blocks=1000, clock=lambda: now[0])
    core = RoutingCore(cluster, build_policy("round_robin", {}), clock=lambda: now[0])
    feats = Features.build({"admission": "pack", "admission_budget_tokens": 1000})
    admitted = []
    sink = Sink()
    pipe = Pipeline(core, lambda: feats, sink, clock=lambda: now[0], on_admit=admitted.append)

    def arrive(name, tokens, base):
        flow = pipe.receive(RouteRequest(name, name, "header", tokens, list(range(base, base + tokens // 16)),
                                         "tokens", "completions", True, 1))
        pipe.route(flow)
        return flow, pipe.admit(flow)

    big, ok_big = arrive("big", 900, 0)
    small, ok_small = arrive("small", 200, 10_000)
    tiny, ok_tiny = arrive("tiny", 50, 20_000)
    gone, ok_gone = arrive("gone", 150, 30_000)
    assert (ok_big, ok_small, ok_tiny, ok_gone) == (True, False, True, False)  # 900 + 50 fits, 200 does not
    now[0] = 1.0
    pipe.abandon(gone, "while waiting for admission")  # the client left: it leaves the queue
    assert [k for k, _ in pipe.queue.waiting[0]] == [id(small.leg.ticket)]
    assert admitted == []
    now[0] = 2.0
    pipe.first_token(big)  # big's prefill is over: small fits now
    assert admitted == [small]
    for f in (big, tiny, small):
        pipe.sent(f)
        pipe.first_token(f)
        pipe.finish(f, OK, output_tokens=1)
    assert pipe.idle() and pipe.queue.pending(0) == 0
    waits = {rid: (status, wait) for rid, status, wait in sink.outcomes}
    assert waits["small"] == ("ok", 2000.0) and waits["tiny"] == ("ok", 0.0)
    assert waits["gone"] == ("client_gone", 0.0)


def test_kvtop_sim_admission_flag_gives_each_engine_its_own_hook():
    import argparse

    from kvtop.sim.cli import add_arguments, build_instances

    p = argparse.ArgumentParser()
    add_arguments(p)
    insts = build_instances(p.parse_args(["--instances", "2", "--admission", "pack"]))
    hooks = [i.engine.admission for i in insts]
    assert all(hooks) and hooks[0] is not hooks[1]
    assert build_instances(p.parse_args([]))[0].engine.admission is None


def test_the_queue_serves_lower_priority_values_first_then_arrival():
    """Issue 39: the router's admission queue orders as vLLM's priority scheduler does."""
    from router.admission import AdmissionQueue

    q = AdmissionQueue(1)
    knobs = {"admission": "fifo", "admission_budget_tokens": 100, "admission_lookahead": 8,
             "admission_force_fifo_every": 4}
    for key, prio in (("late-session", 5), ("early-session", 1), ("late-2", 5), ("early-2", 1), ("none", 0)):
        q.enqueue(0, key, 100, prio)
    order = []
    for _ in range(5):
        got = q.pump(0, knobs)  # one fits at a time: each waits for the one before to finish
        order += got
        q.remove(0, got[0])
    assert order == ["none", "early-session", "early-2", "late-session", "late-2"]
    assert q.waiting == [[]] and q.ranks == [[]]


def test_without_priorities_the_queue_is_arrival_order():
    from router.admission import AdmissionQueue

    q = AdmissionQueue(2)
    for k in range(6):
        q.enqueue(k % 2, f"r{k}", 10)
    q.remove(0, "r2")
    assert [k for k, _ in q.waiting[0]] == ["r0", "r4"] and [k for k, _ in q.waiting[1]] == ["r1", "r3", "r5"]


def test_the_pipeline_admits_an_earlier_session_first_under_session_fcfs():
    """With ``priority=session_fcfs`` a returning turn of the first session overtakes a later
    session's request that waited longer, as the engine would order them."""
    from router.cluster import Cluster
    from router.core import RoutingCore
    from router.features import Features
    from router.pipeline import Pipeline
    from router.policies import build_policy
    from router.request import RouteRequest

    class Sink:
        def decision(self, d):
            pass

        def outcome(self, d, o):
            pass

    now = [0.0]
    cluster = Cluster(["a"], block_size=16, capacity_blocks=1000, clock=lambda: now[0])
    core = RoutingCore(cluster, build_policy("round_robin", {}), clock=lambda: now[0])
    feats = Features.build({"admission": "fifo", "admission_budget_tokens": 1000, "priority": "session_fcfs"})
    admitted = []
    pipe = Pipeline(core, lambda: feats, Sink(), clock=lambda: now[0], on_admit=admitted.append)

    def arrive(rid, session, tokens, base):
        flow = pipe.receive(RouteRequest(rid, session, "header", tokens, list(range(base, base + tokens // 16)),
                                         "tokens", "completions", True, 1))
        pipe.route(flow)
        return flow, pipe.admit(flow)

    first, ok = arrive("s1-t1", "s1", 900, 0)  # session s1 comes first: rank 0
    assert ok
    later, ok_later = arrive("s2-t1", "s2", 800, 10_000)  # s2: rank 1, waits
    back, ok_back = arrive("s1-t2", "s1", 800, 20_000)  # s1 again: rank 0, waits too
    assert (ok_later, ok_back) == (False, False)
    assert (later.decision.extra["priority"], back.decision.extra["priority"]) == (1, 0)
    pipe.first_token(first)  # room for one of them: s1's turn, though s2 waited longer
    assert admitted == [back]
