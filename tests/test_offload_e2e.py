"""Elastic P2P offload and admission through the router to in-process `kvtop sim` instances."""

from __future__ import annotations

import asyncio
import json

import pytest
import sqlite_utils

from kvtop.sim.engine import Engine
from kvtop.sim.server import SimInstance
from kvtop.sim.server import create_app as sim_app
from router.app import STATE, Backend, RouterConfig, create_app

HEAVY = list(range(1, 3001))  # 3000 prompt tokens; offload_threshold is lowered to 1000 below
KNOBS = {"offload_mode": "simple", "offload_threshold": "1000"}


async def sims(aiohttp_server, n, speed=50.0):
    out = []
    for i in range(n):
        inst = SimInstance(Engine("h20", engine_id=f"e{i}"), model="m", speed=speed,
                           stream_interval_ms=0, engine_label=str(i))
        server = await aiohttp_server(sim_app(inst), host="127.0.0.1")
        out.append((inst, str(server.make_url("")).rstrip("/")))
    return out


async def router(router_client, urls, tmp_path, knobs, policy="sticky"):
    cfg = RouterConfig(backends=[Backend(f"i{k}", u) for k, u in enumerate(urls)], policy=policy,
                       knobs=knobs, db=str(tmp_path / "kvtop.db"), state_dir=str(tmp_path / "st"))
    client = await router_client(create_app(cfg))
    return client, client.server.app[STATE]


def rows(state, table):
    state.writer.flush()
    return list(sqlite_utils.Database(state.config.db)[table].rows)


async def start_decoding(client, session, max_tokens=4000):
    """A short prompt with a long answer: its instance is decoding while the test goes on."""
    r = await client.post("/v1/completions", headers={"X-Session-ID": session}, json={
        "prompt": [7] * 50, "max_tokens": max_tokens, "stream": True})
    assert r.status == 200
    await r.content.readline()  # first token: the instance now decodes
    return r


async def test_offloaded_request_runs_both_legs(router_client, aiohttp_server, tmp_path):
    (s0, u0), (s1, u1) = await sims(aiohttp_server, 2)
    client, state = await router(router_client, [u0, u1], tmp_path, KNOBS)
    bg = await start_decoding(client, "s")  # sticky: first turn -> i0 (fewest in flight, first)
    r = await client.post("/v1/completions", headers={"X-Session-ID": "s"},
                          json={"prompt": HEAVY, "max_tokens": 5, "stream": True,
                                "stream_options": {"include_usage": True}})
    body = (await r.read()).decode()
    assert r.status == 200 and r.headers["X-Kvtop-Instance"] == "i0"
    assert body.rstrip().endswith("data: [DONE]") and '"completion_tokens":5' in body
    await bg.read()
    # P computed the prompt and sampled one token; D pulled the KV and decoded 5 tokens
    assert s1.engine.prompt_tokens == 3000 and s1.engine.generation_tokens == 1
    assert s0.engine.generation_tokens == 4000 + 5
    assert state.cluster.counters_zero()
    d = {x["input_tokens"]: x for x in rows(state, "decisions")}[3000]
    assert (d["offload"], d["prefill_instance"], d["instance"]) == (1, "i1", "i0")
    assert (d["offload_reason"], d["route_class"]) == ("p_idle_d_busy", "HEAVY_P2P")
    assert d["t_proxy_recv"] <= d["t_prefill_sent"] <= d["t_prefill_done"]
    o = {x["request_id"]: x for x in rows(state, "outcomes")}[d["request_id"]]
    assert o["status"] == "ok" and d["t_prefill_done"] <= o["t_first_token"] <= o["t_done"]
    assert o["delivered_hit_tokens"] >= 2048  # D's prompt was served from the pulled KV
    # P's leg counted on P (routed, prefill-only), D's on D
    assert [i.routed_total for i in state.cluster.instances] == [2, 1]


async def test_failed_prefill_leg_falls_back_to_d(router_client, aiohttp_server, fake_backends, tmp_path):
    (s0, u0), = await sims(aiohttp_server, 1)
    (fake, uf), = await fake_backends(1)
    fake.fail_status = 500
    client, state = await router(router_client, [u0, uf], tmp_path, KNOBS)
    bg = await start_decoding(client, "s", max_tokens=3000)
    r = await client.post("/v1/completions", headers={"X-Session-ID": "s"},
                          json={"prompt": HEAVY, "max_tokens": 4})
    data = await r.json()
    assert r.status == 200 and r.headers["X-Kvtop-Instance"] == "i0"
    assert data["usage"]["completion_tokens"] == 4 and data.get("kv_transfer_params") is None
    await bg.read()
    assert state.cluster.counters_zero()
    d = {x["input_tokens"]: x for x in rows(state, "decisions")}[3000]
    assert (d["offload"], d["prefill_instance"], d["offload_reason"], d["route_class"]) == \
        (0, "i1", "prefill_failed", "HEAVY_COLO")
    assert state.cluster.instances[1].errors_total == 1


async def test_total_timeout_bounds_the_prefill_leg(router_client, aiohttp_server, fake_backends, tmp_path):
    # P answers only after 5 s; with --total-timeout 0.5 the leg gives up and D prefills itself
    (s0, u0), = await sims(aiohttp_server, 1)
    (fake, uf), = await fake_backends(1, first_delay=5.0)
    cfg = RouterConfig(backends=[Backend("i0", u0), Backend("i1", uf)], policy="sticky", knobs=KNOBS,
                       db=str(tmp_path / "kvtop.db"), state_dir=str(tmp_path / "st"), total_timeout_s=0.5)
    client = await router_client(create_app(cfg))
    state = client.server.app[STATE]
    bg = await start_decoding(client, "s", max_tokens=3000)
    t0 = asyncio.get_running_loop().time()
    r = await client.post("/v1/completions", headers={"X-Session-ID": "s"},
                          json={"prompt": HEAVY, "max_tokens": 4})
    assert r.status == 200 and len(fake.seen) == 1  # the leg went to P
    assert asyncio.get_running_loop().time() - t0 < 4.0  # not P's 5 s
    await bg.read()
    d = {x["input_tokens"]: x for x in rows(state, "decisions")}[3000]
    assert (d["offload"], d["offload_reason"]) == (0, "prefill_failed")


async def test_admission_queue_records_wait_and_counters_return(router_client, aiohttp_server, tmp_path):
    (s0, u0), = await sims(aiohttp_server, 1, speed=20.0)
    knobs = {"admission": "pack", "admission_budget_tokens": "2000"}
    client, state = await router(router_client, [u0], tmp_path, knobs, policy="round_robin")

    async def one(n):
        r = await client.post("/v1/completions", json={"prompt": list(range(n)), "max_tokens": 2})
        return r.status

    statuses = await asyncio.gather(one(1500), one(1500), one(300))
    assert statuses == [200, 200, 200]
    assert state.cluster.counters_zero() and state.pipeline.queue.pending(0) == 0
    waits = [x["admission_wait_ms"] for x in rows(state, "decisions")]
    assert len(waits) == 3 and max(waits) > 0  # 1500 + 1500 > 2000: someone waited


async def test_client_gone_while_waiting_releases_everything(router_client, aiohttp_server, tmp_path):
    (s0, u0), = await sims(aiohttp_server, 1, speed=0.25)  # the first prefill takes ~0.7 s
    knobs = {"admission": "fifo", "admission_budget_tokens": "1000"}
    client, state = await router(router_client, [u0], tmp_path, knobs, policy="round_robin")
    first = asyncio.create_task(client.post("/v1/completions", json={"prompt": list(range(900)),
                                                                     "max_tokens": 1}))
    await asyncio.sleep(0.05)
    waiter = asyncio.create_task(client.post("/v1/completions", json={"prompt": list(range(800)),
                                                                      "max_tokens": 1}))
    await asyncio.sleep(0.05)
    assert len(state.pipeline.queue.waiting[0]) == 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await (await first).read()
    for _ in range(50):
        if state.cluster.counters_zero():
            break
        await asyncio.sleep(0.02)
    assert state.cluster.counters_zero() and not state.pipeline.queue.waiting[0]
    assert state.cluster.instances[0].errors_total == 0  # the client left; the instance did nothing wrong
    assert "client_gone" in {x["status"] for x in rows(state, "outcomes")}


async def test_patch_knobs_takes_policy_and_feature_knobs_together(router_client, aiohttp_server, tmp_path):
    (s0, u0), = await sims(aiohttp_server, 1)
    client, state = await router(router_client, [u0], tmp_path, {"offload_mode": "cost"}, policy="unified_ab")
    assert state.slot.version == 1 and state.features.offload_mode == "cost"
    tok = next((tmp_path / "st").glob("*.token")).read_text().strip()
    hdr = {"Authorization": f"Bearer {tok}"}
    r = await client.patch("/kvtop/v1/knobs", headers=hdr,
                           json={"overload_factor": 1.7, "admission": "pack", "heavy_threshold": 30000,
                                 "offload_threshold": 25000})
    assert r.status == 200, await r.text()
    assert state.slot.version == 2 and state.slot.policy.knobs["overload_factor"] == 1.7
    assert state.features.admission == "pack" and state.features.offload_mode == "cost"
    # two thresholds, two names: unified_ab's migration threshold (input tokens) and the
    # offload threshold (new prefill tokens) move independently
    assert state.slot.policy.knobs["heavy_threshold"] == 30000
    assert state.features.knobs["offload_threshold"] == 25000 and "heavy_threshold" not in state.features.knobs
    bad = await client.patch("/kvtop/v1/knobs", headers=hdr, json={"overload_factor": 1.1, "admission": "x"})
    assert bad.status == 400 and "admission" in (await bad.json())["error"]["message"]
    assert state.slot.version == 2 and state.slot.policy.knobs["overload_factor"] == 1.7  # nothing half-applied
    ev = [x for x in rows(state, "config_events") if x["kind"] == "knobs"][-1]
    assert json.loads(ev["after"])["features"]["admission"] == "pack"
