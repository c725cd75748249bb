"""The engine's prefix lookup starts from the blocks of the last request admitted with the same
first hash (``Engine._chains``) and reads the dict only past them; its answer must be what a
dict read a hash gives, whatever happened to those blocks since (evicted, re-registered,
shared, a prompt that diverges from that request's)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtop.sim.engine import Engine, EngineRejected, EngineRequest

BS = 16


def reference_lookup(e: Engine, hashes, num_tokens) -> list[int]:
    """vLLM's walk: the cached blocks of the leading hashes, up to the first miss."""
    limit = min(len(hashes), (num_tokens - 1) // e.block_size)
    out = []
    for h in hashes[:limit]:
        b = e._cached.get(h)
        if b is None:
            break
        out.append(b)
    return out


def checked(e: Engine) -> list[int]:
    """Compare every lookup with the reference, and every count of a hit's free blocks with the
    refcounts; returns a list counting the lookups the chains answered."""
    lookup = e._lookup
    from_chain = []

    def _lookup(hashes, num_tokens):
        if hashes and hashes[0] in e._chains:
            from_chain.append(1)
        got = lookup(hashes, num_tokens)
        assert got == reference_lookup(e, hashes, num_tokens)
        return got

    count_free_hit = e._count_free_hit

    def _count_free_hit(hit):   # what a lookup that found only held blocks lets it skip
        got = count_free_hit(hit)
        assert got == [e._refcount(b) for b in hit].count(0)
        return got

    e._lookup = _lookup
    e._count_free_hit = _count_free_hit
    return from_chain


def workload(rng: random.Random, n: int, max_blocks: int):
    """Sessions that extend their context, some sharing a system prompt, some rewriting a
    stretch of it (a prompt that diverges from the previous turn's), arrivals overlapping."""
    system = [10_000_000 + k for k in range(rng.randint(0, 6))]
    contexts: dict[int, list[int]] = {}
    fresh = iter(range(1, 1 << 30))
    t = 0.0
    for k in range(n):
        s = rng.randrange(5)
        ctx = contexts.setdefault(s, list(system) if rng.random() < 0.6 else [])
        if ctx and rng.random() < 0.2:   # a compaction: the context diverges from some block on
            del ctx[rng.randrange(len(ctx)):]
        ctx.extend(next(fresh) for _ in range(rng.randint(1, 6)))
        if len(ctx) > max_blocks:
            ctx[:] = ctx[:rng.randint(1, max_blocks // 2)]
        n_tokens = len(ctx) * BS + rng.randint(0, BS - 1)
        t += rng.expovariate(4.0)
        yield t, EngineRequest(f"r{k}", n_tokens, list(ctx), rng.randint(1, 6 * BS), t)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 100_000), blocks=st.integers(24, 160), budget=st.sampled_from([32, 128, 2048]))
def test_lookup_from_the_chains_is_the_dict_walk(seed, blocks, budget):
    rng = random.Random(seed)
    e = Engine("h20", block_size=BS, num_gpu_blocks=blocks, max_num_batched_tokens=budget,
               max_num_seqs=rng.randint(1, 6))
    from_chain = checked(e)
    pending = list(workload(rng, 40, blocks // 2))
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
        for r in rng.sample(list(e._requests.values()), min(2, len(e._requests))):
            e._lookup(r.hashes, r.num_tokens)   # lookups at other moments than admission too
        res = e.step(t)
        # the count that lets a release skip reading refcounts when no block is shared
        assert e._num_shared == sum(r - 1 for r in e._ref if r > 1)
        for f in res.finished:
            if f.request_id in live:
                live.remove(f.request_id)
        if res.idle:
            nxt = e.next_event_time()
            if nxt is None:
                if not pending:
                    break
                nxt = pending[0][0]
            t = max(t, nxt)
        else:
            t = res.end_time
    else:
        raise AssertionError("did not finish")
    assert not e.has_work()


def test_a_returning_turn_is_found_from_its_previous_turn_and_cut_where_evicted():
    e = Engine("h20", block_size=BS, num_gpu_blocks=24)
    from_chain = checked(e)
    t = 0.0

    def run(rid, hashes, n_tokens):
        nonlocal t
        e.add_request(EngineRequest(rid, n_tokens, hashes, 1, t))
        while e.has_work():
            r = e.step(t)
            t = r.end_time if not r.idle else (e.next_event_time() or t)

    a = list(range(100, 110))
    run("a1", a, 10 * BS + 1)
    assert e.lookup_cached_tokens(a + [200], 11 * BS + 1) == 10 * BS    # all of a1's blocks
    assert from_chain                                                   # answered from a1's chain
    run("other", list(range(300, 320)), 20 * BS)   # evicts the tail of a1's run (freed first)
    left = len(reference_lookup(e, a, 10 * BS + 1))
    assert 0 < left < 10
    assert e.lookup_cached_tokens(a, 10 * BS + 1) == left * BS
    # a prompt that diverges from a1's at block 3: only the first 3 blocks can hit
    assert e.lookup_cached_tokens(a[:3] + [999] + a[4:], 10 * BS + 1) == min(3, left) * BS


def test_chains_are_bounded():
    from kvtop.sim import engine as mod

    e = Engine("h20", block_size=BS, num_gpu_blocks=4096)
    t = 0.0
    for k in range(mod._MAX_CHAINS + 10):
        e.add_request(EngineRequest(f"r{k}", 2 * BS, [1_000_000 + k], 1, t))
        while e.has_work():
            r = e.step(t)
            t = r.end_time if not r.idle else (e.next_event_time() or t)
    assert len(e._chains) <= mod._MAX_CHAINS


def test_chains_keep_a_bounded_number_of_hashes_alive():
    from kvtop.sim import engine as mod

    e = Engine("h20", block_size=BS, num_gpu_blocks=64)
    t = 0.0
    for k in range(200):   # long prompts, each of a new session
        hashes = [10_000_000 * (k + 1) + j for j in range(40)]
        e.add_request(EngineRequest(f"r{k}", 40 * BS + 1, hashes, 1, t))
        while e.has_work():
            r = e.step(t)
            t = r.end_time if not r.idle else (e.next_event_time() or t)
    kept = sum(len(c[0]) for c in e._chains.values())
    assert kept == e._chains_size <= mod._CHAIN_BLOCKS_PER_CACHE_BLOCK * 64
    assert 0 < len(e._chains) < 200


def test_a_long_previous_turn_cut_past_its_first_chunk():
    # the check of a chain whose tail was evicted goes in chunks from 64 blocks: the cut at
    # block ~120 lies in the second chunk
    e = Engine("h20", block_size=BS, num_gpu_blocks=200)
    checked(e)
    t = 0.0

    def run(rid, hashes, n_tokens):
        nonlocal t
        e.add_request(EngineRequest(rid, n_tokens, hashes, 1, t))
        while e.has_work():
            r = e.step(t)
            t = r.end_time if not r.idle else (e.next_event_time() or t)

    a = list(range(1_000, 1_150))
    run("a1", a, 150 * BS + 1)
    run("other", list(range(5_000, 5_080)), 80 * BS)   # 49 unused blocks, then a1's tail
    left = len(reference_lookup(e, a, 150 * BS + 1))
    assert 64 < left < 150
    assert e.lookup_cached_tokens(a, 150 * BS + 1) == left * BS
