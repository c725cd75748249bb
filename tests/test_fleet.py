"""A living fleet: cordon, drain and uncordon instances while traffic flows (router/fleet.py).

The rules as a table, then the control API against a real router on 127.0.0.1 with fake vLLM
backends: a drain mid-traffic, cordon, a previous_response_id pinned to a draining instance,
the audit rows and the metrics.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import sqlite_utils

from router.app import STATE, Backend, RouterConfig, create_app
from router.control import CONTROL
from router.fleet import ACTIVE, CORDONED, DRAINING, Fleet, FleetError

TOKEN = "fleet-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}", "X-Kvtop-User": "ops"}


# -- the rules, pure ------------------------------------------------------------------------------

@pytest.mark.parametrize("before,action,after", [
    (ACTIVE, "cordon", CORDONED),
    (ACTIVE, "drain", DRAINING),
    (ACTIVE, "uncordon", ACTIVE),  # nothing to do: no change, no audit row
    (CORDONED, "drain", DRAINING),  # a cordon deepened into a drain
    (CORDONED, "uncordon", ACTIVE),
    (DRAINING, "cordon", CORDONED),  # a drain called off, new sessions still kept away
    (DRAINING, "uncordon", ACTIVE),
])
def test_transitions(before, action, after):
    f = Fleet(3)
    f.states[1] = before
    f._reindex()
    c = f.apply(f.plan(1, action), 10.0)
    assert (c.before, c.after, f.states[1]) == (before, after, after)
    assert f.since[1] == (10.0 if before != after else None)


def test_closed_to_keeps_cordoned_instance_for_its_own_sessions():
    f = Fleet(4)
    assert f.closed_to(None) == ()
    f.apply(f.plan(1, "cordon"), 0.0)
    f.apply(f.plan(2, "drain"), 0.0)
    assert sorted(f.closed_to(None)) == [1, 2]  # a new session: neither
    assert sorted(f.closed_to(3)) == [1, 2]  # a session bound elsewhere does not move onto a cordoned one
    assert f.closed_to(1) == (2,)  # a session bound to the cordoned instance keeps going there
    assert sorted(f.closed_to(2)) == [1, 2]  # ... but not one bound to the draining one: it moves


@pytest.mark.parametrize("action", ["cordon", "drain"])
def test_last_active_instance_needs_force(action):
    f = Fleet(2)
    f.apply(f.plan(0, "cordon"), 0.0)
    with pytest.raises(FleetError) as exc:
        f.plan(1, action)
    assert exc.value.status == 409 and "no active instance" in exc.value.message
    assert f.plan(1, action, force=True).after != ACTIVE


def test_bad_action_and_instance():
    f = Fleet(2)
    with pytest.raises(FleetError) as exc:
        f.plan(0, "evict")
    assert exc.value.status == 400 and "cordon, drain, uncordon" in exc.value.message
    with pytest.raises(FleetError) as exc:
        f.plan(5, "drain")
    assert exc.value.status == 404


def test_offload_never_prefills_on_a_draining_instance():
    """The fleet's exclusion reaches every leg: the offload's prefill instance P too."""
    from router.build import build_router
    from router.lifecycle import Arrived, FirstToken, LegSent
    from router.request import RouteRequest
    from router.settings import Settings

    class Sink:
        def decision(self, d): pass

        def outcome(self, d, o): pass

    def req(k, session, blocks):
        ids = [hash((k, b)) for b in range(blocks)]  # no cache hit between requests: each prefills all
        return RouteRequest(f"r{k}", session, "header", blocks * 16, ids, "tokens", "completions", True, 4)

    r = build_router(Settings.parse("sticky", {"offload_mode": "simple", "offload_threshold": 32}),
                     ["a", "b", "c"], Sink(), block_size=16, capacity_blocks=640, clock=lambda: 0.0)
    life = r.lifecycle
    busy = life.receive(req(0, "s0", 1))  # s0 on a, decoding: a heavy turn of s0 would offload
    life.step(busy, Arrived())
    life.step(busy, LegSent())
    life.step(busy, FirstToken())
    life.step(life.receive(req(1, "s1", 1)), Arrived())  # s1 on b, still prefilling: c is the idlest peer
    heavy = req(2, "s0", 20)
    assert r.pipeline.core.decide(heavy).instance == 0
    r.fleet.apply(r.fleet.plan(2, "drain"), 0.0)
    flow = life.receive(heavy)
    life.step(flow, Arrived())
    assert flow.decision.instance == 0 and flow.decision.extra.get("prefill_instance") != "c"
    assert all(leg.instance != 2 for leg in flow.legs)
    r.fleet.apply(r.fleet.plan(2, "uncordon"), 0.0)  # the same request with c open: P is c
    again = life.receive(req(3, "s0", 20))
    life.step(again, Arrived())
    assert again.decision.extra.get("prefill_instance") == "c"


# -- over HTTP ------------------------------------------------------------------------------------

async def start(router_client, fake_backends, tmp_path, n=3, policy="sticky", **kw):
    fakes = await fake_backends(n, token_delay=0.05)
    kw.setdefault("control_token", TOKEN)
    cfg = RouterConfig(backends=[Backend(f"i{k}", u) for k, (_, u) in enumerate(fakes)], policy=policy,
                       db=str(tmp_path / "kvtop.db"), state_dir=str(tmp_path / "state"),
                       scrape_interval_s=0.2, **kw)
    client = await router_client(create_app(cfg))
    return client, client.server.app[STATE], [f for f, _ in fakes]


async def turn(client, session: str, text: str, max_tokens: int = 4) -> tuple[int, str | None]:
    r = await client.post("/v1/completions", json={"model": "m", "prompt": text, "stream": True,
                                                  "max_tokens": max_tokens}, headers={"X-Session-ID": session})
    await r.read()
    return r.status, r.headers.get("X-Kvtop-Instance")


async def until(cond, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


def config_rows(state) -> list[dict]:
    state.writer.flush()
    return [r for r in sqlite_utils.Database(state.config.db)["config_events"].rows if r["kind"] == "fleet"]


async def test_drain_mid_traffic(router_client, fake_backends, tmp_path):
    client, state, fakes = await start(router_client, fake_backends, tmp_path)
    sessions = [f"s{k}" for k in range(6)]
    texts = {s: f"{s} says hello " * 30 for s in sessions}
    # turn 1 together: sticky places each new session on the instance with fewest requests
    first = await asyncio.gather(*(turn(client, s, texts[s]) for s in sessions))
    assert all(status == 200 for status, _ in first)
    home = {s: state.cluster.sessions[s].instance for s in sessions}
    on_i1 = [s for s in sessions if home[s] == 1]
    assert len(on_i1) == 2

    # turn 2: long streams; drain i1 while its two are in flight
    second = asyncio.gather(*(turn(client, s, texts[s] * 2, max_tokens=20) for s in sessions))
    await until(lambda: state.cluster.instances[1].num_requests == 2)
    r = await client.post("/kvtop/v1/fleet/i1/drain", headers=AUTH)
    assert r.status == 200, await r.text()
    body = await r.json()
    assert body["before"] == ACTIVE and body["after"] == DRAINING and body["changed"]
    assert body["drain"] == {"sessions_homed": 2, "in_flight": 2, "drained": False}
    seen_at_drain = len(fakes[1].seen)
    # a new session arriving during the drain goes elsewhere
    status, where = await turn(client, "newcomer", "a new session " * 30)
    assert status == 200 and where != "i1"
    assert all(status == 200 for status, _ in await second)  # in-flight requests finished

    snap = await (await client.get("/kvtop/v1/state")).json()
    i1 = snap["instances"][1]
    assert i1["fleet_state"] == DRAINING and i1["drain"] == {"sessions_homed": 2, "in_flight": 0, "drained": True}
    assert [i["fleet_state"] for i in snap["instances"]] == [ACTIVE, DRAINING, ACTIVE]

    # turns 3 and 4: each of i1's sessions moves once, at its next turn, and stays moved
    for k in (3, 4):
        results = await asyncio.gather(*(turn(client, s, texts[s] * k) for s in sessions))
        assert all(status == 200 and where != "i1" for status, where in results)
        for s in sessions:
            assert state.cluster.sessions[s].moves == (1 if s in on_i1 else 0), (k, s)
    assert len(fakes[1].seen) == seen_at_drain  # not one new request once drained
    listing = await (await client.get("/kvtop/v1/fleet")).json()
    i1 = listing["instances"][1]
    assert i1["drain"] == {"sessions_homed": 0, "in_flight": 0, "drained": True} and i1["sessions_homed"] == 0
    assert listing["counts"] == {"active": 2, "cordoned": 0, "draining": 1, "removed": 0}
    assert state.cluster.counters_zero()

    metrics = await (await client.get("/metrics")).text()
    assert 'kvtop_instance_fleet_state{instance="i1",state="draining"} 1.0' in metrics
    assert 'kvtop_instance_fleet_state{instance="i1",state="active"} 0.0' in metrics
    assert 'kvtop_instance_drain_sessions_homed{instance="i1"} 0.0' in metrics
    assert 'kvtop_instance_queue_seconds{instance="i0"} 0.0' in metrics

    # uncordon: i1 takes new sessions again (idle, it is the least loaded)
    r = await client.post("/kvtop/v1/fleet/i1/uncordon", headers=AUTH)
    assert (await r.json())["after"] == ACTIVE
    r = await client.post("/kvtop/v1/fleet/i1/uncordon", headers=AUTH)  # again: nothing changes
    assert (await r.json())["changed"] is False
    rows = config_rows(state)
    assert [(json.loads(r["before"])["state"], json.loads(r["after"])["state"]) for r in rows] == [
        (ACTIVE, DRAINING), (DRAINING, ACTIVE)]
    assert {r["who"] for r in rows} == {"ops"} and json.loads(rows[0]["after"])["instance"] == "i1"


async def test_cordon_keeps_bound_sessions_and_refuses_new_ones(router_client, fake_backends, tmp_path):
    client, state, fakes = await start(router_client, fake_backends, tmp_path, n=2)
    assert (await turn(client, "a", "alpha " * 40))[1] == "i0"  # idle fleet: sticky takes the first
    r = await client.post("/kvtop/v1/fleet/i0/cordon", headers=AUTH)
    assert (await r.json())["after"] == CORDONED
    for k in range(3):  # the session bound there keeps going there; new sessions do not
        assert await turn(client, "a", "alpha " * (40 + k)) == (200, "i0")
        assert await turn(client, f"new{k}", f"new {k} " * 40) == (200, "i1")
    assert state.cluster.sessions["a"].moves == 0
    await client.post("/kvtop/v1/fleet/i0/uncordon", headers=AUTH)
    assert await turn(client, "later", "later " * 40) == (200, "i0")  # idle fleet: ties go to the first again
    assert state.cluster.counters_zero()


async def test_previous_response_pinned_to_draining_instance_is_refused_as_unhealthy(
        router_client, fake_backends, tmp_path):
    client, state, _ = await start(router_client, fake_backends, tmp_path, n=2, policy="round_robin")
    r = await client.post("/v1/responses", json={"input": "hello " * 40, "max_output_tokens": 2})
    rid, inst = (await r.json())["id"], r.headers["X-Kvtop-Instance"]
    assert (await client.post(f"/kvtop/v1/fleet/{inst}/drain", headers=AUTH)).status == 200
    r = await client.post("/v1/responses", json={"input": "next", "previous_response_id": rid})
    body = await r.json()
    assert r.status == 503 and rid in body["error"]["message"] and inst in body["error"]["message"]
    assert "draining" in body["error"]["message"]
    assert state.cluster.counters_zero()


async def test_draining_the_last_instance_needs_force(router_client, fake_backends, tmp_path):
    client, state, _ = await start(router_client, fake_backends, tmp_path, n=1)
    r = await client.post("/kvtop/v1/fleet/i0/drain", headers=AUTH)
    assert r.status == 409 and "force" in (await r.json())["error"]["message"]
    assert config_rows(state) == []  # refused: nothing changed, nothing audited
    r = await client.post("/kvtop/v1/fleet/i0/drain", headers=AUTH, json={"force": True})
    assert r.status == 200
    status, _ = await turn(client, "x", "x " * 40)
    assert status == 503
    assert state.cluster.counters_zero()


@pytest.mark.parametrize("path,headers,body,status,words", [
    ("/kvtop/v1/fleet/i0/drain", {}, None, 401, "Bearer"),  # no token
    ("/kvtop/v1/fleet/i9/drain", AUTH, None, 404, "unknown instance 'i9'; known: i0, i1"),
    ("/kvtop/v1/fleet/i0/evict", AUTH, None, 400, "unknown fleet action"),
    ("/kvtop/v1/fleet/i0/drain", AUTH, {"forse": True}, 400, "force"),
    ("/kvtop/v1/fleet/i0/drain", AUTH, {"force": "yes"}, 400, "force"),
])
async def test_bad_fleet_calls(router_client, fake_backends, tmp_path, path, headers, body, status, words):
    client, state, _ = await start(router_client, fake_backends, tmp_path, n=2)
    r = await client.post(path, headers=headers, json=body) if body is not None else \
        await client.post(path, headers=headers)
    assert r.status == status
    assert words in (await r.json())["error"]["message"]
    assert state.router.fleet.states == [ACTIVE, ACTIVE]


async def test_readonly_router_refuses_fleet_changes(router_client, fake_backends, tmp_path):
    client, state, _ = await start(router_client, fake_backends, tmp_path, n=2, control_readonly=True)
    r = await client.post("/kvtop/v1/fleet/i0/cordon", headers=AUTH)
    assert r.status == 403
    assert state.router.fleet.states == [ACTIVE, ACTIVE]


# -- add and remove --------------------------------------------------------------------------------

async def test_live_fleet_add_two_drain_one_remove_it(router_client, fake_backends, tmp_path):
    """The issue's scenario: under steady agentic traffic, add two instances, drain one of the
    first, remove it once drained: no client error, the drained instance gets nothing new, each
    of its sessions moves once, the counters end at zero, and config_events holds each change."""
    client, state, fakes = await start(router_client, fake_backends, tmp_path, n=2)
    spare = await fake_backends(2, token_delay=0.05)
    sessions = [f"s{k}" for k in range(8)]
    statuses: list[int] = []
    where: dict[str, list[str]] = {s: [] for s in sessions}
    stop = asyncio.Event()

    async def agent(s: str) -> None:
        k = 0
        while not stop.is_set():
            k += 1
            status, inst = await turn(client, s, f"{s} turn " * (30 + 5 * k), max_tokens=6)
            statuses.append(status)
            where[s].append(inst)
            await asyncio.sleep(0.02)  # think time

    agents = [asyncio.ensure_future(agent(s)) for s in sessions]
    await until(lambda: all(len(w) >= 2 for w in where.values()))
    for k, (_, url) in enumerate(spare):
        r = await client.post("/kvtop/v1/fleet", headers=AUTH, json={"backend": f"new{k}={url}"})
        assert r.status == 200, await r.text()
        assert (await r.json())["index"] == 2 + k
    on_i0 = {s for s in sessions if state.cluster.sessions[s].instance == 0}
    assert on_i0
    r = await client.post("/kvtop/v1/fleet/i0/drain", headers=AUTH)
    assert r.status == 200
    seen_at_drain = len(fakes[0].seen)
    turns_at_drain = {s: len(where[s]) for s in sessions}
    await until(lambda: all(len(w) >= turns_at_drain[s] + 2 for s, w in where.items()))
    await until(lambda: state.cluster.instances[0].num_requests == 0)
    r = await client.post("/kvtop/v1/fleet/i0/remove", headers=AUTH)
    assert r.status == 200, await r.text()
    await until(lambda: all(len(w) >= turns_at_drain[s] + 4 for s, w in where.items()))
    stop.set()
    await asyncio.gather(*agents)

    assert statuses and set(statuses) == {200}  # zero client errors
    assert len(fakes[0].seen) == seen_at_drain  # nothing new once drained
    for s in sessions:
        after = where[s][turns_at_drain[s] + 1:]  # the turn in flight at the drain may have been on i0
        assert "i0" not in after, s
        assert state.cluster.sessions[s].moves == (1 if s in on_i0 else 0), s
    assert len(spare[0][0].seen) + len(spare[1][0].seen) > 0  # the new instances took work
    assert state.cluster.counters_zero()
    snap = await (await client.get("/kvtop/v1/state")).json()
    assert [(i["name"], i["fleet_state"]) for i in snap["instances"]] == [
        ("i0", "removed"), ("i1", "active"), ("new0", "active"), ("new1", "active")]
    assert snap["instances"][0]["healthy"] is False and 0 not in state.health.tasks
    tel = client.server.app[CONTROL].tel
    scrapes = tel.instances[0].scrape_errors_total, tel.instances[0].scraped_at
    await asyncio.sleep(0.5)  # scrape_interval_s 0.2: two rounds, neither touches the removed instance
    assert (tel.instances[0].scrape_errors_total, tel.instances[0].scraped_at) == scrapes
    assert tel.instances[2].scrape_errors_total > 0  # the added ones are scraped (fakes have no /metrics)
    rows = config_rows(state)
    assert [json.loads(r["after"])["action"] for r in rows] == ["add", "add", "drain", "remove"]
    assert json.loads(rows[0]["after"])["url"] == spare[0][1]


async def test_remove_needs_a_drain_and_a_removed_name_can_come_back(router_client, fake_backends, tmp_path):
    client, state, fakes = await start(router_client, fake_backends, tmp_path, n=2)
    long_turn = asyncio.ensure_future(turn(client, "a", "alpha " * 40, max_tokens=30))
    await until(lambda: state.cluster.instances[0].num_requests == 1)
    r = await client.post("/kvtop/v1/fleet/i0/remove", headers=AUTH)
    assert r.status == 409 and "1 requests are in flight there; drain it" in (await r.json())["error"]["message"]
    await client.post("/kvtop/v1/fleet/i0/drain", headers=AUTH)
    assert (await long_turn)[0] == 200
    r = await client.post("/kvtop/v1/fleet/i0/remove", headers=AUTH)
    assert r.status == 200 and (await r.json())["after"] == "removed"
    r = await client.post("/kvtop/v1/fleet/i0/uncordon", headers=AUTH)
    assert r.status == 409 and "add it again" in (await r.json())["error"]["message"]
    assert await turn(client, "b", "beta " * 40) == (200, "i1")
    # back under its name, at another URL: the same place, active, empty
    other = await fake_backends(1, token_delay=0.05)
    r = await client.post("/kvtop/v1/fleet", headers=AUTH, json={"backend": f"i0={other[0][1]}"})
    body = await r.json()
    assert r.status == 200 and body["index"] == 0 and body["fleet_state"] == "active"
    assert state.cluster.instances[0].url == other[0][1] and state.cluster.instances[0].healthy
    assert state.cluster.index.cached_blocks(0) == 0
    assert await turn(client, "c", "gamma " * 40) == (200, "i0")  # idle, first: sticky's pick
    assert len(other[0][0].seen) == 1 and len(fakes[0].seen) == 1
    assert state.cluster.counters_zero()


@pytest.mark.parametrize("body,status,words", [
    ({"backend": "i1=http://127.0.0.1:1"}, 409, "i1 (http://127.0.0.1:1) is in the fleet already"),
    ({"backend": "ftp://x"}, 400, "backend 'ftp://x': expected http://HOST:PORT"),
    ({"backend": "n=http://127.0.0.1:1@kv=tcp://127.0.0.1:5557"}, 400, "follows no KV events"),
    ({"url": "http://127.0.0.1:1"}, 400, "expected a JSON object"),
])
async def test_bad_adds_change_nothing(router_client, fake_backends, tmp_path, body, status, words):
    client, state, _ = await start(router_client, fake_backends, tmp_path, n=2)
    if "i1=" in body.get("backend", ""):
        state.cluster.instances[1].url = "http://127.0.0.1:1"  # a URL the test knows
    r = await client.post("/kvtop/v1/fleet", headers=AUTH, json=body)
    assert r.status == status and words in (await r.json())["error"]["message"]
    assert len(state.cluster.instances) == 2 and len(state.router.fleet.states) == 2
    assert config_rows(state) == []


# -- kvtop fleet, the CLI -------------------------------------------------------------------------

async def test_cli_drain_waits_and_lists(router_client, fake_backends, tmp_path, capsys):
    from kvtop.cli import main

    # no token given: the CLI finds the router and its generated token as `kvtop attach` does
    client, state, fakes = await start(router_client, fake_backends, tmp_path, n=2, control_token=None)
    sd = str(tmp_path / "state")
    assert (await turn(client, "a", "alpha " * 40))[1] == "i0"
    long_turn = asyncio.ensure_future(turn(client, "a", "alpha " * 50, max_tokens=30))  # 1.5 s on i0
    await until(lambda: state.cluster.instances[0].num_requests == 1)
    rc = await asyncio.to_thread(main, ["fleet", "drain", "i0", "--wait", "10", "--state-dir", sd])
    out = capsys.readouterr().out
    assert rc == 0 and long_turn.done() and (await long_turn)[0] == 200
    assert "i0: active -> draining; in flight: 1, sessions homed: 1" in out
    assert "i0: drained" in out
    assert await turn(client, "a", "alpha " * 60) == (200, "i1")  # it moved at its next turn
    rc = await asyncio.to_thread(main, ["fleet", "list", "--state-dir", sd])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0 and out[0].split()[:2] == ["INSTANCE", "STATE"]
    assert out[1].split()[:5] == ["i0", "draining", "(drained)", "yes", "0"]
    assert out[2].split()[:5] == ["i1", "active", "yes", "0", "1"]
    # then it leaves the fleet, and another instance joins
    other = await fake_backends(1, token_delay=0.05)
    assert await asyncio.to_thread(main, ["fleet", "remove", "i0", "--state-dir", sd]) == 0
    assert await asyncio.to_thread(main, ["fleet", "add", f"i2={other[0][1]}", "--state-dir", sd]) == 0
    out = capsys.readouterr().out
    assert "i0: draining -> removed" in out and "i2: added, active" in out
    assert [s.name for s in state.cluster.instances] == ["i0", "i1", "i2"]
    rows = config_rows(state)
    assert len(rows) == 3 and all(r["who"].startswith("kvtop-fleet:") for r in rows)


@pytest.mark.parametrize("argv,words", [
    (["fleet", "drain"], "needs an instance name"),
    (["fleet", "add"], "needs a backend"),
    (["fleet", "add", "i0=http://127.0.0.1:1"], "is in the fleet already"),
    (["fleet", "list", "i0"], "takes no instance"),
    (["fleet", "cordon", "i0", "--wait", "5"], "--wait S goes with drain"),
    (["fleet", "drain", "i7"], "unknown instance 'i7'; known: i0, i1"),
    (["fleet", "uncordon", "i0", "--token-file", "/nonexistent/token"], "cannot read token file"),
])
async def test_cli_errors_are_one_line(router_client, fake_backends, tmp_path, capsys, argv, words):
    from kvtop.cli import main

    await start(router_client, fake_backends, tmp_path, n=2, control_token=None)
    rc = await asyncio.to_thread(main, argv + ["--state-dir", str(tmp_path / "state")])
    err = capsys.readouterr().err
    assert rc == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_cli_without_a_router(tmp_path, capsys):
    from conftest import free_port
    from kvtop.cli import main

    rc = main(["fleet", "list", "--router", f"127.0.0.1:{free_port()}", "--state-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot reach the router" in err


async def test_added_instance_follows_its_kv_events_and_removal_stops_them(router_client, fake_backends, tmp_path):
    """An instance added with @kv= is followed like one given at start: its events make its hits
    exact; removed, its subscriber stops and the exact index forgets it."""
    from kvfake import FakeEngineCache, FakePublisher, connected, wait_for
    from router import kv_events

    bs = 16
    pubs = [FakePublisher(), FakePublisher()]
    try:
        fakes = await fake_backends(2, token_delay=0.0)
        cfg = RouterConfig(backends=[Backend("i0", fakes[0][1], kv_events=pubs[0].endpoint)], policy="leastwork",
                           block_size=bs, db=str(tmp_path / "kv.db"), control_token=TOKEN,
                           state_dir=str(tmp_path / "state"), kv_speculative_ttl_s=0)
        client = await router_client(create_app(cfg))
        state = client.server.app[STATE]
        spec = f"i1={fakes[1][1]}@kv={pubs[1].endpoint}@kv-replay={pubs[1].replay_endpoint}"
        r = await client.post("/kvtop/v1/fleet", headers=AUTH, json={"backend": spec})
        assert r.status == 200, await r.text()
        sub = state.kv_subscribers[1]
        await connected(sub, pubs[1])
        prompt = list(range(50, 50 + bs * 40))
        pubs[1].publish(FakeEngineCache(bs).run(prompt))  # i1's engine already holds it
        await wait_for(lambda: sub.state == kv_events.EXACT and sub.stats.batches >= 1)
        r = await client.post("/v1/completions", json={"prompt": prompt + [1, 2], "max_tokens": 2})
        assert r.status == 200 and r.headers["X-Kvtop-Instance"] == "i1"
        snap = (await (await client.get("/kvtop/v1/state")).json())["instances"]
        assert snap[1]["index_source"] == "exact" and snap[1]["kv_events"]["router_blocks"] == 40
        await client.post("/kvtop/v1/fleet/i1/drain", headers=AUTH)
        r = await client.post("/kvtop/v1/fleet/i1/remove", headers=AUTH)
        assert r.status == 200, await r.text()
        assert state.kv_subscribers[1] is None and sub.state == kv_events.STOPPED
        ex = state.cluster.exact
        assert not ex.is_live(1) and not ex.published_mask >> 1 & 1 and ex.cached_blocks(1) == 0
        assert state.cluster.counters_zero()
    finally:
        for p in pubs:
            await p.close()


async def test_forced_remove_fails_over_what_is_in_flight(router_client, fake_backends, tmp_path):
    """A forced remove with requests in flight: a non-streaming one (nothing reached its client)
    is retried on another instance and answered; a stream already relaying ends with the
    documented mid-stream error; each attempt has its outcome row; no ticket leaks."""
    client, state, fakes = await start(router_client, fake_backends, tmp_path, n=2, policy="sticky")
    assert (await turn(client, "a", "alpha " * 40))[1] == "i0"
    assert (await turn(client, "b", "beta " * 40))[1] == "i0"  # idle again: sticky's first
    fakes[0].token_delay = 0.2  # i0 slows down: both next turns are still running at the remove

    async def plain(session, text):
        r = await client.post("/v1/completions", json={"model": "m", "prompt": text, "max_tokens": 20},
                              headers={"X-Session-ID": session})
        return r.status, r.headers.get("X-Kvtop-Instance"), await r.read()

    async def stream(session, text):
        r = await client.post("/v1/completions", json={"model": "m", "prompt": text, "stream": True,
                                                      "max_tokens": 40}, headers={"X-Session-ID": session})
        return r.status, await r.read()

    quiet = asyncio.ensure_future(plain("a", "alpha " * 50))
    streaming = asyncio.ensure_future(stream("b", "beta " * 50))
    await until(lambda: state.cluster.instances[0].num_requests == 2)
    await asyncio.sleep(0.3)  # the stream has relayed its first tokens
    r = await client.post("/kvtop/v1/fleet/i0/remove", headers=AUTH)
    assert r.status == 409 and "send force" in (await r.json())["error"]["message"]
    r = await client.post("/kvtop/v1/fleet/i0/remove", headers=AUTH, json={"force": True})
    assert r.status == 200 and (await r.json())["after"] == "removed"
    status, where, _ = await quiet
    assert (status, where) == (200, "i1")  # retried elsewhere
    status, body = await streaming
    assert status == 200 and b"failed mid-stream" in body  # its head was sent: it ends with the error event
    await until(lambda: state.cluster.in_flight == 0)
    assert state.cluster.counters_zero()
    state.writer.flush()
    db = sqlite_utils.Database(state.config.db)
    outcomes = {(o["request_id"], o["attempt"]): o["status"] for o in db["outcomes"].rows}
    decisions = {(d["request_id"], d["attempt"]) for d in db["decisions"].rows}
    assert set(outcomes) == decisions  # every attempt has its outcome: none lost from the log
    assert sorted(outcomes.values()).count("ok") == 3  # two turns before, the retried one after
    assert len(decisions) == 5  # 2 before + quiet's 2 attempts + the stream's 1
    assert state.cluster.instances[0].num_requests == 0 and not state.cluster._prefilling[0]
    # nothing reaches it again, and the next turns of its sessions go to i1
    assert await turn(client, "b", "beta " * 60) == (200, "i1")
