"""The control API against a real router on 127.0.0.1 with fake vLLM backends."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import time

import pytest
import sqlite_utils
from aiohttp import web

from router.app import STATE, Backend, RouterConfig, create_app
from router.control import CONTROL

TOKEN = "test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


# -- a fake vLLM: streams SSE, answers JSON, exposes /metrics -------------------------------------

def fake_vllm(delay_s: float = 0.0) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if delay_s:
            await asyncio.sleep(delay_s)
        usage = {"prompt_tokens": 10, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}}
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "ok"}], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for tok in ("a", "b"):
            await resp.write(b"data: " + json.dumps({"choices": [{"text": tok}]}).encode() + b"\n\n")
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text='vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
                                 'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n')

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    return app


@pytest.fixture
async def router(aiohttp_server, router_client, tmp_path):
    """Factory: start N fake backends and a router over them; returns the router's client."""

    async def make(n: int = 2, *, readonly: bool = False, db: bool = False, policy: str = "unified",
                   delay_s: float = 0.0, **cfg_kw):
        servers = [await aiohttp_server(fake_vllm(delay_s)) for _ in range(n)]
        cfg = RouterConfig(
            backends=[Backend(f"i{k}", str(s.make_url("")).rstrip("/")) for k, s in enumerate(servers)],
            policy=policy, db=str(tmp_path / "kvtop.db") if db else None, control_token=TOKEN,
            control_readonly=readonly, state_dir=str(tmp_path / "state"), scrape_interval_s=0.2, **cfg_kw)
        return await router_client(create_app(cfg))

    return make


async def complete(client, session: str, prompt: str = "hello " * 40, stream: bool = True) -> dict:
    r = await client.post("/v1/completions", json={"model": "m", "prompt": prompt, "stream": stream,
                                                  "max_tokens": 2}, headers={"X-Session-ID": session})
    await r.read()
    return {"status": r.status, "policy": r.headers.get("X-Kvtop-Policy"),
            "request_id": r.headers.get("X-Kvtop-Request-Id")}


# -- state, policies, sessions, decisions -----------------------------------------------------------

async def test_state_shape(router):
    c = await router(2)
    for k in range(3):
        assert (await complete(c, f"s{k}"))["status"] == 200
    r = await c.get("/kvtop/v1/state")
    assert r.status == 200
    s = await r.json()
    assert s["schema_version"] == 1
    assert s["router"]["policy"] == "unified@1" and s["router"]["readonly"] is False
    assert [i["name"] for i in s["instances"]] == ["i0", "i1"]
    inst = s["instances"][0]
    for key in ("healthy", "num_requests", "pending_prefill_tokens", "backlog_s", "decode_requests",
                "decode_tokens", "est_hit_rate", "est_hit_rate_recent", "request_rate", "engine", "gpu", "errors"):
        assert key in inst, key
    assert s["totals"]["routed_total"] == 3 and s["totals"]["num_requests"] == 0
    assert sum(s["decisions_by_reason"].values()) == 3
    assert s["outcomes_by_status"] == {"ok": 3}
    assert s["affinity"]["sessions"] == 3
    assert inst["gpu"]["note"].startswith("n/a: ")
    # kept by the cluster as sessions come (no walk, no cache): a new session shows at once
    assert (await complete(c, "s3"))["status"] == 200
    aff = (await (await c.get("/kvtop/v1/state")).json())["affinity"]
    assert aff["sessions"] == sum(aff["per_instance"].values()) == 4
    assert aff["lookahead_sessions"] == 4 and aff["moves"] == aff["moved_sessions"] == 0


async def test_backlog_seconds_uses_assumed_prefill_rate(router):
    c = await router(1, assumed_prefill_tps=1000.0)
    st = c.server.app[STATE]
    st.cluster.instances[0].pending_prefill_tokens = 2500  # as if a request were being prefilled
    s = await (await c.get("/kvtop/v1/state")).json()
    st.cluster.instances[0].pending_prefill_tokens = 0
    assert s["instances"][0]["backlog_s"] == pytest.approx(2.5)
    assert s["instances"][0]["backlog_source"] == "assumed"
    assert s["router"]["assumed_prefill_tps"] == 1000.0


async def test_backlog_seconds_use_the_measured_prefill_rate_once_there_is_one(router):
    """The issue's case: an assumed 5,000 tokens/s against a measured 30,000 made backlog
    seconds 6x too high. Once first tokens have been timed, the measured rate divides."""
    c = await router(2)
    st = c.server.app[STATE]
    cal = st.cluster.calibration
    for k in range(20):  # instance 0 prefills 30,000 tokens in 1 s, again and again
        cal.observe(0, 30_000, 0, dispatched=100.0 + 2 * k, first_token=101.0 + 2 * k)
    st.cluster.instances[0].pending_prefill_tokens = 46_781
    st.cluster.instances[1].pending_prefill_tokens = 0
    s = await (await c.get("/kvtop/v1/state")).json()
    st.cluster.instances[0].pending_prefill_tokens = 0
    i0, i1 = s["instances"]
    assert i0["backlog_source"] == "measured" and i0["backlog_prefill_tps"] == pytest.approx(cal.tps(0), rel=1e-3)
    assert i0["backlog_s"] == pytest.approx(46_781 / cal.tps(0))
    assert 1.5 < i0["backlog_s"] < 2.0  # about 1.6 s (the prior still weighs a little), not 9.36 s
    assert i1["backlog_source"] == "fleet"  # no sample of its own yet: the fleet's rate
    assert s["totals"]["backlog_s"] == pytest.approx(i0["backlog_s"] + i1["backlog_s"])


async def test_policies_lists_schemas_and_marks_current(router):
    c = await router(1, policy="lmetric")
    body = await (await c.get("/kvtop/v1/policies")).json()
    assert body["current"]["policy"] == "lmetric@1"
    byname = {p["name"]: p for p in body["policies"]}
    assert byname["lmetric"]["current"] and not byname["unified"]["current"]
    knob = {k["name"]: k for k in byname["unified"]["knobs"]}["overload_factor"]
    assert {"type", "default", "range", "doc"} <= set(knob)


async def test_sessions_and_decisions_endpoints(router):
    c = await router(2, policy="sticky")
    for turn in range(3):
        await complete(c, "long", prompt="x " * (200 + 50 * turn))
    await complete(c, "short")
    body = await (await c.get("/kvtop/v1/sessions?sort=turns&limit=1")).json()
    assert body["total"] == 2
    (top,) = body["sessions"]
    assert top["session"] == "long" and top["turns"] == 3 and top["moves"] == 0
    assert top["bound_for_s"] >= 0 and top["instance"] in ("i0", "i1")
    inst = top["instance"]
    only = await (await c.get(f"/kvtop/v1/sessions?instance={inst}")).json()
    assert all(s["instance"] == inst for s in only["sessions"])
    bad = await c.get("/kvtop/v1/sessions?sort=nope")
    assert bad.status == 400 and (await bad.json())["error"]["param"] == "sort"

    d = await (await c.get("/kvtop/v1/decisions?limit=2")).json()
    assert [e["session"] for e in d["decisions"]] == ["short", "long"]  # newest first
    d = await (await c.get("/kvtop/v1/decisions?session=long")).json()
    assert [e["turn"] for e in d["decisions"]] == [3, 2, 1]
    d = await (await c.get("/kvtop/v1/decisions?reason=affinity_stick")).json()
    assert len(d["decisions"]) == 2 and all(e["reason"] == "affinity_stick" for e in d["decisions"])
    assert (await c.get("/kvtop/v1/decisions?limit=0")).status == 400


# -- mutations: auth, read-only, validation ---------------------------------------------------------

async def test_mutations_need_the_token(router):
    c = await router(1)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):  # last: no scheme
        r = await c.patch("/kvtop/v1/knobs", json={"overload_factor": 3.0}, headers=headers)
        assert r.status == 401, headers
        assert (await r.json())["error"]["type"] == "AuthenticationError"
    assert c.server.app[STATE].slot.label == "unified@1"
    r = await c.patch("/kvtop/v1/knobs", json={"overload_factor": 3.0}, headers=AUTH)
    assert r.status == 200 and (await r.json())["policy"] == "unified@2"


async def test_readonly_refuses_every_mutation(router):
    c = await router(1, readonly=True)
    r1 = await c.put("/kvtop/v1/policy", json={"name": "lmetric"}, headers=AUTH)
    r2 = await c.patch("/kvtop/v1/knobs", json={"overload_factor": 3.0}, headers=AUTH)
    assert r1.status == r2.status == 403
    assert c.server.app[STATE].slot.label == "unified@1"
    assert (await c.get("/kvtop/v1/state")).status == 200  # reads still work


@pytest.mark.parametrize("method,path,body,param", [
    # unknown knob for the current policy: names the knob
    ("PATCH", "/kvtop/v1/knobs", {"no_such_knob": 1}, "no_such_knob"),
    # a string where a float is expected
    ("PATCH", "/kvtop/v1/knobs", {"overload_factor": "high"}, "overload_factor"),
    # out of range: the message must give the range
    ("PATCH", "/kvtop/v1/knobs", {"cache_ratio_gate": 7.0}, "cache_ratio_gate"),
    # one good knob and one bad: nothing applies
    ("PATCH", "/kvtop/v1/knobs", {"overload_factor": 1.5, "cache_ratio_gate": -1}, "cache_ratio_gate"),
    ("PATCH", "/kvtop/v1/knobs", [1, 2], "body"),
    ("PUT", "/kvtop/v1/policy", {"name": "nope"}, "name"),
    ("PUT", "/kvtop/v1/policy", {"name": 3}, "name"),
    ("PUT", "/kvtop/v1/policy", {"name": "lmetric", "knobs": {"overload_factor": 2}}, "overload_factor"),
    ("PUT", "/kvtop/v1/policy", {"name": "unified", "knobs": "fast"}, "knobs"),
    ("PUT", "/kvtop/v1/policy", {"name": "unified", "extra": 1}, "extra"),
])
async def test_knob_validation(router, method, path, body, param):
    c = await router(1)
    st = c.server.app[STATE]
    before = (st.slot.label, dict(st.slot.policy.knobs))
    r = await c.request(method, path, json=body, headers=AUTH)
    assert r.status == 400
    err = (await r.json())["error"]
    assert err["param"] == param and param in err["message"]
    assert (st.slot.label, dict(st.slot.policy.knobs)) == before
    if param == "cache_ratio_gate":
        assert "in [" in err["message"]  # the allowed range is stated


async def test_swap_under_concurrent_traffic(router):
    c = await router(2, db=True, delay_s=0.002)
    app = c.server.app
    st = app[STATE]
    results: list[dict] = []

    async def client(k: int) -> None:
        for j in range(12):
            results.append(await complete(c, f"s{k}", prompt=f"p{k} " * (100 + j), stream=j % 2 == 0))

    async def operator() -> None:
        for name, knobs in (("lmetric", {}), ("unified", {"overload_factor": 1.7}), ("leastwork", {})):
            await asyncio.sleep(0.03)
            r = await c.put("/kvtop/v1/policy", json={"name": name, "knobs": knobs},
                            headers={**AUTH, "X-Kvtop-User": "alice"})
            assert r.status == 200

    await asyncio.gather(operator(), *(client(k) for k in range(6)))
    assert all(r["status"] == 200 for r in results)
    assert st.slot.label == "leastwork@4"
    # each reply names the policy that routed it; the ring agrees, and every label is one that existed
    ring = {e["request_id"]: e["policy"] for e in st.ring}
    assert all(ring[r["request_id"]] == r["policy"] for r in results)
    assert {r["policy"] for r in results} <= {"unified@1", "lmetric@2", "unified@3", "leastwork@4"}
    for e in st.ring:  # a decision's reason comes from the policy its label names
        if e["policy"].startswith("lmetric"):
            assert e["reason"] in ("argmin", "tie_first")
    assert st.cluster.counters_zero()
    # affinity lives in the cluster: sessions survive every swap
    assert len(st.cluster.sessions) == 6
    st.writer.flush()
    db = sqlite_utils.Database(st.config.db)
    rows = list(db.query("select policy, policy_version, request_id from decisions"))
    assert len(rows) == len(results)
    assert all(ring[r["request_id"]] == f"{r['policy']}@{r['policy_version']}" for r in rows)
    events = list(db.query("select kind, who, policy_version from config_events where kind != 'run' order by id"))
    assert [(e["who"], e["policy_version"]) for e in events] == [("alice", 2), ("alice", 3), ("alice", 4)]


# -- token and discovery files ----------------------------------------------------------------------

async def test_generated_token_file_is_private_and_removed(aiohttp_server, tmp_path, monkeypatch):
    monkeypatch.delenv("KVTOP_CONTROL_TOKEN", raising=False)
    be = await aiohttp_server(fake_vllm())
    cfg = RouterConfig(backends=[Backend("i0", str(be.make_url("")).rstrip("/"))], db=None, port=18123,
                       state_dir=str(tmp_path / "st"))
    app = create_app(cfg)
    runner = web.AppRunner(app)
    await runner.setup()  # runs cleanup_ctx startup: the files exist now
    try:
        tok = tmp_path / "st" / "router-18123.token"
        info = json.loads((tmp_path / "st" / "router-18123.json").read_text())
        assert stat.S_IMODE(os.stat(tok).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(tmp_path / "st").st_mode) == 0o700
        assert tok.read_text().strip() == app[CONTROL].token and len(app[CONTROL].token) >= 32
        assert info["url"] == "http://127.0.0.1:18123" and info["token_file"] == str(tok.resolve())
        assert app[CONTROL].token not in json.dumps(info)
    finally:
        await runner.cleanup()
    assert not tok.exists() and not (tmp_path / "st" / "router-18123.json").exists()


def test_token_sources(tmp_path, monkeypatch):
    be = [Backend("i0", "http://127.0.0.1:9")]
    monkeypatch.setenv("KVTOP_CONTROL_TOKEN", "from-env")
    assert create_app(RouterConfig(backends=be, db=None))[CONTROL].token == "from-env"
    f = tmp_path / "tok"
    f.write_text("from-file\n")
    f.chmod(0o600)
    app = create_app(RouterConfig(backends=be, db=None, control_token_file=str(f)))
    assert app[CONTROL].token == "from-file"  # the file wins over the environment
    f.write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        create_app(RouterConfig(backends=be, db=None, control_token_file=str(f)))
    with pytest.raises(ValueError, match="missing"):
        create_app(RouterConfig(backends=be, db=None, control_token_file=str(tmp_path / "missing")))


# -- the event stream ---------------------------------------------------------------------------------

async def read_events(resp, seconds: float) -> list[tuple[str, dict]]:
    out, buf = [], b""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            chunk = await asyncio.wait_for(resp.content.readany(), left)
        except asyncio.TimeoutError:
            break
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            raw, buf = buf.split(b"\n\n", 1)
            lines = raw.decode().split("\n")
            ev = next((ln[7:] for ln in lines if ln.startswith("event: ")), None)
            data = next((ln[6:] for ln in lines if ln.startswith("data: ")), None)
            if ev and data:
                out.append((ev, json.loads(data)))
    return out


async def test_events_rate_and_types(router):
    c = await router(2)
    resp = await c.get("/kvtop/v1/events?hz=10")
    assert resp.headers["Content-Type"].startswith("text/event-stream")

    async def traffic():
        await asyncio.sleep(0.1)
        for k in range(5):
            await complete(c, f"s{k}")
        await c.patch("/kvtop/v1/knobs", json={"overload_factor": 2.5}, headers=AUTH)

    evs, _ = await asyncio.gather(read_events(resp, 1.5), traffic())
    resp.close()
    kinds = [k for k, _ in evs]
    states = kinds.count("state")
    assert 8 <= states <= 20, states  # 10 Hz for 1.5 s, generous tolerance
    assert kinds.count("decision") == 5
    cfg_ev = [e for k, e in evs if k == "config"]
    assert cfg_ev and cfg_ev[0]["after"]["version"] == 2
    last_state = [e for k, e in evs if k == "state"][-1]
    assert last_state["schema_version"] == 1

    only = await c.get("/kvtop/v1/events?types=decision")
    evs, _ = await asyncio.gather(read_events(only, 0.6), complete(c, "z"))
    only.close()
    assert [k for k, _ in evs] == ["decision"]
    for q in ("hz=100", "hz=0", "hz=abc", "types=state,bogus", "decisions=-1"):
        r = await c.get("/kvtop/v1/events?" + q)
        assert r.status == 400, q


async def test_decision_rate_limit_says_what_it_dropped(router):
    c = await router(1)
    resp = await c.get("/kvtop/v1/events?types=decision&decisions=2")

    async def burst():
        await asyncio.sleep(0.05)
        await asyncio.gather(*(complete(c, f"s{k}", stream=False) for k in range(30)))

    evs, _ = await asyncio.gather(read_events(resp, 1.0), burst())
    resp.close()
    decisions = sum(1 for k, _ in evs if k == "decision")
    dropped = sum(e["decisions_sampled_out"] for k, e in evs if k == "dropped")
    assert decisions < 30 and decisions + dropped == 30


async def test_slow_viewer_does_not_slow_routing_and_is_bounded(router):
    c = await router(2)
    app = c.server.app
    bc = app[CONTROL].broadcaster
    bc.buffer, bc.sndbuf = 50, 4096
    # A viewer that connects and never reads, with a tiny receive window.
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (c.server.host, c.server.port))
    await asyncio.get_running_loop().sock_sendall(
        sock, b"GET /kvtop/v1/events?hz=20&decisions=10000 HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        for _ in range(100):
            if bc.viewers:
                break
            await asyncio.sleep(0.01)
        (viewer,) = bc.viewers
        t0 = time.monotonic()
        for batch in range(10):
            await asyncio.gather(*(complete(c, f"s{batch}-{k}", prompt="y " * 2000) for k in range(30)))
        elapsed = time.monotonic() - t0
        assert len(viewer.queue) <= 50
        assert viewer.dropped_overflow > 0  # it fell behind and lost old events
        assert elapsed < 10  # 300 requests; routing did not wait on the viewer
        assert app[STATE].outcome_counts == {"ok": 300}
    finally:
        sock.close()


async def test_shutdown_closes_streams(aiohttp_server, tmp_path):
    be = await aiohttp_server(fake_vllm())
    cfg = RouterConfig(backends=[Backend("i0", str(be.make_url("")).rstrip("/"))], db=None,
                       control_token=TOKEN, state_dir=str(tmp_path))
    server = await aiohttp_server(create_app(cfg))
    import aiohttp

    async with aiohttp.ClientSession() as http:
        resp = await http.get(server.make_url("/kvtop/v1/events?hz=5"))
        await resp.content.readany()
        t0 = time.monotonic()
        await asyncio.wait_for(server.close(), 5)
        assert time.monotonic() - t0 < 3
        assert not server.app[CONTROL].broadcaster.viewers
        resp.close()


async def test_auth_endpoint_checks_a_token_and_changes_nothing(router_client, tmp_path):
    from router.app import STATE, Backend, RouterConfig, create_app

    cfg = RouterConfig(backends=[Backend("i0", "http://127.0.0.1:9")], db=None, control_token="t0k",
                       state_dir=str(tmp_path))
    client = await router_client(create_app(cfg))
    version = client.server.app[STATE].slot.version
    assert (await client.get("/kvtop/v1/auth")).status == 401
    assert (await client.get("/kvtop/v1/auth", headers={"Authorization": "Bearer nope"})).status == 401
    ok = await client.get("/kvtop/v1/auth", headers={"Authorization": "Bearer t0k"})
    assert ok.status == 200 and (await ok.json())["ok"] is True
    assert client.server.app[STATE].slot.version == version
    state = await (await client.get("/kvtop/v1/state")).json()
    assert state["router"]["db"] is None and "features" in state["router"]


async def test_state_shows_each_instances_measured_prefill_rate(router):
    """prefill_tps_measured: null before any first token, then tokens/s from the samples."""
    c = await router(2)
    s = await (await c.get("/kvtop/v1/state")).json()
    assert [(i["prefill_tps_measured"], i["prefill_tps_samples"]) for i in s["instances"]] == [(None, 0), (None, 0)]
    st = c.server.app[STATE]
    st.cluster.calibration.observe(1, 4000, 0, dispatched=10.0, first_token=12.0)
    s = await (await c.get("/kvtop/v1/state")).json()
    st.cluster.calibration.forget(1)
    assert s["instances"][1]["prefill_tps_measured"] == pytest.approx(2000.0)
    assert s["instances"][1]["prefill_tps_samples"] == 1
    assert s["instances"][0]["prefill_tps_measured"] is None
