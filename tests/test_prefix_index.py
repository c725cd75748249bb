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
    # non-ASCII text: the chunks are characters, hashed by their UTF-8 bytes; a change in a
    # later chunk leaves the earlier hashes alone
    uni = "é" * 2048 + "x" * 2048 + "日" * 2048
    a, b = hash_text_blocks(uni, 512), hash_text_blocks(uni[:4096] + "z" * 2048, 512)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert hash_text_blocks("x" * 4096, 512) != hash_text_blocks("y" * 4096, 512)


def test_text_hashes_are_the_same_in_every_process():
    """The parser's worker process hashes big bodies: its text hashes must equal the loop's,
    whatever each interpreter's string-hash seed."""
    import subprocess
    import sys

    text = "system prompt " * 2000 + "ü tool output " * 1000
    code = ("import sys; from router.blocks import hash_text_blocks; "
            "print(hash_text_blocks(sys.stdin.read(), 64))")
    outs = {subprocess.run([sys.executable, "-c", code], input=text, capture_output=True, text=True,
                           env={**__import__("os").environ, "PYTHONHASHSEED": seed}, check=True).stdout
            for seed in ("1", "2")}
    assert outs == {f"{hash_text_blocks(text, 64)}\n"}


def test_long_prefixes_take_the_fast_path_and_agree():
    """Chains longer than the short walk (16) go through the accumulate path: same answers."""
    rng = random.Random(11)
    idx = PrefixIndex(6, 2_000, 512)
    chains = [[rng.getrandbits(60) for _ in range(400)] for _ in range(4)]
    for _ in range(300):
        chain = rng.choice(chains)
        idx.insert(rng.randrange(6), chain[: rng.randint(1, 400)])
        probe = rng.choice(chains)[: rng.randint(0, 400)]
        assert idx.match(probe) == brute_match(idx, probe)
    full = chains[0]
    for k in range(6):
        idx.insert(k, full[: 50 * (k + 1)])
    assert idx.match(full) == brute_match(idx, full)


def test_bisection_holds_under_heavy_eviction_with_branching_chains():
    """Chains branch off shared prefixes (a system prompt, forked sessions) and caches are far
    smaller than the traffic, so eviction is constant: the prefix-closed invariant that the
    bisection relies on must survive all of it."""
    rng = random.Random(5)
    idx = PrefixIndex(5, 60, 64)
    trunk = [rng.getrandbits(60) for _ in range(40)]
    chains = []
    for _ in range(12):
        cut = rng.randint(0, 40)
        chains.append(trunk[:cut] + [rng.getrandbits(60) for _ in range(rng.randint(1, 120))])
    for _ in range(2_000):
        chain = rng.choice(chains)
        idx.insert(rng.randrange(5), chain[: rng.randint(1, len(chain))])
        probe = rng.choice(chains)
        assert idx.match(probe) == brute_match(idx, probe)
        for lru in idx._lru:  # the invariant itself: whatever is cached of a chain is a prefix of it
            held = [h in lru for h in probe]
            assert held == sorted(held, reverse=True)


class _PerBlockIndex(PrefixIndex):
    """The insert as a per-block Python loop (the code before the C-level passes): the
    reference the fast insert must equal, state for state."""

    def insert(self, instance, blocks, tag=None):
        self._runs = [None] * len(self._lru)  # oldest_tags reads its LRU afresh (issue 38's runs)
        lru = self._lru[instance]
        owners = self._owners
        bit = 1 << instance
        for h in reversed(blocks):
            if h in lru:
                del lru[h]  # to the newest end (the LRU is a dict in insertion order)
                lru[h] = None
            else:
                lru[h] = None
                owners[h] = owners.get(h, 0) | bit
        if tag is not None:
            self._tags.update(dict.fromkeys(blocks, tag))
        over = len(lru) - self.capacity[instance]
        for old in list(lru)[:max(over, 0)]:
            del lru[old]
            mask = owners.get(old, 0) & ~bit
            if mask:
                owners[old] = mask
            else:
                owners.pop(old, None)
                self._tags.pop(old, None)
        if over > 0:
            self.evictions[instance] += over


def _state(idx):
    idx.flush()
    return ([list(lru) for lru in idx._lru], dict(idx._owners), dict(idx._tags), list(idx.evictions))


@pytest.mark.parametrize("seed", range(6))
def test_insert_equals_the_per_block_loop(seed):
    """Random chains that branch off shared prefixes, inserts of any prefix on any instance,
    with and without a tag, some lists with repeated or foreign hashes (not chains: the insert
    must not rely on the prefix invariant), small caches (constant eviction) and a forget now
    and then: LRU order, owner masks, tags, eviction counts and every answer stay equal."""
    rng = random.Random(seed)
    caps = [rng.randint(5, 80) for _ in range(3)]
    fast, ref = PrefixIndex(3, caps, 16), _PerBlockIndex(3, caps, 16)
    trunk = [rng.getrandbits(60) for _ in range(30)]
    chains = [trunk[:rng.randint(0, 30)] + [rng.getrandbits(60) for _ in range(rng.randint(1, 60))]
              for _ in range(8)]
    for step in range(600):
        chain = rng.choice(chains)
        blocks = chain[:rng.randint(0, len(chain))]
        if step % 7 == 0 and blocks:  # not a chain: a repeat and a foreign hash
            blocks = blocks + [rng.choice(blocks), rng.getrandbits(60)] + blocks[:3]
        if step % 5 == 0:
            blocks = tuple(blocks)
        inst = rng.randrange(3)
        tag = rng.choice([None, "a", "b", "c"])
        fast.insert(inst, blocks, tag)
        ref.insert(inst, blocks, tag)
        # the insert may be left pending: each read, taken first, must see it applied
        probe = rng.choice(chains)
        k, count = rng.randrange(3), rng.randint(0, 90)
        reads = [lambda i: i.match(probe), lambda i: i.oldest_tags(k, count, skip=tag),
                 lambda i: i.cached_blocks(k), lambda i: list(i.evictions)]
        if step % 97 == 0:
            reads = [lambda i: (i.forget_instance(k), _state(i))]
        read = rng.choice(reads)
        assert read(fast) == read(ref)
        assert _state(fast) == _state(ref)
        assert fast.match(probe) == ref.match(probe)


def test_stop_tagging_keeps_the_index_and_refuses_tag_reads():
    """With tags off (the simulator under a policy without the lookahead) the LRUs, owners and
    evictions are those of an index that tags, no tag is kept, and ``oldest_tags`` raises
    instead of answering from tags it does not have."""
    rng = random.Random(3)
    tagged, plain = PrefixIndex(3, [40, 25, 60], 16), PrefixIndex(3, [40, 25, 60], 16)
    plain.insert(0, [1, 2, 3], "s0")
    plain.stop_tagging()
    tagged.insert(0, [1, 2, 3], "s0")
    chains = [[rng.getrandbits(60) for _ in range(rng.randint(1, 50))] for _ in range(6)]
    for _ in range(300):
        inst, chain, tag = rng.randrange(3), rng.choice(chains), rng.choice(["a", "b"])
        for idx in (tagged, plain):
            idx.insert(inst, chain, tag)
        assert tagged.match(chain) == plain.match(chain)
    tagged.flush()
    plain.flush()
    assert [list(x) for x in plain._lru] == [list(x) for x in tagged._lru]
    assert plain._owners == tagged._owners and plain.evictions == tagged.evictions
    assert plain._tags == {} and tagged._tags
    assert tagged.oldest_tags(0, 5)
    with pytest.raises(RuntimeError):
        plain.oldest_tags(0, 5)
