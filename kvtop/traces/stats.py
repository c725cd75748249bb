"""Describe a normalized trace: counts, length percentiles, class mix, rate, prefix ceiling.

Percentiles are ``store.stats.percentile`` (linear interpolation, numpy's default), as in the
traces README, so the figures here can be checked against it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from router.classes import CLASSES, route_class
from kvtop.traces.loader import TraceRequest
from store.stats import percentile

LONG_THRESHOLDS = (20_000, 50_000, 100_000, 200_000)


def _pct(values: Sequence[float], q: float) -> float:
    """``percentile``, but nan for no values: stats are printed and JSON-dumped as numbers."""
    p = percentile(values, q)
    return math.nan if p is None else p


def _dist(values: Sequence[float]) -> dict[str, float]:
    return {
        "p50": _pct(values, 50), "p90": _pct(values, 90),
        "p99": _pct(values, 99), "max": max(values) if values else math.nan,
        "mean": sum(values) / len(values) if values else math.nan,
    }


def prefix_ceiling(requests: Sequence[TraceRequest]) -> tuple[float, float]:
    """(block share, token share) an infinite contiguous prefix cache could serve.

    Walks requests in order, keeping every chain key seen; a request's leading blocks whose
    chain key was seen before are hits; tokens count ``min(hits * block_size, input)``.
    Requests without hash ids count as all-miss tokens.

    A session's turn mostly repeats its previous turn's ids and adds a few: the keys of the
    prefix they share are that turn's keys, all seen already (a walk adds every key it does
    not find), so they are hits without being hashed again, and the walk goes on from there
    (``_prefix_ceiling_walk`` is the plain walk: the same figures, tests/test_prefix_ceiling.py).
    An agentic trace of 10,000 requests and 11.7M ids hashes its 0.8M new ids, not all of them.
    """
    from kvtop.traces.loader import _common_prefix

    seen: set[int] = set()
    hit_blocks = total_blocks = 0
    hit_tokens = total_tokens = 0
    last: dict[Any, tuple[Sequence[int], list[int]]] = {}   # session -> its last turn's ids, keys
    for req in requests:
        ids = req.hash_ids
        prev = last.get(req.session)
        m = _common_prefix(prev[0], ids) if prev is not None else 0
        keys = prev[1][:m] if m else []
        key = keys[-1] if m else 0
        hits = m
        matching = True
        for h in ids[m:]:
            key = hash((key, h))
            keys.append(key)
            if matching and key in seen:
                hits += 1
            else:
                matching = False
                seen.add(key)
        last[req.session] = (ids, keys)
        hit_blocks += hits
        total_blocks += len(ids)
        hit_tokens += min(hits * req.block_size, req.input_tokens)
        total_tokens += req.input_tokens
    return (hit_blocks / total_blocks if total_blocks else 0.0,
            hit_tokens / total_tokens if total_tokens else 0.0)


def _prefix_ceiling_walk(requests: Sequence[TraceRequest]) -> tuple[float, float]:
    """``prefix_ceiling`` as a walk of every id of every request (the reference for tests)."""
    seen: set[int] = set()
    hit_blocks = total_blocks = 0
    hit_tokens = total_tokens = 0
    for req in requests:
        key = 0
        hits = 0
        matching = True
        for h in req.hash_ids:
            key = hash((key, h))
            if matching and key in seen:
                hits += 1
            else:
                matching = False
                seen.add(key)
        hit_blocks += hits
        total_blocks += len(req.hash_ids)
        hit_tokens += min(hits * req.block_size, req.input_tokens)
        total_tokens += req.input_tokens
    return (hit_blocks / total_blocks if total_blocks else 0.0,
            hit_tokens / total_tokens if total_tokens else 0.0)


def trace_stats(requests: Sequence[TraceRequest]) -> dict[str, Any]:
    """All figures ``kvtop trace stats`` prints, as a JSON-ready dict."""
    n = len(requests)
    turns: dict[str, int] = {}
    for r in requests:
        turns[r.session] = turns.get(r.session, 0) + 1
    inputs = [r.input_tokens for r in requests]
    outputs = [r.output_tokens for r in requests]
    arrivals = [r.arrival for r in requests]
    span = (max(arrivals) - min(arrivals)) if arrivals else 0.0
    mix = {name: 0 for name, _, _ in CLASSES}
    for x in inputs:
        mix[route_class(x)] += 1
    block_ceiling, token_ceiling = prefix_ceiling(requests)
    sources: dict[str, int] = {}
    for r in requests:
        sources[r.source] = sources.get(r.source, 0) + 1
    per_session = list(turns.values())
    return {
        "requests": n,
        "sessions": len(turns),
        "sub_agent_sessions": len({r.session for r in requests if r.parent}),
        "sources": sources,
        "turns_per_session": {"p50": _pct(per_session, 50),
                              "p90": _pct(per_session, 90),
                              "max": max(per_session) if per_session else 0},
        "input_tokens": _dist(inputs),
        "output_tokens": _dist(outputs),
        "share_input_at_least": {str(t): (sum(1 for x in inputs if x >= t) / n if n else 0.0)
                                 for t in LONG_THRESHOLDS},
        "class_mix": {k: (v / n if n else 0.0) for k, v in mix.items()},
        "class_counts": mix,
        "span_s": span,
        "rate_rps": (n / span) if span > 0 else math.nan,
        "prefix_ceiling_blocks": block_ceiling,
        "prefix_ceiling_tokens": token_ceiling,
    }


def format_stats(s: dict[str, Any]) -> str:
    """The human-readable form of ``trace_stats``."""
    def d(x: dict[str, float]) -> str:
        return "  ".join(f"{k} {v:,.0f}" for k, v in x.items())

    tps = s["turns_per_session"]
    lines = [
        f"requests      {s['requests']:,}   sessions {s['sessions']:,} "
        f"({s['sub_agent_sessions']} sub-agent)   sources "
        + ", ".join(f"{k or '?'} {v}" for k, v in s["sources"].items()),
        f"turns/session p50 {tps['p50']:g}  p90 {tps['p90']:g}  max {tps['max']}",
        f"input tokens  {d(s['input_tokens'])}",
        f"output tokens {d(s['output_tokens'])}",
        "input >=      " + "  ".join(f"{int(k) // 1000}k {v:.1%}"
                                      for k, v in s["share_input_at_least"].items()),
        "class mix     " + "  ".join(f"{k} {v:.1%}" for k, v in s["class_mix"].items()),
        f"span          {s['span_s']:,.1f} s   rate {s['rate_rps']:.2f} req/s",
        f"prefix ceiling {s['prefix_ceiling_blocks']:.3f} of blocks, "
        f"{s['prefix_ceiling_tokens']:.3f} of tokens (infinite cache, contiguous prefix)",
    ]
    return "\n".join(lines)
