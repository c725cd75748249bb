"""Review of the exact index's free-queue model (issue 16, docs/kv-events.md "Work queued ahead").

The passing tests pin invariants nothing else checked: over random lifecycles the model's pins,
free queue and blocks-to-allocate stay consistent with the events and return to nothing once
every request has ended. The ``xfail(strict=True)`` tests each show one bug found in review:
they fail today and will turn into XPASS (a failure) once the bug is fixed, so the fixer flips
them to plain tests. Engine truth comes from tests/kvfake.py's FakeEngineCache, which frees a
finished prompt tail first and reuses a prefix head-newest, as vLLM's free queue does.
"""

from __future__ import annotations

import copy
import random

import pytest

from kvfake import FakeEngineCache
from router.blocks import hash_token_blocks
from router.cluster import Cluster
from router.exact_index import REMOVED, ExactIndex
from router.kv_batches import decode_batch, encode_batch


def _feed(index: ExactIndex, instance: int, events):
    index.apply(instance, decode_batch(encode_batch(0.0, events))[1])


def _hit_after_queued(c: Cluster, eng: FakeEngineCache, queued: list[int], held: list[int],
                      bs: int = 16) -> tuple[int, int]:
    """Route ``queued`` to instance 0, then probe ``held`` plus a block of new tokens: (tokens
    the engine delivers once ``queued`` has run, the router's hit)."""
    c.dispatch(0, len(queued), 0, hash_token_blocks(queued, bs))
    probe = held + [7] * bs
    truth = copy.deepcopy(eng)
    truth.run(queued)
    delivered = truth.cached_prefix_blocks(probe) * bs
    return delivered, c.hits(hash_token_blocks(probe, bs), len(probe))[0]


def _cluster(capacity_blocks: int, *, block_size: int = 16, ttl: float = 0.0, clock=None) -> Cluster:
    c = Cluster(["a"], block_size=block_size, capacity_blocks=capacity_blocks,
                **({"clock": clock} if clock else {}))
    c.exact = ExactIndex(1, block_size, speculative_ttl_s=ttl)
    c.exact.set_live(0, True)
    return c


def _check_model(ex: ExactIndex, instance: int) -> None:
    """The free-queue model's own invariants, from its definitions (docs/kv-events.md)."""
    st = ex.instances[instance]
    # blocks to allocate: the distinct blocks our requests use that the engine does not hold
    assert st.unheld == sum(1 for h in st.pins if h not in st.counts)
    assert all(n > 0 for n in st.pins.values())  # a pin count of 0 is a leaked key
    assert not set(st.free) - set(st.counts)  # only held blocks can be evicted
    assert not set(st.free) & set(st.pins)  # a block one of our requests uses is not free


# -- invariants (passing) -------------------------------------------------------------------
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_model_stays_consistent_and_empties_over_random_lifecycles(seed):
    """Requests sharing prefixes start and end in random order (ok, error, before or after the
    engine ran them) while the engine stores, evicts and sometimes clears: after every step the
    pins, free queue and blocks-to-allocate agree with the events, and once every request has
    ended nothing is pinned, nothing is left to allocate and every held block is free."""
    rng = random.Random(seed)
    bs = 16
    c = _cluster(40)
    eng = FakeEngineCache(bs, capacity=40)
    ex = c.exact
    prefixes = [[rng.randrange(10_000) for _ in range(bs * rng.randrange(1, 6))] for _ in range(5)]
    live = []
    for _ in range(400):
        r = rng.random()
        if r < 0.4 or not live:
            toks = rng.choice(prefixes) + [rng.randrange(10_000) for _ in range(bs * rng.randrange(0, 4) + 3)]
            t = c.dispatch(0, len(toks), 0, hash_token_blocks(toks, bs))
            live.append((t, toks))
        elif r < 0.7:
            t, toks = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.7:
                _feed(ex, 0, eng.run(toks))  # it ran (else it ended before the engine saw it)
            c.finish(t, error=rng.random() < 0.2)
        elif r < 0.95:
            _feed(ex, 0, eng.run(rng.choice(prefixes) + [rng.randrange(10_000) for _ in range(bs)]))  # another client
        else:
            _feed(ex, 0, eng.clear())
        _check_model(ex, 0)
    for t, _ in live:
        c.finish(t)
    _check_model(ex, 0)
    st = ex.instances[0]
    assert not st.pins and ex.to_allocate(0) == 0 and c.counters_zero()
    assert set(st.free) == set(st.counts)  # nothing in use: every held block is evictable


def test_a_request_retried_elsewhere_releases_its_first_instance():
    """A failed first attempt and its retry on another instance: each instance's model is
    empty again once the request has ended (the first attempt's pins do not outlive it)."""
    c = Cluster(["a", "b"], block_size=16, capacity_blocks=100)
    c.exact = ExactIndex(2, 16, speculative_ttl_s=0)
    blocks = hash_token_blocks(list(range(160)), 16)
    first = c.dispatch(0, 160, 0, blocks)
    c.finish(first, error=True)  # 502 from a: the proxy ends attempt 1 before routing attempt 2
    second = c.dispatch(1, 160, 0, blocks)
    assert c.exact.to_allocate(0) == 0 and not c.exact.instances[0].pins
    assert c.exact.to_allocate(1) == 10
    c.finish(second)
    assert not c.exact.instances[1].pins and c.exact.to_allocate(1) == 0


# -- bugs (xfail, strict) -------------------------------------------------------------------
def test_a_request_repeating_a_block_hash_is_released_completely():
    # what should happen: pin then release of any block list leaves no pin and nothing to allocate
    ex = ExactIndex(1, 16, speculative_ttl_s=0)
    a, b = 11, 12  # router hashes; a repeat needs a collision of the chained hash (crafted input)
    ex.pin(0, [a, b, a])
    during = ex.to_allocate(0)  # today 3: the repeat counted twice
    ex.release(0, [a, b, a])
    # today: pins {a: 0} (a leaked key; a is then never free) and 2 blocks "to allocate" forever
    assert (during, dict(ex.instances[0].pins), ex.to_allocate(0)) == (2, {}, 0)


def test_another_clients_blocks_are_evicted_tail_first():
    # what should happen: the router's hit equals what the engine delivers after the queued work
    bs = 16
    c = _cluster(8)
    eng = FakeEngineCache(bs, capacity=8)
    theirs = list(range(64))  # 4 blocks, stored for another client (another router, curl, ...)
    _feed(c.exact, 0, eng.run(theirs))
    ours = list(range(1000, 1000 + 6 * bs))  # 6 blocks to allocate, room 4: 2 evicted
    assert _hit_after_queued(c, eng, ours, theirs) == (32, 32)  # the engine evicts the tail two


def test_our_blocks_reported_after_our_finish_are_evicted_tail_first():
    # what should happen: the router's hit equals what the engine delivers after the queued work
    bs = 16
    c = _cluster(8)
    eng = FakeEngineCache(bs, capacity=8)
    ours = list(range(64))
    t = c.dispatch(0, 64, 0, hash_token_blocks(ours, bs))
    events = eng.run(ours)
    c.finish(t)  # the HTTP answer is in...
    _feed(c.exact, 0, events)  # ...and the engine's batch for it comes a moment later
    queued = list(range(1000, 1000 + 6 * bs))
    assert _hit_after_queued(c, eng, queued, ours) == (32, 32)


def test_another_clients_reused_prefix_is_evicted_tail_first():
    # what should happen: the router's hit equals what the engine delivers after the queued work
    bs = 16
    c = _cluster(8)
    eng = FakeEngineCache(bs, capacity=8)
    theirs = list(range(64))
    t = c.dispatch(0, 64, 0, hash_token_blocks(theirs, bs))  # ours first: freed tail first
    _feed(c.exact, 0, eng.run(theirs))
    c.finish(t)
    _feed(c.exact, 0, eng.run(theirs + [5] * 3))  # another client reuses the 4 blocks
    ours = list(range(1000, 1000 + 6 * bs))
    assert _hit_after_queued(c, eng, ours, theirs) == (32, 32)


def test_a_text_hashed_request_still_evicts_on_the_engine():
    # what should happen: the exact hit does not exceed what the engine delivers once the text
    # request queued ahead has allocated its blocks
    bs = 16
    c = _cluster(8)
    eng = FakeEngineCache(bs, capacity=8)
    toks = list(range(64))
    t = c.dispatch(0, 64, 0, hash_token_blocks(toks, bs))
    _feed(c.exact, 0, eng.run(toks))
    c.finish(t)  # 4 blocks held and free, room 4
    text_prompt = list(range(5000, 5000 + 6 * bs))  # the engine tokenizes it: 6 new blocks
    c.dispatch(0, len(text_prompt), 0, list(range(900, 906)), exact=False)
    probe = toks + [7] * bs
    truth = copy.deepcopy(eng)
    truth.run(text_prompt)
    delivered = truth.cached_prefix_blocks(probe) * bs
    assert delivered == 32
    assert c.hits(hash_token_blocks(probe, bs), len(probe))[0] <= delivered
    assert c.exact.instances[0].anon == 6
    c.first_token(c._prefilling[0][next(iter(c._prefilling[0]))])  # its prefill is over: held now
    assert c.exact.instances[0].anon == 0


def test_a_failed_request_leaves_no_speculative_hit():
    # what should happen: once the request has ended with nothing stored, its blocks are no hit
    now = [100.0]
    c = _cluster(100, ttl=2.0, clock=lambda: now[0])
    toks = list(range(160))
    blocks = hash_token_blocks(toks, 16)
    t = c.dispatch(0, 160, 0, blocks)
    assert c.hits(blocks, 160) == [144]  # just routed: speculated, as designed
    now[0] += 0.1
    c.finish(t, error=True)  # e.g. HTTP 400 (prompt too long) or connection refused
    now[0] += 0.1
    assert c.hits(blocks, 160) == [0]


def test_a_resync_keeps_the_blocks_a_running_request_uses():
    # what should happen: blocks pinned by a request in flight survive drop_unseen_since_mark
    ex = ExactIndex(1, 16, speculative_ttl_s=0)
    eng = FakeEngineCache(16)
    long_running = list(range(64))
    blocks = hash_token_blocks(long_running, 16)
    ex.pin(0, blocks)
    _feed(ex, 0, eng.run(long_running))  # prefilled, now decoding for a while
    ex.mark_turnover(0)  # a gap nobody could fill
    for k in range(20):  # a cache's worth of other prompts
        _feed(ex, 0, eng.run(list(range(10_000 + 100 * k, 10_064 + 100 * k))))
    ex.drop_unseen_since_mark(0)
    assert ex.hits_by_walk(0, blocks) == 4 and ex.to_allocate(0) == 0


def test_open_router_blocks_take_engine_room():
    # what should happen: the router's hit does not exceed what the engine delivers
    rbs, ebs = 32, 16  # m = 2 (the default --block-size 512 over GPU vLLM's 16 is m = 32)
    c = _cluster(4, block_size=rbs)  # 4 router blocks = 8 engine blocks
    eng = FakeEngineCache(ebs, capacity=8)
    old = list(range(64))  # 2 router blocks (4 engine blocks)
    newer = list(range(500, 548))  # 1 router block + an open half (3 engine blocks)
    for toks in (old, newer):
        t = c.dispatch(0, len(toks), 0, hash_token_blocks(toks, rbs))
        _feed(c.exact, 0, eng.run(toks))
        c.finish(t)
    queued = list(range(2000, 2064))  # 2 router blocks to allocate: the engine has 1 engine block empty
    c.dispatch(0, len(queued), 0, hash_token_blocks(queued, rbs))
    probe = old + [7] * rbs
    truth = copy.deepcopy(eng)
    truth.run(queued)
    delivered = truth.cached_prefix_blocks(probe) * ebs // rbs * rbs
    assert delivered == 0
    assert c.hits(hash_token_blocks(probe, rbs), len(probe))[0] <= delivered


def test_drift_compares_the_estimate_with_the_hit_the_router_uses():
    # what should happen: drift = |estimate - exact hit used for the decision|
    c = _cluster(16)
    toks = list(range(160))
    blocks = hash_token_blocks(toks, 16)
    eng = FakeEngineCache(16)
    t = c.dispatch(0, 160, 0, blocks)
    _feed(c.exact, 0, eng.run(toks))
    c.finish(t)
    big = list(range(5000, 5000 + 63 * 16))
    c.dispatch(0, len(big), 0, hash_token_blocks(big, 16))  # evicts all 10 (exact) and the estimate's too
    view = c.view(blocks, 160, None)
    assert view.hits == [0] and view.estimate_hits == [0]  # they agree
    assert c.exact.instances[0].drift_tokens == 0


def test_survivors_reads_places_not_a_set_of_the_queue():
    # survivors() compares each matched block's place in the free queue with the evicted-th
    # place (one C-level skip over the values, no set of every doomed block): same answer as the
    # set-based definition, for any number evicted, with blocks held by a request in the way
    n = 5_000
    ex = ExactIndex(1, 1, speculative_ttl_s=0)
    ex.store(0, list(range(n)), None, list(range(n)), 1)  # n one-token blocks, one chain
    req = hash_token_blocks(list(range(n)), 1)
    ex.pin(0, req[100:200])  # a request of ours holds a middle run: never in the queue
    free = ex.instances[0].free
    for evicted in (0, 1, 17, 100, 2_500, 4_899, 4_900, 10_000):
        doomed = set(list(free)[:evicted])
        want = next((k for k, b in enumerate(req) if b in doomed), len(req))
        assert ex.survivors(0, req, len(req), evicted) == want, evicted


@pytest.mark.parametrize("ending", ["ok", "prefill_failed", "client_gone_during_prefill_leg"])
def test_p2p_offload_legs_release_their_pins(ending):
    """An offloaded request pins its blocks on P (the prefill leg) and on D: P's pins go when
    its leg ends, ok or failed, D's when the request ends, and a client that leaves during the
    prefill leg releases both."""
    from router.core import RoutingCore
    from router.features import Features
    from router.pipeline import OK, Pipeline
    from router.policies import build_policy
    from router.request import RouteRequest

    class Sink:
        def decision(self, d):
            pass

        def outcome(self, d, o):
            pass

    c = Cluster(["a", "b"], block_size=16, capacity_blocks=1000, clock=lambda: 0.0)
    c.exact = ExactIndex(2, 16, speculative_ttl_s=0)
    busy = c.dispatch(0, 32, 0, [1, 2])
    c.first_token(busy)  # a is decoding: a heavy request routed there is offloaded to idle b
    core = RoutingCore(c, build_policy("round_robin", {}), clock=lambda: 0.0)
    feats = Features.build({"offload_mode": "simple", "offload_threshold": 1000})
    pipe = Pipeline(core, lambda: feats, Sink(), clock=lambda: 0.0)
    toks = list(range(2000))
    flow = pipe.receive(RouteRequest("r", "s", "header", len(toks), hash_token_blocks(toks, 16),
                                     "tokens", "completions", True, 1))
    leg = pipe.route(flow)
    assert (leg.kind, leg.instance, flow.decision.instance) == ("prefill", 1, 0)
    ex = c.exact
    assert ex.to_allocate(0) == 2 + 125 and ex.to_allocate(1) == 125
    pipe.sent(flow)
    if ending == "client_gone_during_prefill_leg":
        pipe.abandon(flow, "during the prefill leg")
    else:
        pipe.prefill_done(flow, {"remote": 1} if ending == "ok" else None)
        assert not ex.instances[1].pins and ex.to_allocate(1) == 0  # P's leg is over
        pipe.sent(flow)
        pipe.first_token(flow)
        pipe.finish(flow, OK, output_tokens=1)
    c.finish(busy)
    for i in (0, 1):
        assert not ex.instances[i].pins and ex.to_allocate(i) == 0
    assert c.counters_zero()


async def test_a_live_router_releases_every_pin_whatever_ends_the_request(router_client, fake_backends, tmp_path):
    """Through the real HTTP path with events flowing: an answered request, one retried after
    a 500, one failing on both instances, and a stream the client drops after its first
    chunk. Once all have ended, no block is pinned and nothing is left to allocate anywhere."""
    import aiohttp

    from kvfake import FakePublisher, connected, wait_for
    from router import kv_events
    from router.app import STATE, Backend, RouterConfig, create_app

    fakes = await fake_backends(2, token_delay=0.05)
    pubs = [FakePublisher(), FakePublisher()]
    cfg = RouterConfig(backends=[Backend(f"i{k}", u, kv_events=p.endpoint, kv_replay=p.replay_endpoint)
                                 for k, ((_, u), p) in enumerate(zip(fakes, pubs))],
                       policy="round_robin", block_size=16, db=None, state_dir=str(tmp_path / "state"),
                       health_interval_s=0)
    client = await router_client(create_app(cfg))
    state = client.server.app[STATE]
    ex = state.cluster.exact
    try:
        for s, p in zip(state.kv_subscribers, pubs):
            await connected(s, p)
        await wait_for(lambda: all(s.state == kv_events.EXACT for s in state.kv_subscribers))
        prompt = list(range(100, 100 + 16 * 20))
        r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert r.status == 200
        fakes[0][0].fail_status = 500
        statuses = [(await client.post("/v1/completions", json={"prompt": prompt + [k], "max_tokens": 2})).status
                    for k in range(2)]
        assert statuses == [200, 200]  # one of them went to i0 first and was retried on i1
        fakes[1][0].fail_status = 500
        r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert r.status == 500  # both attempts failed (the retry's answer is relayed)
        fakes[0][0].fail_status = fakes[1][0].fail_status = None
        async with aiohttp.ClientSession() as http:  # a client that leaves mid-stream
            async with http.post(client.router.url + "/v1/completions",
                                 json={"prompt": prompt, "max_tokens": 50, "stream": True}) as resp:
                await resp.content.readany()
        await wait_for(lambda: state.cluster.in_flight == 0)
        assert state.counts["retries"] >= 2 and state.cluster.counters_zero()
        for i in (0, 1):
            assert not ex.instances[i].pins and ex.to_allocate(i) == 0
    finally:
        for p in pubs:
            await p.close()


def test_an_engine_restarted_with_another_block_size_is_indexed_again():
    # what should happen: after the restart (a clear), the new engine's blocks are indexed
    ex = ExactIndex(1, 32, speculative_ttl_s=0)
    toks = list(range(128))
    _feed(ex, 0, FakeEngineCache(16).run(toks))
    assert ex.hits_by_walk(0, hash_token_blocks(toks, 32)) == 4
    _feed(ex, 0, FakeEngineCache(16).clear())  # the engine restarts (the subscriber clears the index)
    _feed(ex, 0, FakeEngineCache(32).run(toks))  # ...now with --block-size 32
    assert ex.hits_by_walk(0, hash_token_blocks(toks, 32)) == 4 and ex.instances[0].skipped == 0


def test_an_engine_seen_holding_more_than_the_configured_capacity_has_room():
    # what should happen: the events prove the engine is bigger than configured; the router does
    # not project evictions from the configured capacity then (delivered hit is the whole prefix)
    bs = 16
    c = _cluster(8)  # --capacity-tokens 128, the engine really holds 100 blocks
    eng = FakeEngineCache(bs, capacity=100)
    held = list(range(12 * bs))
    t = c.dispatch(0, len(held), 0, hash_token_blocks(held, bs))
    _feed(c.exact, 0, eng.run(held))
    c.finish(t)
    assert c.exact.cached_blocks(0) == 12  # more than the 8 configured
    queued = list(range(5000, 5000 + 2 * bs))
    c.dispatch(0, len(queued), 0, hash_token_blocks(queued, bs))
    probe = held + [7] * bs
    truth = copy.deepcopy(eng)
    truth.run(queued)
    delivered = truth.cached_prefix_blocks(probe) * bs
    assert delivered == 12 * bs
    assert c.hits(hash_token_blocks(probe, bs), len(probe)) == [delivered]


def test_an_instance_without_kv_events_is_not_modelled():
    # only instances that publish events are pinned, speculated or reserved: the others would
    # pay the model's work per request (~4 ms per 200k-token prompt at block size 16) for nothing
    from types import SimpleNamespace

    from router.kv_wiring import attach_index

    backends = [SimpleNamespace(kv_events="tcp://127.0.0.1:1"), SimpleNamespace(kv_events=None)]
    c2 = Cluster(["a", "b"], block_size=16, capacity_blocks=100)
    ex = attach_index(c2, backends)
    assert ex.published_mask == 0b01
    blocks = hash_token_blocks(list(range(160)), 16)
    t0 = c2.dispatch(0, 160, 0, blocks)
    t1 = c2.dispatch(1, 160, 0, blocks)
    assert t0.pinned and not t1.pinned
    assert ex.to_allocate(0) == 10 and ex.to_allocate(1) == 0 and not ex.instances[1].pins
    c2.finish(t0)
    c2.finish(t1)
    assert not ex.instances[0].pins and ex.to_allocate(0) == 0


def test_free_queue_places_grow_along_its_order():
    # survivors() compares places: after any mix of stores (own and foreign, reused, repeated
    # hashes in one event), releases and removals, the places grow in the queue's order
    rng = random.Random(3)
    ex = ExactIndex(1, 16, speculative_ttl_s=0)
    eng = FakeEngineCache(16, capacity=40)
    live: list[list[int]] = []
    for step in range(300):
        toks = [rng.randrange(50) for _ in range(16 * rng.randrange(1, 6))]
        blocks = hash_token_blocks(toks, 16)
        if rng.random() < 0.5:
            ex.pin(0, blocks)
            live.append(blocks)
        _feed(ex, 0, eng.run(toks))
        if live and rng.random() < 0.5:
            ex.release(0, live.pop(rng.randrange(len(live))))
        places = list(ex.instances[0].free.values())
        assert places == sorted(places) and len(set(places)) == len(places), step
