"""The engine's block pool keeps its free queue as runs of blocks (a request's release is one
run, a returning turn's hit leaves it as one slice, other hits leave stale entries that
allocation filters); it must take, free and evict exactly the blocks vLLM's block pool would.
A shadow pool kept the plain way (an ordered free queue, one refcount per block, block by
block) follows every touch, allocation and free the engine makes, on random workloads with
shared prefixes, preemptions, aborts, KV events and a head-of-line memo, and the two must
agree after each one."""

from __future__ import annotations

import random
from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtop.sim.engine import Engine, EngineRejected, EngineRequest

BS = 16


class ShadowPool:
    """vLLM's BlockPool, block by block: the reference the engine is checked against."""

    def __init__(self, n: int):
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(n))
        self.ref = [0] * n
        self.block_hash: dict[int, int] = {}
        self.cached: dict[int, int] = {}

    def touch(self, hit):
        for b in hit:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1

    def allocate(self, n):
        taken = []
        for _ in range(n):
            b = self.free.popitem(last=False)[0]
            h = self.block_hash.pop(b, None)
            if h is not None:
                del self.cached[h]
            self.ref[b] = 1
            taken.append(b)
        return taken

    def release(self, blocks):
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None


def shadowed(e: Engine) -> ShadowPool:
    """Wrap the engine's block-pool methods so that the shadow replays each call and the two
    are compared right after it."""
    shadow = ShadowPool(e.num_gpu_blocks)
    touch, allocate, free_blocks, register = e._touch, e._allocate, e._free_blocks, e._register

    def agree():
        assert e._free_queue() == list(shadow.free)
        assert e.num_free_blocks == len(shadow.free)
        for b in range(e.num_gpu_blocks):
            assert e._refcount(b) == shadow.ref[b], b
        assert e._cached == shadow.cached
        assert {b: h for b, h in enumerate(e._block_hash) if h is not None} == shadow.block_hash
        if e._hol_req is not None:
            assert e._hol_touch_free == [shadow.ref[b] for b in e._hol_hit].count(0)

    def _touch(req, hit):
        shadow.touch(hit)
        touch(req, hit)
        agree()

    def _allocate(req, n):
        before = len(req.blocks)
        expected = shadow.allocate(n)
        allocate(req, n)
        assert req.blocks[before:] == expected
        agree()

    def _free_blocks(req):
        shadow.release(list(req.blocks))
        free_blocks(req)
        agree()

    def _register(req, num_computed):
        register(req, num_computed)
        for idx in range(req.registered):   # what registering cached, as vLLM would
            h, b = req.hashes[idx], req.blocks[idx]
            if h not in shadow.cached and b not in shadow.block_hash:
                shadow.cached[h] = b
                shadow.block_hash[b] = h
        agree()

    e._touch, e._allocate, e._free_blocks, e._register = _touch, _allocate, _free_blocks, _register
    return shadow


def workload(rng: random.Random, n: int, max_blocks: int, compaction: float = 0.0):
    """Sessions whose turns extend their context, some sharing a system prompt; arrivals
    overlap. ``compaction``: the chance a turn first cuts its context at a random block (it
    diverges from the previous turn's from there)."""
    system = [10_000_000 + k for k in range(rng.randint(0, 6))]
    contexts: dict[int, list[int]] = {}
    fresh = iter(range(1, 1 << 30))
    t = 0.0
    for k in range(n):
        s = rng.randrange(5)
        ctx = contexts.setdefault(s, list(system) if rng.random() < 0.6 else [])
        if compaction and ctx and rng.random() < compaction:
            del ctx[rng.randrange(len(ctx)):]
        ctx.extend(next(fresh) for _ in range(rng.randint(1, 6)))
        if len(ctx) > max_blocks:
            ctx[:] = ctx[:rng.randint(1, max_blocks // 2)]
        n_tokens = len(ctx) * BS + rng.randint(0, BS - 1)
        t += rng.expovariate(4.0)
        yield t, EngineRequest(f"r{k}", n_tokens, list(ctx), rng.randint(1, 6 * BS), t)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 100_000), blocks=st.integers(24, 160), events=st.booleans(),
       budget=st.sampled_from([32, 128, 2048]))
def test_run_pool_matches_the_block_by_block_pool(seed, blocks, events, budget):
    rng = random.Random(seed)
    e = Engine("h20", block_size=BS, num_gpu_blocks=blocks, max_num_batched_tokens=budget,
               max_num_seqs=rng.randint(1, 6))
    if events:
        e.kv_events = []
    shadowed(e)
    drive(e, rng, list(workload(rng, 40, blocks // 2)))
    assert e.num_free_blocks == blocks and e.num_allocated_blocks() == 0


def drive(e: Engine, rng: random.Random, pending: list, before_step=None, after_step=None) -> None:
    """Run ``pending`` ((arrival, request), in order) through ``e`` to the end, aborting a live
    request now and then; ``before_step(t)`` and ``after_step()`` around every step."""
    t = 0.0
    live: list[str] = []
    for _ in range(20_000):
        while pending and pending[0][0] <= t:
            _, r = pending.pop(0)
            try:
                e.add_request(r)
                live.append(r.request_id)
            except EngineRejected:
                pass
        if live and rng.random() < 0.03:
            e.abort(live.pop(rng.randrange(len(live))), t)
        if before_step is not None:
            before_step(t)
        res = e.step(t)
        if after_step is not None:
            after_step()
        t = next_time(e, res, t, live, pending[0][0] if pending else None)
        if t is None:
            break
    else:
        raise AssertionError("did not finish")
    assert not e.has_work()


def next_time(e: Engine, res, t: float, live: list[str], next_arrival: float | None) -> float | None:
    """A driver's bookkeeping after a step: finished requests leave ``live``; the next step is
    at the step's end, or, for an idle engine, at its next event or the next arrival (None:
    nothing is left)."""
    for f in res.finished:
        if f.request_id in live:
            live.remove(f.request_id)
    if not res.idle:
        return res.end_time
    nxt = e.next_event_time()
    if nxt is None:
        if next_arrival is None:
            return None
        nxt = next_arrival
    return max(t, nxt)


def test_a_returning_turn_leaves_the_queue_as_one_slice_and_other_hits_go_stale():
    e = Engine("h20", block_size=BS, num_gpu_blocks=32)
    shadowed(e)
    hashes = list(range(100, 110))
    t = 0.0
    dirty = []
    for k, n in enumerate((10, 10, 6, 10)):   # the same prompt, then a shorter one, then again
        e.add_request(EngineRequest(f"r{k}", n * BS + 1, hashes[:n], 1, t))
        while e.has_work():
            r = e.step(t)
            t = r.end_time if not r.idle else (e.next_event_time() or t)
        dirty.append(any(run.dirty for run in e._runs))
    # r1 and r2 take their hit as the tail of the run the turn before released: one slice each.
    # r3's hit spans r2's run and what r1 left free, so it goes block by block: stale entries.
    assert dirty == [False, False, False, True]
    e.add_request(EngineRequest("big", 30 * BS, [], 1, t))    # allocation filters them
    while e.has_work():
        r = e.step(t)
        t = r.end_time if not r.idle else (e.next_event_time() or t)
    assert not any(run.dirty for run in e._runs)
