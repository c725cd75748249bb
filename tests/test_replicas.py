"""Router replicas that route as one (router/replicas.py): real ZeroMQ sockets on loopback.

Replica B prices with replica A's in-flight load within the staleness bound; B falls back to
its own view when A goes quiet, says so in state, /health, /metrics and the log, and shares
again when A returns; whatever a peer sends, B drops and counts what is not a snapshot.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import pytest
import zmq
import zmq.asyncio

from router import replicas as rp
from router.app import STATE, Backend, RouterConfig, create_app
from router.cluster import Cluster
from router.core import RoutingCore
from router.request import RouteRequest
from router.settings import Settings
from router.supervise import Supervisor
from test_control import TOKEN, complete, fake_vllm

INTERVAL_S = 0.02
STALE_S = 0.3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


async def until(cond, timeout: float = 10.0, what: str = "condition") -> float:
    """Wait for ``cond()``; returns the seconds it took."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)
    return time.monotonic() - t0


def request(rid: str, tokens: int = 20_000) -> RouteRequest:
    return RouteRequest(rid, "s-" + rid, "header", tokens, list(range(tokens // 512)), "tokens",
                        "completions", True, 16)


async def test_a_peers_in_flight_load_is_priced_within_the_staleness_bound():
    urls = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]
    a_cl = Cluster(["a0", "a1", "a2"], urls=urls)
    # B lists the same engines in another order and under other names: snapshots match by URL
    b_cl = Cluster(["z", "y", "x"], urls=[urls[2] + "/", urls[1], urls[0]])
    bind_a = endpoint()
    a = rp.Replicas(a_cl, "A", bind=bind_a, peers=[], interval_s=INTERVAL_S, stale_s=STALE_S)
    b = rp.Replicas(b_cl, "B", bind=None, peers=[bind_a], interval_s=INTERVAL_S, stale_s=STALE_S)
    core = RoutingCore(b_cl, Settings.parse("expected_cost", {}).build_policy())
    core.peers = b
    a.open_publisher()
    await a.start(Supervisor())
    await b.start(Supervisor())
    try:
        await until(lambda: b.mode == rp.SHARED, what="B hearing A")
        assert core.decide(request("r0")).extra == {"replica_view": "shared"}
        # A sends three long prompts to its first engine (B's third)
        tickets = [a_cl.dispatch(0, 40_000, 0, list(range(78))) for _ in range(3)]
        took = await until(lambda: b.snapshot()["peer_load"].get("x", {}).get("num_requests") == 3,
                           what="A's load in B's view")
        assert took < STALE_S  # published within the interval after the change
        d = core.decide(request("r1"))
        terms = {t["instance"]: t for t in d.terms}
        assert terms["x"]["BS"] == 3 and terms["x"]["P"] == 120_000
        assert terms["x"]["wait_s"] > 1.0 and terms["z"]["wait_s"] == 0.0
        assert d.instance_name != "x"  # alone, B would see three idle engines and take the first
        assert b_cl.counters_zero()  # B's own books never hold A's requests
        for t in tickets:
            a_cl.finish(t)
        await until(lambda: "x" not in b.snapshot()["peer_load"] or
                    b.snapshot()["peer_load"]["x"]["num_requests"] == 0, what="A's requests ending in B's view")
    finally:
        await a.stop()
        await b.stop()


@pytest.fixture
async def replica_pair(aiohttp_server, router_client, tmp_path):
    """Two kvtop routers over the same two fake engines, each the other's replica peer."""
    servers = [await aiohttp_server(fake_vllm()) for _ in range(2)]
    backends = [Backend(f"i{k}", str(s.make_url("")).rstrip("/")) for k, s in enumerate(servers)]
    ends = [endpoint(), endpoint()]
    clients = []
    for k in range(2):
        cfg = RouterConfig(backends=list(backends), db=None, control_token=TOKEN,
                           state_dir=str(tmp_path / f"state{k}"), scrape_interval_s=0.2,
                           replica_bind=ends[k], replica_peers=[ends[1 - k]],
                           replica_interval_s=INTERVAL_S, replica_stale_s=STALE_S)
        clients.append(await router_client(create_app(cfg)))
    return clients


async def state(client) -> dict:
    r = await client.get("/kvtop/v1/state")
    assert r.status == 200
    return await r.json()


async def metric(client, line_start: str) -> float | None:
    text = await (await client.get("/metrics")).text()
    for line in text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


async def test_losing_every_peer_falls_back_to_own_view_says_so_and_recovers(replica_pair, caplog):
    caplog.set_level(logging.INFO, logger="kvtop.route")
    a, b = replica_pair
    st_a, st_b = a.server.app[STATE], b.server.app[STATE]
    await until(lambda: st_b.replicas.mode == rp.SHARED and st_a.replicas.mode == rp.SHARED,
                what="both replicas sharing")
    s = await state(b)
    assert s["replicas"]["mode"] == "shared" and s["replicas"]["peers_fresh"] == 1
    assert s["replicas"]["peers"][0]["replica"] == st_a.run_id
    assert not [d for d in s["degraded"] if d["kind"] == "replica-peer"]
    assert await metric(b, "kvtop_replica_peers_fresh") == 1
    assert await metric(b, 'kvtop_replica_view{mode="shared"}') == 1
    assert (await complete(b, "s1"))["status"] == 200
    ring = (await (await b.get("/kvtop/v1/decisions?session=s1")).json())["decisions"]
    assert ring[0]["replica_view"] == "shared"

    await st_a.replicas.stop()  # A's publisher (and its subscriber) go away
    await until(lambda: st_b.replicas.degraded(), what="B noticing A is gone")
    s = await state(b)
    assert s["replicas"]["mode"] == "own" and s["replicas"]["peers_fresh"] == 0
    lost = [d for d in s["degraded"] if d["kind"] == "replica-peer"]
    assert len(lost) == 1 and "own view" in lost[0]["fallback"]
    h = await b.get("/health")
    assert (await h.json())["status"] == "degraded" and h.status == 200  # routing goes on
    assert await metric(b, "kvtop_replica_peers_fresh") == 0
    assert await metric(b, 'kvtop_replica_view{mode="own"}') == 1
    assert "routing on this replica's own view" in caplog.text
    assert (await complete(b, "s2"))["status"] == 200
    ring = (await (await b.get("/kvtop/v1/decisions?session=s2")).json())["decisions"]
    assert ring[0]["replica_view"] == "own"

    st_a.replicas.open_publisher()  # A comes back on the same endpoint
    await st_a.replicas.start(st_a.supervisor)
    await until(lambda: st_b.replicas.mode == rp.SHARED, what="B hearing A again")
    s = await state(b)
    assert s["replicas"]["mode"] == "shared"
    assert not [d for d in s["degraded"] if d["kind"] == "replica-peer"]
    assert "routing on the shared view" in caplog.text


async def test_bad_peer_input_is_dropped_and_counted_never_fatal():
    cl = Cluster(["i0"], urls=["http://127.0.0.1:9"])
    bind = endpoint()
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(bind)
    sup = Supervisor()
    b = rp.Replicas(cl, "B", bind=None, peers=[bind], interval_s=INTERVAL_S, stale_s=10.0)
    await b.start(sup)

    def snap(n: int, **over) -> list[bytes]:
        msg = {"kvtop_replica": 1, "replica": "P", "seq": n, "ts": time.time(),
               "instances": [{"url": "http://127.0.0.1:9", "name": "i0", "load": [100, 1, 0, 0, 0.5]}]}
        msg.update(over)
        return [rp.TOPIC, json.dumps(msg).encode()]

    try:
        seq = 0
        while b.peers[0].received == 0:  # a PUB drops what it sends before the SUB has joined
            seq += 1
            await pub.send_multipart(snap(seq))
            await asyncio.sleep(0.02)
        bad = {
            "malformed": [[rp.TOPIC], [rp.TOPIC, b"{}", b"extra"], [rp.TOPIC + b"x", b"{}"],
                          snap(seq + 1, instances="no"), snap(seq + 1, seq=-3), snap(seq + 1, replica=""),
                          snap(seq + 1, instances=[{"url": "u", "name": "n", "load": [1, 2, 3]}]),
                          snap(seq + 1, instances=[{"url": "u", "name": "n", "load": [1, 2, 3, True, 0]}]),
                          [rp.TOPIC, json.dumps({"kvtop_replica": 1, "replica": "P", "seq": seq + 1,
                                                 "ts": 1.0, "instances": [{"load": [1, 1, 1, 1, float("nan")],
                                                                          "url": "", "name": ""}]}).encode()],
                          [rp.TOPIC, b"[1, 2]"]],
            "not_json": [[rp.TOPIC, b"\xff\xfe{"], [rp.TOPIC, b"[" * 200_000]],
            "version": [snap(seq + 1, kvtop_replica=2), snap(seq + 1, kvtop_replica=True),
                        snap(seq + 1, kvtop_replica=1.0)],
            "too_large": [[rp.TOPIC, b" " * (rp.MAX_MESSAGE_BYTES + 1)]],
            "self": [snap(seq + 1, replica="B")],
            "old_seq": [snap(seq)],
        }
        await pub.send_multipart([b"garbage", b"x"])  # not our topic: ZeroMQ's filter drops it, uncounted
        for frames_list in bad.values():
            for frames in frames_list:
                await pub.send_multipart(frames)
        await pub.send_multipart(snap(seq + 1, instances=[
            {"url": "http://127.0.0.1:9", "name": "i0", "load": [7, 2, 0, 0, 0.25]}]))
        await until(lambda: b.peers[0].seq == seq + 1, what="the good snapshot after the bad ones")
        assert b.dropped == {k: len(v) for k, v in bad.items()}
        assert b.snapshot()["peer_load"]["i0"]["pending_prefill_tokens"] == 7
        assert not sup.degraded() and all(h.deaths == 0 for h in sup.tasks.values())
        text = "".join(f"{s.name} {s.labels} {s.value}\n" for f in b.collect() for s in f.samples)
        assert "kvtop_replica_snapshots_dropped_total {'reason': 'too_large'} 1\n" in text
    finally:
        await b.stop()
        pub.close()
        ctx.term()


@pytest.mark.parametrize("argv, message", [
    (["--replica-peer", "localhost:5"], "expected tcp://HOST:PORT"),  # no scheme
    (["--replica-bind", "tcp://127.0.0.1:70000"], "port must be 1-65535"),
    (["--replica-bind", "tcp://127.0.0.1:5", "--replica-peer", "tcp://127.0.0.1:5"], "own --replica-bind"),
    (["--replica-peer", "tcp://h:5", "--replica-peer", "tcp://h:5"], "each peer once"),
    (["--replica-peer", "tcp://h:5", "--replica-stale-ms", "10"], "larger than --replica-interval-ms"),
])
def test_bad_replica_flags_are_one_line_errors(argv, message, capsys):
    from kvtop.cli import main

    assert main(["route", "--backend", "http://127.0.0.1:9", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


async def test_a_taken_bind_port_is_a_startup_error():
    port = free_port()
    taken = zmq.Context()
    s = taken.socket(zmq.PUB)
    s.setsockopt(zmq.LINGER, 0)
    s.bind(f"tcp://127.0.0.1:{port}")
    try:
        cfg = RouterConfig(backends=[Backend("i0", "http://127.0.0.1:9")], db=None,
                           replica_bind=f"tcp://127.0.0.1:{port}")
        with pytest.raises(ValueError, match="--replica-bind"):
            create_app(cfg)
    finally:
        s.close()
        taken.term()


async def test_attach_once_shows_each_replicas_view(replica_pair, capsys):
    from kvtop.cli import main

    a, b = replica_pair
    st_a, st_b = a.server.app[STATE], b.server.app[STATE]
    await until(lambda: st_b.replicas.mode == rp.SHARED and st_a.replicas.mode == rp.SHARED,
                what="both replicas sharing")
    urls = [f"http://127.0.0.1:{c.port}" for c in (a, b)]
    assert await asyncio.to_thread(main, ["attach", "--once", "--readonly", *urls]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("r1 ") and lines[0].endswith("shared view 1/1 peers fresh")
    assert lines[1].startswith("r2 ") and lines[1].endswith("shared view 1/1 peers fresh")
    await st_a.replicas.stop()
    await until(lambda: st_b.replicas.degraded(), what="B noticing A is gone")
    assert await asyncio.to_thread(main, ["attach", "--once", "--readonly", *urls]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].endswith(f"OWN VIEW 0/1 peers fresh (lost: {st_b.config.replica_peers[0]})")
