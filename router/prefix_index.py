"""The router's estimate of what each instance has in its prefix cache.

Each instance has an LRU set of block hashes whose capacity is the instance's real KV
capacity in router blocks: an estimate larger than the engine's cache would promise hits
the engine has already evicted. One global dict maps a block hash to a bitmask of the
instances believed to hold it, so the hits of *all* instances come out of one walk over the
request's blocks: a bit drops out of the live mask at the first block that instance lacks,
and the walk stops when the mask is empty.

Insertion touches a request's blocks from last to first, so the first (most shared) blocks
are the most recently used and the tail is evicted first, as vLLM frees a request's blocks
in reverse order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    def __init__(self, num_instances: int, capacity_blocks: int | Sequence[int], block_size: int):
        if isinstance(capacity_blocks, int):
            capacity_blocks = [capacity_blocks] * num_instances
        if len(capacity_blocks) != num_instances:
            raise ValueError("one capacity per instance")
        if any(c <= 0 for c in capacity_blocks):
            raise ValueError("capacity must be positive")
        self.block_size = block_size
        self.capacity = list(capacity_blocks)
        self._lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_instances)]
        self._owners: dict[int, int] = {}  # block hash -> bitmask of instances
        self.evictions = [0] * num_instances

    @property
    def num_instances(self) -> int:
        return len(self._lru)

    def cached_blocks(self, instance: int) -> int:
        return len(self._lru[instance])

    def match(self, blocks: Sequence[int]) -> list[int]:
        """Return, per instance, how many leading blocks of ``blocks`` it holds."""
        n = len(self._lru)
        matched = [0] * n
        if not blocks:
            return matched
        owners = self._owners
        alive = owners.get(blocks[0], 0)
        if not alive:
            return matched
        depth = 1
        for h in blocks[1:]:
            nxt = alive & owners.get(h, 0)
            dropped = alive & ~nxt
            if dropped:
                _assign(matched, dropped, depth)
            alive = nxt
            if not alive:
                break
            depth += 1
        if alive:
            _assign(matched, alive, depth)
        return matched

    def insert(self, instance: int, blocks: Sequence[int]) -> None:
        """Record that ``instance`` now holds ``blocks`` (a request was dispatched there)."""
        lru = self._lru[instance]
        owners = self._owners
        bit = 1 << instance
        move = lru.move_to_end
        for h in reversed(blocks):
            if h in lru:
                move(h)
            else:
                lru[h] = None
                owners[h] = owners.get(h, 0) | bit
        cap = self.capacity[instance]
        while len(lru) > cap:
            old, _ = lru.popitem(last=False)
            mask = owners.get(old, 0) & ~bit
            if mask:
                owners[old] = mask
            else:
                owners.pop(old, None)
            self.evictions[instance] += 1

    def forget_instance(self, instance: int) -> None:
        """Drop everything believed cached on ``instance`` (it restarted or was reset)."""
        bit = 1 << instance
        owners = self._owners
        for h in self._lru[instance]:
            mask = owners.get(h, 0) & ~bit
            if mask:
                owners[h] = mask
            else:
                owners.pop(h, None)
        self._lru[instance].clear()


def _assign(matched: list[int], mask: int, depth: int) -> None:
    i = 0
    while mask:
        if mask & 1:
            matched[i] = depth
        mask >>= 1
        i += 1
