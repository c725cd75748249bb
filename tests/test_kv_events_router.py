"""KV events inside the router: decisions record ``index_source``, the control API shows the
subscribers, and two routers fed by the same events agree on every instance's hits."""

from __future__ import annotations

import random

import sqlite_utils

from kvfake import FakeEngineCache, FakePublisher, connected, wait_for
from router import kv_events
from router.app import STATE, Backend, RouterConfig, create_app
from router.blocks import hash_token_blocks
from router.request import RouteRequest
from router.state import RouterState

BS = 16


def _rows(state, table):
    state.writer.flush()
    return list(sqlite_utils.Database(state.config.db)[table].rows)


async def test_decisions_record_exact_hits_from_events(router_client, fake_backends, tmp_path):
    fakes = await fake_backends(2)
    pubs = [FakePublisher(), FakePublisher()]
    cfg = RouterConfig(backends=[Backend(f"i{k}", u, kv_events=p.endpoint, kv_replay=p.replay_endpoint)
                                 for k, ((_, u), p) in enumerate(zip(fakes, pubs))],
                       policy="leastwork", block_size=BS, db=str(tmp_path / "kvtop.db"),
                       state_dir=str(tmp_path / "state"), kv_speculative_ttl_s=0)
    client = await router_client(create_app(cfg))
    state = client.server.app[STATE]
    try:
        subs = state.kv_subscribers
        for s, p in zip(subs, pubs):
            await connected(s, p)
        # i1's engine already served this prompt; the router never routed it anywhere
        prompt = list(range(50, 50 + BS * 40))
        engine = FakeEngineCache(BS)
        pubs[1].publish(engine.run(prompt))
        pubs[0].publish(FakeEngineCache(BS).run(list(range(9000, 9000 + BS * 4))))
        await wait_for(lambda: all(s.state == kv_events.EXACT for s in subs))
        r = await client.post("/v1/completions", json={"prompt": prompt + [1, 2, 3], "max_tokens": 2})
        assert r.status == 200 and r.headers["X-Kvtop-Instance"] == "i1"
        # a text prompt's hashes cannot match engine events: it routes on the estimate
        r2 = await client.post("/v1/completions", json={"prompt": "hello " * 100, "max_tokens": 2})
        assert r2.status == 200
        rows = _rows(state, "decisions")
        assert [(d["index_source"], d["est_hit_tokens"]) for d in rows] == [("exact", BS * 40), ("estimate", 0)]
        snap = (await (await client.get("/kvtop/v1/state")).json())["instances"]
        assert [i["index_source"] for i in snap] == ["exact", "exact"]
        ev = snap[1]["kv_events"]
        assert ev["state"] == "exact" and ev["last_seq"] == 0 and ev["gaps"] == 0
        assert ev["router_blocks"] == 40 and ev["engine_block_size"] == BS
        assert ev["drift"]["samples"] >= 1 and ev["drift"]["tokens"] == BS * 40  # the estimate said 0
    finally:
        for p in pubs:
            await p.close()


async def test_instances_without_events_stay_on_the_estimate(router_client, fake_backends, tmp_path):
    fakes = await fake_backends(2)
    pub = FakePublisher()
    cfg = RouterConfig(backends=[Backend("i0", fakes[0][1], kv_events=pub.endpoint), Backend("i1", fakes[1][1])],
                       policy="leastwork", block_size=BS, db=None, state_dir=str(tmp_path / "state"))
    client = await router_client(create_app(cfg))
    state = client.server.app[STATE]
    try:
        assert state.kv_subscribers[1] is None
        snap = (await (await client.get("/kvtop/v1/state")).json())["instances"]
        assert [i["index_source"] for i in snap] == ["estimate", "estimate"]  # i0: nothing came yet
        assert snap[0]["kv_events"]["state"] == "waiting" and snap[1]["kv_events"] is None
    finally:
        await pub.close()


def _request(tokens, rid):
    return RouteRequest(request_id=str(rid), session_id=f"s{rid}", session_source="header",
                        input_tokens=len(tokens), blocks=hash_token_blocks(tokens, BS),
                        token_source="tokens", endpoint="completions", stream=False, max_tokens=1)


async def test_two_routers_on_the_same_events_agree(tmp_path):
    """Two routers subscribed to the same three engines: for 1,000 random requests both give
    the same hit on every instance, and that hit is what the engine's cache would give."""
    rng = random.Random(11)
    pubs = [FakePublisher() for _ in range(3)]
    engines = [FakeEngineCache(BS, capacity=cap) for cap in (60, 120, 400)]
    backends = [Backend(f"i{k}", f"http://127.0.0.1:{1 + k}", kv_events=p.endpoint) for k, p in enumerate(pubs)]
    routers = [RouterState(RouterConfig(backends=backends, block_size=BS, db=None, kv_speculative_ttl_s=0,
                                        capacity_tokens=BS * 400))
               for _ in range(2)]
    subs = [await kv_events.start_subscribers(r.cluster, backends, capacity_tokens=BS * 400) for r in routers]
    try:
        for group in subs:
            for s, p in zip(group, pubs):
                await connected(s, p)
        sessions = [[rng.randrange(30_000) for _ in range(BS * rng.randrange(2, 12))] for _ in range(40)]

        def prompt():
            base = rng.choice(sessions)
            return base[:rng.randrange(len(base) + 1)] + [rng.randrange(30_000) for _ in range(rng.randrange(0, 80))]

        for _ in range(300):  # the engines serve traffic the routers never saw (other clients)
            k = rng.randrange(3)
            pubs[k].publish(engines[k].run(prompt()))
        await wait_for(lambda: all(s.expected == p.seq for g in subs for s, p in zip(g, pubs)))
        assert all(s.state == kv_events.EXACT for g in subs for s in g)
        for rid in range(1000):
            toks = prompt() + [1]
            req = _request(toks, rid)
            views = [r.core.view(req).hits for r in routers]
            assert views[0] == views[1]
            cap = (len(toks) - 1) // BS * BS
            assert views[0] == [min(e.cached_prefix_blocks(toks) * BS, cap) for e in engines]
    finally:
        for g in subs:
            await kv_events.stop_subscribers(g)
        for p in pubs:
            await p.close()
