"""The engine's prefix lookup starts from the blocks of the last request admitted with the same
first hash (``Engine._chains``) and reads the dict only past them; its answer must be what a
dict read a hash gives, whatever happened to those blocks since (evicted, re-registered,
shared, a prompt that diverges from that request's)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtop.sim.engine import Engine, EngineRequest
from test_engine_block_pool import drive
from test_engine_block_pool import workload as pool_workload

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
    """block_pool's sessions, some also rewriting a stretch of their context (a prompt that
    diverges from the previous turn's)."""
    return pool_workload(rng, n, max_blocks, compaction=0.2)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 100_000), blocks=st.integers(24, 160), budget=st.sampled_from([32, 128, 2048]))
def test_lookup_from_the_chains_is_the_dict_walk(seed, blocks, budget):
    rng = random.Random(seed)
    e = Engine("h20", block_size=BS, num_gpu_blocks=blocks, max_num_batched_tokens=budget,
               max_num_seqs=rng.randint(1, 6))
    checked(e)  # every lookup compared with a dict walk

    def lookups_elsewhere(t: float) -> None:  # lookups at other moments than admission too
        for r in rng.sample(list(e._requests.values()), min(2, len(e._requests))):
            e._lookup(r.hashes, r.num_tokens)

    def shared_count() -> None:  # the count that lets a release skip reading refcounts
        assert e._num_shared == sum(r - 1 for r in e._ref if r > 1)

    drive(e, rng, list(workload(rng, 40, blocks // 2)), lookups_elsewhere, shared_count)


def runner(e: Engine):
    """run(rid, hashes, n_tokens): one request of one output token, to its end, on e's own clock."""
    clock = [0.0]

    def run(rid, hashes, n_tokens):
        t = clock[0]
        e.add_request(EngineRequest(rid, n_tokens, hashes, 1, t))
        while e.has_work():
            r = e.step(t)
            t = r.end_time if not r.idle else (e.next_event_time() or t)
        clock[0] = t
    return run


def test_a_returning_turn_is_found_from_its_previous_turn_and_cut_where_evicted():
    e = Engine("h20", block_size=BS, num_gpu_blocks=24)
    from_chain = checked(e)
    run = runner(e)

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
    run = runner(e)
    for k in range(mod._MAX_CHAINS + 10):
        run(f"r{k}", [1_000_000 + k], 2 * BS)
    assert len(e._chains) <= mod._MAX_CHAINS


def test_chains_keep_a_bounded_number_of_hashes_alive():
    from kvtop.sim import engine as mod

    e = Engine("h20", block_size=BS, num_gpu_blocks=64)
    run = runner(e)
    for k in range(200):   # long prompts, each of a new session
        run(f"r{k}", [10_000_000 * (k + 1) + j for j in range(40)], 40 * BS + 1)
    kept = sum(len(c[0]) for c in e._chains.values())
    assert kept == e._chains_size <= mod._CHAIN_BLOCKS_PER_CACHE_BLOCK * 64
    assert 0 < len(e._chains) < 200


def test_a_long_previous_turn_cut_past_its_first_chunk():
    # the check of a chain whose tail was evicted goes in chunks from 64 blocks: the cut at
    # block ~120 lies in the second chunk
    e = Engine("h20", block_size=BS, num_gpu_blocks=200)
    checked(e)
    run = runner(e)

    a = list(range(1_000, 1_150))
    run("a1", a, 150 * BS + 1)
    run("other", list(range(5_000, 5_080)), 80 * BS)   # 49 unused blocks, then a1's tail
    left = len(reference_lookup(e, a, 150 * BS + 1))
    assert 64 < left < 150
    assert e.lookup_cached_tokens(a, 150 * BS + 1) == left * BS
