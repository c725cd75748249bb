"""The held-hit touch (kvtop/sim/engine.py ``_touch``: a hit the lookup found wholly in blocks a
live request holds raises their refcounts without a free-queue test) against the same engine
made to take the general path, state by state, on random workloads with aborts, P/D legs,
admission hooks, extra lookups and coalesced steps. Whenever the fast path is taken, every block
of the hit must be held (refcount >= 1; exactly 1 while no block is shared): a release between
the lookup and the touch (the head-of-line memo keeps a hit across steps) must invalidate it."""

from __future__ import annotations

import random

import pytest

from kvtop.sim.engine import Engine, EngineRejected, EngineRequest
from router.admission import engine_hook
from test_engine_block_pool import next_time

BS = 16


class General(Engine):
    """The engine with the held-hit fast path off."""

    def _touch(self, req, hit):
        saved, self._held_hit = self._held_hit, None
        try:
            super()._touch(req, hit)
        finally:
            self._held_hit = saved


class Checked(Engine):
    fast = 0

    def _touch(self, req, hit):
        if hit and hit is self._held_hit:
            type(self).fast += 1
            refs = [self._ref[b] for b in hit]
            assert all(r >= 1 for r in refs), ("the held hit has a free block", refs)
            if not self._num_shared:
                assert all(r == 1 for r in refs), refs
        super()._touch(req, hit)


def _state(e: Engine):
    return (list(e._ref), list(e._block_hash), dict(e._cached), e._free_queue(), e._num_free, e._num_shared,
            [(r.id, list(r.blocks), r.registered, r.computed, r.state) for r in e._requests.values()])


def _workload(rng: random.Random, n: int, max_blocks: int, pd: bool):
    system = [10_000_000 + k for k in range(rng.randint(0, 6))]
    contexts: dict[int, list[int]] = {}
    fresh = iter(range(1, 1 << 30))
    t = 0.0
    for k in range(n):
        ctx = contexts.setdefault(rng.randrange(5), list(system) if rng.random() < 0.6 else [])
        if ctx and rng.random() < 0.2:
            del ctx[rng.randrange(len(ctx)):]          # a compaction: the context rewritten
        ctx.extend(next(fresh) for _ in range(rng.randint(1, 6)))
        if len(ctx) > max_blocks:
            ctx[:] = ctx[:rng.randint(1, max_blocks // 2)]
        t += rng.expovariate(rng.choice([4.0, 40.0]))
        params = None
        if pd:
            x = rng.random()
            if x < 0.2:
                params = {"do_remote_decode": True}
            elif x < 0.4:
                params = {"do_remote_prefill": True, "remote_block_ids": list(range(rng.randint(0, len(ctx))))}
        yield t, (f"r{k}", len(ctx) * BS + rng.randint(0, BS - 1), list(ctx), rng.randint(1, 6 * BS), t, params)


def _run(seed: int) -> None:
    rng = random.Random(seed)
    blocks = rng.randint(24, 160)
    kw = dict(block_size=BS, num_gpu_blocks=blocks, max_num_batched_tokens=rng.choice([32, 128, 2048]),
              max_num_seqs=rng.randint(1, 6), prefix_metrics=rng.choice(["after_alloc", "at_lookup"]))
    adm = rng.choice([None, "fifo", "pack"])
    a = Checked("h20", admission=engine_hook(adm) if adm else None, **kw)
    b = General("h20", admission=engine_hook(adm) if adm else None, **kw)
    pending = list(_workload(rng, 60, blocks // 2, rng.random() < 0.5))
    coalesce = rng.random() < 0.5
    t, i, live = 0.0, 0, []
    for _ in range(5_000):   # bounded: a workload ends well within this (or stalls, as both do)
        while i < len(pending) and pending[i][0] <= t:
            args = pending[i][1]
            i += 1
            took = []
            for e in (a, b):
                try:
                    e.add_request(EngineRequest(*args[:5], kv_transfer_params=args[5]))
                    took.append(True)
                except EngineRejected:
                    took.append(False)
            assert took[0] == took[1]
            if took[0]:
                live.append(args[0])
        if live and rng.random() < 0.05:
            rid = live.pop(rng.randrange(len(live)))
            assert (a.abort(rid, t) is None) == (b.abort(rid, t) is None)
        if rng.random() < 0.3 and a._requests:   # lookups with no side effect (as admission hooks make)
            for r in rng.sample(list(a._requests.values()), min(2, len(a._requests))):
                a.lookup_cached_tokens(r.hashes, r.num_tokens)
                b.lookup_cached_tokens(r.hashes, r.num_tokens)
        ra, rb = a.step(t, coalesce=coalesce), b.step(t, coalesce=coalesce)
        assert (ra.end_time, ra.emitted, ra.finished, ra.preempted, ra.first_token, ra.transfers_started) == \
               (rb.end_time, rb.emitted, rb.finished, rb.preempted, rb.first_token, rb.transfers_started)
        assert _state(a) == _state(b), seed
        t = next_time(a, ra, t, live, pending[i][0] if i < len(pending) else None)
        if t is None:
            break


@pytest.mark.parametrize("chunk", range(4))
def test_held_hit_touch_is_the_general_touch(chunk):
    before = Checked.fast
    for seed in range(chunk * 60, chunk * 60 + 60):
        _run(seed)
    assert Checked.fast > before   # the fast path was taken, so it was compared
