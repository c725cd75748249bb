"""What a placement would do beyond its own request: the sessions it would evict, and the
sessions bound to each candidate that may still come back (router/policies/expected_cost.py
prices them). Built per decision by ``Cluster.lookahead``; every fact is computed on first
use, per instance, in time bounded by the fleet, never by the sessions held (issue 37)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from copy import copy
from dataclasses import dataclass
from typing import Protocol

from router.calibration import Calibration
from router.prefix_index import PrefixIndex


@dataclass(slots=True)
class SessionInfo:
    session_id: str
    instance: int
    turns: int = 0
    last_input_tokens: int = 0
    total_input_tokens: int = 0
    last_est_hit_tokens: int = 0
    first_seen: float = 0.0
    last_seen: float = 0.0
    bound_since: float = 0.0  # when the session moved to its current instance
    moves: int = 0
    gap_sum: float = 0.0  # seconds from its last answer's end (or its last arrival, if later) to its next turn, summed
    gaps: int = 0
    in_flight: int = 0  # its requests dispatched and not yet finished
    last_done: float = float("-inf")  # when its last request finished
    busy_since: float = 0.0  # when its in_flight last went from 0 to 1 (the arrival of that request)
    fleet_s: float = 0.0  # its closed busy periods, summed: the union of its finished requests' [arrival, end]

    def figures(self, now: float) -> tuple[float, float, float]:
        """``(completion_s, fleet_s, client_s)`` as of ``now`` (store/sessions.py's figures,
        live): first arrival to its last answer's end (to now while a request is in flight);
        the time with a request of its own in the fleet; the rest, the client's own time."""
        fleet = self.fleet_s
        if self.in_flight > 0:
            end = now
            fleet += now - self.busy_since
        else:
            end = max(self.last_done, self.last_seen)
        completion = max(0.0, end - self.first_seen)
        return completion, fleet, max(0.0, completion - fleet)

    def idle_s(self, now: float) -> float:
        """Seconds it has been free to send a turn: since its last answer ended, or its last
        arrival if later; 0 while a request of its own is in flight (an agent waits for the
        answer before its next turn)."""
        if self.in_flight > 0:
            return 0.0
        return now - max(self.last_seen, self.last_done)


class ClusterLike(Protocol):
    """What a lookahead reads of its cluster (router/cluster.py ``Cluster``)."""

    calibration: Calibration
    block_size: int
    index: PrefixIndex
    sessions: OrderedDict[str, SessionInfo]
    _busy: list[dict[str, SessionInfo]]
    _idle: list[OrderedDict[str, SessionInfo]]
    _prior_tokens: list[dict[int, int]]


#: Idle sessions the lookahead prices one by one per instance, the most recently active first
#: (see ``Lookahead.bound``): with the sessions in flight there, what a decision walks, however
#: many sessions the router holds. An agentic fleet has a few dozen sessions between turns per
#: instance (one H20 holds the KV of about two of their contexts).
LOOKAHEAD_IDLE = 64

#: A numerical cut, not a model: a session idle over this many of its mean gaps has odds of
#: return below k e^-14 (k its turns); the lookahead stops pricing it (docs/policies.md).
IDLE_GAPS = 14

#: At most this many idle sessions leave the lookahead in one walk (the first walk after the
#: fleet's first gap may find thousands past their cut): the rest leave at the next ones.
AGE_OUT_PER_WALK = 1024


class Lookahead:
    """What a placement would do beyond its own request, per candidate instance index.

    ``wait_s``: seconds of prefill queued ahead (each pending request's calibrated T(q, h),
    the head's elapsed service taken off); ``session``: the routed session's own record
    (None on its first turn). Three facts are computed on first use, per instance, so a
    policy can skip candidates that cannot win: ``victims(i)``, the sessions whose cached
    blocks the request's new blocks would push out of i's estimated LRU, as (session, tokens
    evicted); ``bound(i)``, the other sessions bound to i that may still come back and are
    priced one by one; ``settled(i)``, the rest of them as one sum (see ``bound``). Each costs
    O(instance's sessions in flight + ``LOOKAHEAD_IDLE``) or O(the request's blocks), never
    O(sessions held). Read them before the request is dispatched."""

    __slots__ = ("now", "calibration", "block_size", "wait_s", "session", "fleet_gap_s",
                 "capacity_tokens", "_cluster", "_num_blocks", "_session_id", "_hits", "_victims",
                 "_bound", "_settled")

    def __init__(self, cluster: ClusterLike, now: float, wait_s: dict[int, float], num_blocks: int,
                 hits: Sequence[int] | dict[int, int], session_id: str | None, session: SessionInfo | None,
                 fleet_gap_s: float | None, capacity_tokens: list[int] | None = None):
        self.now = now
        self.calibration = cluster.calibration
        self.block_size = cluster.block_size
        self.wait_s = wait_s
        self.session = session
        self.fleet_gap_s = fleet_gap_s  # mean gap between turns over every session seen; None before one
        # each instance's capacity in tokens (the cluster passes the list it keeps; read only)
        self.capacity_tokens = (capacity_tokens if capacity_tokens is not None
                                else [n * cluster.block_size for n in cluster.index.capacity])
        self._cluster = cluster
        self._num_blocks = num_blocks
        self._session_id = session_id
        self._hits = hits
        self._victims: dict[int, list[tuple[SessionInfo, int]]] = {}
        self._bound: dict[int, list[SessionInfo]] = {}
        self._settled: dict[int, float] = {}

    def victims(self, i: int) -> list[tuple[SessionInfo, int]]:
        """Placing the request on i adds the blocks i lacks; what exceeds i's capacity leaves
        from the oldest end, and each evicted block counts against the session that last
        inserted it, if that session is still bound to i (one that moved has its cache
        elsewhere). O(evicted blocks)."""
        got = self._victims.get(i)
        if got is None:
            cl = self._cluster
            bs = self.block_size
            lacking = self._num_blocks - self._hits[i] // bs
            overflow = cl.index.cached_blocks(i) + lacking - cl.index.capacity[i]
            got = []
            if overflow > 0:
                for tag, n in cl.index.oldest_tags(i, overflow, skip=self._session_id).items():
                    other = cl.sessions.get(tag) if tag is not None else None
                    if other is not None and other.instance == i:
                        got.append((other, n * bs))
            self._victims[i] = got
        return got

    def freeze(self, indexes: Sequence[int]) -> None:
        """Compute every lazy fact now and copy the session records they hold, so that a
        reader after the request was dispatched (a shadow policy, deferred) sees the cluster
        as it was at the decision, not as the dispatch changed it."""
        for i in indexes:
            self._victims[i] = [(copy(s), n) for s, n in self.victims(i)]
            self._bound[i] = [copy(s) for s in self.bound(i)]
            self.settled(i)
        if self.session is not None:
            self.session = copy(self.session)

    def bound(self, i: int) -> list[SessionInfo]:
        """The other sessions bound to i that may still return, priced one by one.

        While no session has a gap of time between turns (the fleet's mean gap is None or 0)
        every session's odds of return are its Laplace prior, which time does not change:
        none is listed, ``settled(i)`` sums them all. Otherwise: the sessions with a request in
        flight on i, then i's idle sessions from the most recently active back, passing over
        (and ageing out of the lookahead, until their next turn) those idle over ``IDLE_GAPS``
        of their mean gaps, until ``LOOKAHEAD_IDLE`` are listed (or ``AGE_OUT_PER_WALK`` aged
        out); older idle ones are not priced. O(sessions in flight on i + LOOKAHEAD_IDLE +
        AGE_OUT_PER_WALK)."""
        got = self._bound.get(i)
        if got is None:
            got = []
            fleet_gap = self.fleet_gap_s
            if fleet_gap:
                cl = self._cluster
                own = self._session_id
                got.extend(s for sid, s in cl._busy[i].items() if sid != own)
                now = self.now
                idle = cl._idle[i]
                aged: list[str] = []
                listed = 0
                for sid in reversed(idle):
                    if listed >= LOOKAHEAD_IDLE or len(aged) >= AGE_OUT_PER_WALK:
                        break
                    other = idle[sid]
                    g = other.gap_sum / other.gaps if other.gaps else fleet_gap
                    if g and now - max(other.last_seen, other.last_done) > IDLE_GAPS * g:
                        aged.append(sid)
                        continue
                    if sid != own:
                        got.append(other)
                        listed += 1
                for sid in aged:
                    del idle[sid]
            self._bound[i] = got
        return got

    def settled(self, i: int) -> float:
        """The context tokens of the other sessions bound to i that ``bound(i)`` does not
        list, weighted by their odds of return: while the fleet has no gap between turns,
        every one of them at its Laplace prior k / (k + 1) (k its turns), kept as one sum per
        instance and turn count as they come and go; 0 otherwise. O(distinct turn counts)."""
        got = self._settled.get(i)
        if got is None:
            got = 0.0
            if not self.fleet_gap_s:
                own = self.session
                own_k = own.turns if own is not None and own.instance == i else None
                for k, tokens in self._cluster._prior_tokens[i].items():
                    if k == own_k:  # its own record is not a returning other
                        tokens -= own.last_input_tokens
                    got += k / (k + 1.0) * tokens
            self._settled[i] = got
        return got
