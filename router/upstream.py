"""Pooled HTTP/1.1 client connections to the backends, on asyncio protocols and httptools.

The data plane's upstream half. aiohttp's ClientSession spends about 0.15 ms of CPU per
call on work a proxy does not need (cookie jar, tracing hooks, request and response
objects, per-call timers); this pool keeps one idle keep-alive connection list per
backend, writes the request head and body in one ``write`` and feeds the answer to
httptools' C parser. docs/performance.md has the figures.

Errors, mapped by the proxy to its outcome statuses (router/app.py):
  - ``ConnectFailed``: the backend refused or did not accept within ``connect_timeout``;
  - ``Disconnected``: the backend closed the connection before the answer was complete;
  - ``TimeoutError``: no byte for ``read_timeout`` seconds, or the request's ``total_timeout``
    passed (one timer per request enforces both, re-armed only when it fires).
A reused idle connection that the backend had already closed is retried once on a fresh
one, transparently, as long as no byte of the answer arrived.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict

#: Answer bytes buffered per connection before reading from the backend pauses.
HIGH_WATER = 256 * 1024


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


class _Conn(asyncio.Protocol):
    """One connection; carries one request at a time."""

    __slots__ = ("pool", "key", "transport", "parser", "status", "headers", "chunks", "buffered",
                 "complete", "error", "got_bytes", "waiter", "headers_done", "last_data", "paused",
                 "keep_alive", "deadline", "watch", "head_only", "interim",
                 "idle")

    def __init__(self, pool: Pool, key: str):
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.error: BaseException | None = None
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.complete = False
        self.headers_done = False
        self.got_bytes = False
        self.waiter: asyncio.Future | None = None
        self.paused = False
        self.keep_alive = True
        self.deadline: float | None = None
        self.watch: asyncio.TimerHandle | None = None
        self.head_only = False
        self.interim = False
        self.idle = False

    # -- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        set_nodelay(transport)

    def data_received(self, data: bytes) -> None:
        if self.idle:  # nobody asked: whatever this is, the connection is out of step
            self.pool.forget(self)
            self.transport.close()
            return
        self.got_bytes = True
        self.last_data = self.pool.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(Disconnected(f"malformed HTTP answer: {exc}"))
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self.pool.forget(self)
        if exc is None and self.headers_done and not self.complete \
                and "content-length" not in self.headers and "transfer-encoding" not in self.headers:
            self.on_message_complete()  # an answer delimited by the connection's close
            return
        if not self.complete:
            what = "the backend closed the connection" if exc is None else f"connection lost: {exc}"
            self._fail(Disconnected(what))

    # -- httptools callbacks ------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.add(name.decode("latin-1"), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (100 Continue, 103): the real one follows
            self.interim = True
            return
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True
        if self.head_only:  # an answer to HEAD has no body, whatever Content-Length says
            self.complete = True
        self._wake()

    def on_body(self, body: bytes) -> None:
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

    # -- timeouts: one timer per request, re-armed only when it fires ----------------------
    def arm(self) -> None:
        at = self._next_check()
        if at != float("inf"):
            self.watch = self.pool.loop.call_at(at, self._watchdog)

    def disarm(self) -> None:
        if self.watch is not None:
            self.watch.cancel()
            self.watch = None

    def _next_check(self) -> float:
        rt = self.pool.read_timeout
        at = self.last_data + rt if rt is not None else float("inf")
        return min(at, self.deadline) if self.deadline is not None else at

    def _watchdog(self) -> None:
        self.watch = None
        if self.complete or self.error is not None:
            return
        now = self.pool.loop.time()
        rt = self.pool.read_timeout
        if self.deadline is not None and now >= self.deadline:
            why = "the attempt's total time limit passed"
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

    async def read(self) -> bytes:
        c = self._conn
        parts = []
        while True:
            if c.chunks:  # taken as they come: past HIGH_WATER the backend would be paused
                parts.append(self._take())
            if c.complete:
                break
            await c.wait()
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
    """Idle keep-alive connections per backend (``http://host:port``, or ``unix:/path``)."""

    def __init__(self, *, connect_timeout: float | None = 5.0, read_timeout: float | None = 600.0,
                 max_idle_per_backend: int = 1024):
        self.loop = asyncio.get_running_loop()
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle = max_idle_per_backend
        self._idle: dict[str, list[_Conn]] = {}
        self._hosts: dict[str, tuple[str, str | None, int]] = {}
        self._open: set[_Conn] = set()
        self.closed = False

    def _target(self, base: str) -> tuple[str, str | None, int]:
        t = self._hosts.get(base)
        if t is None:
            if base.startswith("unix:"):
                t = ("localhost", base[5:], 0)
            else:
                u = urlsplit(base)
                if u.scheme != "http" or not u.hostname:
                    raise ValueError(f"only http:// backends are supported, got {base!r}")
                t = (u.netloc, None, u.port or 80)
            self._hosts[base] = t
        return t

    async def _connect(self, base: str, deadline: float | None = None) -> _Conn:
        netloc, unix_path, port = self._target(base)
        limit = self.connect_timeout
        if deadline is not None:
            left = deadline - self.loop.time()
            limit = left if limit is None else min(limit, left)
        try:
            async with asyncio.timeout(limit):
                if unix_path is not None:
                    _, conn = await self.loop.create_unix_connection(lambda: _Conn(self, base), unix_path)
                else:
                    host = urlsplit(base).hostname
                    _, conn = await self.loop.create_connection(lambda: _Conn(self, base), host, port)
        except TimeoutError:
            raise ConnectFailed(f"connect to {base} timed out after {limit:g} s") from None
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

    async def request(self, base: str, method: str, path: str, headers: Iterable[tuple[str, str]],
                      body: bytes = b"", *, total_timeout: float | None = None,
                      on_sent: Callable[[], None] | None = None) -> Response:
        """Send one request; return once the answer's status line and headers are in.

        ``total_timeout`` bounds everything from here to the answer's last byte; ``on_sent``
        is called once, right after the request is written (work that can overlap the wait)."""
        if self.closed:
            raise ConnectFailed("the connection pool is closed")
        netloc = self._target(base)[0]
        head = [f"{method} {path} HTTP/1.1\r\nHost: {netloc}\r\nContent-Length: {len(body)}\r\n"]
        for k, v in headers:
            head.append(f"{k}: {v}\r\n")
        head.append("\r\n")
        data = "".join(head).encode("latin-1") + body
        deadline = self.loop.time() + total_timeout if total_timeout else None
        for attempt in (1, 2):
            conn = self._idle_conn(base)
            fresh = conn is None
            if fresh:
                conn = await self._connect(base, deadline)
            conn.deadline = deadline
            conn.head_only = method == "HEAD"
            conn.last_data = self.loop.time()
            conn.arm()
            conn.transport.write(data)
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
        conn.disarm()
        if (conn.complete and conn.keep_alive and conn.error is None and not self.closed
                and not conn.transport.is_closing()):
            idle = self._idle.setdefault(conn.key, [])
            if len(idle) < self.max_idle:
                if conn.paused:
                    conn.transport.resume_reading()
                conn._reset()
                conn.idle = True
                idle.append(conn)
                return
        conn.transport.close()

    def forget(self, conn: _Conn) -> None:
        self._open.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def close(self) -> None:
        self.closed = True
        for conn in list(self._open):
            conn.transport.close()
        self._idle.clear()
