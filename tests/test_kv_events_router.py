"""KV events inside the router: decisions record ``index_source``, the control API shows the
subscribers, and two routers fed by the same events agree on every instance's hits."""

from __future__ import annotations

import random

import sqlite_utils

from kvfake import FakeEngineCache, FakePublisher, connected, wait_for
from router import kv_events, kv_wiring
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
        # exact from the start (an empty replay), so wait for the published batches themselves
        await wait_for(lambda: all(s.stats.batches >= 1 for s in subs))
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
    subs = [await kv_wiring.start_subscribers(r.cluster, backends, capacity_tokens=BS * 400) for r in routers]
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
            await kv_wiring.stop_subscribers(g)
        for p in pubs:
            await p.close()


# -- end to end with kvtop sim publishing ---------------------------------------------------
async def _sim_fleet(n, blocks):
    import asyncio

    from kvtop.sim.engine import Engine
    from kvtop.sim.kv_publisher import KvEventPublisher
    from kvtop.sim.server import SimInstance, serve

    insts = []
    for _ in range(n):
        eng = Engine("h20", num_gpu_blocks=blocks)
        inst = SimInstance(eng, model="sim-model", port=0, speed=1000.0)
        inst.kv_publisher = KvEventPublisher(eng, port=0, replay_port=0)
        insts.append(inst)
    ready = asyncio.Event()
    task = asyncio.get_running_loop().create_task(serve(insts, on_ready=lambda _: ready.set()))
    await ready.wait()
    return insts, task


async def _replay_sessions(client, rng, n_requests):
    sessions = {}
    for rid in range(n_requests):
        sid = f"s{rng.randrange(8)}"
        prev = sessions.get(sid, [])
        prompt = prev + [rng.randrange(30_000) for _ in range(rng.randrange(100, 600))]
        sessions[sid] = prompt
        r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2},
                              headers={"X-Session-ID": sid})
        assert r.status == 200, await r.text()
        await r.read()
        import asyncio
        await asyncio.sleep(0.02)  # the engine's events reach the router (they left before the answer)


async def _hit_error(router_client, tmp_path, name, kv: bool):
    import asyncio

    insts, task = await _sim_fleet(2, blocks=400)  # 6,400 tokens each: 8 sessions do not fit
    try:
        backends = [Backend(f"i{k}", f"http://127.0.0.1:{inst.port}",
                            kv_events=inst.kv_publisher.endpoint if kv else None,
                            kv_replay=inst.kv_publisher.replay_endpoint if kv else None)
                    for k, inst in enumerate(insts)]
        cfg = RouterConfig(backends=backends, policy="leastwork", block_size=BS, capacity_tokens=400 * BS,
                           db=str(tmp_path / f"{name}.db"), state_dir=str(tmp_path / f"state-{name}"))
        client = await router_client(create_app(cfg))
        state = client.server.app[STATE]
        if kv:
            # the publishers' first batch is sequence 0: warm the SUB connections before traffic
            await asyncio.sleep(0.3)
        await _replay_sessions(client, random.Random(5), 80)
        dec = {d["request_id"]: d for d in _rows(state, "decisions")}
        out = _rows(state, "outcomes")
        assert len(out) == 80 and all(o["status"] == "ok" for o in out)
        err = sum(abs(dec[o["request_id"]]["est_hit_tokens"] - o["delivered_hit_tokens"]) for o in out)
        total = sum(o["input_tokens"] for o in out)
        sources = {d["index_source"] for d in dec.values()}
        subs = [s.snapshot() for s in state.kv_subscribers if s is not None]
        return err / total, sources, subs, sum(o["delivered_hit_tokens"] for o in out) / total
    finally:
        task.cancel()
        try:
            await task
        except BaseException:
            pass


async def test_kvtop_sim_events_make_hits_exact_under_capacity_pressure(router_client, tmp_path):
    """The same 80-request replay (8 growing sessions, 2 instances that hold about 2 sessions
    each): with kvtop sim's events the router's estimated hit equals the delivered cached
    tokens within 1% of prompt tokens; the estimate alone is further off."""
    exact_err, sources, subs, apc = await _hit_error(router_client, tmp_path, "events", kv=True)
    assert sources == {"exact"}
    assert all(s["state"] == "exact" and s["gaps"] == 0 and s["batches"] > 0 for s in subs), subs
    # every request has ended: nothing pinned or still to allocate in the free-queue model
    assert all(s["pinned_blocks"] == 0 and s["queued_blocks"] == 0 and s["free_blocks"] > 0
               for s in subs), subs
    assert all(s["blocks_removed"] > 0 for s in subs)  # the engines did evict
    est_err, est_sources, _, _ = await _hit_error(router_client, tmp_path, "estimate", kv=False)
    assert est_sources == {"estimate"}
    print(f"hit error: events {exact_err:.4%}, estimate {est_err:.4%} of prompt tokens; APC {apc:.1%}")
    assert exact_err <= 0.01, (exact_err, est_err)
    assert est_err > exact_err
