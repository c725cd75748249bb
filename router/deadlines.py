"""Request bodies still arriving, failed at their deadline by one timer for all of them.

A body that is not whole when its handler starts (a client sends the head and the body in two
writes, as aiohttp's and httpx's do) must arrive within ``--client-timeout``. An
``asyncio.timeout`` per read cost about 6 µs on uvloop (a timer handle made and cancelled, and
the context's bookkeeping) on every such request's path; here a read registers its deadline in
an insertion-ordered dict and one timer per event loop, re-armed only when it fires, fails the
reads whose deadline has passed: their body stream gets the exception, so the handler's read
raises it, as for any broken body. The timer is set for the earliest deadline registered (a
shorter timeout registered later moves it earlier); when it fires it fails what is overdue and
is set again for the earliest deadline left, so with a steady stream of requests it fires
about once a timeout, not once a request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any
from weakref import WeakKeyDictionary


class BodyDeadlines:
    """The reads waiting on one event loop: ``add`` before a read, ``discard`` after it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.waiting: dict[Any, tuple[float, Callable[[], BaseException]]] = {}
        self.handle: asyncio.TimerHandle | None = None

    def add(self, stream: Any, timeout_s: float, error: Callable[[], BaseException]) -> None:
        """``stream`` (an aiohttp ``StreamReader``) gets ``error()`` once ``timeout_s`` passes
        without a ``discard``."""
        at = self.loop.time() + timeout_s
        self.waiting[stream] = (at, error)
        h = self.handle
        if h is None or h.when() > at:
            if h is not None:
                h.cancel()
            self.handle = self.loop.call_at(at, self._fire)

    def discard(self, stream: Any) -> None:
        self.waiting.pop(stream, None)

    def _fire(self) -> None:
        self.handle = None
        now = self.loop.time()
        nxt = None
        for stream, (at, error) in list(self.waiting.items()):
            if at <= now:
                del self.waiting[stream]
                stream.set_exception(error())
            elif nxt is None or at < nxt:
                nxt = at
        if nxt is not None:
            self.handle = self.loop.call_at(nxt, self._fire)


_BY_LOOP: WeakKeyDictionary[asyncio.AbstractEventLoop, BodyDeadlines] = WeakKeyDictionary()


def body_deadlines() -> BodyDeadlines:
    """The running loop's ``BodyDeadlines``."""
    loop = asyncio.get_running_loop()
    d = _BY_LOOP.get(loop)
    if d is None:
        d = _BY_LOOP[loop] = BodyDeadlines(loop)
    return d
