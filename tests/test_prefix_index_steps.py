"""The prefix index's pending insert, applied in steps by the live router so that a cold
215k-token turn's insert (13,000 blocks added, as many evicted) never holds the event loop in
one piece: stepping must leave exactly what one insert leaves, a read in the middle must see
the whole insert, and the loop must run other work between two steps."""

from __future__ import annotations

import asyncio
import random

import pytest

from router.prefix_index import PrefixIndex
from router.state import _Steps
from test_prefix_index import brute_match as _walk  # match the slow way, block by block


def _state(idx: PrefixIndex):
    return ([list(lru) for lru in idx._lru], dict(idx._owners), dict(idx._tags), list(idx._evictions))


def _workload(seed: int):
    """Chains that grow turn by turn (returning), new chains (cold), and lists that are not
    chains (a foreign hash in the middle, a repeat at the end), on 3 instances of 6,000 blocks,
    past their capacity."""
    rng = random.Random(seed)
    sessions: dict[int, list[int]] = {}
    out = []
    for k in range(60):
        s = rng.randrange(10)
        chain = sessions.setdefault(s, [])
        if len(chain) > 2_500:
            chain.clear()
            s += 100 * k
        chain += [s * 1_000_000 + len(chain) + j for j in range(rng.choice((3, 40, 400, 1_500)))]
        blocks = list(chain)
        if k % 9 == 4:
            blocks.insert(len(blocks) // 2, 7_000_000 + k)
            if k % 2:
                blocks.append(blocks[0])
        out.append((rng.randrange(3), blocks, f"s{s}"))
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("step", [1, 64, 500])
def test_stepped_insert_leaves_what_one_insert_leaves(seed, step):
    whole, stepped = PrefixIndex(3, 6_000, 16), PrefixIndex(3, 6_000, 16)
    for inst, blocks, tag in _workload(seed):
        whole.insert(inst, blocks, tag)
        whole.flush()
        stepped.insert(inst, blocks, tag)
        steps = 0
        while not stepped.flush_step(step):
            steps += 1
            assert steps <= len(blocks) // step + 3  # bounded, and it ends
        assert _state(stepped) == _state(whole)
    assert sum(whole.evictions) > 0


def test_a_read_between_steps_sees_a_whole_insert_of_the_first_blocks():
    stepped = PrefixIndex(2, 10_000, 16)
    old = list(range(100_000, 108_000))
    stepped.insert(0, old, "old")
    stepped.flush()
    cold = list(range(4_000))  # 4,000 added, 2,000 of "old" evicted
    stepped.insert(0, cold, "new")
    assert not stepped.flush_step(1_000)  # begun: nothing applied yet
    assert not stepped.flush_step(1_000) and not stepped.flush_step(1_000)
    assert stepped.match(cold) == _walk(stepped, cold) == [2_000, 0]  # the reads do not wait
    assert stepped.match(old) == _walk(stepped, old) == [8_000, 0]  # nothing evicted yet
    whole = PrefixIndex(2, 10_000, 16)
    for blocks, tag in ((old, "old"), (cold[:2_000], "new")):
        whole.insert(0, blocks, tag)
    assert stepped.match(old) == whole.match(old) and stepped.cached_blocks(0) == whole.cached_blocks(0)
    # another request's insert in between: applied at once, the stepped one goes on after it
    other = list(range(500_000, 500_300))
    stepped.insert(1, other, "other")
    assert stepped.match(other) == [0, 300]
    while not stepped.flush_step(1_000):
        pass
    for chain in (cold, old, other):
        assert stepped.match(chain) == _walk(stepped, chain)
    assert stepped.match(cold) == [4_000, 0] and stepped.evictions == [2_000, 0]


def test_flush_applies_the_rest_at_once():
    idx, whole = PrefixIndex(1, 50_000, 16), PrefixIndex(1, 50_000, 16)
    chain = list(range(20_000))
    for i in (idx, whole):
        i.insert(0, chain[:5_000], "s")
        i.flush()
        i.insert(0, chain, "s")  # 5,000 held, 15,000 added
    idx.flush_step(1_000)
    idx.flush_step(1_000)
    assert idx.match(chain) == [6_000]  # begun (its held prefix touched), then one step
    idx.flush()
    whole.flush()
    assert _state(idx) == _state(whole) and idx.flush_step()


async def test_background_steps_let_the_loop_run_between_them():
    order: list[str] = []
    left = [4]

    def step() -> bool:
        order.append("step")
        left[0] -= 1
        return left[0] == 0

    bg = _Steps()
    loop = asyncio.get_running_loop()
    bg(step)
    bg(step)  # already stepping: not started twice
    loop.call_soon(order.append, "other")
    for _ in range(10):
        await asyncio.sleep(0)
    assert order.count("step") == 4 and order.index("other") < 3 and bg.active == []


def test_a_step_never_evicts_the_chains_own_head():
    idx = PrefixIndex(1, 3_000, 16)
    idx.insert(0, list(range(900_000, 903_000)), "old")  # the instance full
    idx.flush()
    chain = list(range(2_500))
    idx.insert(0, chain, "s")
    for _ in range(3):  # begun, then 1,000 of the chain added, 1,000 old blocks evicted
        assert not idx.flush_step(500)
    assert idx.match(chain) == [1_000]
    other = list(range(500_000, 501_800))  # another request: 1,800 more old blocks go
    idx.insert(0, other, "o")
    assert idx.match(other) == [1_800] and idx.match(chain) == [1_000]
    # the next 500 would evict 300 of the chain's first blocks: the rest is applied whole
    assert idx.flush_step(500)
    assert idx.match(chain) == _walk(idx, chain) == [2_500]
    assert idx.match(other) == _walk(idx, other)
