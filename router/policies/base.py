"""The policy interface: a pure function of (request, cluster view) -> Pick.

A policy never changes counters. It may read the global round-robin counter from the view
and says, in its Pick, whether it consumed it (``uses_rr``); the caller advances it.
Capabilities are class attributes (``needs_session``, ``schema``), so callers ask what a
policy needs instead of testing its name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from router.cluster import Candidate, ClusterView
from router.config import KnobSchema

# The closed vocabulary of decision reasons (docs/policies.md explains each).
ROUND_ROBIN = "round_robin"  # next instance in turn
ARGMIN = "argmin"  # one instance had the lowest score
TIE_FIRST = "tie_first"  # several tied; the first in instance order won
TIE_RR = "tie_rr"  # several tied on every tie-break; the round-robin counter chose
AFFINITY_STICK = "affinity_stick"  # stayed on the session's instance
AFFINITY_NEW = "affinity_new"  # a session's first request, bound to the pick
AFFINITY_LOST = "affinity_lost"  # the session's instance is unhealthy; rebound
OVERLOAD_BREAK = "overload_break"  # the session's instance is over the overload bound
CACHE_GATE_MISS = "cache_gate_miss"  # too little of the prompt is cached on the session's instance
MIGRATE = "migrate"  # unified_ab moved a heavy session off an overloaded instance
RETRY = "retry"  # a second attempt after the first instance failed before any byte
# the peer model cache_aware's three branches (router/policies/cache_aware.py)
CACHE_MATCH = "cache_match"  # longest prefix in its own tree, over the cache threshold
SMALLEST_TREE = "smallest_tree"  # no match over the threshold; the instance with the smallest tree
LOAD_BALANCE = "load_balance"  # the fleet's BS spread over both balance bounds; the least loaded

REASONS: dict[str, str] = {
    ROUND_ROBIN: "next instance in turn",
    ARGMIN: "unique lowest score",
    TIE_FIRST: "lowest score tied; first instance in order won",
    TIE_RR: "lowest score tied on every tie-break; round-robin counter chose",
    AFFINITY_STICK: "stayed on the session's instance",
    AFFINITY_NEW: "first request of a session; bound to the pick",
    AFFINITY_LOST: "session's instance unhealthy; rebound to the pick",
    OVERLOAD_BREAK: "session's instance over the overload bound; fell back to the score",
    CACHE_GATE_MISS: "session's cached share at or below the gate; fell back to the score",
    MIGRATE: "heavy session migrated off an overloaded instance",
    RETRY: "second attempt after the first instance failed before any byte was sent",
    CACHE_MATCH: "cache_aware: longest prefix in its own tree, over the cache threshold",
    SMALLEST_TREE: "cache_aware: no prefix over the threshold; the smallest tree",
    LOAD_BALANCE: "cache_aware: load over both balance bounds; the least loaded",
}


@dataclass(slots=True)
class Pick:
    index: int
    reason: str
    terms: list[dict[str, Any]] = field(default_factory=list)  # each candidate's score terms
    uses_rr: bool = False
    migrated_from: int | None = None


class Policy:
    """Base class. Subclasses set ``name``, ``schema`` and implement ``pick``."""

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    schema: ClassVar[KnobSchema] = KnobSchema()
    needs_session: ClassVar[bool] = False
    #: Asks the cluster for ``view.lookahead`` (queued seconds, eviction victims): O(evicted
    #: blocks) more per decision, so only policies that use it ask.
    needs_lookahead: ClassVar[bool] = False

    def __init__(self, knobs: dict[str, Any] | None = None):
        self.knobs = self.schema.validate(knobs or {})

    def pick(self, req: Any, view: ClusterView) -> Pick:  # pragma: no cover - interface
        raise NotImplementedError

    @classmethod
    def describe(cls) -> dict[str, Any]:
        doc = (cls.__doc__ or "").strip()
        return {"name": cls.name, "aliases": list(cls.aliases), "doc": doc,
                "needs_session": cls.needs_session, "knobs": cls.schema.to_json()}


def terms_of(c: Candidate, score: float) -> dict[str, Any]:
    return {"instance": c.name, "hit": c.hit, "new": c.new, "P": c.pending_prefill,
            "BS": c.num_requests, "D": c.decode_tokens, "score": score}


def argmin_with_ties(cands: Sequence[Candidate], scores: Sequence[float],
                     tie_keys: Sequence[Callable[[Candidate], float]], rr_counter: int,
                     ) -> tuple[int, str, bool]:
    """Lowest score; ties broken by each key in turn, then by the round-robin counter.

    Returns (position in ``cands``, reason, whether the round-robin counter was used).
    """
    best = min(scores)
    tied = [k for k, s in enumerate(scores) if s == best]
    if len(tied) == 1:
        return tied[0], ARGMIN, False
    for key in tie_keys:
        low = min(key(cands[k]) for k in tied)
        tied = [k for k in tied if key(cands[k]) == low]
        if len(tied) == 1:
            return tied[0], ARGMIN, False
    return tied[rr_counter % len(tied)], TIE_RR, True


def argmin_first(scores: Sequence[float]) -> tuple[int, str]:
    """Lowest score with strict ``<``: the first seen wins a tie."""
    best_k = 0
    best = scores[0]
    tie = False
    for k in range(1, len(scores)):
        s = scores[k]
        if s < best:
            best, best_k, tie = s, k, False
        elif s == best:
            tie = True
    return best_k, (TIE_FIRST if tie else ARGMIN)
