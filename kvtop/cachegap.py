"""Where the gap to the prefix ceiling went, and what the fleet's KV capacity allows (issue 38).

Two figures beside the infinite prefix ceiling (kvtop/ceiling.py):

- ``capacity_ceiling``: an upper bound on the cached tokens ANY placement and eviction could
  deliver with the fleet's real KV: the whole fleet's capacity pooled as one cache, evicting
  the block used farthest in the future (Belady's MIN), counting every cached block (not only
  a leading run) as a hit. ``timed_capacity_ceiling`` is the same on one run's timeline, with
  every running request holding its blocks (the figure reports show). docs/ceiling.md states
  the argument and its assumptions.
- ``decompose``: one arm's lost cache, the ceiling's hit tokens less the tokens its engines
  delivered from cache, split per request, in this order:

  first_turn   the session's first request (no prefix of its own; what it lost is a prefix
               other sessions sent, e.g. a shared system prompt, computed elsewhere);
  concurrency  the prefix had been sent but not computed yet anywhere (an in-flight request
               was still prefilling it when this one was dispatched);
  placement    computed, but on other instances only: the router sent it away from the
               instance holding the longest prefix (the policy's choice: moves); with the
               decision rows, only what the router saw still held there;
  evicted      computed on the instance it went to, but no longer cached there, or (with
               the decision rows) computed elsewhere and no longer held anywhere (capacity);
  other        what is left: the run sending requests in another order than the trace (the
               ceiling's), engine grain (the last block of a prompt is never a hit), and
               timing (a prefix that finished while the request queued on the engine).

  Each is measured against the run itself: the prefixes sent, computed (first token out) and
  computed per instance before the request's dispatch (``sent_at`` or ``arrival``, plus its
  admission wait), each as if that cache were infinite. The parts sum to the gap exactly.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PARTS = ("first_turn", "concurrency", "placement", "evicted", "other")


def chain_keys(hash_ids: Iterable[int]) -> list[int]:
    """The request's blocks as chain keys (a block's key names its whole prefix), as
    ``kvtop.traces.stats.prefix_ceiling`` keys them."""
    key = 0
    out = []
    for h in hash_ids:
        key = hash((key, h))
        out.append(key)
    return out


_LAST_CHAINS: list = [None, None]   # (requests, their chains): a report's arms share one trace


def _chains(requests: Sequence[Any]) -> list[list[int]]:
    """``chain_keys`` of every request, kept for the last list asked about (a report asks
    once per arm about the same trace)."""
    if _LAST_CHAINS[0] is not requests:
        _LAST_CHAINS[:] = [requests, [chain_keys(r.hash_ids) for r in requests]]
    return _LAST_CHAINS[1]


def _prefix_len(keys: Sequence[int], held: set[int]) -> int:
    """How many leading keys ``held`` has. ``held`` is prefix-closed (it holds whole requests'
    chains, and a chain key's prefix keys are in every chain that has it), so the held keys of
    one request are a leading run and a bisection finds its end."""
    lo, hi = 0, len(keys)
    while lo < hi:
        mid = (lo + hi) // 2
        if keys[mid] in held:
            lo = mid + 1
        else:
            hi = mid
    return lo


def capacity_ceiling(requests: Sequence[Any], capacity_tokens: int) -> float | None:
    """The share of the requests' input tokens a pooled cache of ``capacity_tokens`` (the
    fleet's KV summed) could serve with the optimal offline eviction, requests taken in the
    order given; None when they have no input. Blocks count as a hit wherever they are in the
    prompt (an upper bound on prefix hits), tokens as ``min(hits x block_size, input)``."""
    total = sum(r.input_tokens for r in requests)
    if not total:
        return None
    bs = min((r.block_size or 16) for r in requests)
    slots = max(0, int(capacity_tokens) // bs)
    chains = _chains(requests)
    flat = [k for c in chains for k in c]
    never = len(flat)
    nxt = [never] * len(flat)
    last: dict[int, int] = {}
    for p in range(len(flat) - 1, -1, -1):
        k = flat[p]
        nxt[p] = last.get(k, never)
        last[k] = p
    cache: dict[int, int] = {}   # key -> its next use
    heap: list[tuple[int, int]] = []   # (-next use, key); stale entries skipped
    hit_tokens = 0
    p = 0
    for r, chain in zip(requests, chains):
        hits = 0
        for k in chain:
            n = nxt[p]
            p += 1
            if k in cache:
                hits += 1
                if n == never:  # never used again: its slot is free from now on
                    del cache[k]
                    continue
            elif n == never or not slots:
                continue   # used once: caching it cannot hit (MIN would evict it first)
            cache[k] = n
            heapq.heappush(heap, (-n, k))
            while len(cache) > slots:   # evict the block used farthest in the future
                neg, victim = heapq.heappop(heap)
                if cache.get(victim) == -neg:
                    del cache[victim]
        hit_tokens += min(hits * (r.block_size or 16), r.input_tokens)
    return hit_tokens / total


def _timeline(pairs: Sequence[tuple[int, Mapping[str, Any]]]) -> list[tuple[int, float, float | None, float | None]]:
    """(trace index, dispatch, first token, end) per matched record, in the run's seconds."""
    out = []
    for k, rec in pairs:
        t0 = rec.get("sent_at")
        if t0 is None:
            t0 = rec.get("arrival") or 0.0
        t0 += (rec.get("admission_wait_ms") or 0.0) / 1000.0
        first = end = None
        if rec.get("status") == "ok" and rec.get("ttft_ms") is not None:
            first = t0 + rec["ttft_ms"] / 1000.0
            if rec.get("e2e_ms") is not None:
                end = max(first, t0 + rec["e2e_ms"] / 1000.0)
        out.append((k, t0, first, end))
    return out


def timed_capacity_ceiling(requests: Sequence[Any], records: Sequence[Mapping[str, Any]],
                           capacity_tokens: int) -> float | None:
    """The capacity ceiling on one run's timeline: as ``capacity_ceiling``, but every request
    that ran holds its prompt's blocks from its first token to its end (as an engine does, and
    longer: from its scheduling), where they cannot be evicted and take their room, and looks
    the cache up at its dispatch. None without matched records. Eviction drops first the blocks
    whose next event is a hold's start (the running request recomputes them: keeping them wins
    nothing), then those whose next lookup is farthest. Output blocks are not counted (an
    engine allocates them as it decodes; counting them all from the first token could make
    the bound too low)."""
    pairs = _match(requests, records)
    if not pairs:
        return None
    bs = min((r.block_size or 16) for r in requests)
    slots = max(0, int(capacity_tokens) // bs)
    chains = _chains(requests)
    events = []   # (time, kind, trace index): 0 starts a hold, 1 looks up, 2 ends it
    for k, t0, first, end in _timeline(pairs):
        events.append((t0, 1, k))
        if first is not None and end is not None:
            events.append((first, 0, k))
            events.append((end, 2, k))
    events.sort()
    # For each lookup and each hold's start, the value of keeping each of its blocks after it:
    # the index of the block's next event if that is a lookup (a hit to win), ``never`` if it is
    # the start of a hold (the running request recomputes it: keeping it until then wins
    # nothing) or there is none. A pass from the end.
    never = len(events)
    after: list[list[int] | None] = [None] * len(events)
    last: dict[int, int] = {}
    for e in range(len(events) - 1, -1, -1):
        _, kind, k = events[e]
        if kind == 2:
            continue
        row = after[e] = []
        for key in chains[k]:
            row.append(last.get(key, never))
            last[key] = e if kind == 1 else never
    # a block's value after now: the one its latest lookup or hold's start saw (an event of the
    # block since would have replaced it)
    upcoming: dict[int, int] = {}
    cache: dict[int, int] = {}   # key -> next use (evictable) or -1 (held by a running request)
    holds: dict[int, int] = {}   # key -> running requests holding it
    heap: list[tuple[int, int]] = []
    hit_tokens = total = 0

    full = False   # the heap is kept only from the first time the cache overflows

    def shrink() -> None:
        nonlocal full, heap
        if len(cache) <= slots:
            return
        if not full:
            full = True
            heap = [(-n, key) for key, n in cache.items() if n >= 0]
            heapq.heapify(heap)
        while len(cache) > slots and heap:
            neg, victim = heapq.heappop(heap)
            if cache.get(victim) == -neg:
                del cache[victim]

    for e, (_, kind, k) in enumerate(events):
        chain = chains[k]
        r = requests[k]
        if kind == 1:
            hits = 0
            for key, n in zip(chain, after[e]):
                if key in cache:
                    hits += 1
                upcoming[key] = n
                if key in holds:
                    continue
                if n == never:
                    cache.pop(key, None)
                    continue
                cache[key] = n
                if full:
                    heapq.heappush(heap, (-n, key))
            hit_tokens += min(hits * (r.block_size or 16), r.input_tokens)
            total += r.input_tokens
            shrink()
        elif kind == 0:
            for key, n in zip(chain, after[e]):
                holds[key] = holds.get(key, 0) + 1
                cache[key] = -1
                upcoming[key] = n
            shrink()
        else:
            for key in chain:
                left = holds[key] - 1
                if left:
                    holds[key] = left
                    continue
                del holds[key]
                n = upcoming.get(key, never)
                if n == never:
                    cache.pop(key, None)
                else:
                    cache[key] = n
                    if full:
                        heapq.heappush(heap, (-n, key))
            shrink()
    return hit_tokens / total if total else None


@dataclass
class Gap:
    """One arm's lost cache in tokens, by part (``PARTS``), over the requests it could match."""

    input_tokens: int = 0
    ceiling_tokens: int = 0
    delivered_tokens: int = 0
    parts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PARTS, 0))
    requests: int = 0
    unmatched: int = 0   # records with no trace request, no instance or no cached tokens
    moved: int = 0       # requests whose placement part is > 0
    decisions: bool = False   # placement from the decision rows (else the infinite-cache model)

    @property
    def lost_tokens(self) -> int:
        return self.ceiling_tokens - self.delivered_tokens

    def share(self, part: str) -> float:
        """The part as a share of the matched requests' input tokens."""
        return self.parts[part] / self.input_tokens if self.input_tokens else 0.0


def _match(requests: Sequence[Any], records: Sequence[Mapping[str, Any]]) -> list[tuple[int, Mapping[str, Any]]]:
    """(trace index, record) pairs: a record is its session's next trace request of the same
    input length (simulate and replay both keep the trace's session and input tokens)."""
    queue: dict[tuple[str, int], list[int]] = {}
    for k in range(len(requests) - 1, -1, -1):
        r = requests[k]
        queue.setdefault((str(r.session), int(r.input_tokens)), []).append(k)
    out = []
    for rec in sorted(records, key=lambda x: (x.get("arrival") or 0.0)):
        ks = queue.get((str(rec.get("session")), int(rec.get("input_tokens") or 0)))
        if ks:
            out.append((ks.pop(), rec))
    return out


def decompose(requests: Sequence[Any], records: Sequence[Mapping[str, Any]],
              decisions: Iterable[Mapping[str, Any]] | None = None) -> Gap:
    """Split one arm's gap to the ceiling (``decompose_by`` with every record in one arm)."""
    return decompose_by(requests, records, decisions, lambda rec: None).get(None, Gap())


def decompose_by(requests: Sequence[Any], records: Sequence[Mapping[str, Any]],
                 decisions: Iterable[Mapping[str, Any]] | None, key: Any) -> dict[Any, Gap]:
    """Split one arm's gap to the ceiling (module docstring). ``requests``: the trace in the
    ceiling's order (by arrival); ``records``: the arm's results (replay or simulate).

    ``decisions``: the arm's decision rows (the decision log's shape, matched by request id;
    a retry's last attempt), when known. Without them, placement is the whole prefix computed
    elsewhere and not on the chosen instance (as if every instance's cache were infinite: an
    upper bound on what a move cost). With them, it is at most what the router saw held
    elsewhere beyond the chosen instance's hit (``best_hit_tokens - est_hit_tokens``); the rest
    of that prefix had been evicted on the instances that computed it, and counts as evicted.

    ``key(record)`` names the arm a record belongs to (a decision log's policy segments share
    one fleet: every request's prefixes count for every arm's splits); one Gap per arm.
    """
    gaps: dict[Any, Gap] = {}
    seen_by: dict[str, Mapping[str, Any]] = {}
    for row in decisions or ():
        rid = str(row.get("request_id"))
        if rid not in seen_by or (row.get("attempt") or 1) >= (seen_by[rid].get("attempt") or 1):
            seen_by[rid] = row
    chains = _chains(requests)
    # the infinite ceiling's hit per request, in the trace's order (prefix_ceiling's walk)
    seen: set[int] = set()
    ceiling_hit = []
    for r, c in zip(requests, chains):
        ceiling_hit.append(min(_prefix_len(c, seen) * (r.block_size or 16), r.input_tokens))
        seen.update(c)
    first_of: dict[str, int] = {}
    for k, r in enumerate(requests):
        first_of.setdefault(str(r.session), k)
    pairs = _match(requests, records)

    def gap_of(rec: Mapping[str, Any]) -> Gap:
        label = key(rec)
        if label not in gaps:
            gaps[label] = Gap(decisions=bool(seen_by))
        return gaps[label]

    matched = {id(rec) for _, rec in pairs}
    for rec in records:
        if id(rec) not in matched:
            gap_of(rec).unmatched += 1
    # events in the run's time: a request's chain is sent at its dispatch and computed at its
    # first token (on its instance, and on its prefill instance when offloaded)
    events: list[tuple[float, int, int, Mapping[str, Any]]] = []
    recs = dict(pairs)
    for k, t0, first, _ in _timeline(pairs):
        events.append((t0, 1, k, recs[k]))
        if first is not None and recs[k].get("instance"):
            events.append((first, 0, k, recs[k]))   # computed before same-time dispatches
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    sent: set[int] = set()
    computed: set[int] = set()
    on: dict[str, set[int]] = {}
    for _, kind, k, rec in events:
        c = chains[k]
        if kind == 0:
            computed.update(c)
            for name in {rec.get("instance"), rec.get("prefill_instance")} - {None}:
                on.setdefault(name, set()).update(c)
            continue
        r = requests[k]
        inst, delivered = rec.get("instance"), rec.get("cached_tokens")
        gap = gap_of(rec)
        if inst is None or delivered is None:
            gap.unmatched += 1
            sent.update(c)
            continue
        bs, n = r.block_size or 16, r.input_tokens
        tok = lambda blocks: min(blocks * bs, n)  # noqa: E731
        ceil = ceiling_hit[k]
        lost = ceil - delivered
        gap.requests += 1
        gap.input_tokens += n
        gap.ceiling_tokens += ceil
        gap.delivered_tokens += delivered
        parts = gap.parts
        if first_of[str(r.session)] == k:
            parts["first_turn"] += lost
        else:
            g = tok(_prefix_len(c, sent))
            k_any = tok(_prefix_len(c, computed))
            k_on = tok(_prefix_len(c, on.get(inst, set())))
            # each part is a stretch of the prompt's positions: [k_on, k_any) placement, [k_any,
            # g) concurrency, [delivered, k_on) evicted; only what lies past ``delivered`` was
            # lost (a prefix that finished while r queued on its engine was a hit after all)
            conc = max(0, g - max(k_any, delivered))
            place = max(0, k_any - max(k_on, delivered))
            evict = max(0, k_on - delivered)
            row = seen_by.get(str(rec.get("request_id")))
            if row is not None and place > 0:   # what the router saw held elsewhere, beyond its pick
                seen = max(0, (row.get("best_hit_tokens") or 0) - (row.get("est_hit_tokens") or 0))
                evict += place - min(place, seen)
                place = min(place, seen)
            parts["concurrency"] += conc
            parts["placement"] += place
            parts["evicted"] += evict
            parts["other"] += lost - conc - place - evict
            gap.moved += place > 0
        sent.update(c)
    return gaps


def format_gaps(rows: Sequence[tuple[str, Gap, float | None]], ceiling: float | None,
                capacity_tokens: int | None, fmt: str = "text") -> str:
    """The table: per arm (label, its gap, its capacity ceiling or None), APC over the matched
    requests against both ceilings, then the gap and its parts as shares of input tokens."""
    head = ["arm", "APC", "of ceiling", "capacity ceiling", "of capacity ceiling", "gap"] + list(PARTS) + ["moved"]
    lines = []
    upper = False
    for label, g, cap in rows:
        if not g.input_tokens:
            continue
        upper = upper or not g.decisions
        apc = g.delivered_tokens / g.input_tokens
        lines.append([label, f"{apc * 100:.1f}%",
                      f"{apc / ceiling * 100:.1f}%" if ceiling else "-",
                      f"{cap * 100:.1f}%" if cap else "-",
                      f"{apc / cap * 100:.1f}%" if cap else "-",
                      f"{g.lost_tokens / g.input_tokens * 100:.1f}%"]
                     + [f"{round(g.share(p) * 100, 1) + 0.0:.1f}%" for p in PARTS] + [f"{g.moved}"])
    if not lines:
        return ""
    notes = [f"ceiling (infinite cache) {ceiling * 100:.1f}%" if ceiling else "ceiling unknown"]
    if capacity_tokens:
        notes.append(f"capacity ceiling: the fleet's {capacity_tokens:,} KV tokens pooled, optimal eviction, "
                     "each arm's running requests holding their blocks")
    if upper:
        notes.append("placement without decision rows: the prefix computed elsewhere, never on the chosen "
                     "instance (an upper bound)")
    note = "; ".join(notes) + "; gap and parts in input tokens (docs/ceiling.md)"
    if fmt == "md":
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(x) + " |" for x in lines]
        return "\n".join(out) + "\n\n" + note
    if fmt == "csv":
        return "\n".join(",".join(x) for x in [head] + lines)
    widths = [max(len(str(x[i])) for x in [head] + lines) for i in range(len(head))]
    out = ["  ".join(str(x[i]).ljust(widths[i]) if i == 0 else str(x[i]).rjust(widths[i])
                     for i in range(len(head))) for x in [head] + lines]
    return "\n".join(out) + "\n" + note


def simulated_gaps(trace: str, policies: Sequence[str], instances: int, profile: str = "h20",
                   mode: str = "closed", fmt: str = "text") -> str:
    """``kvtop simulate``'s run of each policy over ``trace`` again, its decision rows kept, and
    the gap table with placement from them (what the router saw held elsewhere)."""
    from kvtop.simulate import SimConfig, simulate
    from kvtop.sim.profiles import get_profile
    from kvtop.traces.loader import dense_ids, iter_trace
    from kvtop.traces.stats import prefix_ceiling

    requests = dense_ids(iter_trace(trace))
    ordered = sorted(requests, key=lambda r: r.arrival)
    kv = instances * get_profile(profile).kv_capacity_tokens
    rows = []
    for policy in policies:
        decisions: list[dict[str, Any]] = []
        records = simulate(requests, policy, SimConfig(instances=instances, profile=profile, mode=mode),
                           decisions=decisions)
        rows.append((policy, decompose(ordered, records, decisions), timed_capacity_ceiling(ordered, records, kv)))
    return format_gaps(rows, prefix_ceiling(ordered)[1] if ordered else None, kv, fmt)


def decision_rows(db_path: str) -> list[dict[str, Any]]:
    """The split's columns of a decision log's rows (every run: request ids are unique), read
    only (store/reads.py ``decision_hits``); empty when the file is not a decision log."""
    from store.reads import decision_hits

    return decision_hits(db_path)


def log_gaps(path: str, run_id: str | None, kv_tokens: int | None
             ) -> tuple[dict[str, Gap], float | None, float | None]:
    """A decision log's run split per policy (its arms, as ``kvtop report --db`` shows them),
    placement from its decision rows, over the block chains it recorded (the router's blocks,
    512 tokens by default: the ceiling at that grain, as ``kvtop.ceiling.of_log``); with the
    run's ceiling and, given the fleet's KV, its capacity ceiling over all the run's requests.
    Empty when the log has no block chains."""
    from kvtop.cli import CliError
    from kvtop.traces.loader import TraceRequest
    from store.chains import ChainDecoder
    from store.recorded import read_recorded_run

    try:
        got = read_recorded_run(path, run_id)
    except (CliError, OSError, LookupError):
        return {}, None, None
    bs = int(got.config.get("block_size") or 512)
    dec = ChainDecoder()
    requests, records = [], []
    t0 = min((row["t_proxy_recv"] for row in got.decisions if row["t_proxy_recv"] is not None), default=0.0)
    for row in got.decisions:
        chain = dec.decode(row["request_id"], row["blocks_parent"], row["blocks"])
        out = got.outcomes.get(row["request_id"])
        if chain is None or out is None or row["t_proxy_recv"] is None:
            continue
        arrival = row["t_proxy_recv"] - t0
        requests.append(TraceRequest(arrival=arrival, session=str(row["session_id"]), turn=row["turn"] or 0,
                                     input_tokens=row["input_tokens"] or 0, output_tokens=out["output_tokens"] or 0,
                                     hash_ids=list(chain), block_size=bs))
        records.append({"request_id": row["request_id"], "session": str(row["session_id"]),
                        "input_tokens": row["input_tokens"] or 0, "arrival": arrival, "status": out["status"],
                        "ttft_ms": out["ttft_ms"], "e2e_ms": out["e2e_ms"], "instance": out["instance"],
                        "cached_tokens": out["delivered_hit_tokens"], "policy": row["policy"]})
    if not requests:
        return {}, None, None
    requests.sort(key=lambda r: r.arrival)
    from kvtop.traces.stats import prefix_ceiling

    gaps = decompose_by(requests, records, decision_rows(path), lambda rec: rec["policy"])
    cap = timed_capacity_ceiling(requests, records, kv_tokens) if kv_tokens else None
    return gaps, prefix_ceiling(requests)[1], cap
