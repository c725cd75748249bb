"""Review of the HTTP/1.1 front (router/front.py) and its upstream pool (router/upstream.py).

Each xfail(strict=True) test is a bug found in review, written as the behaviour a client or
the on-call engineer expects; its reason names the line and what happens instead. The plain
tests pin behaviour nothing else covers through the front: the memory bound under a stalled
reader, a backend that frames its answer by closing or answers 204, a total timeout
mid-stream, and a body of several MB arriving in many reads.

Backends are FakeVLLM (tests/fakevllm.py) or, where exact bytes matter, ``RawBackend``: a
scripted HTTP/1.1 server on a loopback socket.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import pytest
from test_server import (TOKEN, WAIT_S, assert_json_error, closed_by_server, completion, connect, get,
                        post, read_chunk, read_head, read_response, rows, start, wait_for)

from router.app import Backend, RouterConfig, create_app

#: one block of SSE events, the unit a RawBackend streams (about 64 KiB)
EVENTS = b'data: {"choices":[{"index":0,"text":"x"}]}\n\n' * 1500


class RawBackend:
    """A scripted HTTP/1.1 backend: each POST is answered by ``script(backend, writer)``
    (returning whether to keep the connection); any other request gets an empty 404."""

    def __init__(self, script):
        self.script = script
        self.posts = 0
        self.bodies: list[bytes] = []
        self.sent = 0  # body bytes the script got written (past the kernel's buffers)
        self.tasks: set[asyncio.Task] = set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return "http://127.0.0.1:%d" % self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader, writer):
        self.tasks.add(asyncio.current_task())
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                m = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                body = await reader.readexactly(int(m.group(1)) if m else 0)
                if not head.startswith(b"POST "):
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                    continue
                self.posts += 1
                self.bodies.append(body)
                if not await self.script(self, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def stream(self, writer, total: int) -> None:
        """A 200 SSE answer of ``total`` bytes of events, chunked, as fast as it is read."""
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        left = total
        while left > 0:
            piece = EVENTS[:left]
            writer.write(b"%x\r\n%b\r\n" % (len(piece), piece))
            await writer.drain()
            self.sent += len(piece)
            left -= len(piece)
        done = b"data: [DONE]\n\n"
        writer.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(done), done))
        await writer.drain()

    def close(self) -> None:
        self.server.close()
        for t in self.tasks:
            t.cancel()


@pytest.fixture
async def raw_backend():
    made: list[RawBackend] = []

    async def make(script) -> tuple[RawBackend, str]:
        b = RawBackend(script)
        made.append(b)
        return b, await b.start()

    yield make
    for b in made:
        b.close()


async def start_raw(router_server, url: str, tmp_path, **kw):
    # no active health checks: the scripted backend answers only what the test scripts
    cfg = RouterConfig(backends=[Backend("i0", url)], db=str(tmp_path / "kvtop.db"),
                       state_dir=str(tmp_path / "state"), control_token=TOKEN,
                       health_interval_s=0, **kw)
    return await router_server(create_app(cfg))


async def connect_small(router, rcvbuf: int = 4096):
    """A client socket with a small receive window, so that a reader that stops reading
    pushes back on the front after a few KiB instead of the kernel's megabytes."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.setblocking(False)
    await asyncio.get_running_loop().sock_connect(s, (router.host, router.port))
    return await asyncio.open_connection(sock=s)


def upstream_paused(router) -> bool:
    """True once the front has paused reading from the backend (its own flow control)."""
    return any(c.paused for c in router.state.upstream._open)


def front_buffered(router) -> int:
    """Answer bytes the router holds in user space: client write buffers and upstream reads."""
    out = sum(h.transport.get_write_buffer_size() for h in router.runner.server.connections
              if h.transport is not None)
    return out + sum(c.buffered for c in router.state.upstream._open)


# -- answers larger than the upstream read buffer ---------------------------------------------

async def test_non_streaming_answer_over_256k_reaches_the_client(router_server, fake_backends, tmp_path):
    # 2M characters of text (2 MB): what n>1, logprobs or echo+prompt_logprobs make of ordinary prompts
    router, (fake,) = await start(router_server, fake_backends, tmp_path, read_timeout_s=1.0)
    reader, writer = await connect(router)
    writer.write(post("/v1/completions", completion(max_tokens=2_000_000)))
    r = await read_response(reader)
    assert r.status == 200, r.body[:200]
    assert len(r.json()["choices"][0]["text"]) == 2_000_000
    assert router.state.cluster.counters_zero()
    writer.close()


async def test_relayed_answer_over_256k_reaches_the_client(router_server, fake_backends, tmp_path):
    router, _ = await start(router_server, fake_backends, tmp_path)
    reader, writer = await connect(router)
    writer.write(post("/v1/completions", completion()))
    assert (await read_response(reader)).status == 200
    state = router.state
    # a full ring of real decisions, as after a few minutes of traffic
    state.ring.extend([dict(state.ring[-1])] * (state.ring.maxlen - 1))
    writer.write(get(f"/kvtop/v1/decisions?limit={state.ring.maxlen}"))
    r = await read_response(reader)
    assert len(r.body) > 256 * 1024, "the answer must be larger than the read buffer"
    assert r.status == 200 and len(r.json()["decisions"]) == state.ring.maxlen
    writer.close()


# -- request heads ------------------------------------------------------------------------------

HUGE_HEADS = [
    # (why, the bytes sent: a request head that never ends)
    ("header line", b"GET /health HTTP/1.1\r\nHost: t\r\nX-Pad: " + b"a" * (1 << 20)),
    ("request target", b"GET /health?" + b"a" * (1 << 20)),
]


@pytest.mark.parametrize("why,raw", HUGE_HEADS, ids=[w for w, _ in HUGE_HEADS])
async def test_oversized_request_head_is_refused_early(router_server, fake_backends, tmp_path, why, raw):
    router, _ = await start(router_server, fake_backends, tmp_path, client_timeout_s=30)
    reader, writer = await connect(router)
    try:
        writer.write(raw)
        await writer.drain()
    except ConnectionError:
        pass  # refused while it was still arriving: what we want
    r = await read_response(reader)
    assert r.status in (400, 431), r.status
    assert_json_error(r, r.status)
    try:  # closed: EOF, or a reset since the client is still sending the rest of its head
        assert await reader.read() == b""
    except ConnectionResetError:
        pass
    writer.close()


# -- slow and stalled readers -----------------------------------------------------------------

async def test_stalled_reader_bounds_the_routers_memory(raw_backend, router_server, tmp_path):
    # the backend offers 256 MiB; the client reads the head and stops. What the router holds
    # stays bounded (front write buffer + upstream read buffer) and the backend is held back.
    backend, url = await raw_backend(lambda b, w: b.stream(w, 256 << 20))
    router = await start_raw(router_server, url, tmp_path)
    reader, writer = await connect_small(router)
    writer.write(post("/v1/completions", completion(stream=True)))
    status, _ = await read_head(reader)
    assert status == 200
    await wait_for(lambda: upstream_paused(router))
    peak = 0
    for _ in range(20):
        peak = max(peak, front_buffered(router))
        await asyncio.sleep(0.05)
    assert 0 < peak < 2 << 20, peak
    assert backend.sent < 128 << 20, backend.sent  # kernel buffers only; not the whole answer
    writer.close()
    await wait_for(lambda: router.state.cluster.in_flight == 0)
    assert [o["status"] for o in rows(router.state, "outcomes")] == ["client_gone"]


async def test_slow_reader_is_not_an_upstream_timeout(raw_backend, router_server, tmp_path):
    total = 16 << 20
    backend, url = await raw_backend(lambda b, w: b.stream(w, total))
    router = await start_raw(router_server, url, tmp_path, read_timeout_s=1.0, client_timeout_s=30)
    reader, writer = await connect_small(router)
    writer.write(post("/v1/completions", completion(stream=True)))
    status, _ = await read_head(reader)
    assert status == 200
    await wait_for(lambda: upstream_paused(router))
    await asyncio.sleep(2.0)  # the client is busy; the backend is healthy and waiting
    body = bytearray()
    while chunk := await read_chunk(reader):
        body += chunk
    assert b"failed mid-stream" not in body[-400:]
    assert body.endswith(b"data: [DONE]\n\n") and len(body) > total
    (o,) = rows(router.state, "outcomes")
    assert o["status"] == "ok", o["error"]
    assert router.state.cluster.instances[0].errors_total == 0
    writer.close()


async def test_stalled_reader_does_not_hold_its_request_for_ever(raw_backend, router_server, tmp_path):
    backend, url = await raw_backend(lambda b, w: b.stream(w, 1 << 30))
    router = await start_raw(router_server, url, tmp_path, read_timeout_s=1.0, client_timeout_s=1.0)
    state = router.state
    reader, writer = await connect_small(router)
    writer.write(post("/v1/completions", completion(stream=True)))
    status, _ = await read_head(reader)
    assert status == 200
    await wait_for(lambda: upstream_paused(router))
    # the client never reads again, and never closes
    await wait_for(lambda: not state.upstream._open, timeout=4)  # the watchdog gave up on it
    await wait_for(lambda: state.cluster.in_flight == 0, timeout=4)
    assert state.cluster.counters_zero()
    writer.close()


# -- backends that frame their answers unusually ----------------------------------------------

async def _close_delimited(b, w):
    w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n")
    w.write(json.dumps({"choices": [{"index": 0, "text": "xy"}],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 2}}).encode())
    await w.drain()
    return False


async def _no_content(b, w):
    w.write(b"HTTP/1.1 204 No Content\r\n\r\n")
    return True


@pytest.mark.parametrize("script,status,body", [
    # an answer without Content-Length whose end is the connection's close
    (_close_delimited, 200, b'"text": "xy"'),
    # 204 has no body whatever its headers say; the pooled connection stays in step
    (_no_content, 204, b""),
], ids=["close-delimited", "204"])
async def test_backend_framing_reaches_the_client_intact(raw_backend, router_server, tmp_path,
                                                          script, status, body):
    backend, url = await raw_backend(script)
    router = await start_raw(router_server, url, tmp_path)
    reader, writer = await connect(router)
    for _ in range(2):  # twice on one client connection: each answer framed on its own
        writer.write(post("/v1/completions", completion()))
        r = await read_response(reader)
        assert r.status == status and body in r.body and not r.chunked
    assert backend.posts == 2 and router.state.cluster.counters_zero()
    writer.close()


async def test_total_timeout_mid_stream_through_the_front(router_server, fake_backends, tmp_path):
    # the pool's watchdog, not aiohttp's timer, ends it: an error event, then a proper last chunk
    router, _ = await start(router_server, fake_backends, tmp_path, fake_kw={"token_delay": 0.1},
                            total_timeout_s=0.4)
    reader, writer = await connect(router)
    t0 = time.monotonic()
    writer.write(post("/v1/completions", completion(max_tokens=50, stream=True)))
    r = await read_response(reader)
    assert r.status == 200 and r.chunked and time.monotonic() - t0 < 3
    assert b"failed mid-stream" in r.body.rsplit(b"\n\n", 2)[-2]
    (o,) = rows(router.state, "outcomes")
    assert o["status"] == "timeout" and router.state.cluster.counters_zero()
    # the connection is still good for the next request
    writer.write(post("/v1/completions", completion()))
    assert (await read_response(reader)).status == 200
    writer.close()


async def _small_json(b, w):
    body = json.dumps({"choices": [{"index": 0, "text": "xx"}]}).encode()
    w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
            % (len(body), body))
    return True


async def test_body_of_several_mb_in_many_reads(raw_backend, router_server, tmp_path):
    # (a raw backend: FakeVLLM's aiohttp app refuses bodies over 1 MiB)
    backend, url = await raw_backend(_small_json)
    router = await start_raw(router_server, url, tmp_path, client_timeout_s=30)
    body = json.dumps({"prompt": "w" * (3 << 20), "max_tokens": 2}).encode()  # ~3 MiB
    reader, writer = await connect(router)
    writer.write(post("/v1/completions", b"").replace(b"Content-Length: 0", b"Content-Length: %d" % len(body)))
    for k in range(0, len(body), 64 * 1024):
        writer.write(body[k:k + 64 * 1024])
        await writer.drain()
    r = await read_response(reader)
    assert r.status == 200 and r.json()["choices"][0]["text"] == "xx"
    assert backend.bodies == [body]
    assert router.state.cluster.counters_zero()
    writer.close()


# -- HTTP/1.1 details a client sees -----------------------------------------------------------

async def test_streaming_answer_to_http10_is_not_chunked(router_server, fake_backends, tmp_path):
    router, _ = await start(router_server, fake_backends, tmp_path)
    reader, writer = await connect(router)
    writer.write(post("/v1/completions", completion(max_tokens=3, stream=True)).replace(b"HTTP/1.1", b"HTTP/1.0", 1))
    status, headers = await read_head(reader)
    assert status == 200
    assert "chunked" not in headers.get("transfer-encoding", "")
    async with asyncio.timeout(WAIT_S):
        rest = await reader.read()  # HTTP/1.0: the body ends with the connection
    assert rest.startswith(b"data: ") and rest.endswith(b"data: [DONE]\n\n")
    writer.close()


async def test_head_answer_keeps_the_get_content_length(router_server, fake_backends, tmp_path):
    router, _ = await start(router_server, fake_backends, tmp_path)
    reader, writer = await connect(router)
    writer.write(get("/health"))
    full = await read_response(reader)
    writer.write(b"HEAD /health HTTP/1.1\r\nHost: t\r\n\r\n")
    status, headers = await read_head(reader)
    assert status == 200 and int(headers["content-length"]) == len(full.body)
    writer.close()


async def test_pipelined_request_held_back_by_the_front_is_not_408(router_server, fake_backends, tmp_path):
    router, _ = await start(router_server, fake_backends, tmp_path, client_timeout_s=0.5,
                            fake_kw={"token_delay": 0.2})
    reader, writer = await connect(router)
    last = post("/v1/completions", completion(max_tokens=1))
    # nine whole requests (each 0.2 s upstream) and the first half of a tenth in one write
    writer.write(b"".join(post("/v1/completions", completion(max_tokens=1)) for _ in range(9))
                 + last[:20])
    await writer.drain()
    await asyncio.sleep(0.1)
    writer.write(last[20:])  # the rest arrives at once; the front is not reading it
    statuses = []
    for _ in range(10):
        statuses.append((await read_response(reader)).status)
    assert statuses == [200] * 10
    writer.close()


async def test_idle_keep_alive_connections_are_closed(router_server, fake_backends, tmp_path, monkeypatch):
    """A client that vanishes without closing must not hold a descriptor for ever."""
    import router.app

    monkeypatch.setattr(router.app, "KEEPALIVE_TIMEOUT_S", 0.3)
    router, _ = await start(router_server, fake_backends, tmp_path)
    reader, writer = await connect(router)
    writer.write(post("/v1/completions", completion()))
    assert (await read_response(reader)).status == 200
    busy_reader, busy_writer = await connect(router)
    busy_writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{")
    await busy_writer.drain()  # mid-request: not idle, left to --client-timeout
    assert await closed_by_server(reader)  # idle after its answer: closed by the sweep
    assert not busy_reader.at_eof()
    writer.close()
    busy_writer.close()
