"""The estimated prefix cache: one-pass hits for all instances, LRU with real capacity."""

from __future__ import annotations

import random

import pytest

from router.blocks import hash_text_blocks, hash_token_blocks
from router.prefix_index import PrefixIndex


def brute_match(index, blocks):
    out = []
    for lru in index._lru:
        k = 0
        while k < len(blocks) and blocks[k] in lru:
            k += 1
        out.append(k)
    return out


def test_one_pass_equals_per_instance_walk():
    rng = random.Random(7)
    idx = PrefixIndex(5, 40, 16)
    chains = [[rng.getrandbits(60) for _ in range(30)] for _ in range(6)]
    for _ in range(200):
        chain = rng.choice(chains)
        idx.insert(rng.randrange(5), chain[: rng.randint(1, 30)])
        probe = rng.choice(chains)[: rng.randint(0, 30)]
        assert idx.match(probe) == brute_match(idx, probe)


def test_lru_capacity_and_tail_first_eviction():
    idx = PrefixIndex(1, 4, 16)
    idx.insert(0, [1, 2, 3, 4])
    idx.insert(0, [9, 8])  # needs 2 slots: the oldest are the tail of the first request
    assert idx.match([1, 2, 3, 4]) == [2], "the first blocks (most shared) survive"
    assert idx.cached_blocks(0) == 4 and idx.evictions[0] == 2


def test_forget_instance():
    idx = PrefixIndex(2, 10, 16)
    idx.insert(0, [1, 2])
    idx.insert(1, [1, 2])
    idx.forget_instance(0)
    assert idx.match([1, 2]) == [0, 2]


@pytest.mark.parametrize("a,b,shared", [
    (list(range(2048)), list(range(2048)), 4),
    (list(range(2048)), list(range(1024)) + [7] * 1024, 2),
    (list(range(2048)), [1] + list(range(1, 2048)), 0),
    (list(range(600)), list(range(600)), 1),  # only full blocks are hashed
])
def test_chained_hashes_share_exactly_the_common_prefix(a, b, shared):
    ha, hb = hash_token_blocks(a, 512), hash_token_blocks(b, 512)
    common = 0
    while common < min(len(ha), len(hb)) and ha[common] == hb[common]:
        common += 1
    assert common == shared


def test_text_fallback_chunks():
    base = "x" * 2048 * 3
    assert hash_text_blocks(base, 512)[:2] == hash_text_blocks(base[:4096] + "y" * 2048, 512)[:2]
    assert len(hash_text_blocks("a" * 2047, 512)) == 0
