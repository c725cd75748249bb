"""Request bodies too large to join: kept as the chunks they arrived in."""

from __future__ import annotations

import asyncio
import mmap
import os
from typing import Any, NamedTuple


class Chunks:
    """A large request body kept as the chunks it arrived in (router/parsing.py and
    router/upstream.py take it as it is).

    Joining 60 MB into one ``bytes`` is one memcpy into freshly faulted pages, all under the
    GIL: ~40 ms on an idle VM, hundreds of milliseconds with eight such bodies and the parser's
    hand-off in flight, during which /health waits. Chunks are written upstream as they are
    (``writelines``) and copied into the parser's reused buffer a few megabytes at a time
    between loop turns; ``join`` is for the rare paths that need the whole text at once (the
    offload legs rewrite the body)."""

    __slots__ = ("parts", "size", "_joined")

    def __init__(self, parts: list[bytes], size: int):
        self.parts = parts
        self.size = size
        self._joined: bytes | None = None

    def __len__(self) -> int:
        return self.size

    def join(self) -> bytes:
        if self._joined is None:
            self._joined = b"".join(self.parts)
            self.parts = [self._joined]
        return self._joined


def as_bytes(raw: bytes | Chunks) -> bytes:
    """The body as one ``bytes`` (a join for a large one)."""
    return raw.join() if isinstance(raw, Chunks) else raw


#: Bytes copied into the hand-off buffer between two turns of the event loop.
COPY_STEP = 4 * 1024 * 1024
#: The hand-off buffer grows in steps of this size (it never shrinks).
GROW_STEP = 16 * 1024 * 1024


class ArenaRef(NamedTuple):
    """What crosses to the worker instead of the body: where it lies, and its length."""
    path: str
    size: int


class Handoff:
    """Hands large bodies to the parser's worker process through one reused shared buffer.

    Pickling a 60 MB body for ``ProcessPoolExecutor`` is one memcpy under the GIL into freshly
    faulted pages (and the pickle buffer's reallocations), on the executor's feeder thread:
    meanwhile the event loop cannot run. A fresh shared-memory segment per body was tried and
    was worse (every page faulted in, on the loop). This buffer is an anonymous memory file
    (``memfd_create``, so nothing is left behind if the router is killed), mapped once and
    reused: its pages are faulted in once, and the body is copied into it a few megabytes at a
    time between turns of the loop. One body at a time (the worker parses one at a time anyway):
    the buffer is held from the copy to the worker's answer. Where ``memfd_create`` is missing
    (not Linux), the body is pickled as before."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self.available = hasattr(os, "memfd_create")

    async def run(self, loop: asyncio.AbstractEventLoop, pool, fn, raw: bytes | Chunks, *args) -> Any:
        """``fn(ref_or_bytes, *args)`` in ``pool``; ``fn`` reads the body with ``fetch``."""
        if not self.available:
            return await loop.run_in_executor(pool, fn, as_bytes(raw), *args)
        async with self._lock:
            ref = await self._fill(raw)
            return await loop.run_in_executor(pool, fn, ref, *args)

    async def run_partial(self, loop: asyncio.AbstractEventLoop, pool, fn, raw: bytes | Chunks,
                          *args) -> tuple[bool, Any, asyncio.Future]:
        """``fn`` in ``pool`` (a WorkerProcess), which may answer early (router/worker.partial):
        (True, the early answer, a future of the result) or (False, the result, that future,
        done). The buffer is free again at the first answer: the worker copied the body out
        before it could send one."""
        if not self.available:
            first, final = pool.submit_partial(fn, as_bytes(raw), *args)
            early, value = await asyncio.wrap_future(first, loop=loop)
            return early, value, asyncio.wrap_future(final, loop=loop)
        async with self._lock:
            ref = await self._fill(raw)
            first, final = pool.submit_partial(fn, ref, *args)
            early, value = await asyncio.wrap_future(first, loop=loop)
        return early, value, asyncio.wrap_future(final, loop=loop)

    async def _fill(self, raw: bytes | Chunks) -> ArenaRef:
        n = len(raw)
        if self._map is None or len(self._map) < n:
            self._grow(n)
        view = memoryview(self._map)
        try:
            off = since = 0
            for part in (raw.parts if isinstance(raw, Chunks) else (raw,)):
                whole = memoryview(part)
                for start in range(0, len(part), COPY_STEP):
                    piece = whole[start:start + COPY_STEP]
                    view[off:off + len(piece)] = piece
                    off += len(piece)
                    since += len(piece)
                    if since >= COPY_STEP:
                        since = 0
                        await asyncio.sleep(0)  # let /health and the other requests run
        finally:
            view.release()
        return ArenaRef(f"/proc/{os.getpid()}/fd/{self._fd}", n)

    def _grow(self, n: int) -> None:
        size = -(-n // GROW_STEP) * GROW_STEP
        if self._fd is None:
            self._fd = os.memfd_create("kvtop-body-handoff", os.MFD_CLOEXEC)
        if self._map is not None:
            self._map.close()
        os.ftruncate(self._fd, size)
        self._map = mmap.mmap(self._fd, size)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


_worker_map: dict[str, mmap.mmap] = {}


def fetch(raw: bytes | ArenaRef) -> bytes:
    """In the worker: the body that ``Handoff.run`` passed (a copy, in the worker's process)."""
    if not isinstance(raw, ArenaRef):
        return raw
    m = _worker_map.get(raw.path)
    if m is None or len(m) < raw.size:
        if m is not None:
            m.close()
        with open(raw.path, "rb") as f:
            m = _worker_map[raw.path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return m[:raw.size]


class MemoryReturn:
    """Gives the freed memory of large bodies back to the system once none is held.

    glibc keeps freed memory in its heaps, and after a burst of large bodies its dynamic mmap
    threshold rises, so later large chunks come from the heaps too: the router stayed at
    ~450 MB idle after 8 x 60 MB bodies (review, bench_bodies). ``malloc_trim(0)`` returns every
    free page; it runs in a thread (it can take milliseconds on a large heap), at most once per
    ``interval_s``, and only when the router holds no body and a large one has gone since the
    last trim. Where glibc is absent it does nothing."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self._trim = _malloc_trim()
        self._due = False
        self._last = 0.0
        self._running = False
        self.trims = 0

    def body_done(self, size: int, held_now: int) -> None:
        """A body of ``size`` bytes was let go; ``held_now``: bytes of bodies still held."""
        if self._trim is None:
            return
        if size >= COPY_STEP:
            self._due = True
        if not self._due or held_now > 0 or self._running:
            return
        loop = asyncio.get_running_loop()
        wait = self._last + self.interval_s - loop.time()
        self._running = True
        loop.call_later(max(0.0, wait), self._start, loop)

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._due = False
        self._last = loop.time()
        fut = loop.run_in_executor(None, self._trim, 0)
        fut.add_done_callback(self._done)

    def _done(self, fut) -> None:
        self._running = False
        self.trims += 1
        if not fut.cancelled():  # (at shutdown)
            fut.exception()  # retrieved: a failed trim changes nothing


def _malloc_trim():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
