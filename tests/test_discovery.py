"""Discovery (router/discovery.py, router/discovery_dns.py): a watched backends file and DNS names
apply their edits to a running router through the fleet's own operations, within 2 s; a bad
answer changes nothing and says why. Against a real file, and a real DNS server (dnslib) on
loopback."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest
import sqlite_utils

from router.app import STATE, Backend, RouterConfig, create_app
from router.discovery import DiscoveryError, Reconciler, Status, parse_backends_file
from router.fleet import ACTIVE, DRAINING, REMOVED, Fleet

TOKEN = "discovery-token-0123456789"


# -- the file's format ---------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("", []),
    ("# the fleet\n\n  a=http://10.0.0.1:8000  # first\n", [("a", "http://10.0.0.1:8000")]),
    # unnamed: named by host:port, so its name does not depend on its line
    ("http://10.0.0.2:8000/\n", [("10.0.0.2:8000", "http://10.0.0.2:8000")]),
    ("http://[::1]:8000\n", [("[::1]:8000", "http://[::1]:8000")]),
    ("b=http://h:1@gpu=2@kv=tcp://h:5557\n", [("b", "http://h:1")]),
])
def test_file_format(text, expected):
    assert [(b.name, b.url) for b in parse_backends_file(text)] == expected


@pytest.mark.parametrize("text,words", [
    ("a=http://h:1\na=http://h:2\n", "line 2: the name a is on line 1 already"),
    ("a=http://h:1\nb=http://h:1\n", "line 2: http://h:1 is on line 1 already"),
    ("a=ftp://h:1\n", "line 1: 'a=ftp://h:1': expected http://HOST:PORT"),
    ("a=http://h:1 b=http://h:2\n", "line 1: one backend a line"),
    ("a=http://h:1@gpu=x\n", "line 1: 'a=http://h:1@gpu=x': @gpu= needs an integer"),
])
def test_bad_file_says_which_line(text, words):
    with pytest.raises(DiscoveryError) as exc:
        parse_backends_file(text, "f.txt")
    assert words in str(exc.value) and str(exc.value).startswith("f.txt line")


# -- the reconciler, pure ------------------------------------------------------------------------

class Inst:
    def __init__(self, index, name, url):
        self.index, self.name, self.url, self.num_requests = index, name, url, 0


def b(name, port):
    return Backend(name, f"http://h:{port}")


@pytest.mark.parametrize("owned,fleet,desired,ops", [
    # a new line: added
    (["a"], {"a": 1}, ["a", "c"], [("add", "c")]),
    # a line gone: drained (removed later, once idle)
    (["a", "c"], {"a": 1, "c": 3}, ["a"], [("drain", "c")]),
    # a line whose URL changed: the old one drains, the new one waits for its name
    (["a", "c"], {"a": 1, "c": 3}, ["a", ("c", 4)], [("wait", "c"), ("drain", "c")]),
    # an instance given by --backend that the file names too, at the same URL: adopted, no change
    ([], {"x": 9}, ["x"], [("adopt", "x")]),
    # a cordoned instance the file drops: drained too
    (["a", "c"], {"a": 1, "c": (3, "cordon")}, ["a"], [("drain", "c")]),
])
def test_plan(owned, fleet, desired, ops):
    insts, f = [], Fleet(0)
    for name, port in fleet.items():
        action = None
        if isinstance(port, tuple):
            port, action = port
        insts.append(Inst(f.add(0.0), name, f"http://h:{port}"))
        if action:
            f.apply(f.plan(insts[-1].index, action), 0.0)
    ports = {"a": 1, "c": 3, "x": 9}
    rec = Reconciler(Status("file", "f"), [b(n, ports[n]) for n in owned])
    want = [b(*d) if isinstance(d, tuple) else b(d, ports.get(d, 3)) for d in desired]
    assert [(o.kind, o.name) for o in rec.plan(want, f, insts)] == ops


def test_an_entry_back_while_its_instance_drains_is_uncordoned():
    insts, f = [Inst(0, "a", "http://h:1"), Inst(1, "c", "http://h:3")], Fleet(2)
    f.apply(f.plan(1, "drain"), 0.0)
    rec = Reconciler(Status("file", "f"), [b("a", 1)])
    rec.leaving["c"] = 0.0  # the file dropped c: it drains
    assert [(o.kind, o.name) for o in rec.plan([b("a", 1), b("c", 3)], f, insts)] == [("uncordon", "c")]
    # back at another URL: it waits for the old one to leave
    assert [(o.kind, o.name) for o in rec.plan([b("a", 1), b("c", 4)], f, insts)] == [("wait", "c")]


@pytest.mark.parametrize("owned,fleet,desired,words", [
    # the file names an instance someone else put there, at another URL
    (["a"], {"a": 1, "x": 9}, ["a", ("x", 8)], "x (http://h:9) is in the fleet already, not from this file"),
    # a URL another instance holds
    (["a"], {"a": 1, "x": 9}, ["a", ("y", 9)], "x (http://h:9) is in the fleet already"),
    # emptying the fleet
    (["a"], {"a": 1}, [], "would leave no active instance"),
])
def test_plan_refuses_and_changes_nothing(owned, fleet, desired, words):
    insts, f = [], Fleet(0)
    for name, port in fleet.items():
        insts.append(Inst(f.add(0.0), name, f"http://h:{port}"))
    rec = Reconciler(Status("file", "f"), [b(n, fleet[n]) for n in owned])
    with pytest.raises(DiscoveryError) as exc:
        rec.plan([b(*d) if isinstance(d, tuple) else b(d, fleet[d]) for d in desired], f, insts)
    assert words in str(exc.value)
    assert f.states == [ACTIVE] * len(insts) and list(rec.owned) == owned


# -- a watched file, live ------------------------------------------------------------------------

async def until(cond, timeout_s: float):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if cond():
            return time.monotonic() - t0
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within {timeout_s} s")


def fleet_rows(state):
    state.writer.flush()
    return [r for r in sqlite_utils.Database(state.config.db)["config_events"].rows if r["kind"] == "fleet"]


async def turn(client, session, text):
    r = await client.post("/v1/completions", json={"model": "m", "prompt": text, "max_tokens": 3},
                          headers={"X-Session-ID": session})
    await r.read()
    return r.status, r.headers.get("X-Kvtop-Instance")


async def test_backends_file_edits_apply_within_2s(router_client, fake_backends, tmp_path, caplog):
    fakes = await fake_backends(3, token_delay=0.01)
    path = tmp_path / "backends.txt"
    path.write_text(f"# fleet\na={fakes[0][1]}\nb={fakes[1][1]}\n")
    found = parse_backends_file(path.read_text())
    cfg = RouterConfig(backends=found, policy="leastwork", db=str(tmp_path / "kvtop.db"),
                       state_dir=str(tmp_path / "state"), control_token=TOKEN, backends_file=str(path),
                       discovered={"file": found})
    client = await router_client(create_app(cfg))
    state = client.server.app[STATE]
    names = lambda: [(s.name, state.router.fleet.states[s.index]) for s in state.cluster.instances]  # noqa: E731
    await asyncio.sleep(0.4)  # the watcher has looked once: the file as started changes nothing
    assert names() == [("a", ACTIVE), ("b", ACTIVE)] and fleet_rows(state) == []

    # a line added: the instance joins and takes traffic
    path.write_text(path.read_text() + f"{fakes[2][1]}\n")
    took = await until(lambda: len(state.cluster.instances) == 3, 2.0)
    c_name = fakes[2][1].split("://")[1]
    assert names()[2] == (c_name, ACTIVE) and took < 2.0
    assert state.health.tasks is not None and 2 in state.health.tasks
    for k in range(6):
        assert (await turn(client, f"s{k}", f"hello {k} " * 30))[0] == 200
    assert fakes[2][0].seen

    # a bad edit (a duplicate name): nothing changes; the log, the state and /metrics say why
    caplog.set_level(logging.WARNING, logger="kvtop.route")
    good = path.read_text()
    path.write_text(good + "a=http://127.0.0.1:9\n")
    disc = None
    for _ in range(100):
        disc = (await (await client.get("/kvtop/v1/state")).json())["discovery"][0]
        if not disc["ok"]:
            break
        await asyncio.sleep(0.02)
    assert disc["source"] == "file" and disc["ok"] is False and disc["error"] == "line 5: the name a is on line 2 already"
    assert "the fleet is unchanged" in caplog.text and "the name a is on line 2 already" in caplog.text
    metrics = await (await client.get("/metrics")).text()
    assert f'kvtop_discovery_ok{{source="file",target="{path}"}} 0.0' in metrics
    assert f'kvtop_discovery_errors_total{{source="file",target="{path}"}} 1.0' in metrics
    assert [n for n, _ in names()] == ["a", "b", c_name]

    # b's line removed (and the file good again): b is drained, then removed once idle
    path.write_text(good.replace(f"b={fakes[1][1]}\n", ""))
    took = await until(lambda: state.router.fleet.states[1] == REMOVED, 2.0)
    assert took < 2.0
    disc = (await (await client.get("/kvtop/v1/state")).json())["discovery"][0]
    assert disc["ok"] and disc["instances"] == sorted(["a", c_name]) and disc["leaving"] == []
    seen_b = len(fakes[1][0].seen)
    for k in range(4):
        status, where = await turn(client, f"t{k}", f"again {k} " * 30)
        assert status == 200 and where != "b"
    assert len(fakes[1][0].seen) == seen_b and state.cluster.counters_zero()
    rows = fleet_rows(state)
    assert [(r["who"], json.loads(r["after"])["action"], json.loads(r["after"])["instance"]) for r in rows] == [
        ("file", "add", c_name), ("file", "drain", "b"), ("file", "remove", "b")]
    assert all(json.loads(r["after"])["source"] == "file" for r in rows)

    # the line back: b returns in its old place
    path.write_text(good)
    await until(lambda: state.router.fleet.states[1] == ACTIVE, 2.0)
    assert state.cluster.instances[1].url == fakes[1][1]


async def test_file_drops_an_instance_with_a_request_in_flight(router_client, fake_backends, tmp_path):
    """Drain-then-remove: the request in flight finishes where it is; the remove waits for it."""
    fakes = await fake_backends(2, token_delay=0.05)
    path = tmp_path / "backends.txt"
    path.write_text(f"a={fakes[0][1]}\nb={fakes[1][1]}\n")
    found = parse_backends_file(path.read_text())
    cfg = RouterConfig(backends=found, policy="sticky", db=str(tmp_path / "kvtop.db"), control_token=TOKEN,
                       state_dir=str(tmp_path / "state"), backends_file=str(path), discovered={"file": found})
    client = await router_client(create_app(cfg))
    state = client.server.app[STATE]
    r = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "x " * 40, "max_tokens": 30}))
    await until(lambda: state.cluster.instances[0].num_requests == 1, 2.0)
    path.write_text(f"b={fakes[1][1]}\n")
    await until(lambda: state.router.fleet.states[0] == DRAINING, 2.0)
    assert state.router.fleet.states[0] == DRAINING  # not removed while its request runs
    resp = await r
    assert resp.status == 200 and resp.headers["X-Kvtop-Instance"] == "a"
    await until(lambda: state.router.fleet.states[0] == REMOVED, 2.0)
    assert state.cluster.counters_zero()


@pytest.mark.parametrize("argv,words", [
    ([], "give at least one --backend, or a discovery source"),
    (["--backends-file", "/nonexistent/backends"], "--backends-file /nonexistent/backends: cannot read"),
    (["--backend-dns", "svc.local"], "expected NAME:PORT"),
    (["--backend-srv", "_http._tcp.x", "--dns-server", "localhost:53"], "expected an IP address"),
    (["--backend", "http://127.0.0.1:1", "--dns-server", "127.0.0.1:53"], "goes with --backend-dns"),
])
def test_cli_refuses_bad_discovery_flags(argv, words, capsys):
    from kvtop.cli import main

    assert main(["route", *argv, "--db", "none"]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err


def test_cli_refuses_a_bad_file_at_start(tmp_path, capsys):
    from kvtop.cli import main

    path = tmp_path / "b.txt"
    path.write_text("a=http://127.0.0.1:1\na=http://127.0.0.1:2\n")
    assert main(["route", "--backends-file", str(path), "--db", "none"]) == 2
    assert "line 2: the name a is on line 1 already" in capsys.readouterr().err


# -- DNS, against a real server on loopback ----------------------------------------------------

class Zone:
    """A dnslib resolver answering from a dict the test edits: (name, type) -> [rdata]."""

    def __init__(self):
        self.records: dict[tuple[str, str], list] = {}

    def resolve(self, request, handler):
        from dnslib import QTYPE, RCODE, RR

        reply = request.reply()
        q = request.q
        name = str(q.qname).rstrip(".")
        for rd in self.records.get((name, QTYPE[q.qtype]), []):
            reply.add_answer(RR(q.qname, q.qtype, rdata=rd, ttl=1))
        if not any(n == name for n, _ in self.records):
            reply.header.rcode = RCODE.NXDOMAIN
        return reply


@pytest.fixture
def dns_server():
    from conftest import free_port
    from dnslib.server import DNSLogger, DNSServer

    zone = Zone()
    port = free_port()
    server = DNSServer(zone, port=port, address="127.0.0.1", logger=DNSLogger("-request,-reply,-truncated,-error,-recv,-send,-data", False))
    server.start_thread()
    try:
        yield zone, f"127.0.0.1:{port}"
    finally:
        server.stop()


async def fakes_on(aiohttp_server, hosts, port=None):
    from conftest import free_port
    from fakevllm import FakeVLLM

    port = port or free_port()
    out = []
    for h in hosts:
        fake = FakeVLLM(h)
        await aiohttp_server(fake.app(), host=h, port=port)
        out.append(fake)
    return out, port


async def test_dns_a_records_change_within_2s(router_client, aiohttp_server, dns_server, tmp_path):
    """--backend-dns NAME:PORT: one instance per address; an address that appears joins, one
    that goes is drained and removed; a failed lookup changes nothing."""
    from dnslib import A

    from router.discovery_dns import resolve_at_start

    zone, server = dns_server
    fakes, port = await fakes_on(aiohttp_server, ["127.0.0.2", "127.0.0.3"])
    zone.records[("vllm.test", "A")] = [A("127.0.0.2")]
    cfg = RouterConfig(backends=[], policy="leastwork", db=str(tmp_path / "kvtop.db"), control_token=TOKEN,
                       state_dir=str(tmp_path / "state"), backend_dns=[f"vllm.test:{port}"], dns_server=server,
                       dns_interval_s=0.2)
    found = (await resolve_at_start(cfg))[("a", f"vllm.test:{port}")]
    cfg.backends = found
    cfg.discovered = {f"dns:vllm.test:{port}": found}
    assert [x.name for x in found] == [f"127.0.0.2:{port}"]
    client = await router_client(create_app(cfg))
    state = client.server.app[STATE]
    states = lambda: {s.name: state.router.fleet.states[s.index] for s in state.cluster.instances}  # noqa: E731

    zone.records[("vllm.test", "A")] = [A("127.0.0.2"), A("127.0.0.3")]
    took = await until(lambda: len(state.cluster.instances) == 2, 2.0)
    assert took < 2.0 and states() == {f"127.0.0.2:{port}": ACTIVE, f"127.0.0.3:{port}": ACTIVE}
    for k in range(4):
        assert (await turn(client, f"s{k}", f"dns {k} " * 30))[0] == 200
    assert fakes[1].seen

    # the server stops answering for the name: nothing changes, the state says why
    del zone.records[("vllm.test", "A")]
    for _ in range(100):
        disc = (await (await client.get("/kvtop/v1/state")).json())["discovery"][0]
        if not disc["ok"]:
            break
        await asyncio.sleep(0.02)
    assert disc["source"] == "dns" and "NXDOMAIN" in disc["error"]
    assert set(states().values()) == {ACTIVE}

    zone.records[("vllm.test", "A")] = [A("127.0.0.3")]
    took = await until(lambda: states()[f"127.0.0.2:{port}"] == REMOVED, 2.0)
    assert took < 2.0
    rows = fleet_rows(state)
    assert [(r["who"], json.loads(r["after"])["action"]) for r in rows] == [("dns", "add"), ("dns", "drain"),
                                                                            ("dns", "remove")]
    assert state.cluster.counters_zero()


async def test_dns_srv_records(router_client, aiohttp_server, dns_server, tmp_path):
    """--backend-srv NAME: each target's address on the record's port."""
    from dnslib import A, SRV

    from router.discovery_dns import resolve_at_start

    zone, server = dns_server
    f1, p1 = await fakes_on(aiohttp_server, ["127.0.0.1"])
    f2, p2 = await fakes_on(aiohttp_server, ["127.0.0.1"])
    zone.records[("a.test", "A")] = [A("127.0.0.1")]
    zone.records[("_http._tcp.vllm.test", "SRV")] = [SRV(0, 1, p1, "a.test.")]
    cfg = RouterConfig(backends=[], policy="leastwork", db=str(tmp_path / "kvtop.db"), control_token=TOKEN,
                       state_dir=str(tmp_path / "state"), backend_srv=["_http._tcp.vllm.test"], dns_server=server,
                       dns_interval_s=0.2)
    found = (await resolve_at_start(cfg))[("srv", "_http._tcp.vllm.test")]
    cfg.backends, cfg.discovered = found, {"srv:_http._tcp.vllm.test": found}
    client = await router_client(create_app(cfg))
    state = client.server.app[STATE]
    zone.records[("_http._tcp.vllm.test", "SRV")] = [SRV(0, 1, p1, "a.test."), SRV(0, 1, p2, "a.test.")]
    took = await until(lambda: len(state.cluster.instances) == 2, 2.0)
    assert took < 2.0 and [s.url for s in state.cluster.instances] == [f"http://127.0.0.1:{p1}",
                                                                      f"http://127.0.0.1:{p2}"]


# -- KV-event endpoints the engine announces (@kv=auto) --------------------------------------------

@pytest.mark.parametrize("answer,url,expected", [
    # vLLM's current shape: a bare array, one entry per DP rank; rank 0's is followed, wildcard -> host
    ([{"data_parallel_rank": 1, "endpoint": "tcp://*:5558", "replay_endpoint": None, "topic": ""},
      {"data_parallel_rank": 0, "endpoint": "tcp://0.0.0.0:5557", "replay_endpoint": "tcp://*:5560", "topic": ""}],
     "http://10.0.0.4:8000", ("tcp://10.0.0.4:5557", "tcp://10.0.0.4:5560")),
    # an earlier revision's envelope; a concrete host is kept
    ({"sources": [{"data_parallel_rank": 0, "endpoint": "tcp://10.1.1.1:5557", "replay_endpoint": None}]},
     "http://h:8000", ("tcp://10.1.1.1:5557", None)),
    ([{"endpoint": "tcp://*:5557"}], "http://[::1]:8000", ("tcp://[::1]:5557", None)),
    ([], "http://h:1", None),  # KV events off
    ({"detail": "Not Found"}, "http://h:1", None),
    ([{"endpoint": "nats://x"}], "http://h:1", None),  # not a ZMQ endpoint kvtop can follow
])
def test_announced_kv_sources(answer, url, expected):
    from router.kv_sources import pick

    assert pick(answer, url) == expected


async def test_an_instance_added_with_kv_auto_follows_what_it_announces(router_client, aiohttp_server, tmp_path):
    from aiohttp import web

    from fakevllm import FakeVLLM
    from kvfake import FakePublisher, connected
    from router.app import STATE

    pubs = [FakePublisher(), FakePublisher()]
    try:
        urls = []
        for k, pub in enumerate(pubs):
            fake = FakeVLLM(f"f{k}")
            app = fake.app()
            port = pub.endpoint.rsplit(":", 1)[1]

            async def sources(request, port=port, pub=pub):  # as vLLM: the bind address, a wildcard host
                return web.json_response([{"data_parallel_rank": 0, "endpoint": f"tcp://*:{port}",
                                           "replay_endpoint": pub.replay_endpoint, "topic": ""}])
            app.router.add_get("/kv_event_sources", sources)
            server = await aiohttp_server(app, host="127.0.0.1")
            urls.append(str(server.make_url("")).rstrip("/"))
        from router.cli import resolve_kv_sources

        cfg = RouterConfig(backends=[Backend("i0", urls[0], kv_events="auto")], policy="leastwork",
                           db=str(tmp_path / "kv.db"), control_token=TOKEN, state_dir=str(tmp_path / "state"))
        await resolve_kv_sources(cfg)  # as kvtop route does before it starts
        assert cfg.backends[0].kv_events == pubs[0].endpoint
        client = await router_client(create_app(cfg))
        state = client.server.app[STATE]
        r = await client.post("/kvtop/v1/fleet", headers={"Authorization": f"Bearer {TOKEN}"},
                              json={"backend": f"i1={urls[1]}@kv=auto"})
        assert r.status == 200, await r.text()
        sub = state.kv_subscribers[1]
        assert sub is not None
        await connected(sub, pubs[1])
        state.writer.flush()
        rows = [json.loads(r["after"]) for r in sqlite_utils.Database(cfg.db)["config_events"].rows
                if r["kind"] == "fleet"]
        assert rows[0]["kv_events"] == pubs[1].endpoint and rows[0]["kv_replay"] == pubs[1].replay_endpoint
    finally:
        for p in pubs:
            await p.close()


async def test_an_entry_the_fleet_refuses_is_not_owned_and_says_why(router_client, fake_backends, tmp_path):
    """A line the control API would refuse (@kv= on a router that follows no KV events): the rest
    of the edit applies, that entry is not taken as there, and the state says why."""
    fakes = await fake_backends(3)
    path = tmp_path / "backends.txt"
    path.write_text(f"a={fakes[0][1]}\n")
    found = parse_backends_file(path.read_text())
    cfg = RouterConfig(backends=found, policy="leastwork", db="",
                       control_token=TOKEN, state_dir=str(tmp_path / "state"), backends_file=str(path),
                       discovered={"file": found})
    client = await router_client(create_app(cfg))
    state = client.server.app[STATE]
    path.write_text(f"a={fakes[0][1]}\nb={fakes[1][1]}\nc={fakes[2][1]}@kv=tcp://127.0.0.1:1\n")
    await until(lambda: len(state.cluster.instances) == 2, 2.0)
    for _ in range(50):
        disc = (await (await client.get("/kvtop/v1/state")).json())["discovery"][0]
        if not disc["ok"]:
            break
        await asyncio.sleep(0.02)
    assert disc["ok"] is False and "refused by the fleet: add c: this router follows no KV events" in disc["error"]
    assert disc["instances"] == ["a", "b"] and [s.name for s in state.cluster.instances] == ["a", "b"]


async def test_kvtop_sim_announces_its_kv_events_as_vllm_does():
    """kvtop sim serves vLLM's GET /kv_event_sources; @kv=auto at start finds its publisher."""
    from kvtop.sim.engine import Engine
    from kvtop.sim.kv_publisher import KvEventPublisher
    from kvtop.sim.server import SimInstance, serve
    from router.cli import resolve_kv_sources

    with_kv = SimInstance(Engine("h20", num_gpu_blocks=64), model="m", port=0, speed=1000.0)
    with_kv.kv_publisher = KvEventPublisher(with_kv.engine, port=0, replay_port=0)
    without = SimInstance(Engine("h20", num_gpu_blocks=64), model="m", port=0, speed=1000.0)
    ready = asyncio.Event()
    task = asyncio.get_running_loop().create_task(serve([with_kv, without], on_ready=lambda _: ready.set()))
    try:
        await ready.wait()
        cfg = RouterConfig(backends=[Backend("a", f"http://127.0.0.1:{with_kv.port}", kv_events="auto"),
                                     Backend("b", f"http://127.0.0.1:{without.port}", kv_events="auto")])
        await resolve_kv_sources(cfg)
        a, b_ = cfg.backends
        assert (a.kv_events, a.kv_replay) == (with_kv.kv_publisher.endpoint, with_kv.kv_publisher.replay_endpoint)
        assert (b_.kv_events, b_.kv_replay) == (None, None)  # announces none: the estimate serves it
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_file_entry_with_kv_auto_is_not_replaced_once_its_endpoints_are_found(
        router_client, aiohttp_server, tmp_path):
    """The file says @kv=auto; the router's copy gets the announced endpoints. The watcher
    compares with what the file said, so its next look changes nothing (it did not drain and
    re-add the instance)."""
    import argparse

    from aiohttp import web

    from fakevllm import FakeVLLM
    from kvfake import FakePublisher
    from router.cli import add_arguments, config_from_args, resolve_kv_sources

    pub = FakePublisher()
    try:
        app = FakeVLLM("f").app()

        async def sources(request):
            return web.json_response([{"data_parallel_rank": 0, "endpoint": pub.endpoint,
                                       "replay_endpoint": None, "topic": ""}])
        app.router.add_get("/kv_event_sources", sources)
        server = await aiohttp_server(app, host="127.0.0.1")
        path = tmp_path / "backends.txt"
        path.write_text(f"a={str(server.make_url('')).rstrip('/')}@kv=auto\n")
        p = argparse.ArgumentParser()
        add_arguments(p)
        cfg = config_from_args(p.parse_args(["--backends-file", str(path), "--db", str(tmp_path / "k.db"),
                                             "--state-dir", str(tmp_path / "st")]))
        await resolve_kv_sources(cfg)
        assert cfg.backends[0].kv_events == pub.endpoint and cfg.discovered["file"][0].kv_events == "auto"
        client = await router_client(create_app(cfg))
        state = client.server.app[STATE]
        await asyncio.sleep(0.6)  # two looks of the watcher
        assert fleet_rows(state) == [] and state.kv_subscribers[0] is not None
        disc = (await (await client.get("/kvtop/v1/state")).json())["discovery"][0]
        assert disc["ok"] and disc["instances"] == ["a"]
    finally:
        await pub.close()


@pytest.mark.parametrize("spec,expected", [
    ("vllm.ns:8000", ("vllm.ns:8000", None)),
    ("vllm.ns:8000@kv=auto", ("vllm.ns:8000", "auto")),
    ("_http._tcp.vllm.ns@kv=auto", ("_http._tcp.vllm.ns", "auto")),
])
def test_dns_names_take_kv_auto(spec, expected):
    from router.discovery_dns import split_kv

    assert split_kv(spec) == expected


def test_dns_names_take_no_other_option():
    from router.discovery_dns import split_kv
    from store.errors import CliError

    with pytest.raises(CliError) as exc:
        split_kv("vllm.ns:8000@kv=tcp://x:1")
    assert "the only option a DNS name takes is @kv=auto" in str(exc.value)
