"""A fake vLLM KV-event publisher for the tests: PUB + replay ROUTER on 127.0.0.1, and a tiny
engine cache that turns prompts into the BlockStored/BlockRemoved events vLLM would send.

The engine's block hashes are sha256 digests of (parent, tokens), bytes as newer vLLM sends
them, so nothing in the router can rely on knowing the engine's hash function.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict, deque

import zmq
import zmq.asyncio

from router.exact_index import CLEARED, REMOVED, STORED
from router.kv_batches import END_SEQ, encode_batch, seq_bytes


class FakeEngineCache:
    """An LRU prefix cache of ``capacity`` blocks that reports what it stores and evicts."""

    def __init__(self, block_size: int = 16, capacity: int = 1 << 30, *, report_reuse: bool = True):
        self.block_size = block_size
        self.report_reuse = report_reuse  # vLLM 0.32 reports prefix-cache reuse as BlockStored
        self.capacity = capacity
        self.blocks: OrderedDict[bytes, None] = OrderedDict()

    def chain(self, tokens: list[int]) -> list[bytes]:
        out, parent = [], b""
        bs = self.block_size
        for s in range(0, len(tokens) - bs + 1, bs):
            parent = hashlib.sha256(parent + repr(tokens[s:s + bs]).encode()).digest()
            out.append(parent)
        return out

    def cached_prefix_blocks(self, tokens: list[int]) -> int:
        n = 0
        for h in self.chain(tokens):
            if h not in self.blocks:
                break
            n += 1
        return n

    def run(self, tokens: list[int]) -> list[tuple]:
        """Serve a prompt: store its new blocks (one BlockStored), evict LRU blocks past capacity."""
        bs = self.block_size
        hashes = self.chain(tokens)
        events: list[tuple] = []
        first_new = 0
        for k, h in enumerate(hashes):
            if h in self.blocks:
                first_new = k + 1
            else:
                break
        for h in reversed(hashes[:first_new]):
            self.blocks.move_to_end(h)
        if first_new and self.report_reuse:
            events.append((STORED, hashes[:first_new], None, tokens[:first_new * bs], bs))
        new = hashes[first_new:]
        if new:
            parent = hashes[first_new - 1] if first_new else None
            events.append((STORED, new, parent, tokens[first_new * bs:len(hashes) * bs], bs))
            for h in reversed(new):
                self.blocks[h] = None
        evicted = []
        while len(self.blocks) > self.capacity:
            h, _ = self.blocks.popitem(last=False)
            evicted.append(h)
        if evicted:
            events.append((REMOVED, evicted))
        return events

    def clear(self) -> list[tuple]:
        self.blocks.clear()
        return [(CLEARED,)]


class FakePublisher:
    """vLLM's ZmqEventPublisher, as seen from outside: topic + 8-byte seq + msgpack batch on
    PUB, and a ROUTER replay socket answering ``[b"", start_seq]`` with the buffered batches."""

    def __init__(self, port: int | None = None, replay_port: int | None = None, *, replay: bool = True,
                 buffer: int = 10_000, topic: bytes = b"", three_frame_replay: bool = True,
                 sndhwm: int = 1_000_000):
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, sndhwm)
        if port is None:
            port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        else:
            self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.port = port
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.topic = topic
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self.three_frame_replay = three_frame_replay
        self.router = None
        self.replay_endpoint = None
        self._task = None
        if replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            if replay_port is None:
                replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
            else:
                self.router.bind(f"tcp://127.0.0.1:{replay_port}")
            self.replay_port = replay_port
            self.replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    async def _serve_replay(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= start_seq:
                    body = [self.topic, seq_bytes(seq), payload] if self.three_frame_replay else [seq_bytes(seq), payload]
                    await self.router.send_multipart([client, b"", *body])
            tail = [b"", seq_bytes(END_SEQ), b""] if self.three_frame_replay else [seq_bytes(END_SEQ), b""]
            await self.router.send_multipart([client, b"", *tail])

    def publish(self, events: list[tuple], *, drop: bool = False, ts: float = 0.0) -> int:
        """Send one batch (``drop``: number it and buffer it for replay, but do not send it)."""
        seq = self.seq
        self.seq += 1
        payload = encode_batch(ts, events)
        self.buffer.append((seq, payload))
        if not drop:
            self.pub.send_multipart([self.topic, seq_bytes(seq), payload])
        return seq

    def send_raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)
        self.ctx.destroy(linger=0)


async def wait_for(pred, timeout: float = 5.0, interval: float = 0.01) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(interval)


async def connected(sub, pub: FakePublisher, timeout: float = 5.0) -> None:
    """PUB drops messages until the SUB's connection is up (ZMQ's slow joiner): wait for it by
    sending empty batches that are not part of the stream (seq of the all-ones kind is refused)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    bad0 = sub.stats.bad_messages
    while sub.stats.bad_messages == bad0:
        if loop.time() > end:
            raise AssertionError("subscriber never connected")
        pub.send_raw([b"", b"probe"])  # a malformed seq: counted as bad, changes nothing else
        await asyncio.sleep(0.02)
