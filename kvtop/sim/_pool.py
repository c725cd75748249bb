"""The engine's inner loops (kvtop/sim/engine.py: the block pool's per-block loops and the
step's per-request ones), compiled or in Python.

``kvtop/sim/_blockpool.c`` holds them in C; ``pip install`` builds it when a C compiler and
the Python headers are there and goes on without it when not (setup.py, ``optional=True``).
The functions below are the same loops in Python, the fallback: they give the same results
on the same lists and dicts, element by element (tests/test_engine_cpool.py runs random
workloads through an engine on each and compares every result). The per-request loops in C
read the request objects' slots directly (``C.bind_request``, at engine.py's import) and
leave any object they cannot read to the Python loop. ``KVTOP_PURE_PYTHON=1``
forces the fallback. ``IMPL`` says which one the engine uses: ``"c"`` or ``"python"``.
"""

from __future__ import annotations

import bisect
import os
import types
from collections.abc import Sequence
from itertools import compress, count, repeat
from operator import itemgetter, ne
from typing import Any

#: the functions each implementation has, under these names
NAMES = ("gather", "fill", "incr", "count_free", "select_equal", "evict_claim",
         "release", "touch", "register", "cached_prefix", "chain_prefix", "running_plain",
         "sample_plain", "decode_room", "advance", "decode_times", "decode_plan")


def gather(values: list[Any], index: Sequence[int]) -> tuple[Any, ...]:
    """``values[i]`` for each ``i`` in ``index``, as a tuple: one ``itemgetter`` call, about half
    the cost of ``map(values.__getitem__, index)`` (a method-wrapper call per item)."""
    if len(index) > 1:
        return itemgetter(*index)(values)
    return (values[index[0]],) if index else ()


_py_gather = gather


def fill(lst: list[Any], index: Sequence[int], value: Any) -> None:
    """``lst[i] = value`` for each ``i`` in ``index``."""
    for i in index:
        lst[i] = value


def incr(lst: list[int], index: Sequence[int]) -> None:
    """``lst[i] += 1`` for each ``i`` in ``index``."""
    for i in index:
        lst[i] += 1


_negative = (0).__gt__     # as a C-level predicate


def count_free(ref: list[int], index: Sequence[int], shared: int) -> int:
    """How many ``ref[i]`` for ``i`` in ``index`` are negative (free blocks). ``shared``: the
    engine's count of extra holders; while it is 0 every held block's entry is 1, and counting
    those is about twice as cheap in Python (the C loop just counts negatives). C-level passes:
    ``list.count`` of a bool is far cheaper than ``sum`` over bools (it leaves sum's int path)."""
    refs = _py_gather(ref, index)
    if not shared:
        return len(refs) - refs.count(1)
    return list(map(_negative, refs)).count(True)


def select_equal(lst: list[Any], index: Sequence[int], value: Any) -> list[int]:
    """The ``i`` of ``index``, in order, whose ``lst[i] == value``."""
    return list(compress(index, map(value.__eq__, _py_gather(lst, index))))


def evict_claim(taken: Sequence[int], block_hash: list[int | None], cached: dict[int, int],
                ref: list[int], value: int, stop: set[int] | None, start: int) -> int:
    """``_allocate``'s loop over the blocks it took, from ``taken[start]`` on: a block that holds
    a hash loses it (out of ``cached``, ``block_hash[b] = None``), and each block's ``ref``
    entry becomes ``value``. Stops before a block that holds a hash and is in ``stop`` (the
    caller handles it) and returns its position, else ``len(taken)``."""
    if not stop:
        for b in (taken[start:] if start else taken):
            h = block_hash[b]
            if h is not None:
                del cached[h]
                block_hash[b] = None
            ref[b] = value
        return len(taken)
    for k in range(start, len(taken)):
        b = taken[k]
        h = block_hash[b]
        if h is not None:
            if b in stop:
                return k
            del cached[h]
            block_hash[b] = None
        ref[b] = value
    return len(taken)


def release(blocks: Sequence[int], ref: list[int], value: int) -> list[int]:
    """``_free_blocks``' general loop: each block, last first, loses a holder; one left with
    none gets ``value`` and is appended to the list returned."""
    q = []
    for b in reversed(blocks):
        r = ref[b] - 1
        if r == 0:
            ref[b] = value
            q.append(b)
        else:
            ref[b] = r
    return q


def touch(hit: Sequence[int], ref: list[int]) -> tuple[list[int], list[int]]:
    """``_touch``'s general loop: a held block gains a holder; a free one (a negative entry)
    becomes held by one. Returns the free ones and their former entries, in order."""
    free: list[int] = []
    entries: list[int] = []
    for b in hit:
        r = ref[b]
        if r < 0:
            free.append(b)
            entries.append(r)
            ref[b] = 1
        else:
            ref[b] = r + 1
    return free, entries


def register(cached: dict[int, int], block_hash: list[int | None], hashes: Sequence[int],
             blocks: Sequence[int], k: int, upto: int) -> None:
    """``_register``'s loop: for each ``idx`` in ``range(k, upto)`` whose hash is not cached,
    ``cached[hashes[idx]] = blocks[idx]`` and ``block_hash[blocks[idx]] = hashes[idx]``.

    In Python, the common case (no hash of the run cached already: no exception on the agentic
    benchmark trace) is one C-level update, checked afterwards by the dict's growth, which a
    hash cached already or repeated inside the run cuts short; then it is undone and done
    block by block."""
    run = hashes[k:upto]
    before = len(cached)
    run_blocks = blocks[k:upto]
    cached.update(zip(run, run_blocks))
    if len(cached) - before == upto - k:
        for b, h in zip(run_blocks, run):
            block_hash[b] = h
        return
    # Undo it: a hash that another block held (its block_hash entry says which; the run's own
    # blocks hold none yet) is given back to that block, in place, and the run's new hashes
    # are removed.
    run_set = set(run)
    held = {h: b for b, h in enumerate(block_hash) if h is not None and h in run_set}
    for h in run_set:
        b = held.get(h)
        if b is None:
            del cached[h]
        else:
            cached[h] = b
    for idx in range(k, upto):
        h = hashes[idx]
        if h not in cached:   # another block may already hold this content
            b = blocks[idx]
            cached[h] = b
            block_hash[b] = h


def cached_prefix(cached: dict[int, int], hashes: Sequence[int], start: int,
                  limit: int) -> list[int]:
    """``cached[h]`` for the hashes of ``hashes[start:limit]``, up to the first one not cached.

    C-level passes (map + index) instead of a Python loop, ~10x faster on long prompts, over
    chunks that double from 64 blocks: the scan ends in the chunk of the first miss, not at the
    prompt's end. A chunk that hits throughout (most of them) is read by one itemgetter call,
    about 40% cheaper per hash than map(get); the chunk with the miss is read again with get."""
    get = cached.get
    found: list[int] = []
    size = 64
    if limit > len(hashes):
        limit = len(hashes)
    while start < limit:
        end = start + size if start + size < limit else limit
        part = hashes[start:end]
        if end - start > 1:
            try:
                found += itemgetter(*part)(cached)
                start, size = end, size * 2
                continue
            except KeyError:
                pass
        chunk = list(map(get, part, repeat(-1, end - start)))
        try:
            miss = chunk.index(-1)
        except ValueError:
            found += chunk
            start, size = end, size * 2
            continue
        found += chunk[:miss]
        break
    return found


def _first_difference(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Index of the first position where equal-length ``a`` and ``b`` differ, else their length."""
    return next(compress(count(), map(ne, a, b)), len(a))


def chain_prefix(c_hashes: Sequence[int], c_blocks: list[int], hashes: Sequence[int],
                 limit: int, block_hash: list[int | None]) -> list[int]:
    """The leading blocks of ``c_blocks`` (a request's blocks, ``c_hashes`` its hashes) that
    still hold ``hashes[:limit]``'s leading hashes: ``_lookup``'s answer for that stretch."""
    m = min(limit, len(c_hashes), len(c_blocks), len(hashes))
    want = hashes[:m]
    if c_hashes[:m] != want:
        m = _first_difference(c_hashes[:m], want)
        want = want[:m]
    blocks = c_blocks[:m]
    if not m or block_hash[blocks[-1]] == want[-1]:
        # The last one still holds its hash: all of them, usually (evictions take a released
        # request's last blocks first), checked in one pass.
        held = _py_gather(block_hash, blocks)
        if held != tuple(want):
            del blocks[_first_difference(held, want):]
        return blocks
    # Some were evicted: check chunks that double from 64 blocks, so that a request evicted
    # from its first block on costs one chunk rather than a pass over all of its blocks.
    start, size = 0, 64
    while start < m:
        end = start + size if start + size < m else m
        part = blocks[start:end]
        held = _py_gather(block_hash, part)
        if held != tuple(want[start:end]):
            del blocks[start + _first_difference(held, want[start:end]):]
            return blocks
        start, size = end, size * 2
    return blocks


def running_plain(running: list, i: int, budget: int, threshold: int | None, bs: int,
                  scheduled: list) -> tuple[int, int, int, int]:
    """``Engine.step``'s loop over its running requests (fcfs) from ``running[i]`` on, for the
    requests that need neither a new block nor a registration: each gets ``min(pending,
    threshold, budget)`` tokens and is appended to ``scheduled``. Stops at the first one that
    needs more (the caller handles it) or when the budget is spent; returns where it stopped,
    the budget left, and the attention and decode-context sums it added."""
    attn = ctx = 0
    while i < len(running) and budget > 0:
        req = running[i]
        computed = req.computed
        num_new = req.num_tokens - computed
        if threshold and num_new > threshold:
            num_new = threshold
        if num_new > budget:
            num_new = budget
        if (num_new <= 0 or -(-(computed + num_new) // bs) > len(req.blocks)
                or req.registered < len(req.hashes)):
            break
        if num_new == 1 and req.output:
            ctx += computed + 1
        else:
            attn += num_new * (2 * computed + num_new)
        req.computed = computed + num_new
        budget -= num_new
        scheduled.append(req)
        i += 1
    return i, budget, attn, ctx


def sample_plain(scheduled: list, k: int, emitted: dict[str, int]) -> tuple[int, int]:
    """``Engine.step``'s sampling loop from ``scheduled[k]`` on, for the requests that neither
    get their first token nor finish: one mid-prefill is passed over, one whose tokens are all
    computed gets one. Stops at the first that would get its first token or finish (the caller
    handles it); returns its position and how many tokens were sampled."""
    sampled = 0
    n = len(scheduled)
    while k < n:
        req = scheduled[k]
        if req.computed < req.num_tokens:
            k += 1
            continue    # a non-final prefill chunk
        if req.first_token_time is None or req.output + 1 >= req.max_tokens:
            break
        req.output += 1
        req.num_tokens += 1
        sampled += 1
        emitted[req.id] = req.output
        k += 1
    return k, sampled


def decode_room(running: list, bs: int, n: int) -> int | None:
    """The least of ``n`` and, over the running requests, the decode steps before each needs a
    block and before the one it ends in (``_coalesce``'s bound). (C: None if a request is not
    one it reads, and the caller runs this.)"""
    for req in running:
        room = len(req.blocks) * bs - req.computed   # decode steps before it needs a block
        left = req.max_tokens - req.output - 1        # decode steps before the one it ends in
        if room < n:
            n = room
        if left < n:
            n = left
    return n


def advance(running: list, u: int, emitted: dict[str, int]) -> bool:
    """``_advance``'s loop: each running request's counts go up by ``u`` and ``emitted[id] =
    output``. (C: False, nothing changed, if a request is not one it reads.)"""
    for req in running:
        req.computed += u
        req.num_tokens += u
        req.output += u
        emitted[req.id] = req.output
    return True


def decode_times(base: float, kappa: float, ctx: int, num: int, n: int, t: float, busy: float,
                 horizon: float) -> tuple[list[float], list[float], list[float]] | None:
    """The starts, ends and busy times after each of up to ``n`` decode steps of ``num``
    requests, the first starting at ``t`` with contexts summing to ``ctx`` (each step's sum
    ``num`` more): a step lasts ``base + kappa * ctx`` (Profile.decode_base), ends at its
    start plus that, and adds it to ``busy``, the float operations a loop of ``step()`` calls
    makes, in the same order. Only the steps that start before ``horizon``. (C: None if a
    number is not one it reads, and the caller runs this.)"""
    starts: list[float] = []
    ends: list[float] = []
    busys: list[float] = []
    for _ in range(n):
        if not t < horizon:
            break
        duration = base + kappa * ctx
        starts.append(t)
        t = t + duration
        ends.append(t)
        busy = busy + duration
        busys.append(busy)
        ctx += num
    return starts, ends, busys


def decode_plan(running: list, bs: int, k: int, free: int) -> tuple[int, list[int], list[int]] | None:
    """The decode steps the running requests can run on, blocks taken on the way: at most
    ``k``, none that ends a request (``max_tokens - output - 1`` steps at most), and none in
    which a block would be missing (at most ``free`` blocks taken in all). Returns that number
    of steps and the blocks they take, in the order ``step()`` would take them (by step, then by
    running order): each one's step and the index of the request it goes to. A request needs
    one at each step that starts with its blocks full (``len(blocks) * bs - computed`` steps
    from now, then every ``bs`` steps). (C: None if a request is not one it reads, or there
    would be too many, and the caller runs this.)"""
    for req in running:
        left = req.max_tokens - req.output - 1
        if left < k:
            k = left
    if k <= 0:
        return k, [], []
    events: list[tuple[int, int]] = []
    for i, req in enumerate(running):
        j = len(req.blocks) * bs - req.computed + 1
        if j < 1:
            j = 1
        events.extend((s, i) for s in range(j, k + 1, bs))
    events.sort()
    if len(events) > free:
        k = events[free][0] - 1
        del events[bisect.bisect_left(events, (k + 1, -1)):]
    return k, [s for s, _ in events], [i for _, i in events]


#: the Python implementation, as a namespace of NAMES (for tests that compare the two)
PY = types.SimpleNamespace(**{_name: globals()[_name] for _name in NAMES})

C: Any = None
try:
    from kvtop.sim import _blockpool as C   # type: ignore[attr-defined,no-redef]
except ImportError:   # not built (no compiler at install time): the Python loops above
    C = None

FORCED_PURE = os.environ.get("KVTOP_PURE_PYTHON", "") not in ("", "0")
IMPL = "c" if C is not None and not FORCED_PURE else "python"
if IMPL == "c":
    for _name in NAMES:
        globals()[_name] = getattr(C, _name)
