"""The body parser's worker process, called straight from the event loop over a socket pair.

``concurrent.futures.ProcessPoolExecutor`` carries each call through two threads of the
caller's process (its queue-management thread and its queue's feeder thread) and back through
the management thread; on a busy 2-core host each of those wake-ups waits for a core and the
GIL: an 830 KB call answered with 13,000 ints took 4.5-12 ms p50 there at load 3, against 2.3
ms over a socket pair.
Here a call is one framed pickle written to the socket by the event loop, and the answer is read
by the event loop's own protocol: no thread between the loop and the worker.

It is an ``Executor`` (``loop.run_in_executor`` takes it), driven from the loop that started
it; ``submit`` must be called from that loop. One process, one call at a time in it, in order.
If the process dies, every call in flight and every later one raise ``BrokenProcessPool``, as
a process pool's would; the owner starts a new one.

A call may also send one early answer before its result (``partial`` in the worker,
``submit_partial`` in the router): the router can act on a first, provisional answer (a
returning turn's shared prefix, counted) while the worker finishes the rest (its new text).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import socket
import struct
from concurrent.futures import Executor, Future
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable

_LEN = struct.Struct("!I")
#: Socket buffers: a pickled call or answer of a few MB fits without the writer waiting for
#: the reader (Linux caps it at net.core.wmem_max).
_SOCKET_BUFFER = 4 * 1024 * 1024
#: Answers up to this size are unpickled on the event loop (a 200k-token prompt's 13,000 block
#: hashes: ~120 KB, half a millisecond); bigger ones (a 40 MB body's 600,000: 40 ms) in a thread.
_DECODE_ON_LOOP = 512 * 1024

#: In the worker: the socket and id of the call running now, for ``partial``.
_current: tuple[socket.socket, int] | None = None


def partial(value: Any) -> bool:
    """In the worker, during a call: send ``value`` to the router now, as the call's early
    answer (at most one per call; a second is dropped). False where there is nobody to send it
    to (not in a worker call, or one was sent already): the caller goes on as if it was sent."""
    global _current
    cur = _current
    if cur is None:
        return False
    _current = None
    sock, call_id = cur
    try:
        out = pickle.dumps((call_id, None, value), pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - an early answer that does not pickle is simply not sent
        return False
    sock.sendall(_LEN.pack(len(out)) + out)
    return True


def _serve(sock: socket.socket, initializer: Callable[[], None] | None) -> None:
    """The worker's loop: read a call, run it, write the answer; until the socket closes."""
    global _current
    if initializer is not None:
        initializer()
    rfile = sock.makefile("rb", buffering=1 << 20)
    while True:
        head = rfile.read(_LEN.size)
        if len(head) < _LEN.size:
            return  # the router closed its end (or exited)
        n = _LEN.unpack(head)[0]
        payload = rfile.read(n)
        if len(payload) < n:
            return
        call_id, fn, args = pickle.loads(payload)
        _current = (sock, call_id)
        try:
            answer = (call_id, True, fn(*args))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            answer = (call_id, False, exc)
        _current = None
        try:
            out = pickle.dumps(answer, pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # an answer or exception that does not pickle
            out = pickle.dumps((call_id, False, RuntimeError(f"worker: {answer[2]!r} ({exc})")),
                               pickle.HIGHEST_PROTOCOL)
        sock.sendall(_LEN.pack(len(out)) + out)


class _Answers(asyncio.Protocol):
    def __init__(self, worker: WorkerProcess):
        self.worker = worker
        self.buf = bytearray()

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while len(buf) >= _LEN.size:
            n = _LEN.unpack_from(buf)[0]
            if len(buf) < _LEN.size + n:
                break
            frame = bytes(memoryview(buf)[_LEN.size:_LEN.size + n])
            del buf[:_LEN.size + n]
            if n <= _DECODE_ON_LOOP:
                try:
                    answer = pickle.loads(frame)
                except Exception:  # noqa: BLE001 - a frame we cannot read: nothing after it can be trusted
                    self.worker._broken()
                    return
                self.worker._answer(answer)
            else:  # in a thread, where the GIL still lets the loop in every switch interval
                done = asyncio.get_running_loop().run_in_executor(None, pickle.loads, frame)
                done.add_done_callback(self._decoded)

    def _decoded(self, done: asyncio.Future) -> None:
        if done.cancelled():
            return
        if done.exception() is not None:  # unreadable: fail every call in flight rather than hang one
            self.worker._broken()
            return
        self.worker._answer(done.result())

    def connection_lost(self, exc: Exception | None) -> None:
        self.worker._broken()


class WorkerProcess(Executor):
    """One spawned worker process (``await WorkerProcess.start(...)``)."""

    def __init__(self) -> None:
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._transport: asyncio.Transport | None = None
        self._pending: dict[int, Future] = {}
        self._early: dict[int, Future] = {}  # submit_partial's first answers, by call id
        self._next = 0
        self.broken = False

    @classmethod
    async def start(cls, initializer: Callable[[], None] | None = None) -> WorkerProcess:
        self = cls()
        ours, theirs = socket.socketpair()
        for s in (ours, theirs):
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                try:
                    s.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER)
                except OSError:
                    pass
        # spawn, not fork: the router has threads (the writer) that a fork would copy mid-flight
        ctx = multiprocessing.get_context("spawn")
        self._proc = ctx.Process(target=_serve, args=(theirs, initializer), daemon=True,
                                 name="kvtop-parse-worker")
        self._proc.start()
        theirs.close()
        loop = asyncio.get_running_loop()
        self._transport, _ = await loop.create_unix_connection(lambda: _Answers(self), sock=ours)
        return self

    def submit_partial(self, fn: Callable, /, *args: Any) -> tuple[Future, Future]:
        """(first, final): ``first`` resolves with ``(True, value)`` when the call sends an early
        answer (``partial``), else with ``(False, result)`` (or the call's exception) together
        with ``final``, which resolves with the call's result."""
        final = self.submit(fn, *args)
        first: Future = Future()
        first.set_running_or_notify_cancel()
        self._early[self._next] = first
        return first, final

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Future:
        if kwargs:
            raise TypeError("WorkerProcess.submit takes positional arguments only")
        if self.broken or self._transport is None or self._transport.is_closing():
            raise BrokenProcessPool("the parser's worker process is gone")
        self._next += 1
        payload = pickle.dumps((self._next, fn, args), pickle.HIGHEST_PROTOCOL)
        fut: Future = Future()
        fut.set_running_or_notify_cancel()
        self._pending[self._next] = fut
        self._transport.write(_LEN.pack(len(payload)))
        self._transport.write(payload)
        return fut

    def _answer(self, answer: tuple) -> None:
        call_id, ok, value = answer
        if ok is None:  # an early answer: the call goes on
            first = self._early.pop(call_id, None)
            if first is not None and not first.done():
                first.set_result((True, value))
            return
        first = self._early.pop(call_id, None)  # none came (or it was decoded after this one)
        if first is not None and not first.done():
            if ok:
                first.set_result((False, value))
            else:
                first.set_exception(value)
        fut = self._pending.pop(call_id, None)
        if fut is not None and not fut.done():  # a cancelled call's answer is dropped
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)

    def _broken(self) -> None:
        self.broken = True
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()  # the worker reads EOF and exits
        pending, self._pending = self._pending, {}
        early, self._early = self._early, {}
        for fut in [*early.values(), *pending.values()]:
            if not fut.done():
                fut.set_exception(BrokenProcessPool("the parser's worker process exited"))

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Close the socket (the worker exits at its end) and stop the process."""
        if self._transport is not None:
            self._transport.close()
        self._broken()
        proc = self._proc
        if proc is not None and proc.pid is not None:
            if proc.is_alive():
                proc.terminate()  # mid-way through a big body it would not read the EOF soon
            proc.join(5 if wait else 0.5)
