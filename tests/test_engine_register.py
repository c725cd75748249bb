"""Registering a run of prompt blocks in one dict update must cache what the block-by-block
loop caches: the first block of a repeated hash holds it, blocks whose hash another block
already holds stay unregistered, and block -> hash agrees with hash -> block."""

from __future__ import annotations

import pytest

from kvtop.sim.engine import Engine, EngineRequest

BS = 16


def run(e: Engine, req: EngineRequest, t: float = 0.0) -> float:
    e.add_request(req)
    for _ in range(10_000):
        if not e.has_work():
            return t
        r = e.step(t)
        t = r.end_time if not r.idle else (e.next_event_time() or t)
    raise AssertionError("engine did not finish")


def consistent(e: Engine) -> None:
    for h, b in e._cached.items():
        assert e._block_hash[b] == h
    assert sum(h is not None for h in e._block_hash) == len(e._cached)


@pytest.mark.parametrize("hashes, cached_at", [
    ([11, 12, 13, 14], {11: 0, 12: 1, 13: 2, 14: 3}),   # all new: the one-update path
    ([11, 11, 12, 13], {11: 0, 12: 2, 13: 3}),           # a hash repeated inside the run: first block wins
    ([11, 12, 12, 12], {11: 0, 12: 1}),
])
def test_run_registers_like_the_loop(hashes, cached_at):
    e = Engine("h20", block_size=BS, num_gpu_blocks=64)
    run(e, EngineRequest("a", len(hashes) * BS + 1, hashes, 1, 0.0))
    # block ids are taken from the free queue's head in order: 0, 1, 2, ...
    assert e._cached == cached_at
    consistent(e)


def test_blocks_cached_by_another_request_stay_unregistered():
    e = Engine("h20", block_size=BS, num_gpu_blocks=64)
    t = run(e, EngineRequest("a", 2 * BS + 1, [21, 22], 1, 0.0))
    before = dict(e._cached)
    # b shares a's first two blocks (hits) and adds two of its own
    run(e, EngineRequest("b", 4 * BS + 1, [21, 22, 23, 24], 1, t), t)
    assert {h: e._cached[h] for h in before} == before
    assert 23 in e._cached and 24 in e._cached
    consistent(e)
