"""Hostile backends: outlier detection on real traffic, and a backend that accepts and never answers.

A backend whose /health answers 200 while its completions fail looks idle to load-aware
policies, so without outlier detection it draws most first attempts (132 of 200 once, under
``unified``). Everything runs on 127.0.0.1 and is bounded in time.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import sqlite_utils

from router.app import STATE, Backend, RouterConfig, create_app


async def start(router_client, urls, tmp_path, **kw):
    cfg = RouterConfig(backends=[Backend(f"i{k}", u) for k, u in enumerate(urls)],
                       db=str(tmp_path / "kvtop.db"), state_dir=str(tmp_path / "state"), **kw)
    client = await router_client(create_app(cfg))
    return client, client.server.app[STATE]


async def completion(client, k: int) -> int:
    async with client.post("/v1/completions", headers={"X-Session-ID": f"s{k % 7}"},
                           json={"prompt": list(range(k % 50, k % 50 + 64)), "max_tokens": 2,
                                 "stream": True}) as r:
        await r.read()
        return r.status


async def test_backends_failing_real_traffic_are_ejected_and_return(router_client, fake_backends, tmp_path):
    fakes = await fake_backends(3)
    for fake, _ in fakes[1:]:
        fake.fail_status = 500  # /health stays 200
    client, state = await start(router_client, [u for _, u in fakes], tmp_path, policy="unified",
                                health_interval_s=0.1, outlier_consecutive=5, outlier_ejection_s=0.5)
    statuses = [await completion(client, k) for k in range(200)]
    warm = statuses[20:]
    assert sum(s != 200 for s in warm) / len(warm) < 0.02, statuses
    state.writer.flush()
    db = sqlite_utils.Database(state.config.db)
    events = [json.loads(e["after"]) for e in db["config_events"].rows_where("kind = 'health'")]
    ejected = {e["instance"] for e in events if not e["healthy"] and "ejected" in (e["reason"] or "")}
    assert ejected == {"i1", "i2"}
    # each was ejected within 5 failures in a row: no bad instance saw a 6th attempt before it
    outs = list(db.query("select instance, status from outcomes order by id"))
    for name in ("i1", "i2"):
        mine = [o["status"] for o in outs if o["instance"] == name]
        assert mine[:5] == ["upstream_error"] * 5, mine[:8]
    assert all(i.ejections_total >= 1 for i in state.cluster.instances[1:])
    async with client.get("/kvtop/v1/state") as r:
        snap = await r.json()
    assert snap["instances"][1]["health"]["ejections"] >= 1
    async with client.get("/metrics") as r:
        metrics = await r.text()
    assert 'kvtop_instance_ejections_total{instance="i1"}' in metrics
    # they recover: after the ejection and a good probe they are back on trial and serve
    for fake, _ in fakes[1:]:
        fake.fail_status = None
    deadline = time.monotonic() + 10
    while not all(i.healthy for i in state.cluster.instances):
        assert time.monotonic() < deadline, [(i.name, i.healthy) for i in state.cluster.instances]
        await asyncio.sleep(0.05)
    seen_before = [len(f.seen) for f, _ in fakes]
    for k in range(30):
        assert await completion(client, 1000 + k) == 200
    assert all(len(f.seen) > n for (f, _), n in zip(fakes[1:], seen_before[1:]))
    assert state.cluster.counters_zero()


async def test_ejection_keeps_one_instance_in(router_client, fake_backends, tmp_path):
    fakes = await fake_backends(2)
    for fake, _ in fakes:
        fake.fail_status = 500
    client, state = await start(router_client, [u for _, u in fakes], tmp_path, health_interval_s=0,
                                outlier_consecutive=2, outlier_ejection_s=30)
    for k in range(20):
        # the backend's own 500 after a retry, or 502 once no other instance is left to retry on
        assert await completion(client, k) in (500, 502)
    assert sum(i.ejected for i in state.cluster.instances) == 1
    assert sum(i.healthy for i in state.cluster.instances) == 1


async def test_a_backend_that_accepts_and_never_answers_is_retried_within_the_first_byte_timeout(
        router_client, fake_backends, tmp_path):
    async def silent(reader, writer):
        await reader.read(65536)  # take the request, never answer
        await asyncio.sleep(60)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    dead = "http://127.0.0.1:%d" % server.sockets[0].getsockname()[1]
    fakes = await fake_backends(1)
    try:
        client, state = await start(router_client, [dead, fakes[0][1]], tmp_path, policy="round_robin",
                                    health_interval_s=0, first_byte_timeout_s=0.5)
        t0 = time.monotonic()
        for k in range(4):
            assert await completion(client, k) == 200
        took = time.monotonic() - t0
        assert took < 4 * 0.5 + 2.0, took  # at most one first-byte timeout per request
        state.writer.flush()
        outs = list(sqlite_utils.Database(state.config.db).query("select instance, status from outcomes"))
        assert {"instance": "i0", "status": "timeout"} in outs
        assert state.cluster.counters_zero()
    finally:
        server.close()
