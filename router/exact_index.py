"""What each instance really holds in its prefix cache, from the engine's own KV events.

The estimate (router/prefix_index.py) models what an instance probably still caches; this
index is built from what the engine says it stored and removed (vLLM's ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``; router/kv_events.py decodes them). It is keyed by
the router's own chained hashes of token ids (router/blocks.py ``hash_token_blocks`` at the
router's block size), computed from the token ids the events carry, so a lookup needs no
engine hash function (vLLM's sha256 over pickled keys, its seed, its extra keys) and the same
request hashes serve both indexes.

The engine's blocks (``engine_block_size`` tokens, e.g. 16 on GPU, 128 on CPU) are chained
by the engine's own hashes (``parent_block_hash``). The router's block size must be a
multiple m of the engine's: a router block is one run of m engine blocks, and it counts as
cached while its last engine block is (with m = 1, the router's block size equal to the
engine's, hits are exact to the block). vLLM evicts a request's blocks tail first, so a
router block loses its last engine block first; with m > 1 a middle block evicted alone
would go unseen until the last one goes.

Per instance the index keeps one node per engine block it holds: (parent engine hash, the
chain's router hash after this block, the block's tokens while its router block is still
open, depth). One dict maps a router hash to a bitmask of the instances holding it, so all
instances' hits come out of one pass over the request's blocks, as in the estimate. An
instance's sets are not assumed prefix-closed (the engine decides what it evicts), so the
pass ANDs the owner masks of every block (in C, ``itertools.accumulate``) and bisects that.

After a sequence gap nobody could fill, the index cannot know which removals it missed; the
subscriber routes that instance on the estimate until the engine has reported a cache's
worth of new blocks, then drops every block not stored or reused since the gap
(``drop_unseen_since_mark``).

Blocks the router just sent somewhere are held as speculative entries for
``speculative_ttl_s`` seconds (or until the engine's event for that block arrives), so a
burst of one session's turns sees its own previous turn before the engine has reported it.

Pure: no I/O, no clock of its own (callers pass ``now``).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence
from itertools import accumulate, compress, filterfalse, islice, repeat
from operator import and_
from dataclasses import dataclass, field

from router.blocks import ROOT_HASH

#: The media whose blocks count as prefix-cache hits (vLLM's GPU tier; None in older vLLM).
HIT_MEDIA = (None, "GPU")

# Decoded events (router/kv_events.py): plain tuples, the first item says which.
STORED, REMOVED, CLEARED = "stored", "removed", "cleared"


@dataclass(slots=True)
class InstanceBlocks:
    """One instance's engine blocks and the router blocks they make."""

    nodes: dict = field(default_factory=dict)  # engine hash -> (parent, rhash_after, tokens|None, depth, epoch)
    counts: dict = field(default_factory=dict)  # router hash -> engine chains ending a router block there
    engine_block_size: int | None = None
    per_router_block: int = 0  # m: engine blocks per router block (0 until the first store)
    speculative: OrderedDict = field(default_factory=OrderedDict)  # router hash -> expiry
    # The engine's free queue as the router can model it: held router blocks no request of this
    # router is using, in the order the engine would evict them (front first).
    # router hash -> its place in the queue (a number that only grows: the dict's order and the
    # values' order agree, so "evicted by the first k" is one comparison with the k-th value)
    free: dict = field(default_factory=dict)
    seq: int = 0  # the next place in the free queue
    pins: Counter = field(default_factory=Counter)  # router hash -> requests of this router using it
    unheld: int = 0  # pinned blocks the engine has not reported: what our requests will allocate
    anon: int = 0  # blocks our text-hashed requests still in prefill will allocate (no hashes to pin)
    # counters
    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0
    unknown_removed: int = 0  # removals of blocks this index never saw (before a gap, other media)
    orphans: int = 0  # stores whose parent this index does not hold
    skipped: int = 0  # stores/removals of other media, other KV groups, or a block size that does not fit
    stored_since_mark: int = 0  # blocks stored since mark_turnover (resync progress)
    epoch: int = 0  # bumped by mark_turnover; a node remembers the epoch it was last stored in
    drift_tokens: int = 0  # |estimate - exact| summed over decisions
    drift_input_tokens: int = 0  # input tokens of those decisions
    drift_samples: int = 0


class ExactIndex:
    def __init__(self, num_instances: int, block_size: int, *, speculative_ttl_s: float = 2.0,
                 max_speculative: int = 65_536, max_nodes: int = 4_000_000):
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.speculative_ttl_s = speculative_ttl_s
        self.max_speculative = max_speculative
        #: Engine blocks held per instance at most; past it the instance's events no longer
        #: describe a real cache (a bug, or phantoms after many gaps), so it is cleared.
        self.max_nodes = max_nodes
        self.instances = [InstanceBlocks() for _ in range(num_instances)]
        self._owners: dict[int, int] = {}  # router hash -> bitmask of instances
        #: Instances whose hits come from this index (their events flow and are consistent).
        self.live_mask = 0
        #: Instances that publish events at all: only their requests are modelled (pinned,
        #: speculated, reserved); every instance unless the router says otherwise.
        self.published_mask = (1 << num_instances) - 1

    def add_instance(self, published: bool) -> int:
        """A new instance holding nothing; ``published``: it has a KV-event endpoint."""
        self.instances.append(InstanceBlocks())
        i = len(self.instances) - 1
        if published:
            self.published_mask |= 1 << i
        return i

    # -- which instances are exact -------------------------------------------------------
    def set_live(self, instance: int, live: bool) -> None:
        bit = 1 << instance
        self.live_mask = (self.live_mask | bit) if live else (self.live_mask & ~bit)

    def is_live(self, instance: int) -> bool:
        return bool(self.live_mask >> instance & 1)

    def cached_blocks(self, instance: int) -> int:
        """Router blocks the instance holds."""
        return len(self.instances[instance].counts)

    def engine_blocks(self, instance: int) -> int:
        return len(self.instances[instance].nodes)

    # -- events ------------------------------------------------------------------------
    def apply(self, instance: int, events: Iterable[tuple]) -> None:
        """Apply decoded events (router/kv_events.py ``decode_batch``) in order."""
        for ev in events:
            kind = ev[0]
            if kind == STORED:
                self.store(instance, ev[1], ev[2], ev[3], ev[4], medium=ev[5], group=ev[6])
            elif kind == REMOVED:
                self.remove(instance, ev[1], medium=ev[2], group=ev[3])
            elif kind == CLEARED:
                self.clear(instance)

    def store(self, instance: int, block_hashes: Sequence, parent, token_ids: Sequence[int],
              engine_block_size: int, *, medium: str | None = None, group: int | None = None) -> None:
        st = self.instances[instance]
        if medium not in HIT_MEDIA or group not in (None, 0):
            st.skipped += len(block_hashes)
            return
        ebs = engine_block_size
        if st.engine_block_size != ebs:
            if st.engine_block_size is not None or ebs <= 0 or self.block_size % ebs:
                st.skipped += len(block_hashes)  # the router's blocks cannot be built from these
                return
            st.engine_block_size = ebs
            st.per_router_block = self.block_size // ebs
        m = st.per_router_block
        nodes = st.nodes
        if parent is None:
            base, depth = ROOT_HASH, -1
        else:
            pn = nodes.get(parent)
            if pn is None:
                st.orphans += len(block_hashes)
                return
            base, depth = pn[1], pn[3]
        n = min(len(block_hashes), len(token_ids) // ebs)
        counts = st.counts
        owners = self._owners
        bit = 1 << instance
        spec = st.speculative
        free, pins = st.free, st.pins
        epoch = st.epoch
        # Blocks nobody of ours uses join the free queue when this event is done, last block
        # first, as vLLM frees a request's blocks (another client's, ours after our finish, a
        # prefix another client reused): its tail is evicted before its head.
        newly_free: list = []
        try:
            self._store_run(st, instance, block_hashes, token_ids, n, m, ebs, base, depth, parent,
                            newly_free)
        finally:
            if newly_free:
                # once each (a repeated hash would take a new place at its old position in the
                # dict, and places must grow along the queue's order: survivors() relies on it)
                newly_free = list(dict.fromkeys(reversed(newly_free)))
                free.update(zip(newly_free, range(st.seq, st.seq + len(newly_free))))
                st.seq += len(newly_free)
        st.blocks_stored += n
        st.stored_since_mark += n
        if len(nodes) > self.max_nodes:
            self.clear(instance)

    def _store_run(self, st: InstanceBlocks, instance: int, block_hashes: Sequence,
                   token_ids: Sequence[int], n: int, m: int, ebs: int, base, depth: int, parent,
                   newly_free: list) -> None:
        nodes, counts, owners = st.nodes, st.counts, self._owners
        bit = 1 << instance
        spec = st.speculative
        free, pins = st.free, st.pins
        epoch = st.epoch
        for k in range(n):
            h = block_hashes[k]
            depth += 1
            node = nodes.get(h)
            if node is not None:  # stored again (vLLM reports reused blocks since 0.11 or so)
                if node[4] != epoch:
                    nodes[h] = (*node[:4], epoch)
                if node[2] is None and free.pop(node[1], None) is not None:  # reused, not by ours:
                    newly_free.append(node[1])  # now among the newest
                base, depth, parent = node[1], node[3], h
                continue
            # a tuple, not the list slice: a node of ints only is one the cyclic GC untracks,
            # where a list inside kept every open block tracked and made each full collection
            # walk them all (100-300 ms stalls under a 12 MB batch: bench_kv_events.py)
            toks = tuple(token_ids[k * ebs:(k + 1) * ebs])
            if m == 1:
                rh = hash((base, toks))
                nodes[h] = (parent, rh, None, depth, epoch)
            elif (depth + 1) % m:  # the router block is still open: keep the tokens
                nodes[h] = (parent, base, toks, depth, epoch)
                parent = h
                continue
            else:
                parts = [toks]
                cur = parent
                try:
                    for _ in range(m - 1):
                        pn = nodes[cur]
                        parts.append(pn[2])
                        cur = pn[0]
                except (KeyError, TypeError):  # an open block of this run is gone: cannot chain
                    st.orphans += n - k
                    st.blocks_stored -= n - k
                    st.stored_since_mark -= n - k
                    return
                full: list[int] = []
                for p in reversed(parts):
                    full.extend(p)
                rh = hash((base, tuple(full)))
                nodes[h] = (parent, rh, None, depth, epoch)
            c = counts.get(rh, 0)
            counts[rh] = c + 1
            if not c:
                owners[rh] = owners.get(rh, 0) | bit
                if rh not in pins:  # nobody of ours uses it (another client's, or ours finished)
                    newly_free.append(rh)
                else:
                    st.unheld -= 1
            if spec:
                spec.pop(rh, None)
            base, parent = rh, h

    def remove(self, instance: int, block_hashes: Sequence, *, medium: str | None = None,
               group: int | None = None) -> None:
        st = self.instances[instance]
        if medium not in HIT_MEDIA or group not in (None, 0):
            st.skipped += len(block_hashes)
            return
        nodes, counts, owners = st.nodes, st.counts, self._owners
        bit = 1 << instance
        for h in block_hashes:
            node = nodes.pop(h, None)
            if node is None:
                st.unknown_removed += 1
                continue
            st.blocks_removed += 1
            if node[2] is not None:  # inside an open router block: no router block ends here
                continue
            rh = node[1]
            c = counts.get(rh, 0) - 1
            if c > 0:
                counts[rh] = c
            elif c == 0:
                del counts[rh]
                st.free.pop(rh, None)
                if rh in st.pins:  # one of our requests' blocks, gone: it will be allocated again
                    st.unheld += 1
                mask = owners.get(rh, 0) & ~bit
                if mask:
                    owners[rh] = mask
                else:
                    owners.pop(rh, None)

    def clear(self, instance: int) -> None:
        """Everything on ``instance`` is gone (AllBlocksCleared, or a restart)."""
        st = self.instances[instance]
        bit = 1 << instance
        owners = self._owners
        for rh in st.counts:
            mask = owners.get(rh, 0) & ~bit
            if mask:
                owners[rh] = mask
            else:
                owners.pop(rh, None)
        st.nodes.clear()
        st.counts.clear()
        st.speculative.clear()
        st.free.clear()
        st.unheld = len(st.pins)
        st.clears += 1
        # a restarted engine may come back with another block size: the next store sets it
        st.engine_block_size = None
        st.per_router_block = 0

    def mark_turnover(self, instance: int) -> None:
        """Start counting stores from now (a resync waits for a cache's worth of them)."""
        st = self.instances[instance]
        st.stored_since_mark = 0
        st.epoch += 1

    def drop_unseen_since_mark(self, instance: int) -> int:
        """End a resync: forget blocks neither stored nor reused since ``mark_turnover``.

        After a gap the index may hold blocks whose removal was lost. Once the engine has
        stored a cache's worth of blocks since, an LRU cache has evicted every block nobody
        touched in that time, and vLLM reports a touch (a prefix-cache reuse) as a store, so
        what was not seen since is gone. Returns how many engine blocks were dropped."""
        st = self.instances[instance]
        pins = st.pins  # a block a request of ours runs with cannot have been evicted
        stale = [h for h, node in st.nodes.items()
                 if node[4] != st.epoch and (node[2] is not None or node[1] not in pins)]
        self.remove(instance, stale)
        st.blocks_removed -= len(stale)
        return len(stale)

    # -- speculation ---------------------------------------------------------------------
    def speculate(self, instance: int, blocks: Sequence[int], now: float) -> None:
        """The router just sent ``blocks`` to ``instance``: count them as held for a short while."""
        if self.speculative_ttl_s <= 0 or not blocks:
            return
        st = self.instances[instance]
        spec = st.speculative
        while spec:  # entries are in expiry order (one TTL): drop the expired from the front
            h, exp = next(iter(spec.items()))
            if exp > now:
                break
            spec.popitem(last=False)
        exp = now + self.speculative_ttl_s
        counts = st.counts
        for h in blocks:
            if h in counts:
                continue
            if h in spec:
                spec.move_to_end(h)
            spec[h] = exp
        while len(spec) > self.max_speculative:
            spec.popitem(last=False)

    # -- the engine's free queue ----------------------------------------------------------
    def pin(self, instance: int, blocks: Sequence[int]) -> None:
        """A request of this router on ``instance`` uses ``blocks`` until ``release``: the engine
        takes its hit blocks out of the free queue and allocates the rest."""
        st = self.instances[instance]
        pins, counts = st.pins, st.counts
        # every step in C; a block repeated in one request (only a hash collision does that) is
        # one block to allocate
        fresh = list(dict.fromkeys(filterfalse(pins.__contains__, blocks)))
        st.unheld += len(fresh) - sum(map(counts.__contains__, fresh))
        pins.update(blocks)
        deque(map(st.free.pop, blocks, repeat(None)), maxlen=0)

    def release(self, instance: int, blocks: Sequence[int]) -> None:
        """That request finished: like vLLM, its blocks join the free queue's end last block
        first, so its tail is evicted before its head. Blocks another request still uses stay."""
        st = self.instances[instance]
        pins = st.pins
        held = list(map(pins.get, blocks, repeat(0)))
        shared = list(compress(blocks, map((1).__lt__, held)))  # with a request in flight
        for h in shared:
            pins[h] -= 1
        last = list(compress(reversed(blocks), map((1).__eq__, reversed(held))))
        deque(map(pins.pop, last), maxlen=0)
        # a block this request held twice (a repeated hash) reached 0 above without being last
        zero = list(dict.fromkeys(filterfalse(pins.get, shared))) if shared else ()
        if zero:
            deque(map(pins.pop, zero), maxlen=0)
            last += zero
        cached = list(filter(st.counts.__contains__, last))
        st.unheld -= len(last) - len(cached)
        st.free.update(zip(cached, range(st.seq, st.seq + len(cached))))
        st.seq += len(cached)

    def to_allocate(self, instance: int) -> int:
        """Blocks this router's requests on ``instance`` use that the engine has not reported
        holding: what their prefills will still allocate."""
        return self.instances[instance].unheld

    def queued_evictions(self, instance: int, capacity_blocks: int) -> int:
        """Router blocks of the free queue that this router's requests in flight on ``instance``
        will evict: what they still allocate beyond the engine's room, counted in engine blocks
        (an open router block at a prompt's end holds engine blocks too). ``capacity_blocks`` is
        the configured capacity in router blocks; an engine seen holding more than that is not
        the configured one, and nothing is projected for it (set --capacity-tokens right)."""
        st = self.instances[instance]
        m = st.per_router_block or 1
        held = len(st.nodes)
        cap = capacity_blocks * m
        if held > cap:
            return 0
        over = (st.unheld + st.anon) * m - (cap - held)
        return -(-over // m) if over > 0 else 0

    def reserve(self, instance: int, blocks: int) -> None:
        """A request hashed from text (its hashes match no event, so it cannot be pinned) will
        allocate about ``blocks`` blocks on ``instance`` during its prefill; negative when the
        prefill is over or the request ended."""
        st = self.instances[instance]
        st.anon = max(0, st.anon + blocks)

    def unspeculate(self, instance: int, blocks: Sequence[int]) -> None:
        """A request sent with ``blocks`` failed: whatever the engine did store, its events say."""
        spec = self.instances[instance].speculative
        if spec:
            deque(map(spec.pop, blocks, repeat(None)), maxlen=0)

    def survivors(self, instance: int, blocks: Sequence[int], matched: int, evicted: int) -> int:
        """How many of the ``matched`` leading ``blocks`` are still held after the engine evicts
        the ``evicted`` oldest blocks of its free queue (the prefills queued ahead of this
        request allocate that many beyond the engine's free room)."""
        st = self.instances[instance]
        free = st.free
        if evicted <= 0 or not matched or not free:
            return matched
        if evicted <= matched:  # a set of the few doomed blocks, one membership test per block
            doomed = set(islice(free, evicted))
            gone = list(map(doomed.__contains__, islice(blocks, matched)))
        else:
            # Many doomed: the queue's places grow along its order, so the first ``evicted``
            # blocks are those whose place is at most the evicted-th one's: one skip over the
            # values in C, then two C-level passes over the matched blocks. A block not in the
            # queue (a request of ours holds it) reads as a place past that one: never evicted.
            last = (st.seq - 1 if evicted >= len(free)
                    else next(islice(free.values(), evicted - 1, None)))
            gone = list(map(last.__ge__, map(free.get, islice(blocks, matched), repeat(last + 1))))
        try:
            return gone.index(True)
        except ValueError:
            return matched

    # -- lookups -------------------------------------------------------------------------
    def match(self, blocks: Sequence[int], mask: int, now: float = 0.0) -> dict[int, int]:
        """Leading blocks of ``blocks`` held, for each instance in ``mask``: {instance: blocks}.

        Then each instance's speculative entries may extend its match."""
        out: dict[int, int] = {}
        nb = len(blocks)
        get = self._owners.get
        if not nb or not mask & get(blocks[0], 0):
            for i in _bits(mask):
                out[i] = 0
        else:
            # acc[k]: the instances holding all of blocks[:k]. The AND over the prefix only loses
            # bits, so each instance's depth is a bisection; the AND itself runs in C.
            acc = list(accumulate(map(get, blocks, repeat(0, nb)), and_, initial=mask))
            for i in _bits(mask):
                bit = 1 << i
                lo, hi = 0, nb  # acc[lo] has the bit; find the last index that has it
                if acc[hi] & bit:
                    out[i] = nb
                    continue
                while hi - lo > 1:
                    mid = (lo + hi) >> 1
                    if acc[mid] & bit:
                        lo = mid
                    else:
                        hi = mid
                out[i] = lo
        for i, depth in out.items():
            spec = self.instances[i].speculative
            if spec:
                while depth < nb and spec.get(blocks[depth], 0.0) > now:
                    depth += 1
                out[i] = depth
        return out

    def hits_by_walk(self, instance: int, blocks: Sequence[int]) -> int:
        """The plain definition (leading blocks whose router hash the instance holds), for tests."""
        counts = self.instances[instance].counts
        k = 0
        while k < len(blocks) and blocks[k] in counts:
            k += 1
        return k

    def record_drift(self, instance: int, estimated: int, exact: int, input_tokens: int) -> None:
        st = self.instances[instance]
        st.drift_tokens += abs(estimated - exact)
        st.drift_input_tokens += input_tokens
        st.drift_samples += 1


def _bits(mask: int) -> list[int]:
    out, i = [], 0
    while mask:
        if mask & 1:
            out.append(i)
        mask >>= 1
        i += 1
    return out
