"""router/body.py: large bodies kept as chunks, handed to the parser's worker process through
one reused memory file (real process, real mmap)."""

import asyncio
import hashlib
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from router.body import COPY_STEP, GROW_STEP, ArenaRef, Chunks, Handoff, as_bytes, fetch

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd_create is Linux-only")


def _digest(raw, tag):
    """In the worker: what arrived, as (tag, length, sha256)."""
    data = fetch(raw)
    return tag, len(data), hashlib.sha256(data).hexdigest(), isinstance(raw, ArenaRef)


def test_chunks_join_once_and_keep_their_length():
    parts = [b"a" * 10, b"b" * 5, b"c"]
    c = Chunks(list(parts), 16)
    assert len(c) == 16
    joined = c.join()
    assert joined == b"".join(parts)
    assert c.join() is joined and c.parts == [joined]
    assert as_bytes(c) is joined and as_bytes(b"xy") == b"xy"


async def test_bodies_cross_byte_for_byte_and_the_buffer_grows_and_is_reused():
    loop = asyncio.get_running_loop()
    handoff = Handoff()
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        small = os.urandom(3 * 1024 * 1024)
        # chunks of uneven sizes, one of them bigger than a copy step
        big_parts = [os.urandom(65536) for _ in range(100)] + [os.urandom(COPY_STEP + 12345), b"}"]
        big = Chunks(big_parts, sum(map(len, big_parts)))
        larger = os.urandom(GROW_STEP + 1)  # past the first buffer: it grows, the worker re-maps
        for tag, raw in (("small", small), ("big", big), ("larger", larger), ("small-again", small)):
            got = await handoff.run(loop, pool, _digest, raw, tag)
            want = as_bytes(raw)
            assert got == (tag, len(want), hashlib.sha256(want).hexdigest(), True)
        assert len(handoff._map) == 2 * GROW_STEP  # grown once, by whole steps, never shrunk
        # several at once: each waits for the buffer, none sees another's bytes
        bodies = [os.urandom(1_000_000 + k) for k in range(6)]
        results = await asyncio.gather(*(handoff.run(loop, pool, _digest, b, k) for k, b in enumerate(bodies)))
        for k, b in enumerate(bodies):
            assert results[k] == (k, len(b), hashlib.sha256(b).hexdigest(), True)
    finally:
        pool.shutdown()
        handoff.close()
    assert handoff._map is None and handoff._fd is None


async def test_without_memfd_the_body_is_pickled_as_before():
    loop = asyncio.get_running_loop()
    handoff = Handoff()
    handoff.available = False
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        parts = [b"x" * 1000, b"y" * 7]
        got = await handoff.run(loop, pool, _digest, Chunks(parts, 1007), "p")
        assert got == ("p", 1007, hashlib.sha256(b"".join(parts)).hexdigest(), False)
    finally:
        pool.shutdown()
        handoff.close()


async def test_freed_memory_is_given_back_once_no_body_is_held():
    from router.body import MemoryReturn

    calls = []
    mem = MemoryReturn(interval_s=0.05)
    mem._trim = lambda pad: calls.append(pad) or 1
    mem.body_done(1000, 0)  # a small body: nothing to give back
    await asyncio.sleep(0.1)
    assert calls == []
    mem.body_done(COPY_STEP, 5 * COPY_STEP)  # a large one, but others are still held: later
    await asyncio.sleep(0.1)
    assert calls == []
    mem.body_done(10, 0)  # the last body let go: now, once
    mem.body_done(10, 0)
    for _ in range(100):
        if mem.trims:
            break
        await asyncio.sleep(0.01)
    assert calls == [0] and mem.trims == 1
    mem.body_done(COPY_STEP, 0)  # the next one waits out the interval, then trims again
    await asyncio.sleep(0.2)
    assert calls == [0, 0]
