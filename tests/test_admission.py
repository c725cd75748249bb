"""Prefill admission (router/admission.py): the pure rule, the engine hook and the live gate."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.admission import AdmissionGate, admit, engine_hook
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


async def test_gate_waits_releases_and_forgets_a_cancelled_waiter():
    knobs = FEATURE_KNOBS.validate({"admission": "pack", "admission_budget_tokens": 1000})
    gate = AdmissionGate(2, lambda: knobs)
    assert await gate.wait(0, "big", 900) >= 0  # nothing pending: admitted at once
    small = asyncio.create_task(gate.wait(0, "small", 200))
    tiny = asyncio.create_task(gate.wait(0, "tiny", 50))
    gone = asyncio.create_task(gate.wait(0, "gone", 150))
    await asyncio.sleep(0.01)
    assert tiny.done() and not small.done() and not gone.done()  # 900 + 50 fits, 200 does not
    gone.cancel()
    await asyncio.sleep(0.01)
    assert [k for k, _ in gate.queue.waiting[0]] == ["small"]  # the cancelled one left the queue
    gate.release(0, "big")  # first token of the big one
    await asyncio.sleep(0.01)
    assert small.done()
    for key in ("tiny", "small"):
        gate.release(0, key)
    assert gate.queue.pending(0) == 0 and not gate.futures


def test_kvtop_sim_admission_flag_gives_each_engine_its_own_hook():
    import argparse

    from kvtop.sim.cli import add_arguments, build_instances

    p = argparse.ArgumentParser()
    add_arguments(p)
    insts = build_instances(p.parse_args(["--instances", "2", "--admission", "pack"]))
    hooks = [i.engine.admission for i in insts]
    assert all(hooks) and hooks[0] is not hooks[1]
    assert build_instances(p.parse_args([]))[0].engine.admission is None
