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

This keeps each instance's cached blocks of any chain a prefix of it: a block's hash covers
its whole prefix, so every request that touches block k also touches blocks 0..k-1, after
k; block k-1 is therefore always at least as recent as block k and is evicted later. The
one-pass ``match`` relies on this (tests compare it with a block-by-block walk), and ``insert``
uses it to find a request's blocks not yet held by bisection (checked, so any list is safe).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence
from functools import reduce
from itertools import groupby, islice, repeat
from operator import or_

try:   # the per-block loops of ``_insert`` in C (router/_index_loops.c), when the install built it
    from router import _index_loops as _loops
except ImportError:
    _loops = None
if os.environ.get("KVTOP_PURE_PYTHON", "") not in ("", "0"):   # the Python loops below, forced
    _loops = None

_ABSENT = object()

#: Blocks a ``flush_step`` adds (and about as many it evicts): about a millisecond of the loop.
STEP_BLOCKS = 1024
#: The least of an instance's LRU (from the oldest end) read into tag runs at once.
RUNS_MIN_BLOCKS = 512
#: ``oldest_tags`` walks this few blocks one by one instead of reading runs.
DIRECT_WALK_BLOCKS = 256


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
        #: Per instance, its blocks from the least recently used to the most: a plain dict's
        #: insertion order (a touch deletes and re-inserts), cheaper per block than an OrderedDict.
        self._lru: list[dict[int, None]] = [{} for _ in range(num_instances)]
        self._owners: dict[int, int] = {}  # block hash -> bitmask of instances
        self._tags: dict[int, str] = {}  # block hash -> the session that last inserted it (lookahead)
        #: Tags are kept (for ``oldest_tags``) unless a driver that knows no reader will come
        #: turned them off (``stop_tagging``).
        self.tagging = True
        self._evictions = [0] * num_instances
        #: Per instance, its LRU's tags from the oldest end as runs [(tag, blocks)], built on
        #: first read and dropped when its LRU or the tag of a block it holds changes (the
        #: lookahead reads every candidate's oldest blocks per decision: see ``oldest_tags``).
        self._runs: list[tuple[list[tuple[str | None, int]], bool, int] | None] = [None] * num_instances
        self._runs_want = [0] * num_instances  # blocks a read needed past the runs it found
        #: An insert not applied yet (see ``insert``): every read applies it first.
        self._pending: tuple[int, Sequence[int], str | None] | None = None
        #: Inserts being applied in steps (``flush_step``), oldest first: [instance, blocks,
        #: tag, blocks applied so far, its oldest block]; reads leave them as they are.
        self._stepping: deque[list] = deque()

    @property
    def num_instances(self) -> int:
        return len(self._lru)

    @property
    def evictions(self) -> list[int]:
        """Blocks evicted so far, per instance."""
        self._settle()
        return self._evictions

    def cached_blocks(self, instance: int) -> int:
        self._settle()
        return len(self._lru[instance])

    @property
    def settled(self) -> bool:
        """No insert is waiting to be applied (``flush`` and ``flush_step`` would do nothing)."""
        return self._pending is None and not self._stepping

    def flush(self) -> None:
        """Apply every insert not applied yet: the rest of those in steps, then the pending one."""
        while self._stepping:
            instance, blocks, tag = self._stepping.popleft()[:3]
            self._insert(instance, blocks, tag)
        self._settle()

    def _settle(self) -> None:
        """Apply the pending insert (not the ones in steps: their states are consistent)."""
        p = self._pending
        if p is not None:
            self._pending = None
            self._insert(*p)

    def flush_step(self, step: int = STEP_BLOCKS) -> bool:
        """Apply the next part of the inserts not applied yet; True when none is left.

        A cold 215k-token turn's insert (13,000 blocks added at block size 16, as many evicted)
        held the live router's event loop 7-20 ms in one piece. Here the pending insert is
        applied in steps of about ``step`` blocks added and as many evicted (the live router
        takes one step per turn of its loop), and each step leaves a state a whole insert could
        have left: the request's held prefix is touched first, then its other blocks are added
        in the order of the chain, each step as the newest blocks, and the oldest beyond the
        capacity evicted; a last whole insert puts them in the order one insert leaves (one
        C-level pass). Before that, the instance holds the chain's first blocks, as if a shorter
        request had been inserted: ``match`` stays right (what an instance holds of a chain is
        a prefix of it), so reads need not wait for the rest, and with nothing in between the
        result is the one insert's (tests/test_prefix_index_steps.py). An insert small enough
        for one step, a list that is not a chain, or one larger than the instance is applied
        whole, and so is the rest of one whose next step would evict a block of its own (the
        instance full of blocks newer than its first ones: the chain would lose its head)."""
        p = self._pending
        if p is not None:
            self._pending = None
            instance, blocks, tag = p
            lru = self._lru[instance]
            if not isinstance(blocks, (list, tuple)):
                blocks = list(blocks)
            held = _held_prefix(lru, blocks)
            n = len(blocks)
            if (n - held <= step or n >= self.capacity[instance] or len(set(blocks)) < n
                    or any(map(lru.__contains__, blocks[held:]))):
                self._insert(instance, blocks, tag)
            else:
                if held:
                    self._insert(instance, blocks[:held], tag)  # its held prefix: newest, kept
                # its oldest block from here on: the held prefix's last, else the first step's
                oldest = blocks[held - 1] if held else blocks[min(step, n) - 1]
                self._stepping.append([instance, blocks, tag, held, oldest])
            return not self._stepping
        if not self._stepping:
            return True
        s = self._stepping[0]
        instance, blocks, tag, done, oldest = s
        piece = blocks[done:done + step]
        lru = self._lru[instance]
        over = len(lru) + len(piece) - self.capacity[instance]
        if not piece or (over > 0 and oldest in lru and oldest in set(islice(lru, over))):
            self._stepping.popleft()
            self._insert(instance, blocks, tag)  # the one insert's order, and its evictions
        else:
            s[3] = done + step
            self._insert(instance, piece, tag)
        return not self._stepping and self._pending is None

    def match(self, blocks: Sequence[int]) -> list[int]:
        """Return, per instance, how many leading blocks of ``blocks`` it holds.

        Each instance's cached blocks of a chain form a prefix of it (see the module doc), so
        the owner mask only loses bits along ``blocks``: mask(k+1) is a subset of mask(k). The
        depth at which each bit drops is found by bisecting for the end of each run of equal
        masks: at most (instances + 1) x log2(len(blocks)) lookups, not a walk of every block.
        """
        self._settle()
        matched = [0] * len(self._lru)
        nb = len(blocks)
        get = self._owners.get
        pos = 0
        v = get(blocks[0], 0) if nb else 0
        while v:
            lo, hi = pos, nb - 1  # mask(lo) == v; find the last index whose mask is still v
            if get(blocks[hi], 0) != v:
                while hi - lo > 1:  # invariant: mask(lo) == v != mask(hi)
                    mid = (lo + hi) >> 1
                    if get(blocks[mid], 0) == v:
                        lo = mid
                    else:
                        hi = mid
                hi = lo
            nxt = get(blocks[hi + 1], 0) if hi + 1 < nb else 0
            _assign(matched, v & ~nxt, hi + 1)
            pos, v = hi + 1, nxt
        return matched

    def insert(self, instance: int, blocks: Sequence[int], tag: str | None = None) -> None:
        """Record that ``instance`` now holds ``blocks`` (a request was dispatched there).

        ``tag`` (a session id) marks the blocks as that session's, for ``oldest_tags``.

        The work is left pending until the next read of the index (``match``,
        ``cached_blocks``, ``oldest_tags``, ``evictions``, ``forget_instance``, the next
        insert) or ``flush``, whichever comes first, so every reader sees exactly what an
        immediate insert would have left (or, while the live router applies it in steps, what
        an insert of the request's first blocks would have); the live router applies it in steps
        (``flush_step``) once the request is written upstream (``Pipeline.sent``), so that it
        neither delays the request nor holds the event loop. ``blocks`` must not change until
        then (a request's blocks never do).
        """
        self._settle()
        self._pending = (instance, blocks, tag)

    def extend(self, instance: int, blocks: Sequence[int], tag: str | None = None) -> None:
        """``insert`` for a request whose own insert had only a prefix of ``blocks`` (it was
        dispatched before its new text was counted): while that insert is still pending, it
        becomes this one: one walk instead of two, with the same blocks held in the same
        order (the evictions too, unless the request alone overflows the instance)."""
        p = self._pending
        if p is not None and p[0] == instance and p[2] == tag and len(p[1]) <= len(blocks) \
                and list(blocks[:len(p[1])]) == list(p[1]):
            self._pending = (instance, blocks, tag)
        else:
            self.insert(instance, blocks, tag)

    def _insert(self, instance: int, blocks: Sequence[int], tag: str | None) -> None:
        """The insert itself.

        The result is the walk from the last block to the first: a block not held is appended
        (its owner bit set), a held one moves to the newest end; then the oldest beyond
        capacity are evicted. A returning 215k-token turn (~13,300 blocks at block size 16,
        all but its last ~150 held) touches its held blocks in one C-level pass, not a Python
        step each: the blocks not held are found by bisection, as ``match`` does (what an
        instance holds of a chain is a prefix of it), and checked, so a list that is not a
        chain (a repeated or foreign hash) gets the walk's result too. Blocks added or
        evicted go through a Python loop that does all of one block's work at once: for a
        cold turn's ~12,000 of each, that was faster than one C-level pass per dict (each
        pass misses the caches again on every block)."""
        lru = self._lru[instance]
        owners = self._owners
        bit = 1 << instance
        if not isinstance(blocks, (list, tuple)):
            blocks = list(blocks)
        n = len(blocks)
        held = _held_prefix(lru, blocks)  # blocks[held:] are the ones not held, if a chain
        before = len(lru)
        if _loops is not None:
            _loops.add(lru, owners, blocks, held, bit)
        else:
            for h in reversed(blocks[held:]):
                if h not in lru:
                    lru[h] = None
                    owners[h] = owners.get(h, 0) | bit
        # Touch from the last block to the first. When every block from ``held`` on was absent
        # (the chain case) they were just appended in that order and are the newest already.
        end = held if len(lru) - before == n - held else n
        if _loops is not None:
            _loops.touch(lru, owners, blocks, end, bit)
        else:
            _touch(lru, owners, blocks[end - 1::-1] if end else [], bit)
        runs = self._runs
        runs[instance] = None
        if tag is not None and self.tagging:
            if runs.count(None) < len(runs):
                # a retag changes what the other instances holding these blocks would evict, by
                # tag (the distinct owner masks first: a set pass is cheaper than an OR per
                # block); with no runs read (no policy that reads oldest_tags), none to drop
                others = reduce(or_, set(map(owners.get, blocks, repeat(0))), 0) & ~bit
                while others:
                    low = others & -others
                    runs[low.bit_length() - 1] = None
                    others ^= low
            self._tags.update(zip(blocks, repeat(tag)))
        over = len(lru) - self.capacity[instance]
        if over > 0:
            # The oldest ``over`` read in one C-level pass, then unlinked: cheaper than a
            # popitem (and its tuple) per evicted block.
            tags = self._tags
            keep = ~bit
            if _loops is not None:
                _loops.evict(lru, owners, tags, list(islice(lru, over)), keep)
            else:
                for old in list(islice(lru, over)):
                    del lru[old]
                    mask = owners.pop(old, 0) & keep
                    if mask:
                        owners[old] = mask
                    else:
                        tags.pop(old, None)
            self._evictions[instance] += over

    def oldest_tags(self, instance: int, count: int, skip: str | None = None) -> dict[str | None, int]:
        """The next ``count`` blocks ``instance`` would evict, counted by tag (session).

        Blocks tagged ``skip`` (the session being routed: its blocks are touched, not evicted)
        are passed over. O(the runs of equal tags among them): the LRU's tags are read as
        runs once per change of the instance (``_tag_runs``), not block by block per read;
        the counts, and their order (first seen from the oldest end), are the walk's."""
        if not self.tagging:
            raise RuntimeError("oldest_tags read from a prefix index whose tags were turned off")
        self._settle()
        out: dict[str | None, int] = {}
        if count <= 0:
            return out
        if count <= DIRECT_WALK_BLOCKS:  # a few blocks: the walk itself is cheaper than runs
            tags = self._tags
            for h in self._lru[instance]:
                t = tags.get(h)
                if t is not None and t == skip:
                    continue
                out[t] = out.get(t, 0) + 1
                count -= 1
                if count == 0:
                    break
            return out
        while True:
            runs, whole = self._tag_runs(instance, count)
            left = count
            part: dict[str | None, int] = {}
            for t, n in runs:
                if t is not None and t == skip:
                    continue
                if n >= left:
                    part[t] = part.get(t, 0) + left
                    left = 0
                    break
                part[t] = part.get(t, 0) + n
                left -= n
            if left == 0 or whole:
                return part
            # the runs read so far held too few blocks not tagged ``skip``: read further
            self._runs[instance] = None
            count_read = sum(n for _, n in runs)
            self._runs_want[instance] = 2 * max(count_read, count)

    def _tag_runs(self, instance: int, count: int) -> tuple[list[tuple[str | None, int]], bool]:
        """``instance``'s LRU from the oldest end as runs of equal tags, and whether they cover
        the whole LRU: read (one C-level pass) as far as a read has needed, at least
        ``RUNS_MIN_BLOCKS`` and twice ``count``, after an insert into it, a retag of a block
        it holds (an insert elsewhere under another session) or a reset; kept otherwise. Reading
        only the oldest part keeps a small eviction cheap on a large cache."""
        got = self._runs[instance]
        if got is not None and (got[1] or got[2] >= count):
            return got[0], got[1]
        lru = self._lru[instance]
        want = max(RUNS_MIN_BLOCKS, 2 * count, self._runs_want[instance])
        runs = [(t, len(list(g))) for t, g in groupby(map(self._tags.get, islice(lru, want)))]
        whole = want >= len(lru)
        self._runs[instance] = (runs, whole, min(want, len(lru)))
        return runs, whole

    def stop_tagging(self) -> None:
        """Keep no tags from now on: for a driver whose policy never reads ``oldest_tags`` (the
        lookahead's) and cannot change (the simulator's run under one policy, no shadows), the
        tag of each block inserted is work for nothing (about 2% of such a run). A later
        ``oldest_tags`` raises rather than answer from tags not kept."""
        self.flush()
        self.tagging = False
        self._tags.clear()
        self._runs = [None] * len(self._runs)

    def add_instance(self, capacity_blocks: int) -> int:
        """A new instance, caching nothing yet (the fleet grew); returns its index."""
        if capacity_blocks <= 0:
            raise ValueError("capacity must be positive")
        self.capacity.append(capacity_blocks)
        self._lru.append({})
        self._runs.append(None)
        self._runs_want.append(0)
        self._evictions.append(0)
        return len(self._lru) - 1

    def forget_instance(self, instance: int) -> None:
        """Drop everything believed cached on ``instance`` (it restarted or was reset)."""
        self.flush()
        bit = 1 << instance
        owners = self._owners
        for h in self._lru[instance]:
            mask = owners.get(h, 0) & ~bit
            if mask:
                owners[h] = mask
            else:
                owners.pop(h, None)
                self._tags.pop(h, None)
        self._lru[instance].clear()
        self._runs[instance] = None


def _held_prefix(lru: dict[int, None], blocks: Sequence[int]) -> int:
    """How many leading ``blocks`` ``lru`` holds, if what it holds of them is a prefix (true of
    a chain; ``insert`` checks it): the end of the held run, by bisection."""
    n = len(blocks)
    if not n or blocks[0] not in lru:
        return 0
    if blocks[-1] in lru:
        return n
    lo, hi = 0, n - 1  # invariant: blocks[lo] held, blocks[hi] not
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if blocks[mid] in lru:
            lo = mid
        else:
            hi = mid
    return hi


def _touch(lru: dict[int, None], owners: dict[int, int], touch: list[int], bit: int) -> None:
    """Move each of ``touch`` to the newest end of ``lru``, in order (an absent one is added
    there and its owner bit set): what ``move_to_end`` of each would do, in C-level passes.
    The blocks are taken out in one pass and put back in another, which is the same order
    unless a block is absent or repeated: a pass stops there (a ``KeyError``), the blocks it
    took are put back, and that one block is moved alone."""
    i, n = 0, len(touch)
    while i < n:
        size = len(lru)
        try:
            deque(map(lru.pop, islice(touch, i, None)), maxlen=0)
            j = n
        except KeyError:
            j = i + size - len(lru)   # the blocks before touch[j] were taken out
        lru.update(zip(islice(touch, i, j), repeat(None)))
        if j < n:   # absent (not a chain) or taken out already (a repeat): moved alone
            h = touch[j]
            if lru.pop(h, _ABSENT) is _ABSENT:
                owners[h] = owners.get(h, 0) | bit
            lru[h] = None
            j += 1
        i = j


def _assign(matched: list[int], mask: int, depth: int) -> None:
    i = 0
    while mask:
        if mask & 1:
            matched[i] = depth
        mask >>= 1
        i += 1
