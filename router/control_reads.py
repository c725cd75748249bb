"""The control API's reads: query parameters parsed with bounds (a 400 naming the parameter),
and fairness between planes (a token bucket per client, a bounded share of the event loop
while requests are in flight, shared snapshots of answers), so observers cannot cost the data
plane more than READ_LOOP_SHARE (issue 36)."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from router.http import error_response
from router.state import STATE, RouterState


def _param(request: web.Request, name: str, default, lo, hi, conv, what: str):
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = conv(raw)
    except ValueError:
        value = None
    if value is None or not lo <= value <= hi:  # NaN fails too
        raise BadParam(name, f"{name} must be {what} in [{lo:g}, {hi:g}], got {raw!r}")
    return value


def int_param(request: web.Request, name: str, default: int, lo: int, hi: int) -> int:
    return _param(request, name, default, lo, hi, int, "an integer")


def float_param(request: web.Request, name: str, default: float, lo: float, hi: float) -> float:
    return _param(request, name, default, lo, hi, float, "a number")


class BadParam(Exception):
    def __init__(self, param: str, message: str, status: int = 400):
        super().__init__(message)
        self.param = param
        self.message = message
        self.status = status


def bad_params(handler):
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except BadParam as exc:
            msg = exc.message if exc.message.startswith(exc.param) else f"{exc.param}: {exc.message}"
            resp = error_response(exc.status, msg, param=exc.param)
            if exc.status in (408, 413):  # the body is unread: close behind the answer
                resp.force_close()
            return resp
    wrapped.__name__ = handler.__name__
    return wrapped


#: Control reads while requests are in flight come from a snapshot at most this old, shared
#: by every client asking the same question (a read never costs the data plane twice).
READ_SNAPSHOT_S = 0.25
#: Per client address: control reads per second, the burst allowed above it, and how long a
#: read over the rate may wait for its turn before it is refused (a client reading in a loop
#: is slowed to the rate instead of spinning on fast 429s).
READ_RATE, READ_BURST, READ_MAX_WAIT_S = 50.0, 100.0, 2.0
_MAX_CLIENTS = 4096  # rate-limit buckets kept (oldest forgotten first)
#: While requests are in flight, control reads from every client together take at most this
#: share of the event loop (their handler time, plus their answer's bytes at WRITE_S_PER_BYTE
#: and READ_OVERHEAD_S each), with READ_WORK_BURST_S of work allowed above it: four clients
#: reading ``decisions?limit=2000`` in a loop cost the data plane 27% of its throughput before
#: (issue 36). A read over the share waits its turn (READ_MAX_WAIT_S at most, then 429).
READ_LOOP_SHARE = 0.05
READ_WORK_BURST_S = 0.05
READ_OVERHEAD_S = 0.0003
WRITE_S_PER_BYTE = 2e-9


class ReadGuard:
    """Fairness between planes: a token bucket per client address, and shared snapshots of
    read answers while the data plane is busy."""

    def __init__(self, state: RouterState):
        self.state = state
        self.buckets: dict[str, tuple[float, float]] = {}  # address -> (tokens, last refill)
        self.cache: dict[str, tuple[float, bytes]] = {}  # path?query -> (made at, body)
        self.refused = 0
        self.served_from_snapshot = 0
        self.work = READ_WORK_BURST_S  # seconds of loop work control reads may still take now
        self.work_at: float | None = None
        self.cost: dict[str, float] = {}  # path?query -> what its last read cost (an estimate)
        self.paced_s = 0.0  # total time reads waited for the loop share

    def work_turn(self, key: str, now: float) -> float | None:
        """Reserve this read's estimated cost against READ_LOOP_SHARE: seconds it waits for
        its turn (0: at once), or None: refuse it (the wait would pass READ_MAX_WAIT_S)."""
        last = self.work_at if self.work_at is not None else now
        self.work_at = now
        self.work = min(READ_WORK_BURST_S, self.work + (now - last) * READ_LOOP_SHARE)
        guess = self.cost.get(key, READ_OVERHEAD_S)
        wait = max(0.0, guess - self.work) / READ_LOOP_SHARE
        if wait > READ_MAX_WAIT_S:
            self.refused += 1
            return None
        self.work -= guess
        self.paced_s += wait
        return wait

    def spent(self, key: str, guess: float, cost: float) -> None:
        """The read's measured cost replaces the guess made at its turn."""
        self.work -= cost - guess
        if len(self.cost) > 256:
            self.cost.clear()
        self.cost[key] = cost

    def turn(self, who: str, now: float) -> float | None:
        """Seconds this read waits for its turn (0: at once), or None: refuse it. Tokens may go
        negative: each waiting read holds its place in the client's line."""
        tokens, last = self.buckets.pop(who, (READ_BURST, now))
        tokens = min(READ_BURST, tokens + (now - last) * READ_RATE) - 1.0
        wait = -tokens / READ_RATE if tokens < 0 else 0.0
        if wait > READ_MAX_WAIT_S:
            tokens += 1.0  # refused: it takes no place
            self.refused += 1
            self.buckets[who] = (tokens, now)
            return None
        self.buckets[who] = (tokens, now)  # re-inserted: newest last
        if len(self.buckets) > _MAX_CLIENTS:
            del self.buckets[next(iter(self.buckets))]
        return wait

    def cached(self, key: str, now: float) -> bytes | None:
        hit = self.cache.get(key)
        if hit is not None and now - hit[0] < READ_SNAPSHOT_S and self.state.cluster.in_flight:
            self.served_from_snapshot += 1
            return hit[1]
        return None

    def keep(self, key: str, now: float, body: bytes) -> None:
        if len(self.cache) > 256:  # distinct queries are few; a client inventing them gets no cache
            self.cache.clear()
        self.cache[key] = (now, body)


def guarded_read(handler):
    """A control read: rate-limited per client, answered from a shared snapshot when busy."""
    async def wrapped(request: web.Request) -> web.StreamResponse:
        guard: ReadGuard = request.app[GUARD]
        now = time.monotonic()
        wait = guard.turn(request.remote or "?", now)
        if wait is None:
            return error_response(429, f"more than {READ_RATE:g} control reads per second from this client; "
                                       "use GET /kvtop/v1/events for a live view", headers={"Retry-After": "1"})
        if wait:
            await asyncio.sleep(wait)
            now = time.monotonic()
        key = request.path_qs
        busy = request.app[STATE].cluster.in_flight > 0  # an idle router answers reads at once
        guess = guard.cost.get(key, READ_OVERHEAD_S)
        if busy:
            pace = guard.work_turn(key, now)
            if pace is None:
                return error_response(429, "control reads are taking more than their share of the router "
                                           "while it serves requests; use GET /kvtop/v1/events for a live view",
                                      headers={"Retry-After": "1"})
            if pace:
                await asyncio.sleep(pace)
                now = time.monotonic()
        t0 = time.perf_counter()
        body = guard.cached(key, now)
        if body is not None:
            resp = web.Response(body=body, content_type="application/json")
        else:
            resp = await handler(request)
            if resp.status == 200 and isinstance(resp.body, bytes):
                guard.keep(key, now, resp.body)
        if busy:
            size = len(resp.body) if isinstance(resp.body, bytes) else 0
            guard.spent(key, guess, time.perf_counter() - t0 + READ_OVERHEAD_S + size * WRITE_S_PER_BYTE)
        return resp
    wrapped.__name__ = handler.__name__
    return wrapped


#: The app's ReadGuard (router/control.py sets it with its Control).
GUARD = web.AppKey("control_reads", ReadGuard)
