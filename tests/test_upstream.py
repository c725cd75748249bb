"""The backend client (router/upstream.py): its limits, exact framing, TLS, timeouts and reuse.

Each backend is a ``Scripted`` server on 127.0.0.1 that writes exact bytes, so a test can
send what no well-behaved server would: an endless head, trailers, a second answer. Servers
that write without end stop themselves after a few seconds, and every one stops with its test.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import ssl
import subprocess
import time

import pytest

from router.upstream import (HIGH_WATER, BadResponse, ConnectFailed, Disconnected, Pool, TooLarge,
                             UpstreamError)

MiB = 1024 * 1024
#: how long a backend that writes without end keeps at it, should the client never stop it
ENDLESS_S = 5.0


def ok(body: bytes = b"ok", status: bytes = b"200 OK", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %b\r\nContent-Type: application/json\r\n%bContent-Length: %d\r\n\r\n%b" % (
        status, extra, len(body), body)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Scripted:
    """A backend answering each request with ``await script(backend, writer, conn_no)``; a
    false return closes the connection. It counts the connections it accepted, keeps the
    request heads, counts the bytes a script got past the kernel's buffers (``sent``), and
    sets ``peer_closed`` once the client closes a connection."""

    def __init__(self, script, ssl_ctx: ssl.SSLContext | None = None):
        self.script = script
        self.ssl_ctx = ssl_ctx
        self.connections = 0
        self.heads: list[bytes] = []
        self.sent = 0
        self.peer_closed = asyncio.Event()
        self.tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> Scripted:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.ssl_ctx)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"{'https' if self.ssl_ctx else 'http'}://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _handle(self, reader, writer):
        self.tasks.add(asyncio.current_task())
        self.connections += 1
        n = self.connections
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                m = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                await reader.readexactly(int(m.group(1)) if m else 0)
                self.heads.append(head)
                if not await self.script(self, writer, n):
                    break
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            self.peer_closed.set()
        except asyncio.CancelledError:
            pass  # the test is over; ended normally, the stream's done-callback stays quiet
        finally:
            writer.close()

    async def endless(self, writer, first: bytes, block: bytes) -> bool:
        """Write ``first``, then ``block`` again and again as fast as the client reads."""
        writer.write(first)
        stop = time.monotonic() + ENDLESS_S
        while time.monotonic() < stop:
            writer.write(block)
            await writer.drain()  # raises once the client has closed
            self.sent += len(block)
        return False


async def answer_ok(b, w, n):
    w.write(ok())
    return True


@pytest.fixture
async def make_pool():
    pools = []

    def make(**kw) -> Pool:
        kw.setdefault("connect_timeout", 2.0)
        kw.setdefault("read_timeout", 5.0)
        pools.append(Pool(**kw))
        return pools[-1]

    yield make
    for p in pools:
        p.close()


async def get(pool: Pool, url: str, **kw) -> tuple[int, bytes]:
    total = kw.pop("total", 5.0)
    up = await pool.request(url, "POST", "/v1/completions", [], b"{}", total_timeout=total, **kw)
    async with up:
        return up.status, await up.read()


# -- 1. the head: size and header count are bounded ---------------------------------------------

FILLER = b"X-Filler: " + b"f" * 54 + b"\r\n"  # 66 bytes a line


@pytest.mark.parametrize("first, block", [
    # header lines without end, fast (the case that grew the router by ~400 MB/s)
    (b"HTTP/1.1 200 OK\r\n", FILLER * 1000),
    # one header line without end: httptools joins its pieces until the line ends
    (b"HTTP/1.1 200 OK\r\nX-Endless: ", b"v" * 65536),
    # interim answers without end: each head is small, together they are not
    (b"", b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n" * 500),
], ids=["header-lines", "one-header-line", "interim-answers"])
async def test_endless_head_fails_fast_with_bounded_memory(make_pool, first, block):
    async def script(b, w, n):
        return await b.endless(w, first, block)

    pool = make_pool(read_timeout=10.0)
    async with Scripted(script) as backend:
        before = rss()
        t0 = time.monotonic()
        with pytest.raises(BadResponse, match="head"):
            await get(pool, backend.url, total=4.0)
        assert time.monotonic() - t0 < 1.0  # at the bound, not at a timeout
        assert rss() - before < 32 * MiB
        await asyncio.wait_for(backend.peer_closed.wait(), 2.0)  # the connection was closed
        assert backend.sent < 16 * MiB  # what the kernel's buffers took, not what 4 s would send
        assert not pool._open


async def test_head_limits_are_configurable_and_exact(make_pool):
    # 302 short headers (about 3 KB): under the size bound, over the default count of 256
    many = ok(extra=b"".join(b"X-H%d: v\r\n" % i for i in range(300)))

    async def script(b, w, n):
        w.write(many)
        return True

    async with Scripted(script) as backend:
        with pytest.raises(BadResponse, match="302 headers"):
            await get(make_pool(), backend.url)
        status, body = await get(make_pool(max_headers=400), backend.url)
        assert (status, body) == (200, b"ok")
        assert len(many) > 3000
        with pytest.raises(BadResponse, match="head"):  # the same answer against a 2 KiB bound
            await get(make_pool(max_head_bytes=2048, max_headers=400), backend.url)


async def test_large_head_and_body_within_bounds(make_pool):
    # a 60 KB head and a 1 MB body, written at once: one read holds head and body both, and
    # nothing of the body counts against the head's bound
    big = ok(b"b" * MiB, extra=b"".join(b"X-Big-%d: %b\r\n" % (i, b"v" * 580) for i in range(100)))

    async def script(b, w, n):
        w.write(big)
        await w.drain()
        return True

    async with Scripted(script) as backend:
        pool = make_pool()
        for _ in range(2):
            status, body = await get(pool, backend.url)
            assert status == 200 and body == b"b" * MiB
        assert backend.connections == 1


async def test_malformed_answer_is_bad_response(make_pool):
    async def script(b, w, n):
        w.write(b"HTX/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        return True

    async with Scripted(script) as backend:
        with pytest.raises(BadResponse, match="malformed"):
            await get(make_pool(), backend.url)


async def test_trailers_never_become_headers(make_pool):
    async def script(b, w, n):
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"2\r\nok\r\n0\r\nContent-Type: text/html\r\nX-Session-ID: evil\r\n\r\n")
        return True

    async with Scripted(script) as backend:
        pool = make_pool()
        up = await pool.request(backend.url, "POST", "/", [], b"")
        async with up:
            assert await up.read() == b"ok"
        # read after the body, as the proxy does for a non-streaming answer's Content-Type
        assert up.headers.getall("Content-Type") == ["application/json"]
        assert "X-Session-ID" not in up.headers
        assert await get(pool, backend.url) == (200, b"ok")  # and the connection was fine to reuse
        assert backend.connections == 1


async def test_endless_trailers_are_bounded(make_pool):
    async def script(b, w, n):
        return await b.endless(w, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n",
                               FILLER * 1000)

    async with Scripted(script) as backend:
        before = rss()
        with pytest.raises(BadResponse):
            await get(make_pool(), backend.url, total=4.0)
        assert rss() - before < 32 * MiB
        await asyncio.wait_for(backend.peer_closed.wait(), 2.0)
        assert backend.sent < 16 * MiB


# -- 2. a buffered answer is bounded; a streamed one is flow-controlled -------------------------

def endless_body(framing: str):
    """An answer that says it is 1 GiB, or never says: it is as long as the client reads."""
    head = {"length": b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (1 << 30),
            "chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            "close": b"HTTP/1.0 200 OK\r\n\r\n"}[framing]
    block = b"x" * 65536
    if framing == "chunked":
        block = b"%x\r\n%b\r\n" % (len(block), block)

    async def script(b, w, n):
        return await b.endless(w, head, block)
    return script


@pytest.mark.parametrize("framing", ["length", "chunked", "close"])
async def test_read_over_the_bound_fails_clearly(make_pool, framing):
    async with Scripted(endless_body(framing)) as backend:
        pool = make_pool(max_buffered_bytes=MiB)
        before = rss()
        up = await pool.request(backend.url, "POST", "/", [], b"", total_timeout=4.0)
        with pytest.raises(TooLarge, match="1048576"):
            async with up:
                await up.read()
        assert rss() - before < 64 * MiB
        await asyncio.wait_for(backend.peer_closed.wait(), 2.0)
        assert backend.sent < 16 * MiB
        assert not pool._open


async def test_read_limit_per_call(make_pool):
    async def script(b, w, n):
        w.write(ok(b"z" * 1000))
        return True

    async with Scripted(script) as backend:
        pool = make_pool()
        up = await pool.request(backend.url, "POST", "/", [], b"")
        with pytest.raises(TooLarge):
            async with up:
                await up.read(limit=999)
        up = await pool.request(backend.url, "POST", "/", [], b"")
        async with up:
            assert await up.read(limit=1000) == b"z" * 1000  # the bound itself is allowed
        assert backend.connections == 2  # the refused answer's connection was not reused


async def test_streaming_is_flow_controlled_and_not_bounded(make_pool):
    total = 32 * MiB
    piece = b"data: x\n\n" * 7000

    async def script(b, w, n):
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        left = total
        while left:
            p = piece[:left]
            w.write(b"%x\r\n%b\r\n" % (len(p), p))
            await w.drain()
            b.sent += len(p)
            left -= len(p)
        w.write(b"0\r\n\r\n")
        return True

    async with Scripted(script) as backend:
        pool = make_pool(max_buffered_bytes=64 * 1024)
        up = await pool.request(backend.url, "POST", "/", [], b"")
        async with up:
            await asyncio.sleep(0.3)  # a client that does not read yet
            conn = up._conn
            assert conn.paused and conn.buffered < HIGH_WATER + 512 * 1024
            assert backend.sent < total // 2  # the backend is held back
            got = 0
            async for chunk in up.iter_chunks():
                got += len(chunk)
        assert got == total


# -- 3. exact framing -----------------------------------------------------------------------

SECOND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 5\r\n\r\nEVIL!"


@pytest.mark.parametrize("excess, delay", [
    (SECOND, 0.0),                    # two answers for one request, in one write
    (SECOND, 0.1),                    # the second arrives while the first is being read
    (SECOND[:10], 0.0),               # the start of a second answer: no parser event follows it
    (b"garbage", 0.0),                # not HTTP at all
    (SECOND, 0.5),                    # the second arrives once the connection is idle
], ids=["second-answer", "second-answer-later", "start-of-one", "garbage", "second-answer-idle"])
async def test_bytes_after_a_complete_answer_are_not_glued(make_pool, excess, delay):
    async def script(b, w, n):
        if n == 1 and len(b.heads) == 1:
            w.write(ok(b"hello"))
            if delay:
                await w.drain()
                await asyncio.sleep(delay)
            w.write(excess)
        else:
            w.write(ok(b"world"))
        return True

    async with Scripted(script) as backend:
        pool = make_pool()
        up = await pool.request(backend.url, "POST", "/", [], b"")
        async with up:
            await asyncio.sleep(0.3)
            assert await up.read() == b"hello"
            assert up.status == 200 and up.headers.getall("Content-Length") == ["5"]
        await asyncio.sleep(max(0.0, delay - 0.3) + 0.1)
        assert await get(pool, backend.url) == (200, b"world")
        assert backend.connections == 2  # the first connection was never reused


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"a" * 10,
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\na\r\n" + b"a" * 10 + b"\r\n",
], ids=["length", "chunked"])
@pytest.mark.parametrize("streaming", [False, True])
async def test_answer_cut_short_is_disconnected(make_pool, answer, streaming):
    async def script(b, w, n):
        w.write(answer)
        return False

    async with Scripted(script) as backend:
        up = await make_pool().request(backend.url, "POST", "/", [], b"")
        with pytest.raises(Disconnected):
            async with up:
                if streaming:
                    async for _ in up.iter_chunks():
                        pass
                else:
                    await up.read()


@pytest.mark.parametrize("head", [b"HTTP/1.0 200 OK\r\n\r\n", b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n",
                                  b"HTTP/1.1 200 OK\r\n\r\n"])
async def test_close_delimited_answer_works_and_is_not_reused(make_pool, head):
    async def script(b, w, n):
        w.write(head + b"until the end %d" % n)
        return False

    async with Scripted(script) as backend:
        pool = make_pool()
        assert await get(pool, backend.url) == (200, b"until the end 1")
        assert await get(pool, backend.url) == (200, b"until the end 2")
        assert backend.connections == 2


# -- 4. TLS ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Two private CAs, a certificate for 127.0.0.1 signed by the first, and one signed by
    it for another name."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    d = tmp_path_factory.mktemp("pki")

    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    for ca in ("ca", "other-ca"):
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN=kvtop test {ca}",
            "-keyout", f"{ca}.key", "-out", f"{ca}.pem")
    for name, san in (("ip", "IP:127.0.0.1"), ("wrong", "DNS:wrong.example")):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
            "-out", f"{name}.csr")
        (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem")
    return d


def server_ctx(pki, name: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(pki / f"{name}.pem", pki / f"{name}.key")
    return ctx


async def test_https_backend_with_a_private_ca(make_pool, pki):
    async with Scripted(answer_ok, server_ctx(pki, "ip")) as backend:
        assert backend.url.startswith("https://")
        pool = make_pool(ssl_ca_file=str(pki / "ca.pem"))
        for _ in range(3):
            assert await get(pool, backend.url) == (200, b"ok")
        assert backend.connections == 1  # kept alive over TLS too
        assert b"\r\nHost: 127.0.0.1:" in backend.heads[0]


@pytest.mark.parametrize("ca, cert, why", [
    ("other-ca.pem", "ip", "certificate"),      # signed by a CA we were not told to trust
    (None, "ip", "certificate"),                # the default trust store does not know it
    ("ca.pem", "wrong", "certificate"),         # trusted CA, but issued for another name
])
async def test_https_certificate_must_verify(make_pool, pki, ca, cert, why):
    async with Scripted(answer_ok, server_ctx(pki, cert)) as backend:
        pool = make_pool(ssl_ca_file=str(pki / ca) if ca else None)
        with pytest.raises(ConnectFailed, match=why):
            await get(pool, backend.url)


# -- 5. behaviours that stay ----------------------------------------------------------------

async def test_keep_alive_reuse_and_exact_request_head(make_pool):
    async def script(b, w, n):  # chunked and Content-Length answers in turn, on one connection
        if len(b.heads) % 2:
            w.write(ok(b"ok %d" % len(b.heads)))
        else:
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                    b"3\r\nok \r\n1\r\n%d\r\n0\r\n\r\n" % len(b.heads))
        return True

    async with Scripted(script) as backend:
        pool = make_pool()
        for i in range(1, 5):
            up = await pool.request(backend.url, "POST", "/v1/chat/completions",
                                    [("X-Request-Id", "r1")], b"{}")
            async with up:
                assert await up.read() == b"ok %d" % i
        assert backend.connections == 1
        port = backend.url.rsplit(":", 1)[1]
        # the pool adds Host and Content-Length and nothing else: no Expect, no Connection
        assert backend.heads[0] == (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%b\r\n"
                                    b"Content-Length: 2\r\nX-Request-Id: r1\r\n\r\n" % port.encode())


async def test_stale_idle_connection_is_retried_once(make_pool):
    async def script(b, w, n):
        if n == 1 and len(b.heads) == 2:
            return False  # the backend's idle timeout met our second request: closed, no answer
        w.write(ok(b"%d" % n))
        return True

    async with Scripted(script) as backend:
        pool = make_pool()
        assert await get(pool, backend.url) == (200, b"1")
        assert await get(pool, backend.url) == (200, b"2")  # transparently, on a new connection
        assert backend.connections == 2


async def test_fresh_connection_closed_without_answer_is_not_retried(make_pool):
    async def script(b, w, n):
        return False

    async with Scripted(script) as backend:
        with pytest.raises(Disconnected):
            await get(make_pool(), backend.url)
        assert backend.connections == 1


async def test_interim_answers_are_skipped(make_pool):
    async def script(b, w, n):
        w.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n")
        await w.drain()
        await asyncio.sleep(0.05)
        w.write(ok())
        return True

    async with Scripted(script) as backend:
        pool = make_pool()
        up = await pool.request(backend.url, "POST", "/", [], b"")
        async with up:
            assert up.status == 200 and "Link" not in up.headers
            assert await up.read() == b"ok"
        assert await get(pool, backend.url) == (200, b"ok")
        assert backend.connections == 1


@pytest.mark.parametrize("answer", [b"", b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"],
                         ids=["no-head", "half-body"])
async def test_read_timeout(make_pool, answer):
    async def script(b, w, n):
        w.write(answer)
        await asyncio.sleep(ENDLESS_S)
        return False

    async with Scripted(script) as backend:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="no data"):
            await get(make_pool(read_timeout=0.3), backend.url)
        assert 0.25 < time.monotonic() - t0 < 1.5


async def test_total_timeout(make_pool):
    async def script(b, w, n):  # a byte every 50 ms: never silent for the read timeout
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
        for _ in range(100):
            w.write(b"x")
            await w.drain()
            await asyncio.sleep(0.05)
        return False

    async with Scripted(script) as backend:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="total"):
            await get(make_pool(read_timeout=1.0), backend.url, total=0.4)
        assert 0.35 < time.monotonic() - t0 < 1.5


async def test_connect_timeout_and_refused(make_pool):
    # a listener that never accepts, its queue full: a further connect is never answered
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(0)
    port = lsock.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            fillers.append(s)
        t0 = time.monotonic()
        with pytest.raises(ConnectFailed, match="timed out"):
            await get(make_pool(connect_timeout=0.3), f"http://127.0.0.1:{port}")
        assert 0.25 < time.monotonic() - t0 < 1.5
    finally:
        for s in fillers:
            s.close()
        lsock.close()
    with pytest.raises(ConnectFailed):  # nothing listens there now
        await get(make_pool(), f"http://127.0.0.1:{port}")


def test_errors_are_upstream_errors():
    for exc in (BadResponse, TooLarge, ConnectFailed, Disconnected):
        assert issubclass(exc, UpstreamError)
    # a malformed or oversized answer is never retried as if the connection had been stale
    assert not issubclass(BadResponse, Disconnected)


# -- the data plane's fast forms ------------------------------------------------------------------

async def test_header_lines_given_as_bytes_go_up_as_they_are(make_pool):
    """The data plane passes the client's header bytes (router/forward.py upstream_head): the
    head is the request line, Host, Content-Length, then those lines unchanged."""
    async with Scripted(answer_ok) as b:
        pool = make_pool()
        up = await pool.request(b.url, "POST", "/v1/completions", "X-Note: café\r\nX-Tag: a\r\n".encode(), b"{}")
        async with up:
            await up.read()
        host = b.url.split("//")[1].encode()
        assert b.heads == [b"POST /v1/completions HTTP/1.1\r\nHost: " + host + b"\r\nContent-Length: 2\r\n"
                           + "X-Note: café\r\nX-Tag: a\r\n\r\n".encode()]


async def test_read_without_release_keeps_the_connection_until_released(make_pool):
    """``read(release=False)``: the answer is whole, the connection stays with the response
    until ``release`` (the data plane answers its client first), then goes back and is reused."""
    async with Scripted(answer_ok) as b:
        pool = make_pool()
        up = await pool.request(b.url, "POST", "/v1/completions", [], b"{}")
        assert await up.read(release=False) == b"ok"
        assert not pool._idle.get(b.url)  # not back yet
        up.release()
        assert len(pool._idle[b.url]) == 1
        assert await get(pool, b.url) == (200, b"ok")
        assert b.connections == 1


async def test_a_kept_alive_connection_reuses_its_timer_and_still_times_out(make_pool, monkeypatch):
    """One timer per connection: the next request on it schedules none while the pending one
    fires first; a stalled backend is still caught, by the read timeout and by an earlier
    total limit alike."""
    async def script(b, w, n):
        if len(b.heads) == 1:
            w.write(ok())
        return True  # later requests: no answer

    async with Scripted(script) as b:
        pool = make_pool(read_timeout=0.4)
        calls = []
        real = pool.loop.call_at
        monkeypatch.setattr(pool.loop, "call_at", lambda at, fn, *a: calls.append(fn.__name__) or real(at, fn, *a))
        assert await get(pool, b.url) == (200, b"ok")
        assert calls.count("_watchdog") == 1
        t0 = time.monotonic()
        armed = []
        with pytest.raises(TimeoutError, match="no data from the backend"):
            await get(pool, b.url, on_sent=lambda: armed.append(calls.count("_watchdog")))
        assert armed == [1]  # the second request, sent, scheduled no timer of its own
        assert 0.3 < time.monotonic() - t0 < 2.0
        assert b.connections == 1  # the second request went on the kept-alive connection

    async with Scripted(script) as b:
        pool = make_pool(read_timeout=30.0)
        assert await get(pool, b.url) == (200, b"ok")
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="total time limit"):
            await get(pool, b.url, total=0.3)  # earlier than the connection's pending timer
        assert time.monotonic() - t0 < 2.0
        assert b.connections == 1


async def test_head_timeout_bounds_the_head_only(make_pool):
    """``head_timeout`` (the data plane's --first-byte-timeout for streams) fails a backend that
    takes the request and sends nothing, as the ``asyncio.timeout`` it replaced did (an empty
    TimeoutError: outcome rows say what they said); an answer whose head came in time may
    take longer than that for its body."""
    async def silent(b, w, n):
        await asyncio.sleep(ENDLESS_S)
        return False

    async with Scripted(silent) as b:
        pool = make_pool(read_timeout=30.0)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as err:
            await get(pool, b.url, head_timeout=0.3)
        assert 0.25 < time.monotonic() - t0 < 2.0 and str(err.value) == ""
        assert not pool._idle.get(b.url)  # the connection is closed, not kept
        assert all(c.transport.is_closing() for c in pool._open)

    async def slow_body(b, w, n):
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n")
        await w.drain()
        await asyncio.sleep(0.6)
        w.write(b"ok")
        return True

    async with Scripted(slow_body) as b:
        pool = make_pool(read_timeout=30.0)
        assert await get(pool, b.url, head_timeout=0.3) == (200, b"ok")
        assert await get(pool, b.url, head_timeout=0.3) == (200, b"ok")  # on the kept connection
        assert b.connections == 1
