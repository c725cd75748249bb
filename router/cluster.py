"""Per-instance load counters, session affinity and the request lifecycle.

The counters follow DESIGN.md exactly and change only when a request starts and ends,
never inside a policy:

- dispatch to i: ``num_requests += 1``, ``ongoing_tokens += input``,
  ``pending_prefill_tokens += new_prefill`` (new_prefill = input - estimated hit on i);
  the request's blocks enter i's estimated cache.
- first token: ``pending_prefill_tokens -= new_prefill``, ``ongoing_decode_tokens += input``.
- end (done, error, client gone, upstream gone): undo exactly what is still applied.

A ``Ticket`` remembers what one request applied, so ending it twice, or ending it before
its first token, releases exactly the right amounts. The live router, the simulated server
and the offline simulator all use this class.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from router.exact_index import ExactIndex
from router.prefix_index import PrefixIndex


@dataclass(slots=True)
class InstanceState:
    index: int
    name: str
    url: str = ""
    healthy: bool = True
    ejected: bool = False  # taken out by outlier detection (router/health.py); healthy is then False
    ejections_total: int = 0
    # live load, DESIGN.md accounting
    num_requests: int = 0
    ongoing_tokens: int = 0
    pending_prefill_tokens: int = 0
    ongoing_decode_tokens: int = 0
    decode_requests: int = 0
    # cumulative, for rates and hit accounting
    routed_total: int = 0
    input_tokens_total: int = 0
    est_hit_tokens_total: int = 0
    errors_total: int = 0


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


@dataclass(slots=True)
class Candidate:
    """What a policy sees of one healthy instance for one request."""

    index: int
    name: str
    hit: int  # estimated cached prefix tokens for this request
    new: int  # max(0, input - hit): tokens this instance would have to prefill
    pending_prefill: int  # P_i
    num_requests: int  # BS_i
    decode_tokens: int  # D_i


@dataclass(slots=True)
class ClusterView:
    """A policy's whole input besides the request: healthy candidates and session facts."""

    candidates: list[Candidate]
    input_tokens: int
    session_instance: int | None  # the session's bound instance, healthy or not
    session_turn: int  # the turn this request is (1 for a new session)
    rr_counter: int
    hits: list[int]  # estimated hit per instance index, healthy or not

    def candidate(self, index: int | None) -> Candidate | None:
        if index is None:
            return None
        for c in self.candidates:
            if c.index == index:
                return c
        return None


@dataclass(slots=True)
class Ticket:
    instance: int
    input_tokens: int
    new_prefill: int
    decode: bool = True  # False for a prefill-only leg (elastic P2P offload)
    phase: str = "prefill"  # prefill -> decode -> done
    started: float = 0.0


class Cluster:
    def __init__(self, names: Sequence[str], *, block_size: int = 512,
                 capacity_blocks: int | Sequence[int] = 518, urls: Sequence[str] | None = None,
                 max_sessions: int = 200_000, clock=time.time):
        if not names:
            raise ValueError("a cluster needs at least one instance")
        urls = list(urls) if urls is not None else [""] * len(names)
        self.instances = [InstanceState(i, n, u) for i, (n, u) in enumerate(zip(names, urls))]
        self.block_size = block_size
        self.index = PrefixIndex(len(names), capacity_blocks, block_size)
        self.sessions: OrderedDict[str, SessionInfo] = OrderedDict()
        self.max_sessions = max_sessions
        self.rr_counter = 0
        self.clock = clock
        self.in_flight = 0
        #: What the engines report they hold (router/kv_events.py feeds it); None without KV events.
        self.exact: ExactIndex | None = None

    # -- what policies see ----------------------------------------------------------
    def hits(self, blocks: Sequence[int], input_tokens: int, *, exact: bool = True,
             drift: bool = False) -> list[int]:
        """Estimated cached prefix tokens per instance, capped like the engine's hit.

        vLLM always recomputes the last token, so a hit never exceeds input - 1 rounded
        down to a whole block. Instances whose KV events flow (``exact.live_mask``) answer
        from the exact index instead of the estimate, unless ``exact`` is False (a prompt
        hashed from text, whose block hashes no engine event can match); ``drift`` records
        how far the estimate was from them.
        """
        bs = self.block_size
        cap = max(0, (input_tokens - 1) // bs) * bs
        matched = self.index.match(blocks)
        ex = self.exact
        if exact and ex is not None and ex.live_mask:
            for i, m in ex.match(blocks, ex.live_mask, self.clock()).items():
                if drift:
                    ex.record_drift(i, min(matched[i] * bs, cap), min(m * bs, cap), input_tokens)
                matched[i] = m
        return [min(m * bs, cap) for m in matched]

    def index_source(self, instance: int, *, exact: bool = True) -> str:
        """Where ``instance``'s hit comes from: ``exact`` (its KV events) or ``estimate``."""
        ex = self.exact
        return "exact" if exact and ex is not None and ex.live_mask >> instance & 1 else "estimate"

    def view(self, blocks: Sequence[int], input_tokens: int, session_id: str | None, *,
             exact: bool = True) -> ClusterView:
        hits = self.hits(blocks, input_tokens, exact=exact, drift=True)
        cands = [
            Candidate(s.index, s.name, hits[s.index], max(0, input_tokens - hits[s.index]),
                      s.pending_prefill_tokens, s.num_requests, s.ongoing_decode_tokens)
            for s in self.instances if s.healthy
        ]
        sess = self.sessions.get(session_id) if session_id is not None else None
        return ClusterView(cands, input_tokens, sess.instance if sess else None,
                           (sess.turns + 1) if sess else 1, self.rr_counter, hits)

    # -- lifecycle ------------------------------------------------------------------
    def dispatch(self, instance: int, input_tokens: int, est_hit: int, blocks: Sequence[int],
                 *, decode: bool = True, cache_blocks: bool = True) -> Ticket:
        """Charge ``instance`` for a request and record its blocks in the estimated cache."""
        s = self.instances[instance]
        new_prefill = max(0, input_tokens - est_hit)
        s.num_requests += 1
        s.ongoing_tokens += input_tokens
        s.pending_prefill_tokens += new_prefill
        s.routed_total += 1
        s.input_tokens_total += input_tokens
        s.est_hit_tokens_total += est_hit
        if cache_blocks:
            self.index.insert(instance, blocks)
            if self.exact is not None:
                self.exact.speculate(instance, blocks, self.clock())
        self.in_flight += 1
        return Ticket(instance, input_tokens, new_prefill, decode, "prefill", self.clock())

    def first_token(self, t: Ticket) -> None:
        if t.phase != "prefill":
            return
        s = self.instances[t.instance]
        s.pending_prefill_tokens -= t.new_prefill
        if t.decode:
            s.ongoing_decode_tokens += t.input_tokens
            s.decode_requests += 1
        t.phase = "decode"

    def finish(self, t: Ticket, *, error: bool = False) -> None:
        if t.phase == "done":
            return
        s = self.instances[t.instance]
        if t.phase == "prefill":
            s.pending_prefill_tokens -= t.new_prefill
        elif t.decode:
            s.ongoing_decode_tokens -= t.input_tokens
            s.decode_requests -= 1
        s.num_requests -= 1
        s.ongoing_tokens -= t.input_tokens
        if error:
            s.errors_total += 1
        t.phase = "done"
        self.in_flight -= 1

    # -- sessions -------------------------------------------------------------------
    def bind_session(self, session_id: str, instance: int, input_tokens: int, est_hit: int,
                     *, new_turn: bool = True) -> SessionInfo:
        now = self.clock()
        sess = self.sessions.get(session_id)
        if sess is None:
            sess = SessionInfo(session_id, instance, first_seen=now, bound_since=now)
            self.sessions[session_id] = sess
            if len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        else:
            self.sessions.move_to_end(session_id)
            if sess.instance != instance:
                sess.instance = instance
                sess.bound_since = now
                sess.moves += 1
        if new_turn:
            sess.turns += 1
            sess.total_input_tokens += input_tokens
        sess.last_input_tokens = input_tokens
        sess.last_est_hit_tokens = est_hit
        sess.last_seen = now
        return sess

    def set_healthy(self, instance: int, healthy: bool) -> bool:
        """Mark an instance healthy or not; return True when this changed its state."""
        s = self.instances[instance]
        if s.healthy == healthy:
            return False
        s.healthy = healthy
        return True

    def counters_zero(self) -> bool:
        return all(
            s.num_requests == 0 and s.ongoing_tokens == 0 and s.pending_prefill_tokens == 0
            and s.ongoing_decode_tokens == 0 and s.decode_requests == 0
            for s in self.instances
        ) and self.in_flight == 0
