"""The router end to end over real loopback HTTP: responses, counters, SQLite rows, 4xx.

Tests taking ``router_client`` run twice (tests/conftest.py): through pytest-aiohttp's test
server, and through the HTTP/1.1 front that `kvtop route` listens with (router/front.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import aiohttp
import sqlite_utils

from conftest import free_port
from fakevllm import CLOSED_PORT
from router.app import STATE, Backend, RouterConfig, create_app


async def start_router(router_client, urls, tmp_path, **kw):
    cfg = RouterConfig(backends=[Backend(f"i{k}", u) for k, u in enumerate(urls)],
                       db=str(tmp_path / "kvtop.db"), state_dir=str(tmp_path / "state"), **kw)
    client = await router_client(create_app(cfg))
    return client, client.server.app[STATE]


def rows(state, table):
    state.writer.flush()
    return list(sqlite_utils.Database(state.config.db)[table].rows)


async def read_sse(resp):
    events = []
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"data:"):
            events.append(line[5:].strip())
    return events


async def test_streaming_and_non_streaming(router_client, fake_backends, tmp_path):
    fakes = await fake_backends(2)
    client, state = await start_router(router_client, [u for _, u in fakes], tmp_path, policy="leastwork")
    prompt = list(range(2000))
    body = {"prompt": prompt, "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    r = await client.post("/v1/completions", json=body, headers={"X-Session-ID": "s1"})
    assert r.status == 200 and r.headers["X-Kvtop-Instance"] in ("i0", "i1")
    events = await read_sse(r)
    assert events[-1] == b"[DONE]" and len(events) == 7  # 5 tokens + usage + DONE
    # second turn, non-streaming: same session, longer prompt, lands where the cache is
    r2 = await client.post("/v1/completions", json={"prompt": prompt + [1] * 600, "max_tokens": 3},
                           headers={"X-Session-ID": "s1"})
    data = await r2.json()
    assert data["choices"][0]["text"] == "xxx"
    assert r2.headers["X-Kvtop-Instance"] == r.headers["X-Kvtop-Instance"]
    # chat streaming opens with an empty role delta, which is not the first token
    r3 = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi " * 50}], "stream": True, "max_tokens": 2})
    assert (await read_sse(r3))[-1] == b"[DONE]"

    assert state.cluster.counters_zero()
    d = rows(state, "decisions")
    o = {x["request_id"]: x for x in rows(state, "outcomes")}
    assert len(d) == 3 and len(o) == 3
    first, second, chat = d
    assert (first["turn"], second["turn"]) == (1, 2)
    assert second["est_hit_tokens"] == 1536  # 2000 tokens -> 3 full 512-blocks cached
    assert second["token_source"] == "tokens" and chat["token_source"] == "text_approx"
    assert first["policy"] == "leastwork" and first["policy_version"] == 1
    assert len(json.loads(first["scores"])) == 2
    of = o[first["request_id"]]
    assert of["status"] == "ok" and of["output_tokens"] == 5 and of["ttft_ms"] is not None
    assert of["delivered_hit_tokens"] == 0
    # the fake engine caches in 16-token blocks: all 2000 tokens of turn 1 (125 blocks)
    assert o[second["request_id"]]["delivered_hit_tokens"] == 2000
    assert o[second["request_id"]]["ttft_ms"] is None  # not observable without streaming


async def test_client_request_reaches_backend_unchanged(router_client, fake_backends, tmp_path):
    fakes = await fake_backends(1)
    client, _ = await start_router(router_client, [fakes[0][1]], tmp_path)
    raw = b'{"prompt": [1, 2, 3],   "max_tokens": 2, "extra_field": {"keep": "me"}}'
    r = await client.post("/v1/completions", data=raw, headers={"Content-Type": "application/json",
                                                                 "Authorization": "Bearer k"})
    assert r.status == 200
    assert fakes[0][0].raw[-1] == raw
    assert fakes[0][0].seen[-1]["headers"]["Authorization"] == "Bearer k"


BAD = [
    ("POST", "/v1/completions", b"{not json", 400),
    ("POST", "/v1/completions", b"\xff\xfe", 400),
    ("POST", "/v1/completions", b"", 400),
    ("POST", "/v1/completions", b'{"max_tokens": 3}', 400),
    ("POST", "/v1/completions", b'{"prompt": ""}', 400),
    ("POST", "/v1/completions", b'{"prompt": "hi", "stream": "yes"}', 400),
    ("POST", "/v1/completions", b'{"prompt": [1, "a"]}', 400),
    ("POST", "/v1/completions", b'{"prompt": [' + b",".join([b"1"] * 300) + b"]}", 400),  # over max 256
    ("POST", "/v1/chat/completions", b'{"messages": 3}', 400),
    ("GET", "/v1/nope", b"", 404),
    ("GET", "/v1/completions", b"", 405),
]


async def test_bad_input_gets_json_4xx_and_changes_nothing(router_client, fake_backends, tmp_path):
    fakes = await fake_backends(1)
    client, state = await start_router(router_client, [fakes[0][1]], tmp_path, max_input_tokens=256)
    for method, path, body, status in BAD:
        r = await client.request(method, path, data=body, headers={"Content-Type": "application/json"})
        assert r.status == status, (path, body[:40])
        err = (await r.json())["error"]
        assert err["message"] and err["code"] == status and "type" in err
    assert state.cluster.counters_zero()
    assert state.counts["requests"] == 0 and not fakes[0][0].seen
    r = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})
    assert r.status == 200, "the router keeps serving"
    assert len(rows(state, "decisions")) == 1


async def test_failed_backend_is_retried_once_elsewhere(router_client, fake_backends, tmp_path):
    fakes = await fake_backends(1)
    dead = f"http://127.0.0.1:{CLOSED_PORT}"
    client, state = await start_router(router_client, [dead, fakes[0][1]], tmp_path, policy="round_robin")
    r = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "stream": True})
    assert r.status == 200 and r.headers["X-Kvtop-Instance"] == "i1"
    await read_sse(r)
    d = rows(state, "decisions")
    assert [(x["attempt"], x["instance"], x["reason"]) for x in d] == [(1, "i0", "round_robin"), (2, "i1", "retry")]
    o = sorted(rows(state, "outcomes"), key=lambda x: x["attempt"])
    assert [x["status"] for x in o] == ["upstream_error", "ok"]
    assert state.cluster.counters_zero()


async def test_backend_500_retried_then_passed_through(router_client, fake_backends, tmp_path):
    fakes = await fake_backends(2)
    for f, _ in fakes:
        f.fail_status = 500
    client, state = await start_router(router_client, [u for _, u in fakes], tmp_path)
    r = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert r.status == 500 and "error" in await r.json()
    # both attempts failed on their instance (outlier detection counts each); the 500 passes through
    assert [x["status"] for x in rows(state, "outcomes")] == ["upstream_error", "upstream_error"]
    assert state.cluster.counters_zero()


async def test_backend_drop_mid_stream_ends_with_error_event(router_client, fake_backends, tmp_path):
    fakes = await fake_backends(1)
    fakes[0][0].drop_after = 2
    client, state = await start_router(router_client, [fakes[0][1]], tmp_path)
    r = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 10, "stream": True})
    events = await read_sse(r)
    assert b'"error"' in events[-1]
    assert [x["status"] for x in rows(state, "outcomes")] == ["upstream_error"]
    assert state.cluster.counters_zero()


async def test_client_disconnect_releases_counters(router_client, fake_backends, tmp_path):
    fakes = await fake_backends(1, token_delay=0.05)
    client, state = await start_router(router_client, [fakes[0][1]], tmp_path)
    r = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 200, "stream": True})
    await r.content.readline()
    assert state.cluster.in_flight == 1
    r.close()  # the client goes away mid-stream
    for _ in range(100):
        if state.cluster.in_flight == 0:
            break
        await asyncio.sleep(0.02)
    assert state.cluster.counters_zero()
    assert [x["status"] for x in rows(state, "outcomes")] == ["client_gone"]


async def test_no_healthy_instance_is_503(router_client, fake_backends, tmp_path):
    fakes = await fake_backends(1)
    client, state = await start_router(router_client, [fakes[0][1]], tmp_path)
    state.cluster.set_healthy(0, False)
    r = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
    assert r.status == 503 and (await r.json())["error"]["type"] == "ServiceUnavailableError"
    h = await client.get("/health")
    assert h.status == 503 and (await h.json())["status"] == "unavailable"


async def test_models_and_health(router_client, fake_backends, tmp_path):
    fakes = await fake_backends(2)
    client, _ = await start_router(router_client, [u for _, u in fakes], tmp_path)
    assert (await (await client.get("/v1/models")).json())["data"][0]["id"] == "fake-model"
    assert (await (await client.get("/health")).json())["status"] == "ok"


async def test_kvtop_route_process(fake_backends, tmp_path):
    """`kvtop route` as a real process: routes, writes the log, exits 0 on SIGTERM."""
    fakes = await fake_backends(2)
    port = free_port()
    db = tmp_path / "route.db"
    cmd = [sys.executable, "-m", "kvtop", "route", "--port", str(port), "--db", str(db),
           "--state-dir", str(tmp_path / "st"), "--policy", "unified"]
    for _, u in fakes:
        cmd += ["--backend", u]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 15
            while True:
                try:
                    async with http.get(base + "/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < deadline, proc.stderr.read1().decode() if proc.poll() else "no start"
                await asyncio.sleep(0.1)
            n = 12
            for k in range(n):
                body = {"prompt": list(range(k % 3, 1500)), "max_tokens": 3, "stream": k % 2 == 0,
                        "session_id": f"s{k % 3}"}
                async with http.post(base + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    await r.read()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err.decode()
    db = sqlite_utils.Database(db)
    assert db["decisions"].count == n and db["outcomes"].count == n
    assert {r["status"] for r in db["outcomes"].rows} == {"ok"}
    run = next(db["runs"].rows)
    assert run["ended_at"] is not None and run["policy"] == "unified"
    # turns 2+ of each session landed where their first turn's blocks are cached
    turns = list(db.query("select session_id, instance from decisions order by id"))
    for s in ("s0", "s1", "s2"):
        assert len({t["instance"] for t in turns if t["session_id"] == s}) == 1


def test_route_rejects_bad_config(tmp_path):
    env = {**os.environ}
    for args, msg in [
        (["--backend", "http://127.0.0.1:9", "--policy", "nope"], "unknown policy"),
        (["--backend", "http://127.0.0.1:9", "--knob", "overload_factor=-1"], "overload_factor"),
        (["--backend", "nohttp"], "expected http://HOST:PORT"),
        (["--backend", f"http://127.0.0.1:{CLOSED_PORT}", "--db", "none"], "no backend answered"),
    ]:
        p = subprocess.run([sys.executable, "-m", "kvtop", "route", *args], capture_output=True,
                           text=True, timeout=30, env=env, cwd=tmp_path)
        assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1


async def test_client_leaving_after_done_is_still_ok(router_client, fake_backends, tmp_path):
    """A client may drop the connection once it has [DONE], before the stream's terminator:
    the response was delivered whole, so the outcome is ok and the instance is not blamed."""
    fakes = await fake_backends(1)
    fakes[0][0].linger_after_done = 0.3
    client, state = await start_router(router_client, [fakes[0][1]], tmp_path)
    r = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, "stream": True})
    async for line in r.content:
        if line.strip() == b"data: [DONE]":
            break
    r.close()
    for _ in range(100):
        if state.cluster.in_flight == 0:
            break
        await asyncio.sleep(0.02)
    assert [x["status"] for x in rows(state, "outcomes")] == ["ok"]
    assert state.cluster.instances[0].errors_total == 0


async def test_client_gone_does_not_count_as_instance_error(router_client, fake_backends, tmp_path):
    fakes = await fake_backends(1, token_delay=0.05)
    client, state = await start_router(router_client, [fakes[0][1]], tmp_path)
    r = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 200, "stream": True})
    await r.content.readline()
    r.close()
    for _ in range(100):
        if state.cluster.in_flight == 0:
            break
        await asyncio.sleep(0.02)
    assert [x["status"] for x in rows(state, "outcomes")] == ["client_gone"]
    assert state.cluster.instances[0].errors_total == 0


def test_done_inside_generated_text_is_not_the_end_of_the_stream():
    from router.forward import StreamScan

    scan = StreamScan()
    scan.feed(b'data: {"choices":[{"text":"say [DONE] now"}]}\n\n')
    assert not scan.saw_done, "[DONE] in the model's text is not the closing event"
    scan.feed(b"data: [DONE]\n\n")
    assert scan.saw_done


async def test_upstream_read_timeout_is_recorded_as_timeout(router_client, fake_backends, tmp_path):
    fakes = await fake_backends(1, token_delay=0.5)
    client, state = await start_router(router_client, [fakes[0][1]], tmp_path, read_timeout_s=0.2)
    r = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 5, "stream": True})
    events = await read_sse(r)
    assert b'"error"' in events[-1]
    assert [x["status"] for x in rows(state, "outcomes")] == ["timeout"]
    assert state.cluster.counters_zero()


async def test_expect_100_continue_gets_each_client_its_own_answer(router_client, fake_backends, tmp_path):
    # curl sends Expect: 100-continue on its own for large bodies (long prompts)
    fakes = await fake_backends(1)
    client, state = await start_router(router_client, [fakes[0][1]], tmp_path)
    for n in (2, 5):
        async with asyncio.timeout(5):  # a client waiting for an answer that never comes fails, not hangs
            r = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": n}, expect100=True)
            assert r.status == 200 and (await r.json())["choices"][0]["text"] == "x" * n
    assert [x["status"] for x in rows(state, "outcomes")] == ["ok", "ok"]
