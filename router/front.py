"""The router's listening socket: a small HTTP/1.1 server on asyncio protocols and httptools.

Why not aiohttp's server here: on the 2-core reference machine aiohttp's request handling
alone adds about 0.3 ms to every proxied request, twice the whole overhead of the Rust
peer routers (docs/performance.md). This server parses with httptools' C parser, hands the
two data-plane endpoints (``POST /v1/completions``, ``POST /v1/chat/completions``) to the
same ``router.app.proxy`` the aiohttp handlers call, and relays every other request
(control API, event streams, /metrics, /health, /v1/models, errors) unchanged to the
router's aiohttp application, which listens on a private Unix socket.

HTTP/1.1 as clients use it: keep-alive, pipelined requests answered in order, chunked or
sized request bodies, ``Expect: 100-continue``; a body over ``--max-body-mb`` gets a JSON 413,
one that does not arrive within ``--client-timeout`` a JSON 408, a malformed request a JSON
400, each closing the connection. A client that leaves cancels its request, which the proxy
records as ``client_gone``. Streaming answers are chunked, and a slow reader pauses the
upstream read (transport flow control), so memory stays bounded.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import deque
from http import HTTPStatus
from typing import TYPE_CHECKING

import httptools
from multidict import CIMultiDict

from router.app import RouterState, error_body, proxy
from router.upstream import Pool, UpstreamError, set_nodelay

if TYPE_CHECKING:
    from aiohttp import web

DATA_PLANE = {b"/v1/completions": ("completions", "/v1/completions"),
              b"/v1/chat/completions": ("chat", "/v1/chat/completions")}

#: Response headers this server sets itself (framing and connection management).
_OWN = frozenset(("content-length", "transfer-encoding", "connection", "keep-alive"))
#: Request headers not relayed to the internal application.
_HOP = frozenset(("host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
                  "trailer", "upgrade", "proxy-connection", "expect"))
_REASON = {s.value: s.phrase for s in HTTPStatus}
#: Requests parsed ahead of the one being answered before reading pauses (pipelining bound).
_MAX_QUEUED = 8
#: Largest request line plus headers; aiohttp's limit was 8,190 bytes a line (431 past this).
MAX_HEAD_BYTES = 64 * 1024
#: An idle keep-alive connection is closed after this long (aiohttp's default).
KEEPALIVE_TIMEOUT_S = 75.0
SWEEP_EVERY_S = 5.0


def _head(status: int, headers, keep_alive: bool, length: int | None) -> bytes:
    """Status line and headers. ``length`` None: a chunked body; -1: a body ended by closing
    the connection (HTTP/1.0 clients, who cannot read chunks)."""
    out = [f"HTTP/1.1 {status} {_REASON.get(status, 'Unknown')}\r\n"]
    for k, v in (headers.items() if hasattr(headers, "items") else headers):
        if k.lower() not in _OWN:
            out.append(f"{k}: {v}\r\n")
    if status in (204, 304):
        pass  # no body, and no framing header (RFC 9110 8.6)
    elif length is None:
        out.append("Transfer-Encoding: chunked\r\n")
    elif length >= 0:
        out.append(f"Content-Length: {length}\r\n")
    if not keep_alive:
        out.append("Connection: close\r\n")
    out.append("\r\n")
    return "".join(out).encode("latin-1")


def _error_bytes(status: int, message: str, keep_alive: bool) -> bytes:
    body = json.dumps(error_body(status, message)).encode()
    return _head(status, {"Content-Type": "application/json"}, keep_alive, len(body)) + body


class FrontRequest:
    __slots__ = ("method", "url", "path", "headers", "body", "keep_alive", "t_recv", "http10")

    def __init__(self, method: str, url: bytes, headers: CIMultiDict[str], body: bytes,
                 keep_alive: bool, t_recv: float, http10: bool = False):
        self.http10 = http10
        self.method = method
        self.url = url
        self.path = url.partition(b"?")[0]
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.t_recv = t_recv


class Exchange:
    """One request's answer, written straight to the client's transport (see app.AioExchange)."""

    __slots__ = ("proto", "request", "headers", "started", "chunked")

    def __init__(self, proto: FrontProtocol, request: FrontRequest):
        self.proto = proto
        self.request = request
        self.headers = request.headers
        self.started = False
        self.chunked = False

    @property
    def gone(self) -> bool:
        return self.proto.gone

    def _write(self, data: bytes) -> None:
        if self.proto.gone:
            raise ConnectionResetError("the client disconnected")
        self.proto.transport.write(data)

    async def respond(self, status: int, headers, body: bytes) -> None:
        self._write(_head(status, headers, self.request.keep_alive, len(body)) + body)
        self.started = True

    async def send(self, resp: web.Response) -> None:
        await self.respond(resp.status, resp.headers, resp.body or b"")

    async def respond_head(self, status: int, headers, length: int | None) -> None:
        """An answer to HEAD: the headers a GET would get, with its Content-Length, no body."""
        self._write(_head(status, headers, self.request.keep_alive, -1 if length is None else length))
        self.started = True

    async def start(self, status: int, headers) -> None:
        req = self.request
        if req.http10:  # no chunked coding in HTTP/1.0: the body ends when the connection does
            req.keep_alive = False
            self._write(_head(status, headers, False, -1))
        else:
            self._write(_head(status, headers, req.keep_alive, None))
            self.chunked = True
        self.started = True

    async def write(self, chunk: bytes) -> None:
        if chunk:
            self._write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if self.chunked else chunk)
            if self.proto.write_paused:
                await self.proto.drain()

    async def finish(self) -> None:
        if self.chunked:
            self._write(b"0\r\n\r\n")


class FrontProtocol(asyncio.Protocol):
    """One client connection."""

    def __init__(self, server: FrontServer):
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[FrontRequest] = deque()
        self.task: asyncio.Task | None = None
        self.gone = False
        self.closing = False
        self.write_paused = False
        self.read_paused = False
        self._drain: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._in_message = False
        self._url = b""
        self._headers: list[tuple[str, str]] = []
        self._body: list[bytes] = []
        self._size = 0
        self._t_recv = 0.0
        self._continue = False  # a 100 Continue owed once the answers before it are out
        self._in_head = False
        self._head_bytes = 0
        self.last_active = self.loop.time()

    # -- connection ---------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections.add(self)
        set_nodelay(transport)

    def connection_lost(self, exc) -> None:
        self.gone = True
        self.server.connections.discard(self)
        self._cancel_timer()
        if self.task is not None:
            self.task.cancel()  # the proxy records client_gone and releases its counters
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)  # the next write sees `gone` and raises

    def eof_received(self) -> bool:
        return False  # a client that half-closes is treated as gone, as aiohttp does

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    async def drain(self) -> None:
        """Wait while the client's socket buffer is full. A client that reads nothing for
        ``--client-timeout`` seconds is dropped (and its request recorded as client_gone)."""
        if self.write_paused and not self.gone:
            if self._drain is None:
                self._drain = self.loop.create_future()
            limit = self.server.client_timeout_s or None
            try:
                async with asyncio.timeout(limit):
                    await asyncio.shield(self._drain)
            except TimeoutError:
                self.transport.abort()
                raise ConnectionResetError(f"the client read nothing for {limit:g} s") from None

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        self.last_active = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.reject(400, "protocol upgrades are not supported by this router", upgrade=True)
        except httptools.HttpParserError as exc:
            self.reject(400, f"malformed HTTP request: {exc}")
        if self._in_head and not self.closing:  # still in the request line and headers
            self._head_bytes += len(data)
        if self._in_head and self._head_bytes > MAX_HEAD_BYTES and not self.closing:
            self.reject(431, f"the request line and headers exceed {MAX_HEAD_BYTES} bytes")
            return
        if self._in_message and self._timer is None and not self.closing and not self.read_paused:
            timeout = self.server.client_timeout_s
            if timeout:  # the rest of this request must arrive within --client-timeout
                self._timer = self.loop.call_later(timeout, self._body_timeout)

    def reject(self, status: int, message: str, *, upgrade: bool = False) -> None:
        """Answer with a JSON error and close: the rest of the stream cannot be trusted."""
        if self.closing or self.gone:
            return
        self.closing = True
        self._cancel_timer()
        self.server.state.counts["bad_requests"] += 1
        if upgrade and self.queue and "upgrade" in getattr(self.queue[-1], "headers", ()):
            self.queue.pop()  # the upgrade request itself is what gets the 400
        if self.task is None:  # nothing is being answered: this answer goes out now
            self.transport.write(_error_bytes(status, message, keep_alive=False))
            self.linger()
        else:  # in order: after the requests that came whole before the bad bytes
            self.queue.append(_Rejection(status, message))

    def linger(self, linger_s: float = 2.0) -> None:
        """Close after an error answer without resetting it away: send FIN, keep reading
        (and dropping) what the client still sends for up to ``linger_s``, then close.
        Closing a socket with unread bytes sends RST, and the client may lose the answer."""
        self.closing = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(linger_s, self.transport.close)
        else:
            self.transport.close()

    def _body_timeout(self) -> None:
        self._timer = None
        t = self.server.client_timeout_s
        self.reject(408, f"the request body did not arrive within {t:g} s")

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- httptools callbacks ------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._in_message = True
        self._in_head = True
        self._url = b""
        self._headers = []
        self._body = []
        self._size = 0
        self._t_recv = time.time()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        limit = self.server.max_body_bytes
        for k, v in self._headers:
            kl = k.lower()
            if kl == "content-length" and v.isdigit() and int(v) > limit:
                self.reject(413, "request body too large")
                raise httptools.HttpParserCallbackError("body too large")
            if kl == "expect" and v.lower() == "100-continue":
                if self.task is None:
                    self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                else:  # not inside the answer being written: after it (_serve sends it)
                    self._continue = True

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self.server.max_body_bytes:
            self.reject(413, "request body too large")
            raise httptools.HttpParserCallbackError("body too large")
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._in_message = False
        self._continue = False  # the body came without waiting for it
        self._cancel_timer()
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        req = FrontRequest(self.parser.get_method().decode("latin-1"), self._url,
                           CIMultiDict(self._headers), body,
                           self.parser.should_keep_alive(), self._t_recv,
                           self.parser.get_http_version() == "1.0")
        self.queue.append(req)
        if self.task is None:
            self.task = self.loop.create_task(self._serve())
        elif len(self.queue) >= _MAX_QUEUED and not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()
            self._cancel_timer()  # the client is not slow: we are not reading

    # -- answering, in order --------------------------------------------------------------
    async def _serve(self) -> None:
        try:
            while self.queue and not self.gone:
                req = self.queue.popleft()
                if self.read_paused and len(self.queue) < _MAX_QUEUED // 2:
                    self.read_paused = False
                    self.transport.resume_reading()
                    if self._in_message and self._timer is None and self.server.client_timeout_s:
                        self._timer = self.loop.call_later(self.server.client_timeout_s, self._body_timeout)
                if isinstance(req, _Rejection):
                    self.transport.write(_error_bytes(req.status, req.message, keep_alive=False))
                    self.linger()
                    return
                x = Exchange(self, req)
                try:
                    await self.server.handle(x)
                except (ConnectionResetError, asyncio.CancelledError):
                    return
                except Exception as exc:  # a bug: say so plainly, keep serving others
                    print(f"kvtop route: internal error on {req.path.decode('latin-1')}: {exc!r}",
                          file=sys.stderr)
                    if not x.started and not self.gone:
                        self.transport.write(_error_bytes(500, "internal router error", keep_alive=False))
                    self.transport.close()
                    return
                if not req.keep_alive:
                    self.transport.close()
                    return
                if self._continue and not self.queue and not self.gone:
                    self._continue = False
                    self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        finally:
            self.task = None
            self.last_active = self.loop.time()
            if self.queue and not self.gone and not self.closing and not self.server.closing:
                self.task = self.loop.create_task(self._serve())


class _Rejection:
    __slots__ = ("status", "message")

    def __init__(self, status: int, message: str):
        self.status = status
        self.message = message


class FrontServer:
    """The listening socket's protocol factory and the relay to the aiohttp application."""

    def __init__(self, state: RouterState, internal: str):
        self.state = state
        self.internal = internal  # "unix:/path" of the aiohttp application
        self.loop = asyncio.get_running_loop()
        cfg = state.config
        self.max_body_bytes = cfg.max_body_bytes
        self.client_timeout_s = cfg.client_timeout_s
        self.relay_pool = Pool(connect_timeout=5.0, read_timeout=None)
        self.connections: set[FrontProtocol] = set()
        self.server: asyncio.AbstractServer | None = None
        self.closing = False
        self._sweeper: asyncio.Task | None = None

    async def start(self, sock) -> asyncio.AbstractServer:
        self.server = await self.loop.create_server(lambda: FrontProtocol(self), sock=sock)
        self._sweeper = self.loop.create_task(self._sweep_idle())
        return self.server

    async def _sweep_idle(self) -> None:
        """Close keep-alive connections idle for KEEPALIVE_TIMEOUT_S: clients that vanish
        without closing would otherwise hold a descriptor each for ever."""
        while True:
            await asyncio.sleep(SWEEP_EVERY_S)
            cutoff = self.loop.time() - KEEPALIVE_TIMEOUT_S
            for c in list(self.connections):
                if c.task is None and not c._in_message and c.last_active < cutoff:
                    c.transport.close()

    async def close(self, grace_s: float = 1.0) -> None:
        """Stop listening; give open answers ``grace_s``, then drop the connections."""
        self.closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self.server is not None:
            self.server.close()
        deadline = self.loop.time() + grace_s
        while any(c.task is not None for c in self.connections) and self.loop.time() < deadline:
            await asyncio.sleep(0.02)
        for c in list(self.connections):
            if c.task is not None:
                c.task.cancel()
            c.transport.close()
        self.relay_pool.close()

    async def handle(self, x: Exchange) -> None:
        req = x.request
        target = DATA_PLANE.get(req.path) if req.method == "POST" else None
        if target is not None:
            await proxy(self.state, x, req.body, target[0], target[1], req.t_recv)
            return
        await self.relay(x)

    async def relay(self, x: Exchange) -> None:
        """Pass the request to the aiohttp application and its answer back, streamed."""
        req = x.request
        headers = [(k, v) for k, v in req.headers.items() if k.lower() not in _HOP]
        try:
            up = await self.relay_pool.request(self.internal, req.method, req.url.decode("latin-1"),
                                               headers, req.body)
        except UpstreamError as exc:
            await x.respond(502, {"Content-Type": "application/json"},
                            json.dumps(error_body(502, f"router internal relay failed: {exc}")).encode())
            return
        async with up:
            out = [(k, v) for k, v in up.headers.items() if k.lower() not in _OWN]
            if req.method == "HEAD":
                length = up.headers.get("content-length")
                await x.respond_head(up.status, out, int(length) if length and length.isdigit() else None)
                return
            if "content-length" in up.headers:
                await x.respond(up.status, out, await up.read())
                return
            await x.start(up.status, out)
            try:
                async for chunk in up.iter_chunks():
                    await x.write(chunk)
            except (UpstreamError, TimeoutError):
                # the application ended the stream (shutting down, or it dropped the viewer):
                # end the client's connection the same way, without a chunk terminator
                x.proto.transport.close()
                return
            await x.finish()

