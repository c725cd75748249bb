"""The HTTP/1.1 front `kvtop route` listens with (router/front.py), over raw sockets.

Clients see HTTP/1.1 only through this server: keep-alive, pipelining, chunked and
100-continue bodies, the JSON 4xx it answers itself, the relay of everything that is not
the data plane to the aiohttp application, and the bookkeeping of streams that end early.
The routing logic behind it is tested through both serving paths in test_router_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
import sqlite_utils

from router.app import Backend, RouterConfig, create_app
from router.policies import DEFAULT_POLICY

TOKEN = "front-test-token"
#: bound on every network wait, so a server that never answers fails the test instead of hanging it
WAIT_S = 5.0


async def start(router_server, fake_backends, tmp_path, n=1, fake_kw=None, **kw):
    fakes = await fake_backends(n, **(fake_kw or {}))
    cfg = RouterConfig(backends=[Backend(f"i{k}", u) for k, (_, u) in enumerate(fakes)],
                       db=str(tmp_path / "kvtop.db"), state_dir=str(tmp_path / "state"),
                       control_token=TOKEN, **kw)
    router = await router_server(create_app(cfg))
    return router, [f for f, _ in fakes]


def rows(state, table):
    state.writer.flush()
    return list(sqlite_utils.Database(state.config.db)[table].rows)


async def wait_for(cond, timeout=WAIT_S):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


# -- a minimal HTTP/1.1 client: exactly the bytes we mean, and the framing as it came --------

def post(path: str, body: bytes, *extra: str) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\n" + "".join(h + "\r\n" for h in extra)
    return head.encode() + b"\r\n" + body


def with_expect(raw_head: bytes, length: int) -> bytes:
    """A request head announcing ``length`` bytes of body that will follow a 100 Continue."""
    return raw_head.replace(b"Content-Length: 0", b"Content-Length: %d" % length)


def get(path: str, *extra: str) -> bytes:
    return (f"GET {path} HTTP/1.1\r\nHost: t\r\n" + "".join(h + "\r\n" for h in extra) + "\r\n").encode()


def completion(max_tokens=2, stream=False, **kw) -> bytes:
    return json.dumps({"prompt": [1, 2, 3], "max_tokens": max_tokens, "stream": stream, **kw}).encode()


class Resp:
    def __init__(self, status: int, headers: dict[str, str], body: bytes, chunked: bool):
        self.status = status
        self.headers = headers
        self.body = body
        self.chunked = chunked

    def json(self):
        return json.loads(self.body)


async def read_head(reader) -> tuple[int, dict[str, str]]:
    async with asyncio.timeout(WAIT_S):
        line = await reader.readline()
        assert line.startswith((b"HTTP/1.1 ", b"HTTP/1.0 ")), line  # 1.0: an answer to bytes that were not a request
        status = int(line.split()[1])
        headers: dict[str, str] = {}
        while (h := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = h.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
    return status, headers


async def read_chunk(reader) -> bytes:
    """One chunk of a chunked body; b"" for the last one."""
    async with asyncio.timeout(WAIT_S):
        size = int((await reader.readline()).split(b";")[0], 16)
        data = await reader.readexactly(size)
        assert await reader.readexactly(2) == b"\r\n"
    if size == 0:
        return b""
    return data


async def read_response(reader) -> Resp:
    status, headers = await read_head(reader)
    if 100 <= status < 200 or status in (204, 304):  # no body, and no framing header
        assert "content-length" not in headers or status >= 300, headers
        return Resp(status, headers, b"", False)
    if headers.get("transfer-encoding") == "chunked":
        parts = []
        while chunk := await read_chunk(reader):
            parts.append(chunk)
        return Resp(status, headers, b"".join(parts), True)
    assert "content-length" in headers, headers  # the front always frames its answers
    async with asyncio.timeout(WAIT_S):
        body = await reader.readexactly(int(headers["content-length"]))
    return Resp(status, headers, body, False)


async def closed_by_server(reader) -> bool:
    """True when the server closes the connection (EOF) with nothing more to say."""
    try:
        async with asyncio.timeout(WAIT_S):
            return await reader.read() == b""
    except (ConnectionResetError, TimeoutError):
        return False


async def connect(router):
    return await asyncio.open_connection(router.host, router.port)


def assert_json_error(resp: Resp, status: int):
    assert resp.status == status and resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert err["code"] == status and err["message"] and err["type"]


# -- HTTP/1.1 ---------------------------------------------------------------------------

async def test_keep_alive_serves_two_requests_on_one_connection(router_server, fake_backends, tmp_path):
    router, (fake,) = await start(router_server, fake_backends, tmp_path)
    reader, writer = await connect(router)
    for n in (2, 3):
        writer.write(post("/v1/completions", completion(max_tokens=n)))
        r = await read_response(reader)
        assert r.status == 200 and r.json()["choices"][0]["text"] == "x" * n
        assert "close" not in r.headers.get("connection", "")
    assert len(fake.seen) == 2 and not reader.at_eof()
    writer.close()


async def test_pipelined_requests_are_answered_in_order(router_server, fake_backends, tmp_path):
    # the fake takes token_delay per token: the first request is answered last unless the
    # front keeps its answers in request order
    router, (fake,) = await start(router_server, fake_backends, tmp_path, fake_kw={"token_delay": 0.05})
    reader, writer = await connect(router)
    writer.write(post("/v1/completions", completion(max_tokens=6))
                 + get("/health")
                 + post("/v1/completions", completion(max_tokens=1)))
    first, second, third = [await read_response(reader) for _ in range(3)]
    assert first.json()["choices"][0]["text"] == "xxxxxx"
    assert second.json()["status"] == "ok"  # GET /health, relayed to the app
    assert third.json()["choices"][0]["text"] == "x"
    writer.close()


async def test_pipelining_past_the_read_pause_bound(router_server, fake_backends, tmp_path):
    # more requests in one write than the front parses ahead (it pauses reading, then resumes)
    router, (fake,) = await start(router_server, fake_backends, tmp_path, fake_kw={"token_delay": 0.005})
    n = 30
    reader, writer = await connect(router)
    writer.write(b"".join(post("/v1/completions", completion(max_tokens=1 + k % 4)) if k % 2 == 0
                          else get("/health") for k in range(n)))
    for k in range(n):
        r = await read_response(reader)
        assert r.status == 200, k
        if k % 2 == 0:
            assert r.json()["choices"][0]["text"] == "x" * (1 + k % 4), k
        else:
            assert r.json()["status"] == "ok", k
    assert len(fake.seen) == n // 2 and router.state.cluster.counters_zero()
    writer.close()


async def test_requests_before_malformed_bytes_are_still_answered(router_server, fake_backends, tmp_path):
    # aiohttp's parser drops whole requests that arrive in the same read as the bad bytes, so
    # the garbage follows once the first answer is back (as any client that waits does)
    router, (fake,) = await start(router_server, fake_backends, tmp_path)
    reader, writer = await connect(router)
    writer.write(post("/v1/completions", completion(max_tokens=2)))
    r = await read_response(reader)
    assert r.status == 200 and r.json()["choices"][0]["text"] == "xx"
    writer.write(b"\x00 garbage\r\n\r\n")
    assert_json_error(await read_response(reader), 400)
    assert await closed_by_server(reader)
    writer.close()


async def test_100_continue_waits_for_the_answer_before_it(router_server, fake_backends, tmp_path):
    router, _ = await start(router_server, fake_backends, tmp_path, fake_kw={"token_delay": 0.05})
    body = json.dumps({"name": "round_robin"}).encode()
    reader, writer = await connect(router)
    writer.write(post("/v1/completions", completion(max_tokens=6, stream=True)))
    status, headers = await read_head(reader)
    assert status == 200 and headers["transfer-encoding"] == "chunked"
    # the next request is pipelined while the stream is still going
    writer.write(with_expect(post("/kvtop/v1/policy", b"", f"Authorization: Bearer {TOKEN}",
                                  "Expect: 100-continue").replace(b"POST", b"PUT", 1), len(body)))
    events = []
    while chunk := await read_chunk(reader):  # the stream's framing must stay intact
        events.append(chunk)
    assert events[-1].strip() == b"data: [DONE]"
    assert (await read_response(reader)).status == 100
    writer.write(body)
    assert (await read_response(reader)).status == 200
    writer.close()


async def test_chunked_request_body_reaches_the_backend_whole(router_server, fake_backends, tmp_path):
    router, (fake,) = await start(router_server, fake_backends, tmp_path)
    body = completion(max_tokens=2)
    parts = [body[:5], body[5:11], body[11:]]
    reader, writer = await connect(router)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
    for p in parts:
        writer.write(b"%x\r\n%b\r\n" % (len(p), p))
        await writer.drain()
        await asyncio.sleep(0.02)  # separate reads on the server side
    writer.write(b"0\r\n\r\n")
    r = await read_response(reader)
    assert r.status == 200 and r.json()["choices"][0]["text"] == "xx"
    assert fake.raw == [body]
    writer.close()


async def test_expect_100_continue_on_a_relayed_request(router_server, fake_backends, tmp_path):
    router, _ = await start(router_server, fake_backends, tmp_path)
    body = json.dumps({"name": "round_robin"}).encode()
    reader, writer = await connect(router)
    writer.write(with_expect(post("/kvtop/v1/policy", b"", f"Authorization: Bearer {TOKEN}",
                                  "Expect: 100-continue").replace(b"POST", b"PUT", 1), len(body)))
    # the client waits for the go-ahead before it sends the body
    assert (await read_response(reader)).status == 100
    writer.write(body)
    r = await read_response(reader)
    assert r.status == 200 and r.json()["name"] == "round_robin"
    writer.close()


async def test_expect_100_continue_on_a_completion(router_server, fake_backends, tmp_path):
    router, (fake,) = await start(router_server, fake_backends, tmp_path)
    body = completion(max_tokens=2)
    reader, writer = await connect(router)
    writer.write(with_expect(post("/v1/completions", b"", "Expect: 100-continue"), len(body)))
    assert (await read_response(reader)).status == 100
    assert not fake.seen
    writer.write(body)
    r = await read_response(reader)
    assert r.status == 200 and r.json()["choices"][0]["text"] == "xx"
    assert fake.raw == [body]
    writer.close()


async def test_expect_100_continue_does_not_desync_the_upstream_pool(router_server, fake_backends, tmp_path):
    # what a client sees is its own answer, whatever the request before it on the same
    # pooled upstream connection did
    router, (fake,) = await start(router_server, fake_backends, tmp_path)
    body = completion(max_tokens=2)
    reader, writer = await connect(router)
    writer.write(post("/v1/completions", body, "Expect: 100-continue"))  # body sent at once, as curl may
    await wait_for(lambda: len(fake.seen) == 1)
    await asyncio.sleep(0.2)  # whatever this request's answer was, it is over
    writer.close()
    reader, writer = await connect(router)
    writer.write(post("/v1/completions", completion(max_tokens=5)))
    r = await read_response(reader)
    assert r.status == 200 and r.json()["choices"][0]["text"] == "xxxxx"
    writer.close()


TOO_BIG = [
    # (why, the bytes sent)
    ("declared length over the limit: refused before the body is read",
     b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 5000\r\n\r\n" + b"{" * 100),
    ("chunked body that grows past the limit",
     b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
     + b"400\r\n" + b" " * 0x400 + b"\r\n" + b"400\r\n" + b" " * 0x400 + b"\r\n"),
    ("control API body over the limit (the server bounds every body)",
     b"PUT /kvtop/v1/policy HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer " + TOKEN.encode()
     + b"\r\nContent-Length: 4096\r\n\r\n" + b" " * 4096),
]


@pytest.mark.parametrize("why,raw", TOO_BIG, ids=[w.split(":")[0] for w, _ in TOO_BIG])
async def test_body_over_max_body_bytes_is_json_413_and_closes(router_server, fake_backends, tmp_path, why, raw):
    router, (fake,) = await start(router_server, fake_backends, tmp_path, max_body_bytes=1024)
    reader, writer = await connect(router)
    writer.write(raw)
    r = await read_response(reader)
    assert_json_error(r, 413)
    assert r.headers.get("connection") == "close"
    assert await closed_by_server(reader)
    assert not fake.seen and router.state.counts["requests"] == 0
    writer.close()


async def test_body_that_stops_arriving_is_json_408(router_server, fake_backends, tmp_path):
    router, (fake,) = await start(router_server, fake_backends, tmp_path, client_timeout_s=0.3)
    reader, writer = await connect(router)
    t0 = time.monotonic()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
    r = await read_response(reader)
    took = time.monotonic() - t0
    assert_json_error(r, 408)
    assert 0.25 <= took < 2.0, took
    assert await closed_by_server(reader)
    assert not fake.seen and router.state.cluster.counters_zero()
    writer.close()


async def test_idle_keep_alive_connection_is_not_timed_out(router_server, fake_backends, tmp_path):
    # --client-timeout bounds a request that has begun, not the wait between requests
    router, _ = await start(router_server, fake_backends, tmp_path, client_timeout_s=0.2)
    reader, writer = await connect(router)
    writer.write(post("/v1/completions", completion()))
    assert (await read_response(reader)).status == 200
    await asyncio.sleep(0.5)
    writer.write(post("/v1/completions", completion()))
    assert (await read_response(reader)).status == 200
    writer.close()


GARBAGE = [
    # (why, the bytes sent)
    ("binary noise", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(40)) + b"\r\n\r\n"),
    ("a header line without a colon", b"GET /health HTTP/1.1\r\nHost: t\r\nno colon here\r\n\r\n"),
    ("a negative content length", b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: -5\r\n\r\n"),
    ("content length and chunked together (request smuggling)",
     b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
    ("an invalid chunk size", b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                              b"zz\r\nabc\r\n"),
]


@pytest.mark.parametrize("why,raw", GARBAGE, ids=[w for w, _ in GARBAGE])
async def test_malformed_request_is_json_400_and_closes(router_server, fake_backends, tmp_path, why, raw):
    router, (fake,) = await start(router_server, fake_backends, tmp_path)
    reader, writer = await connect(router)
    writer.write(raw)
    r = await read_response(reader)
    assert_json_error(r, 400)
    assert await closed_by_server(reader)
    assert not fake.seen and router.state.counts["bad_requests"] == 1
    writer.close()


async def test_upgrade_to_another_protocol_is_never_switched(router_server, fake_backends, tmp_path):
    # RFC 9110 lets a server ignore Upgrade: the request is answered as plain HTTP/1.1, no 101
    router, _ = await start(router_server, fake_backends, tmp_path)
    reader, writer = await connect(router)
    writer.write(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n")
    r = await read_response(reader)
    assert r.status == 200 and r.json()["status"] == "ok"
    writer.close()


@pytest.mark.parametrize("raw", [
    post("/v1/completions", completion(), "Connection: close"),
    get("/health", "Connection: close"),  # relayed: the front, not the app, owns the connection
    b"GET /health HTTP/1.0\r\n\r\n",  # HTTP/1.0 without keep-alive closes by default
], ids=["data plane", "relayed", "http/1.0"])
async def test_connection_close_closes_after_the_answer(router_server, fake_backends, tmp_path, raw):
    router, _ = await start(router_server, fake_backends, tmp_path)
    reader, writer = await connect(router)
    writer.write(raw)
    r = await read_response(reader)
    # HTTP/1.0 without keep-alive closes by default: no header needed to say so
    assert r.status == 200 and (r.headers.get("connection") == "close" or raw.startswith(b"GET /health HTTP/1.0"))
    assert await closed_by_server(reader)
    writer.close()


# -- the relay to the aiohttp application ------------------------------------------------

async def test_unknown_path_gets_the_apps_json_404(router_server, fake_backends, tmp_path):
    router, _ = await start(router_server, fake_backends, tmp_path)
    reader, writer = await connect(router)
    writer.write(get("/v1/nope?x=1"))
    r = await read_response(reader)
    assert_json_error(r, 404)
    assert r.json()["error"]["message"] == "no route for GET /v1/nope"  # router/app.py json_errors
    writer.write(get("/v1/completions"))  # the data plane's path, wrong method: the app's 405
    r = await read_response(reader)
    assert_json_error(r, 405)
    writer.close()


async def test_control_state_through_the_relay(router_server, fake_backends, tmp_path):
    router, _ = await start(router_server, fake_backends, tmp_path, n=2)
    reader, writer = await connect(router)
    writer.write(get("/kvtop/v1/state"))
    r = await read_response(reader)
    assert r.status == 200
    snap = r.json()
    assert snap["router"]["run_id"] == router.state.run_id
    assert snap["router"]["url"] == router.url  # the harness binds first, as serve() does
    assert [i["name"] for i in snap["instances"]] == ["i0", "i1"]
    writer.close()


async def test_control_mutation_needs_the_token_through_the_relay(router_server, fake_backends, tmp_path):
    router, _ = await start(router_server, fake_backends, tmp_path)
    body = json.dumps({"name": "round_robin"}).encode()
    reader, writer = await connect(router)
    writer.write(post("/kvtop/v1/policy", body).replace(b"POST", b"PUT", 1))
    assert_json_error(await read_response(reader), 401)
    assert router.state.slot.policy.name == DEFAULT_POLICY  # unchanged
    writer.write(post("/kvtop/v1/policy", body, f"Authorization: Bearer {TOKEN}").replace(b"POST", b"PUT", 1))
    r = await read_response(reader)
    assert r.status == 200 and r.json()["name"] == "round_robin"
    assert router.state.slot.policy.name == "round_robin"
    writer.close()


async def test_control_event_stream_through_the_relay(router_server, fake_backends, tmp_path):
    router, _ = await start(router_server, fake_backends, tmp_path)
    broadcaster = _broadcaster(router)
    reader, writer = await connect(router)
    writer.write(get("/kvtop/v1/events?types=state,decision&hz=20"))
    status, headers = await read_head(reader)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert headers["transfer-encoding"] == "chunked"
    assert len(broadcaster.viewers) == 1
    async with aiohttp.ClientSession() as http:
        async with http.post(router.url + "/v1/completions", data=completion()) as resp:
            assert resp.status == 200
    seen: set[str] = set()
    buf = b""
    while not {"state", "decision"} <= seen:
        buf += await read_chunk(reader)
        *events, buf = buf.split(b"\n\n")
        for ev in events:
            for line in ev.split(b"\n"):
                if line.startswith(b"event: "):
                    seen.add(line[7:].decode())
    # a viewer that leaves the front leaves the application too: the relay's connection closes
    writer.close()
    await wait_for(lambda: not broadcaster.viewers)


async def test_head_request_through_the_relay(router_server, fake_backends, tmp_path):
    # HEAD /health is what many load balancers probe with; aiohttp answers HEAD on GET routes
    router, _ = await start(router_server, fake_backends, tmp_path)
    reader, writer = await connect(router)
    writer.write(b"HEAD /health HTTP/1.1\r\nHost: t\r\n\r\n")
    status, headers = await read_head(reader)
    assert status == 200
    # a HEAD answer has no body: the next answer on the connection starts right after the head
    writer.write(get("/health"))
    r = await read_response(reader)
    assert r.status == 200 and r.json()["status"] == "ok"
    writer.close()


# -- the data plane ---------------------------------------------------------------------

async def test_streaming_completion_is_chunked_sse_and_logged(router_server, fake_backends, tmp_path):
    router, (fake,) = await start(router_server, fake_backends, tmp_path)
    state = router.state
    reader, writer = await connect(router)
    writer.write(post("/v1/completions", completion(max_tokens=4, stream=True,
                                                   stream_options={"include_usage": True})))
    r = await read_response(reader)
    assert r.status == 200 and r.chunked
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-kvtop-instance"] == "i0"
    events = [e for e in r.body.split(b"\n\n") if e]
    assert len(events) == 6 and events[-1] == b"data: [DONE]"  # 4 tokens, usage, [DONE]
    (d,) = rows(state, "decisions")
    (o,) = rows(state, "outcomes")
    assert d["request_id"] == o["request_id"] == r.headers["x-kvtop-request-id"]
    assert d["instance"] == "i0" and d["attempt"] == 1
    assert o["status"] == "ok" and o["stream"] == 1 and o["output_tokens"] == 4
    assert o["http_status"] == 200 and o["ttft_ms"] is not None
    assert state.cluster.counters_zero()
    writer.close()


async def test_client_leaving_mid_stream_is_client_gone(router_server, fake_backends, tmp_path):
    router, (fake,) = await start(router_server, fake_backends, tmp_path, fake_kw={"token_delay": 0.05})
    state = router.state
    reader, writer = await connect(router)
    writer.write(post("/v1/completions", completion(max_tokens=200, stream=True)))
    status, _ = await read_head(reader)
    assert status == 200
    assert b"data: " in await read_chunk(reader)
    assert state.cluster.in_flight == 1
    writer.close()
    await wait_for(lambda: state.cluster.in_flight == 0)
    assert state.cluster.counters_zero()
    assert [x["status"] for x in rows(state, "outcomes")] == ["client_gone"]
    assert state.cluster.instances[0].errors_total == 0  # a client leaving says nothing of the instance


async def test_client_leaving_before_a_non_streaming_answer_is_client_gone(router_server, fake_backends, tmp_path):
    router, (fake,) = await start(router_server, fake_backends, tmp_path, fake_kw={"first_delay": 0.3})
    state = router.state
    reader, writer = await connect(router)
    writer.write(post("/v1/completions", completion(max_tokens=2)))
    await wait_for(lambda: fake.seen)
    writer.close()
    await wait_for(lambda: state.cluster.in_flight == 0)
    assert [x["status"] for x in rows(state, "outcomes")] == ["client_gone"]


async def test_hundred_concurrent_requests(router_server, fake_backends, tmp_path):
    router, fakes = await start(router_server, fake_backends, tmp_path, n=2, fake_kw={"token_delay": 0.01})
    state = router.state
    n = 100
    peak = 0

    async def one(k: int, http) -> bytes:
        nonlocal peak
        body = completion(max_tokens=3, stream=k % 2 == 0, session_id=f"s{k % 10}")
        async with http.post(router.url + "/v1/completions", data=body) as r:
            peak = max(peak, state.cluster.in_flight)
            assert r.status == 200
            return await r.read()

    # one connection each: the front, not a client-side pool, carries the concurrency
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn) as http:
        bodies = await asyncio.wait_for(asyncio.gather(*(one(k, http) for k in range(n))), 30)
    assert all(b.rstrip().endswith(b"data: [DONE]") for b in bodies[0::2])
    assert all(json.loads(b)["choices"][0]["text"] == "xxx" for b in bodies[1::2])
    assert peak > 1, "the requests overlapped"
    assert state.cluster.in_flight == 0 and state.cluster.counters_zero()
    assert state.counts["requests"] == n
    assert sum(len(f.seen) for f in fakes) == n
    outcomes = rows(state, "outcomes")
    assert len(outcomes) == n and {o["status"] for o in outcomes} == {"ok"}
    assert len(rows(state, "decisions")) == n


def _broadcaster(router):
    from router.control import CONTROL

    return router.app[CONTROL].broadcaster
