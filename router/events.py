"""Fan-out of router events to server-sent-event viewers, without costing the router time.

The routing path only calls ``Broadcaster.__call__`` (a ``state.listeners`` entry): it
serializes an event once and appends it to each viewer's bounded deque. Each viewer's own
handler task drains its deque every ``flush_s`` and writes a coalesced state snapshot at
the viewer's rate. A viewer that cannot keep up loses its oldest events (counted, and
reported in a ``dropped`` event); it never slows routing, and its memory stays bounded.

Two bounds keep viewers, however many and however hostile, from taking the router's time
(issue 36: 250 viewers that never read cost 29% of throughput): a viewer whose connection
holds ``stall_bytes`` unsent is *stalled*: it leaves the routing path's fan-out (its events
are counted as lost, not queued) until its client reads again; and every viewer's flushes
together take at most ``VIEWER_LOOP_SHARE`` of the loop: a flush over the share waits.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from aiohttp import web

from router.http import dumps

EVENT_TYPES = ("state", "decision", "config", "health", "outcome")
DEFAULT_TYPES = frozenset({"state", "decision", "config", "health"})
HZ_MIN, HZ_MAX, HZ_DEFAULT = 0.2, 20.0, 4.0
DECISIONS_MAX, DECISIONS_DEFAULT = 10_000.0, 200.0
#: The share of the event loop every viewer's flushes together may take, and the burst of work
#: allowed above it (seconds).
VIEWER_LOOP_SHARE = 0.05
VIEWER_WORK_BURST_S = 0.05


def sse(event: str, data: str) -> bytes:
    return f"event: {event}\ndata: {data}\n\n".encode()


class DecisionSampler:
    """A token bucket shared by every viewer with the same decision rate.

    Over the rate, decisions are sampled evenly (burst of a tenth of a second) instead of
    the first N of each second passing. Sharing it means ten viewers at the default rate
    take the same decisions, so each is serialized once, not ten times.
    """

    def __init__(self, rate: float):
        self.rate = rate
        self.burst = max(1.0, rate / 10)
        self.tokens = self.burst
        self.last_refill = time.monotonic()
        self.seq = -1
        self.ok = False

    def admit(self, seq: int, now: float) -> bool:
        if seq != self.seq:  # decide once per event for all the viewers sharing this bucket
            self.seq = seq
            self.tokens = min(self.burst, self.tokens + (now - self.last_refill) * self.rate)
            self.last_refill = now
            self.ok = self.tokens >= 1.0
            if self.ok:
                self.tokens -= 1.0
        return self.ok


class Viewer:
    """One attached event-stream client: its filter, sampler and bounded buffer."""

    def __init__(self, types: frozenset[str], hz: float, decisions_per_s: float, buffer: int):
        self.types = types
        self.hz = hz
        self.decisions_per_s = decisions_per_s
        self.sampler = DecisionSampler(decisions_per_s)  # replaced by a shared one on attach
        self.queue: deque[bytes] = deque(maxlen=buffer)
        self.dropped_rate = 0  # decisions left out by the decision rate limit (sampling)
        self.dropped_overflow = 0  # events pushed out of a full buffer (a slow viewer)
        self.reported_rate = 0
        self.reported_overflow = 0
        self.sent_events = 0
        self.closed = False
        self.stalled_at: int | None = None  # the broadcaster's event count when it stalled
        self.task: asyncio.Task | None = None

    def admit(self, kind: str, seq: int, now: float) -> bool:
        """Whether this viewer takes the event (type filter, then decision sampling)."""
        if kind not in self.types:
            return False
        if kind == "decision" and not self.sampler.admit(seq, now):
            self.dropped_rate += 1
            return False
        return True

    def push(self, data: bytes) -> None:
        if len(self.queue) == self.queue.maxlen:
            self.dropped_overflow += 1
        self.queue.append(data)


class Broadcaster:
    """Holds the attached viewers; a ``state.listeners`` entry."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], *, buffer: int = 2000,
                 flush_s: float = 0.05, heartbeat_s: float = 15.0, sndbuf: int | None = 256 * 1024,
                 stall_bytes: int = 64 * 1024, stall_poll_s: float = 0.25):
        self.snapshot = snapshot
        self.buffer = buffer
        self.flush_s = flush_s
        self.heartbeat_s = heartbeat_s
        self.sndbuf = sndbuf  # caps kernel buffering per viewer, so "old events lost" stays true
        self.viewers: set[Viewer] = set()
        self.live: set[Viewer] = set()  # the viewers not stalled: the ones events go to
        self.stall_bytes = stall_bytes  # unsent bytes on a viewer's connection that mark it stalled
        self.stall_poll_s = stall_poll_s
        self.work = VIEWER_WORK_BURST_S  # seconds of loop work viewers may still take now
        self.work_at: float | None = None
        self.paced_s = 0.0  # total time flushes waited for the viewers' share
        self.stalls = 0
        self.closing = False
        self._snap: tuple[float, bytes] | None = None
        self._samplers: dict[float, DecisionSampler] = {}
        self._seq = 0

    # -- routing path: must stay cheap and never await ------------------------------------
    def __call__(self, kind: str, payload: dict[str, Any]) -> None:
        self._seq += 1
        if not self.live:
            return
        data: bytes | None = None
        now = time.monotonic()
        for v in self.live:
            if v.admit(kind, self._seq, now):
                if data is None:  # serialized once, and only if some viewer takes it
                    data = sse(kind, dumps(payload))
                v.push(data)

    # -- snapshots, coalesced across viewers ------------------------------------------------
    def snapshot_bytes(self) -> bytes:
        now = time.monotonic()
        if self._snap is None or now - self._snap[0] >= 0.01:
            body = dumps(self.snapshot())
            self._snap = (now, sse("state", body))
        return self._snap[1]

    # -- pacing -------------------------------------------------------------------------------
    def _work_wait(self, now: float) -> float:
        """Seconds the next flush waits so that flushes keep to VIEWER_LOOP_SHARE."""
        last = self.work_at if self.work_at is not None else now
        self.work_at = now
        self.work = min(VIEWER_WORK_BURST_S, self.work + (now - last) * VIEWER_LOOP_SHARE)
        return 0.0 if self.work >= 0 else -self.work / VIEWER_LOOP_SHARE

    def _stall(self, viewer: Viewer) -> None:
        """The viewer's client is not reading: no more events for it until it does."""
        self.live.discard(viewer)
        viewer.stalled_at = self._seq
        viewer.dropped_overflow += len(viewer.queue)
        viewer.queue.clear()
        self.stalls += 1

    def _unstall(self, viewer: Viewer) -> None:
        viewer.dropped_overflow += self._seq - viewer.stalled_at  # (an upper bound: all events)
        viewer.stalled_at = None
        self.live.add(viewer)

    # -- one viewer's handler ---------------------------------------------------------------
    async def stream(self, request: web.Request, viewer: Viewer) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        sock = request.transport.get_extra_info("socket") if request.transport else None
        if sock is not None and self.sndbuf:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.sndbuf)
            except OSError:
                pass
        viewer.task = asyncio.current_task()
        viewer.sampler = self._samplers.setdefault(viewer.decisions_per_s, viewer.sampler)
        self.viewers.add(viewer)
        self.live.add(viewer)
        loop = asyncio.get_running_loop()
        want_state = "state" in viewer.types
        period = 1.0 / viewer.hz
        # Ticks on a shared grid, so viewers at the same rate share one snapshot.
        next_state = math.floor(loop.time() * viewer.hz) / viewer.hz
        last_write = loop.time()
        try:
            await resp.write(b"retry: 2000\n\n")
            while not viewer.closed and not self.closing:
                tr = request.transport
                if tr is None or tr.is_closing():
                    break
                if tr.get_write_buffer_size() >= self.stall_bytes:  # its client is not reading
                    if viewer.stalled_at is None:
                        self._stall(viewer)
                    else:  # what it missed meanwhile, counted as it goes
                        viewer.dropped_overflow += self._seq - viewer.stalled_at
                        viewer.stalled_at = self._seq
                    await asyncio.sleep(self.stall_poll_s)
                    continue
                if viewer.stalled_at is not None:
                    self._unstall(viewer)
                pace = self._work_wait(loop.time())
                if pace:
                    self.paced_s += pace
                    await asyncio.sleep(min(pace, 1.0))
                t_work = time.perf_counter()
                now = loop.time()
                chunks: list[bytes] = []
                if (viewer.dropped_rate != viewer.reported_rate
                        or viewer.dropped_overflow != viewer.reported_overflow):
                    body = {"decisions_sampled_out": viewer.dropped_rate - viewer.reported_rate,
                            "overflow": viewer.dropped_overflow - viewer.reported_overflow,
                            "decisions_per_s": viewer.decisions_per_s, "buffer": viewer.queue.maxlen,
                            "total_sampled_out": viewer.dropped_rate,
                            "total_overflow": viewer.dropped_overflow}
                    viewer.reported_rate, viewer.reported_overflow = viewer.dropped_rate, viewer.dropped_overflow
                    chunks.append(sse("dropped", json.dumps(body)))
                q = viewer.queue
                while q:
                    chunks.append(q.popleft())
                if want_state and now >= next_state:
                    chunks.append(self.snapshot_bytes())
                    # Coalesce: a viewer that fell behind gets the latest snapshot, not a backlog.
                    next_state += period
                    if next_state <= now:
                        next_state = (math.floor(now * viewer.hz) + 1) / viewer.hz
                if chunks:
                    viewer.sent_events += len(chunks)
                    data = b"".join(chunks)
                    self.work -= time.perf_counter() - t_work + len(data) * 2e-9  # building + the write's copy
                    if tr.get_write_buffer_size() + len(data) >= self.stall_bytes:
                        # this write may wait for a client that does not read: out of the fan-out
                        # until it is done (the loop's top puts it back once its client reads)
                        self._stall(viewer)
                    await resp.write(data)
                    last_write = loop.time()
                elif loop.time() - last_write >= self.heartbeat_s:
                    await resp.write(b": keepalive\n\n")
                    last_write = loop.time()
                else:
                    self.work -= time.perf_counter() - t_work
                wait = self.flush_s
                if want_state:
                    wait = min(wait, max(0.0, next_state - loop.time()))
                await asyncio.sleep(wait)
        except (ConnectionResetError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.viewers.discard(viewer)
            self.live.discard(viewer)
            if not any(v.decisions_per_s == viewer.decisions_per_s for v in self.viewers):
                self._samplers.pop(viewer.decisions_per_s, None)
            viewer.closed = True
        return resp

    async def close(self, grace_s: float = 0.5) -> None:
        """On app shutdown: end every stream; cancel the ones stuck writing to a dead reader."""
        self.closing = True
        tasks = [v.task for v in list(self.viewers) if v.task is not None and not v.task.done()]
        for v in list(self.viewers):
            v.closed = True
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace_s)
            for t in pending:
                t.cancel()
