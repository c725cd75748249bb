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
from typing import Any

from router.calibration import DEFAULT_PRIOR, Calibration, PrefillPrior
from router.exact_index import ExactIndex
from router.lookahead import Lookahead, SessionInfo
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
    sessions: int = 0  # sessions bound to the instance that the cluster holds


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
    decode_requests: int = 0  # requests decoding on i now
    prefill_tps: float = 0.0  # i's measured prefill rate (router/calibration.py); 0: no sample in the fleet yet


@dataclass(slots=True)
class ClusterView:
    """A policy's whole input besides the request: healthy candidates and session facts."""

    candidates: list[Candidate]
    input_tokens: int
    session_instance: int | None  # the session's bound instance, healthy or not
    session_turn: int  # the turn this request is (1 for a new session)
    rr_counter: int
    hits: list[int]  # estimated hit per instance index, healthy or not
    #: Filled only for a policy that asks (``needs_lookahead``); see ``Cluster.lookahead``.
    lookahead: "Lookahead | None" = None
    #: The router's own estimate (LRU model) per instance index, where ``hits`` came from KV
    #: events instead; None when every hit is the estimate (for the decision log's drift).
    estimate_hits: list[int] | None = None

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
    pinned: Sequence[int] = ()  # its blocks, held in the exact index's model until it finishes
    anon: int = 0  # blocks a text-hashed prefill will allocate, counted in the exact model until it ends
    session_id: str | None = None  # the session whose turn this is (None for a prefill-only leg)
    #: (new_prefill, input_tokens, T0 of them): the prior's seconds as the lookahead last
    #: computed them, reused while the sizes are those (every decision reads every ticket)
    prior_s: tuple[int, int, float] | None = None


class Cluster:
    def __init__(self, names: Sequence[str], *, block_size: int = 512,
                 capacity_blocks: int | Sequence[int] = 518, urls: Sequence[str] | None = None,
                 max_sessions: int = 200_000, clock=time.time,
                 prefill_prior: PrefillPrior = DEFAULT_PRIOR):
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
        #: Each instance's measured prefill speed (router/calibration.py), fed by first tokens.
        self.calibration = Calibration(len(names), prefill_prior)
        self._prefilling: list[dict[int, Ticket]] = [{} for _ in names]  # tickets before first token
        self.gap_sum = 0.0  # every session's gaps between turns, for sessions with none yet
        self.gaps = 0
        # The sessions bound to each instance, for the lookahead (``Lookahead.bound``): those
        # with a request in flight; the idle ones by last activity, the most recent last (a
        # session enters at its end when its last request ends, so the order is free); and per
        # turn count the sum of their last contexts, the prior-weighted sum ``settled`` reads.
        # Every session held is in exactly one of the first two of its instance's, unless the
        # lookahead aged it out; a session leaves them all when it moves or is forgotten.
        self._busy: list[dict[str, SessionInfo]] = [{} for _ in names]
        self._idle: list[OrderedDict[str, SessionInfo]] = [OrderedDict() for _ in names]
        self._prior_tokens: list[dict[int, int]] = [{} for _ in names]
        self.session_moves = 0  # moves of the sessions held, summed
        self.moved_sessions = 0  # sessions held that moved at least once
        #: Told of each own session request's end and amend (router/replica_sessions.py); None alone.
        self.session_listener: Any = None
        self._capacity_seen: list[int] = []  # index.capacity when _capacity_tokens was computed
        self._capacity_tokens: list[int] = []  # each instance's capacity in tokens, for the lookahead

    # -- what policies see ----------------------------------------------------------
    def hits(self, blocks: Sequence[int], input_tokens: int, *, exact: bool = True,
             drift: bool = False, estimates: list[int] | None = None) -> list[int]:
        """Estimated cached prefix tokens per instance, capped like the engine's hit.

        vLLM always recomputes the last token, so a hit never exceeds input - 1 rounded
        down to a whole block. Instances whose KV events flow (``exact.live_mask``) answer
        from the exact index instead of the estimate, unless ``exact`` is False (a prompt
        hashed from text, whose block hashes no engine event can match); ``drift`` records
        how far the estimate was from them. ``estimates``, when given and some hit came from
        the events, is filled with the estimate's hit per instance.
        """
        bs = self.block_size
        cap = max(0, (input_tokens - 1) // bs) * bs
        matched = self.index.match(blocks)
        ex = self.exact
        if exact and ex is not None and ex.live_mask:
            if estimates is not None:
                estimates[:] = [min(m * bs, cap) for m in matched]
            for i, m in ex.match(blocks, ex.live_mask, self.clock()).items():
                if m:
                    # The events say what the engine holds now; vLLM delivers what is still there
                    # when the request is scheduled, after the prefills queued ahead of it have
                    # evicted the oldest blocks of its free queue (docs/kv-events.md).
                    m = ex.survivors(i, blocks, m, self._queued_evictions(i))
                if drift:  # the estimate against the hit the decision uses
                    ex.record_drift(i, min(matched[i] * bs, cap), min(m * bs, cap), input_tokens)
                matched[i] = m
        return [min(m * bs, cap) for m in matched]

    def _queued_evictions(self, instance: int) -> int:
        """Blocks the prefills queued on ``instance`` will evict before a request routed there
        now is scheduled: the blocks of this router's requests in flight there that the engine
        has not reported holding (what they will still allocate), beyond the room it has beside
        what it holds (``capacity`` as the estimate counts it)."""
        return self.exact.queued_evictions(instance, self.index.capacity[instance])

    def index_source(self, instance: int, *, exact: bool = True) -> str:
        """Where ``instance``'s hit comes from: ``exact`` (its KV events) or ``estimate``."""
        ex = self.exact
        return "exact" if exact and ex is not None and ex.live_mask >> instance & 1 else "estimate"

    def view(self, blocks: Sequence[int], input_tokens: int, session_id: str | None, *,
             exact: bool = True, lookahead: bool = False) -> ClusterView:
        estimates: list[int] = []
        hits = self.hits(blocks, input_tokens, exact=exact, drift=True, estimates=estimates)
        cal = self.calibration
        rates = cal.rates()[1] if cal.measured else None  # rates[i] is cal.tps(i)
        cands = [
            Candidate(s.index, s.name, hits[s.index], max(0, input_tokens - hits[s.index]),
                      s.pending_prefill_tokens, s.num_requests, s.ongoing_decode_tokens,
                      s.decode_requests, rates[s.index] if rates is not None else 0.0)
            for s in self.instances if s.healthy
        ]
        sess = self.sessions.get(session_id) if session_id is not None else None
        view = ClusterView(cands, input_tokens, sess.instance if sess else None,
                           (sess.turns + 1) if sess else 1, self.rr_counter, hits,
                           estimate_hits=estimates or None)
        if lookahead:
            view.lookahead = self.lookahead(cands, len(blocks), session_id, sess, hits)
        return view

    def lookahead(self, cands: Sequence[Candidate], num_blocks: int, session_id: str | None,
                  sess: SessionInfo | None, hits: Sequence[int] | None = None) -> Lookahead:
        """The facts a future-aware policy needs beyond the counters (see ``Lookahead``): the
        queued seconds now, the evictions and bound sessions when asked. ``hits``: the hit
        per instance index the candidates took theirs from (read from them when None).

        Per decision, so written for this interpreter: T(q, h) as scale x T0(q, h) with the
        scale read once per instance (``Calibration.seconds`` is that product), and no
        min()/max() calls (each costs more than the comparison)."""
        now = self.clock()
        cal = self.calibration
        seconds = cal.prior.seconds
        prefilling = self._prefilling
        wait: dict[int, float] = {}
        scales = None
        for c in cands:
            i = c.index
            tickets = prefilling[i]
            if tickets:
                if scales is None:
                    scales = cal.rates()[0]  # scales[i] is cal.scale(i)
                scale = scales[i]
                total = 0.0
                head = None
                head_s = 0.0
                for t in tickets.values():
                    q, size, memo = t.new_prefill, t.input_tokens, t.prior_s
                    if memo is None or memo[0] != q or memo[1] != size:
                        memo = t.prior_s = (q, size, seconds(q, size - q))
                    t_s = scale * memo[2]  # cal.seconds(i, q, size - q)
                    total += t_s
                    if head is None or t.started < head.started:
                        head, head_s = t, t_s
                # the head has been served since it arrived or the last first token, whichever is later
                last = cal.last_first(i)
                done = now - (last if last > head.started else head.started)
                if 0.0 > done:
                    done = 0.0
                total -= head_s if head_s < done else done  # min(max(done, 0.0), head_s)
                wait[i] = 0.0 if 0.0 > total else total  # max(total, 0.0)
            else:
                wait[i] = 0.0
        fleet_gap = self.gap_sum / self.gaps if self.gaps else None
        capacity = self.index.capacity
        if capacity != self._capacity_seen:  # the token capacities change only with the blocks'
            self._capacity_seen = list(capacity)
            self._capacity_tokens = [n * self.block_size for n in capacity]
        return Lookahead(self, now, wait, num_blocks, {c.index: c.hit for c in cands} if hits is None else hits,
                         session_id, sess, fleet_gap, self._capacity_tokens)

    # -- lifecycle ------------------------------------------------------------------
    def dispatch(self, instance: int, input_tokens: int, est_hit: int, blocks: Sequence[int],
                 *, decode: bool = True, cache_blocks: bool = True,
                 session_id: str | None = None, exact: bool = True) -> Ticket:
        """Charge ``instance`` for a request and record its blocks in the estimated cache
        (as ``session_id``'s, for the lookahead's eviction estimate), and, when they are hashes
        of token ids (``exact``; not a prompt hashed from text, which no engine event can
        match), in the exact index's speculation and free-queue model until it finishes."""
        s = self.instances[instance]
        new_prefill = max(0, input_tokens - est_hit)
        s.num_requests += 1
        s.ongoing_tokens += input_tokens
        s.pending_prefill_tokens += new_prefill
        s.routed_total += 1
        s.input_tokens_total += input_tokens
        s.est_hit_tokens_total += est_hit
        if cache_blocks:
            self.index.insert(instance, blocks, session_id)
        pinned: Sequence[int] = ()
        ex = self.exact
        if ex is not None and not ex.published_mask >> instance & 1:
            ex = None  # an instance without KV events: nothing of it is modelled
        if cache_blocks and exact and ex is not None:
            ex.speculate(instance, blocks, self.clock())
            ex.pin(instance, blocks)
            pinned = blocks
        anon = 0
        if cache_blocks and not exact and ex is not None and new_prefill:
            # no hashes the engine will report, but its prefill still allocates (and evicts)
            anon = -(-new_prefill // self.block_size)
            ex.reserve(instance, anon)
        self.in_flight += 1
        t = Ticket(instance, input_tokens, new_prefill, decode, "prefill", self.clock(), pinned,
                   anon, session_id if decode else None)
        self._prefilling[instance][id(t)] = t
        return t

    def first_token(self, t: Ticket, *, observed: bool = True) -> None:
        """The ticket's prefill is over. ``observed``: the router saw the first token when it
        came (a streamed answer), so its time measures the instance's prefill speed."""
        if t.phase != "prefill":
            return
        if observed:
            self.calibration.observe(t.instance, t.new_prefill, t.input_tokens - t.new_prefill,
                                     t.started, self.clock())
        self._prefilling[t.instance].pop(id(t), None)
        if t.anon:  # its blocks are allocated now; the engine reports them as held
            self.exact.reserve(t.instance, -t.anon)
            t.anon = 0
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
            self._prefilling[t.instance].pop(id(t), None)
            if t.anon:
                self.exact.reserve(t.instance, -t.anon)
                t.anon = 0
        elif t.decode:
            s.ongoing_decode_tokens -= t.input_tokens
            s.decode_requests -= 1
        s.num_requests -= 1
        s.ongoing_tokens -= t.input_tokens
        if t.pinned and self.exact is not None:
            if error:  # what the engine stored before the failure, its events say
                self.exact.unspeculate(t.instance, t.pinned)
            self.exact.release(t.instance, t.pinned)
            t.pinned = ()
        if error:
            s.errors_total += 1
        if t.session_id is not None:  # its session may send its next turn from now
            self.session_done(t.session_id)
            if self.session_listener is not None:  # router replicas: tell the peers (router/replica_sessions.py)
                self.session_listener.done(t.session_id)
        t.phase = "done"
        self.in_flight -= 1

    def session_done(self, session_id: str, at: float | None = None) -> None:
        """One of the session's requests ended (``at``, now by default): it may send its next
        turn from then. Its own ticket's end (``finish``) or a peer replica's word of one."""
        sess = self.sessions.get(session_id)
        if sess is not None and sess.in_flight > 0:
            sess.in_flight -= 1
            sess.last_done = self.clock() if at is None else max(at, sess.last_done)
            if sess.in_flight == 0:
                sess.fleet_s += max(0.0, sess.last_done - sess.busy_since)  # a busy period closes
                i = sess.instance
                self._busy[i].pop(sess.session_id, None)
                self._idle[i][sess.session_id] = sess  # the most recently active now

    def amend(self, t: Ticket, input_tokens: int, blocks: Sequence[int], *,
              session_id: str | None = None, cache_blocks: bool = True) -> None:
        """A request dispatched on an estimate of its size (a returning turn routed before its
        new text was tokenized) is counted now: ``input_tokens`` and ``blocks`` replace what
        ``dispatch`` charged, which were its shared prefix (exact) and that estimate. The
        charge moves by the difference (all of it new prefill: the hit was the prefix's), the
        new blocks are recorded where the prefix's were, and the totals say the counted figure.
        A ticket that already finished releases nothing more: only the totals and the cache
        records change (``cache_blocks`` False: not the cache records, for an attempt that
        failed before its retry)."""
        s = self.instances[t.instance]
        delta = input_tokens - t.input_tokens
        s.input_tokens_total += delta
        if session_id is not None:
            self.amend_session(session_id, input_tokens, delta)
            if self.session_listener is not None:
                self.session_listener.amended(session_id, input_tokens)
        if cache_blocks:
            self.index.extend(t.instance, blocks, session_id)
        if t.phase == "done":
            t.input_tokens = input_tokens
            return
        s.ongoing_tokens += delta
        if t.phase == "prefill":
            new_prefill = max(0, t.new_prefill + delta)
            s.pending_prefill_tokens += new_prefill - t.new_prefill
            t.new_prefill = new_prefill
        elif t.decode:
            s.ongoing_decode_tokens += delta
        t.input_tokens = input_tokens
        held = len(t.pinned)
        ex = self.exact
        if ex is not None and cache_blocks and held and len(blocks) > held:
            more = blocks[held:]
            ex.speculate(t.instance, more, self.clock())
            ex.pin(t.instance, more)
            t.pinned = blocks

    # -- sessions -------------------------------------------------------------------
    def amend_session(self, session_id: str, input_tokens: int, delta: int | None = None) -> None:
        """The session's last request was counted at ``input_tokens`` (``amend``, or a peer
        replica's word of one); ``delta`` its change to the session's total (from the last
        context by default)."""
        sess = self.sessions.get(session_id)
        if sess is not None:
            sess.total_input_tokens += input_tokens - sess.last_input_tokens if delta is None else delta
            self._weigh(sess, -1)
            sess.last_input_tokens = input_tokens
            self._weigh(sess, 1)

    def bind_session(self, session_id: str, instance: int, input_tokens: int, est_hit: int,
                     *, new_turn: bool = True, arrival: float | None = None,
                     at: float | None = None) -> SessionInfo:
        """Record a session's request on ``instance`` (dispatched now): its turn, its gap since
        its last answer, its move if it moved. The cluster holds at most ``max_sessions``
        records; past that the least recently active is forgotten (its next request is a first
        turn). A record is a fixed set of numbers: the memory per session is bounded.
        ``arrival``: the request's receipt (``t_recv``, before parsing and admission), from
        which its session's first_seen and busy time count, as in the log (store/sessions.py).
        ``at``: when it was dispatched, if not now (a peer replica's request, heard of later)."""
        now = self.clock() if at is None else at
        start = now if arrival is None else min(arrival, now)
        sess = self.sessions.get(session_id)
        if sess is None:
            sess = SessionInfo(session_id, instance, first_seen=start, bound_since=now)
            self.sessions[session_id] = sess
            self.instances[instance].sessions += 1
            if len(self.sessions) > self.max_sessions:
                self.forget_session(next(iter(self.sessions)))
        else:
            self.sessions.move_to_end(session_id)
            self._weigh(sess, -1)
            self._unlist(sess)
            if new_turn and sess.turns:
                gap = max(0.0, now - max(sess.last_seen, sess.last_done))  # its think time, not its service
                sess.gap_sum += gap
                sess.gaps += 1
                self.gap_sum += gap
                self.gaps += 1
            if sess.instance != instance:
                self.instances[sess.instance].sessions -= 1
                self.instances[instance].sessions += 1
                self.moved_sessions += sess.moves == 0
                self.session_moves += 1
                sess.instance = instance
                sess.bound_since = now
                sess.moves += 1
        if new_turn:
            sess.turns += 1
            sess.total_input_tokens += input_tokens
        sess.last_input_tokens = input_tokens
        sess.last_est_hit_tokens = est_hit
        sess.last_seen = now
        if sess.in_flight == 0:  # a busy period opens (after the last one's end: the union)
            sess.busy_since = max(start, sess.last_done)
        sess.in_flight += 1
        self._busy[instance][session_id] = sess
        self._weigh(sess, 1)
        return sess

    def forget_session(self, session_id: str) -> SessionInfo | None:
        """Drop a session's record and everything the lookahead keeps of it."""
        sess = self.sessions.pop(session_id, None)
        if sess is not None:
            self._weigh(sess, -1)
            self._unlist(sess)
            self.instances[sess.instance].sessions -= 1
            self.session_moves -= sess.moves
            self.moved_sessions -= sess.moves > 0
        return sess

    def _unlist(self, sess: SessionInfo) -> None:
        i, sid = sess.instance, sess.session_id
        if self._busy[i].pop(sid, None) is None:
            self._idle[i].pop(sid, None)

    def _weigh(self, sess: SessionInfo, sign: int) -> None:
        """Add (1) or take off (-1) the session's last context in its instance's sum for its
        turn count; called around every change of its instance, turns or context."""
        if not sess.turns:
            return
        sums = self._prior_tokens[sess.instance]
        left = sums.get(sess.turns, 0) + sign * sess.last_input_tokens
        if left or sign > 0:
            sums[sess.turns] = left
        else:
            del sums[sess.turns]

    def lookahead_held(self) -> int:
        """Sessions the lookahead may price one by one (in flight or idle and not aged out)."""
        return sum(len(b) + len(d) for b, d in zip(self._busy, self._idle))

    def add_instance(self, name: str, url: str = "", *, capacity_blocks: int, kv_events: bool = False) -> int:
        """A new instance, empty and idle (the fleet grew while it ran); returns its index.
        ``kv_events``: its engine publishes KV events (modelled in the exact index, if any)."""
        i = len(self.instances)
        self.index.add_instance(capacity_blocks)
        self.calibration.add_instance()
        if self.exact is not None:
            self.exact.add_instance(kv_events)
        self._prefilling.append({})
        self._busy.append({})
        self._idle.append(OrderedDict())
        self._prior_tokens.append({})
        self.instances.append(InstanceState(i, name, url))
        return i

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
        ) and self.in_flight == 0 and not any(self._prefilling)
