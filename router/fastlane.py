"""The data plane's lane through aiohttp's connection handler: one task per request, no queue.

aiohttp's ``RequestHandler`` serves a connection from one long-lived ``start()`` task: each
parsed request is queued, the task is woken through a future, makes the request object and a
fresh task for the handler, awaits it, then finishes the response and re-arms the keep-alive
timer. On the router's sequential non-streaming path that machinery (three loop callbacks and
their futures and tasks a request) was about 40 µs of CPU of 90 that aiohttp's server spent per
answer, measured with a trivial handler (docs/performance.md, issue 37 round 4).

``FastLane`` keeps aiohttp's parser, limits, error answers, lingering, keep-alive, TLS and
shutdown, and changes one thing: a POST to a data-plane path that arrives while the connection
is idle (``start()`` parked, nothing queued, no ``Expect`` or upgrade) is handled at once in one
task of its own, the lane. While the lane runs, ``start()`` stays parked and whatever else
arrives is queued as aiohttp queues it; when the lane ends it takes the next queued request if
that one is also a plain data-plane POST, else hands the queue back to ``start()``. So requests
on one connection are still answered one at a time, in order, and every other request
(control API, metrics, GETs, 100-continue, malformed heads) goes through aiohttp exactly as
before.

The lane reads aiohttp's private connection state (``_waiter``, ``_messages``,
``_request_in_progress``, ``_current_request``...), as ``router.app._JsonErrorHandler`` already
does; tests/test_fastlane.py pins the behaviour that depends on it, so an aiohttp upgrade
that changes it fails there, not in production.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import hdrs, web
from aiohttp.helpers import ceil_timeout
from aiohttp.http_writer import StreamWriter
from aiohttp.web_protocol import RequestHandler

#: What a request's body stream raises once its handler is done (aiohttp's own).
try:
    from aiohttp.web_protocol import _PAYLOAD_ACCESS_ERROR
except ImportError:  # pragma: no cover - older aiohttp
    from aiohttp.http_exceptions import PayloadAccessError  # type: ignore[attr-defined]
    _PAYLOAD_ACCESS_ERROR = PayloadAccessError()

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


class FastLane(RequestHandler):
    """aiohttp's connection handler with the data plane's lane (see the module's docstring).
    The server (``router.app._Server``) carries ``kvtop_lanes``: path -> handler, the handler
    taking the request and returning its response, as aiohttp's handlers do."""

    __slots__ = ("_lane", "_parked")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lane: asyncio.Task | None = None
        self._parked: asyncio.Future | None = None  # start()'s waiter, held while the lane runs

    def _lane_handler(self, msg: Any) -> Handler | None:
        """The lane's handler for a parsed request, or None when aiohttp should serve it."""
        # (a malformed request is queued as aiohttp's error record, with no method: aiohttp answers it)
        if getattr(msg, "method", None) != "POST" or msg.upgrade or self._upgraded or self._manager is None:
            return None
        handler = getattr(self._manager, "kvtop_lanes", {}).get(msg.path)
        if handler is None or hdrs.EXPECT in msg.headers:
            return None
        return handler

    def data_received(self, data: bytes) -> None:
        lane = self._lane
        waiter = self._waiter
        if lane is None and (waiter is None or waiter.done()):
            super().data_received(data)  # start() is busy, or not started yet: aiohttp's way
            return
        if lane is None:
            self._waiter = None  # parse without waking start(): the lane may take the request
        try:
            super().data_received(data)
        finally:
            if lane is None and self._waiter is None:
                self._waiter = waiter
        if lane is not None or not self._messages:
            return  # a running lane looks at the queue when it ends
        handler = self._lane_handler(self._messages[0][0]) if len(self._messages) == 1 else None
        if handler is None or self._waiter is not waiter or self._close or self._force_close:
            if not waiter.done():
                waiter.set_result(None)  # start() serves it, as aiohttp would have
            return
        msg, payload = self._take()
        self._parked, self._waiter = waiter, None  # so that the keep-alive timer sees a busy connection
        self._request_in_progress = True
        self._lane = self._loop.create_task(self._run_lane(msg, payload, handler))

    def _take(self) -> tuple[Any, Any]:
        msg, payload = self._messages.popleft()
        consumed = getattr(self._parser, "message_consumed", None)  # aiohttp >= 3.14
        if consumed is not None:
            consumed()
        return msg, payload

    async def _run_lane(self, msg: Any, payload: Any, handler: Handler) -> None:
        loop = self._loop
        keep = False
        try:
            while True:
                keep = await self._serve_one(msg, payload, handler)
                self._keepalive = keep  # read by aiohttp's keep-alive timer, as start() sets it
                if not keep or self._close or self._force_close:
                    break
                close_time = loop.time() + self._keepalive_timeout
                self._next_keepalive_close_time = close_time
                if self._keepalive_handle is None:
                    self._keepalive_handle = loop.call_at(close_time, self._process_keepalive)
                nxt = self._lane_handler(self._messages[0][0]) if len(self._messages) == 1 else None
                if nxt is None:
                    break
                handler = nxt
                msg, payload = self._take()
        except (asyncio.CancelledError, ConnectionError):
            keep = False  # the client left, or the router is stopping: the connection goes
        except Exception as exc:  # a bug in the handler's machinery: logged, the connection closed
            self.log_exception("Unhandled exception", exc_info=exc)
            keep = False
        finally:
            self._lane = None
            self._request_in_progress = False
            parked, self._parked = self._parked, None
            self._waiter = parked
            if self._handler_waiter is not None:  # shutdown() waits for the request in progress
                self._handler_waiter.set_result(None)
            if not keep or self._close or self._force_close:
                self.force_close()  # ends start() too (its waiter is cancelled)
            elif self._messages and parked is not None and not parked.done():
                parked.set_result(None)  # start() serves what queued up behind the lane

    async def _serve_one(self, msg: Any, payload: Any, handler: Handler) -> bool:
        """One request through ``handler``; whether the connection stays open after it."""
        loop = self._loop
        assert self._manager is not None and self._request_factory is not None
        self._manager.requests_count += 1
        writer = StreamWriter(self, loop)
        request = self._request_factory(msg, payload, self, writer, self._lane)
        self._current_request = request
        try:
            resp = await handler(request)
        finally:
            self._current_request = None
        try:
            request._finish()
            await resp.prepare(request)
            await resp.write_eof()
        finally:
            request._task = None  # as aiohttp: no cycle through the task
        keep = bool(resp.keep_alive)
        if not payload.is_eof():  # the answer came before the body's end (a refusal): read it
            lingering = self._lingering_time
            if not self._force_close and lingering:
                now = loop.time()
                end_t = now + lingering
                try:
                    while not payload.is_eof() and now < end_t:
                        async with ceil_timeout(end_t - now):
                            await payload.readany()
                        now = loop.time()
                except (asyncio.CancelledError, asyncio.TimeoutError):
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        raise
            if not payload.is_eof():
                keep = False
        payload.set_exception(_PAYLOAD_ACCESS_ERROR)
        return keep

    def connection_lost(self, exc: BaseException | None) -> None:
        lane = self._lane
        cancel = self._manager is not None and self._manager.handler_cancellation
        super().connection_lost(exc)
        if lane is not None and cancel:
            lane.cancel()  # the client left: its request is cancelled at once, as aiohttp does

    async def shutdown(self, timeout: float | None = 15.0) -> None:
        await super().shutdown(timeout)
        lane = self._lane
        if lane is not None:  # still running past the timeout
            lane.cancel()
