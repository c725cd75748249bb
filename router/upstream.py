"""Pooled HTTP/1.1 client connections to the backends, on asyncio protocols and httptools.

The data plane's upstream half. aiohttp's ClientSession spends about 0.15 ms of CPU per
call on work a proxy does not need (cookie jar, tracing hooks, request and response
objects, per-call timers); this pool keeps one idle keep-alive connection list per
backend, writes the request head and body in one ``write`` and feeds the answer to
httptools' C parser. docs/performance.md has the figures.

Limits (``Pool`` keyword arguments; each breach closes the connection):
  - ``max_head_bytes`` (64 KiB): the status line and headers, interim (1xx) answers included;
    the same bound holds for the trailers and chunk framing after the last body byte;
  - ``max_headers`` (256): header lines in one head; trailers are read and dropped, never
    added to ``headers``;
  - ``max_buffered_bytes`` (64 MiB): a body taken whole with ``read()`` (or ``read(limit=)``);
    ``iter_chunks`` is not bounded by it: it holds at most ``HIGH_WATER`` bytes before
    reading from the backend pauses;
  - exact framing: an answer ends where its Content-Length or last chunk says, or at the
    connection's close when it says neither (that connection is never reused); any byte after
    a complete answer closes the connection instead of reaching this or the next answer;
  - ``https://`` backends are verified (certificate and host name) against the default trust
    store plus ``ssl_ca_file``, when given.

Errors, all ``UpstreamError`` but the timeout, mapped by the proxy to its outcome statuses:
  - ``ConnectFailed``: the backend refused, did not accept within ``connect_timeout``, or its
    TLS certificate did not verify;
  - ``Disconnected``: the backend closed the connection before the answer was complete;
  - ``BadResponse``: the answer is not HTTP/1.x, or its head breaks a bound above;
  - ``TooLarge``: ``read()`` met a body over its bound;
  - ``TimeoutError``: no byte for ``read_timeout`` seconds, or the request's ``total_timeout``
    passed (one timer per request enforces both, re-armed only when it fires).
A reused idle connection that the backend had already closed is retried once on a fresh
one, transparently, as long as no byte of the answer arrived.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict

from router.body import Chunks

#: Bodies from this size on are written upstream as their own buffer (no copy).
_BIG_BODY = 1 << 20
#: Answer bytes buffered per connection before reading from the backend pauses.
HIGH_WATER = 256 * 1024
#: Bytes of status line and headers (interim answers included), and of trailers, per answer.
MAX_HEAD_BYTES = 64 * 1024
#: Header lines in one head.
MAX_HEADERS = 256
#: A body taken whole by ``Response.read``.
MAX_BUFFERED_BYTES = 64 * 1024 * 1024


def set_nodelay(transport: asyncio.BaseTransport) -> None:
    """Turn Nagle off. asyncio does so only for sockets whose ``proto`` is IPPROTO_TCP, and
    ``socket.create_server`` (the router's listener) makes them with proto 0: without this,
    each SSE event after the first waits for the client's delayed ACK (40 ms)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


class UpstreamError(Exception):
    """The backend could not be reached or did not finish its answer."""


class ConnectFailed(UpstreamError):
    pass


class Disconnected(UpstreamError):
    pass


class BadResponse(UpstreamError):
    """The answer is not well-formed HTTP/1.x, or its head is over a bound."""


class TooLarge(UpstreamError):
    """A body read whole was longer than its bound."""


class _Stop(Exception):
    """Raised from a parser callback to stop parsing what follows."""


class _Conn(asyncio.Protocol):
    """One connection; carries one request at a time."""

    __slots__ = ("pool", "key", "transport", "parser", "status", "headers", "chunks", "buffered",
                 "complete", "error", "got_bytes", "waiter", "headers_done", "last_data", "paused",
                 "keep_alive", "deadline", "head_deadline", "watch", "head_only", "interim",
                 "idle", "since_body")

    def __init__(self, pool: Pool, key: str):
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.error: BaseException | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.chunks: deque[bytes] = deque()
        self._reset()

    def _reset(self) -> None:
        """Ready for the next request. The parser is kept: after a complete answer it waits
        at the start of the next one (a connection in any other state is closed, not reused)."""
        self.status = 0
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.chunks.clear()
        self.buffered = 0
        self.complete = False
        self.headers_done = False
        self.got_bytes = False
        self.waiter: asyncio.Future | None = None
        self.paused = False
        self.keep_alive = True
        self.deadline: float | None = None
        self.head_deadline: float | None = None  # the answer's head must be in by then
        self.watch: asyncio.TimerHandle | None = None
        self.head_only = False
        self.interim = False
        self.idle = False
        #: bytes read since the last body byte: the head, or the trailers after the body
        self.since_body = 0

    # -- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        set_nodelay(transport)

    def data_received(self, data: bytes) -> None:
        if self.idle or self.complete:
            # nobody asked, or the answer is whole: whatever this is, the connection is out of step
            self.keep_alive = False
            self.pool.forget(self)
            self.transport.close()
            return
        pool = self.pool
        self.got_bytes = True
        self.last_data = pool.loop.time()
        self.since_body += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            # a callback stopped the parse (a bound, or bytes after the answer), or it is not HTTP
            if self.error is None and not self.complete:
                self._fail(BadResponse(f"malformed HTTP answer: {exc}"))
            self.keep_alive = False
            self.transport.close()
            return
        if self.since_body > pool.max_head_bytes and not self.complete:
            # checked per read, not per byte: reads with no body byte in them (a head, interim
            # heads, trailers) add up to at most one read over the bound
            what = "trailers" if self.headers_done else "head"
            self._fail(BadResponse(f"more than {pool.max_head_bytes} bytes of the answer's {what}"))
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self.pool.forget(self)
        if exc is None and self.headers_done and not self.complete and self.error is None \
                and "content-length" not in self.headers and "transfer-encoding" not in self.headers:
            self.on_message_complete()  # an answer delimited by the connection's close
            return
        if not self.complete:
            what = "the backend closed the connection" if exc is None else f"connection lost: {exc}"
            self._fail(Disconnected(what))

    # -- httptools callbacks ------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.complete:  # a second answer to one request: it belongs to no one
            raise _Stop

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.headers_done:  # trailers are dropped: they never become headers
            self.headers.add(name.decode("latin-1"), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        headers = self.headers
        pool = self.pool
        if len(headers) > pool.max_headers:
            self._fail(BadResponse(f"the answer has {len(headers)} headers, more than {pool.max_headers}"))
            raise _Stop
        if self.since_body > pool.max_head_bytes:
            # the reads so far are over the bound, and may hold body bytes too: measure the head
            # itself (its header lines; the status line is bounded with the reads)
            size = sum(len(k) + len(v) + 4 for k, v in headers.items())
            if size > pool.max_head_bytes:
                self._fail(BadResponse(f"more than {pool.max_head_bytes} bytes of the answer's head"))
                raise _Stop
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (100 Continue, 103): the real one follows
            self.interim = True
            return
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True
        if self.head_only:
            # an answer to HEAD has no body, whatever Content-Length says: the parser would
            # wait for one, so what follows is not ours and the connection is not reused
            self.complete = True
            self.keep_alive = False
            self._wake()
            raise _Stop
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.since_body = 0
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()
            self.disarm()  # a slow consumer is not a silent backend: the clock restarts on resume
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            self.headers = CIMultiDict()
            return
        self.complete = True
        self._wake()

    # -- plumbing -----------------------------------------------------------------------
    def _wake(self) -> None:
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():
                w.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:  # the first failure is the one to report
            self.error = exc
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():
                w.set_exception(self.error)

    async def wait(self) -> None:
        """Until the next parser event or the connection's end (the watchdog bounds it)."""
        if self.error is not None:
            raise self.error
        self.waiter = fut = self.pool.loop.create_future()
        await fut

    # -- timeouts: one timer per connection, re-armed only when it fires -------------------
    def arm(self) -> None:
        """Make sure the watchdog looks at this request by its next possible expiry. A timer
        still pending from an earlier request on this connection does, when it fires first (it
        then re-arms for the rest): a request on a kept-alive connection usually schedules no
        timer at all, where one per request cost a schedule and a cancel on the answer's path."""
        at = self._next_check()
        if at == float("inf"):
            return
        w = self.watch
        if w is not None:
            if w.when() <= at:
                return
            w.cancel()
        self.watch = self.pool.loop.call_at(at, self._watchdog)

    def disarm(self) -> None:
        if self.watch is not None:
            self.watch.cancel()
            self.watch = None

    def _next_check(self) -> float:
        rt = self.pool.read_timeout
        at = self.last_data + rt if rt is not None else float("inf")
        if self.head_deadline is not None and not self.headers_done:
            at = min(at, self.head_deadline)
        return min(at, self.deadline) if self.deadline is not None else at

    def _watchdog(self) -> None:
        self.watch = None
        if self.idle or self.complete or self.error is not None:  # no request is waiting on it
            return
        now = self.pool.loop.time()
        rt = self.pool.read_timeout
        if self.deadline is not None and now >= self.deadline:
            why = "the attempt's total time limit passed"
        elif self.head_deadline is not None and not self.headers_done and now >= self.head_deadline:
            why = ""  # said as the asyncio.timeout it replaces said it (outcome rows unchanged)
        elif rt is not None and now - self.last_data >= rt:
            why = f"no data from the backend for {rt:g} s"
        else:  # data arrived since: sleep until the next possible expiry
            self.arm()
            return
        self._fail(TimeoutError(why))
        self.transport.close()  # half an answer: the connection cannot be reused


class Response:
    """An upstream answer: ``status`` and ``headers`` now, the body by ``read``/``iter_chunks``."""

    __slots__ = ("status", "headers", "_conn", "_released")

    def __init__(self, conn: _Conn):
        self._conn = conn
        self.status = conn.status
        self.headers = conn.headers
        self._released = False

    def _take(self) -> bytes:
        """Everything buffered, as one piece: a read from the backend often holds several
        HTTP chunks (several SSE events), and the client gets them in one write."""
        c = self._conn
        chunks = c.chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        c.buffered = 0
        if c.paused:
            c.paused = False
            c.transport.resume_reading()
            c.last_data = c.pool.loop.time()
            if c.watch is None:
                c.arm()
        return data

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        c = self._conn
        while True:
            if c.chunks:
                yield self._take()
            if c.complete and not c.chunks:
                self.release()
                return
            if not c.chunks:
                await c.wait()

    async def read(self, limit: int | None = None, *, release: bool = True) -> bytes:
        """The whole body, at most ``limit`` bytes (default: the pool's ``max_buffered_bytes``);
        past it, ``TooLarge`` and the connection is closed. ``release=False`` leaves the
        connection's return to the pool to ``release`` (``async with``): the data plane relays
        the answer first and tidies the connection after."""
        c = self._conn
        if limit is None:
            limit = c.pool.max_buffered_bytes
        parts = []
        size = 0
        while True:
            if c.chunks:  # taken as they come: past HIGH_WATER the backend would be paused
                part = self._take()
                size += len(part)
                if size > limit:
                    exc = TooLarge(f"the answer's body is over {limit} bytes, the bound on a buffered answer")
                    c._fail(exc)
                    c.disarm()
                    c.transport.close()
                    self.release()
                    raise exc
                parts.append(part)
            if c.complete:
                break
            await c.wait()
        if release:
            self.release()
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        """Back to the pool when the answer is complete and the connection may be reused,
        else closed. Idempotent; call it (``async with``) on every path."""
        if self._released:
            return
        self._released = True
        self._conn.pool.put_back(self._conn)

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()


class Pool:
    """Idle keep-alive connections per backend (``http://host:port``, ``https://host:port``,
    or ``unix:/path``), with the limits in the module's docstring."""

    def __init__(self, *, connect_timeout: float | None = 5.0, read_timeout: float | None = 600.0,
                 max_idle_per_backend: int = 1024, max_head_bytes: int = MAX_HEAD_BYTES,
                 max_headers: int = MAX_HEADERS, max_buffered_bytes: int = MAX_BUFFERED_BYTES,
                 ssl_ca_file: str | None = None):
        self.loop = asyncio.get_running_loop()
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle = max_idle_per_backend
        self.max_head_bytes = max_head_bytes
        self.max_headers = max_headers
        self.max_buffered_bytes = max_buffered_bytes
        self.ssl_ca_file = ssl_ca_file
        # built now when a CA file is named, so that a bad one fails at start, not per request
        self._ssl: ssl.SSLContext | None = self._ssl_context() if ssl_ca_file else None
        self._idle: dict[str, list[_Conn]] = {}
        self._hosts: dict[str, tuple[str, str | None, str | None, int, bool, bytes]] = {}
        self._open: set[_Conn] = set()
        self._refused: set[str] = set()  # backends cut off (a forced remove): no new connection
        self.closed = False

    def _ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context()  # verifies the certificate and the host name
        if self.ssl_ca_file:
            ctx.load_verify_locations(cafile=self.ssl_ca_file)
        ctx.set_alpn_protocols(["http/1.1"])
        return ctx

    def _target(self, base: str) -> tuple[str, str | None, str | None, int, bool, bytes]:
        """(Host header, unix path, host, port, TLS, the Host header as bytes) for a backend's
        base URL."""
        t = self._hosts.get(base)
        if t is None:
            if base.startswith("unix:"):
                t = ("localhost", base[5:], None, 0, False, b"localhost")
            else:
                u = urlsplit(base)
                if u.scheme not in ("http", "https") or not u.hostname:
                    raise ValueError(f"only http:// and https:// backends are supported, got {base!r}")
                tls = u.scheme == "https"
                netloc = u.netloc.rpartition("@")[2]
                t = (netloc, None, u.hostname, u.port or (443 if tls else 80), tls, netloc.encode("latin-1"))
            self._hosts[base] = t
        return t

    async def _connect(self, base: str, deadline: float | None = None) -> _Conn:
        if base in self._refused:
            raise ConnectFailed(f"{base} was removed from the fleet")
        _, unix_path, host, port, tls, _ = self._target(base)
        limit = self.connect_timeout
        if deadline is not None:
            left = deadline - self.loop.time()
            limit = left if limit is None else min(limit, left)
        try:
            async with asyncio.timeout(limit):
                if unix_path is not None:
                    _, conn = await self.loop.create_unix_connection(lambda: _Conn(self, base), unix_path)
                elif tls:
                    if self._ssl is None:
                        self._ssl = self._ssl_context()
                    _, conn = await self.loop.create_connection(lambda: _Conn(self, base), host, port,
                                                                ssl=self._ssl, server_hostname=host)
                else:
                    _, conn = await self.loop.create_connection(lambda: _Conn(self, base), host, port)
        except TimeoutError:
            raise ConnectFailed(f"connect to {base} timed out after {limit:g} s") from None
        except ssl.SSLCertVerificationError as exc:
            raise ConnectFailed(f"the TLS certificate of {base} did not verify: "
                                f"{exc.verify_message or exc}") from None
        except ssl.SSLError as exc:
            raise ConnectFailed(f"TLS handshake with {base} failed: {exc.reason or exc}") from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {base}: {exc.strerror or exc}") from None
        self._open.add(conn)
        return conn

    def _idle_conn(self, base: str) -> _Conn | None:
        idle = self._idle.get(base)
        while idle:
            conn = idle.pop()
            if not conn.transport.is_closing():
                conn.idle = False
                return conn
        return None

    async def request(self, base: str, method: str, path: str, headers: Iterable[tuple[str, str]] | bytes,
                      body: bytes | Chunks = b"", *, total_timeout: float | None = None,
                      head_timeout: float | None = None,
                      on_sent: Callable[[], None] | None = None) -> Response:
        """Send one request; return once the answer's status line and headers are in.

        ``headers``: (name, value) pairs, or header lines already on the wire's form (bytes,
        each line ending in CRLF; the data plane passes the client's own bytes through).
        ``total_timeout`` bounds everything from here to the answer's last byte, ``head_timeout``
        from here to the answer's head (a stream's first byte; ``TimeoutError`` either way,
        kept by the connection's own timer rather than a timer of its own); ``on_sent`` is
        called once, right after the request is written (work that can overlap the wait)."""
        if self.closed:
            raise ConnectFailed("the connection pool is closed")
        host = self._hosts.get(base) or self._target(base)
        if not isinstance(headers, bytes):
            headers = "".join([f"{k}: {v}\r\n" for k, v in headers]).encode("latin-1")
        head_bytes = b"%s %s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n%s\r\n" % (
            method.encode("latin-1"), path.encode("latin-1"), host[5], len(body), headers)
        # One write for a small request (one send); a large body goes as its own buffers (the
        # chunks it arrived in), so a 60 MB prompt is not copied on the event loop just to put
        # 300 bytes in front of it.
        if isinstance(body, Chunks):
            parts, data = body.parts, None
        else:
            parts, data = (body,), (head_bytes + body if len(body) < _BIG_BODY else None)
        now = self.loop.time()
        deadline = now + total_timeout if total_timeout else None
        head_deadline = now + head_timeout if head_timeout else None
        for attempt in (1, 2):
            conn = self._idle_conn(base)
            fresh = conn is None
            if fresh:
                limits = [t for t in (deadline, head_deadline) if t is not None]
                try:
                    conn = await self._connect(base, min(limits) if limits else None)
                except ConnectFailed:
                    if head_deadline is not None and self.loop.time() >= head_deadline:
                        raise TimeoutError() from None  # the head's time ran out while connecting
                    raise
            conn.deadline = deadline
            conn.head_deadline = head_deadline
            conn.head_only = method == "HEAD"
            conn.last_data = self.loop.time()
            conn.arm()
            if data is not None:
                conn.transport.write(data)
            else:
                conn.transport.writelines((head_bytes, *parts))
            if on_sent is not None:
                on_sent()
                on_sent = None
            try:
                while not conn.headers_done:
                    await conn.wait()
            except Disconnected:
                conn.disarm()
                if fresh or conn.got_bytes or attempt == 2:
                    raise
                continue  # the backend had closed this idle connection: once more on a new one
            except BaseException:
                conn.disarm()
                conn.transport.close()
                raise
            return Response(conn)
        raise AssertionError("unreachable")  # pragma: no cover

    def put_back(self, conn: _Conn) -> None:
        if (conn.complete and conn.keep_alive and conn.error is None and not self.closed
                and not conn.transport.is_closing()):
            idle = self._idle.setdefault(conn.key, [])
            if len(idle) < self.max_idle:
                if conn.paused:
                    conn.transport.resume_reading()
                watch = conn.watch
                conn._reset()
                conn.watch = watch  # kept for the next request (see ``arm``); idle, it does nothing
                conn.idle = True
                idle.append(conn)
                return
        conn.disarm()
        conn.transport.close()

    def forget(self, conn: _Conn) -> None:
        conn.disarm()  # gone: nothing left to watch
        self._open.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def cut_off(self, base: str) -> int:
        """Close every connection to ``base``, busy ones too, and open no new one until
        ``allow(base)``: the requests on them fail as when a backend drops them (retried
        elsewhere when nothing reached the client). Returns how many were open."""
        self._refused.add(base)
        self._idle.pop(base, None)
        cut = [conn for conn in self._open if conn.key == base]
        for conn in cut:
            conn.transport.close()
        return len(cut)

    def allow(self, base: str) -> None:
        self._refused.discard(base)

    def close(self) -> None:
        self.closed = True
        for conn in list(self._open):
            conn.transport.close()
        self._idle.clear()
