"""The engine's prefix lookup scans in chunks that double from 64 blocks and stops in the chunk
of the first miss; it must give exactly the longest cached chain a block-by-block walk gives,
wherever that miss falls (chunk edges included) and whatever caps the scan."""

from __future__ import annotations

import pytest

from kvtop.sim.engine import Engine

BS = 16


def walk(e: Engine, hashes: list[int], num_tokens: int) -> list[int]:
    """The reference: block by block until the first miss, capped at num_tokens - 1."""
    out = []
    for h in hashes[:max(0, (num_tokens - 1) // BS)]:
        b = e._cached.get(h)
        if b is None:
            break
        out.append(b)
    return out


def engine_with_cached(hashes: list[int]) -> Engine:
    e = Engine("h20", block_size=BS, num_gpu_blocks=4096)
    for b, h in enumerate(hashes):     # block b holds hash h, as a registered prompt block would
        e._cached[h] = b
    return e


# first miss at: none, the first block, each side of the chunk edges 64, 64+128, 64+128+256
@pytest.mark.parametrize("miss", [None, 0, 1, 63, 64, 65, 191, 192, 193, 447, 448, 449, 1999])
@pytest.mark.parametrize("num_blocks", [1, 64, 65, 500, 2000])
def test_lookup_is_the_longest_cached_chain(miss, num_blocks):
    hashes = [1_000_003 * (k + 1) for k in range(num_blocks)]
    cached = [h for k, h in enumerate(hashes) if k != miss]
    e = engine_with_cached(cached)
    for num_tokens in (1, BS, BS + 1, num_blocks * BS, num_blocks * BS + 1, 70 * BS):
        expected = walk(e, hashes, num_tokens)
        assert e._lookup(hashes, num_tokens) == expected
        assert e.lookup_cached_tokens(hashes, num_tokens) == len(expected) * BS


def test_lookup_stops_at_a_miss_even_when_later_blocks_are_cached():
    # an evicted middle block hides the blocks after it, as in vLLM's chain of hashes
    hashes = list(range(10, 310))
    e = engine_with_cached(hashes[:100] + hashes[101:])
    assert e._lookup(hashes, 300 * BS + 1) == list(range(100))
