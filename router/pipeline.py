"""The request pipeline's books: tickets, the admission queue, decision and outcome records.

No sockets, no HTTP types, no event loop. Its methods are the steps of a request's life
(receive, route, admit, sent, prefill_done, first_token, finish, amend, abandon); the ORDER
of those steps, the retry and the offload's legs are router/lifecycle.py's, which both
drivers follow: ``kvtop route`` (router/proxy.py) over real HTTP with wall time, ``kvtop
simulate`` (kvtop/simulate.py) in virtual time. Both inject the clock, so every latency
counts from ONE receive time per request, the client's view: the admission wait and the
offload prefill leg are inside TTFT and E2E, and are also recorded on their own.

Every path releases every ticket exactly once; tests assert the counters return to zero
(tests/test_lifecycle_invariant.py, over every order of events).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from router.admission import AdmissionQueue
from router.classes import HEAVY_COLO
from router.cluster import Cluster, Ticket
from router.core import Decision, RoutingCore
from router.features import Features
from router.offload import PREFILL_FAILED, decide_offload, loads
from router.policies.base import RETRY
from router.priority import SessionOrder, priority_for
from router.request import RouteRequest

#: Outcome statuses. ``client_gone`` says nothing about the instance; the others except ok do.
OK, ERROR, UPSTREAM_ERROR, TIMEOUT, CLIENT_GONE = "ok", "error", "upstream_error", "timeout", "client_gone"

PREFILL, SERVE = "prefill", "serve"


@dataclass(slots=True)
class Leg:
    """One upstream call the driver must make: ``prefill`` on P (offload), or ``serve``."""

    kind: str
    instance: int
    ticket: Ticket


@dataclass(slots=True)
class Outcome:
    """How one attempt ended. Latencies count from the router's receipt of the request."""

    status: str
    stream: int
    t_recv: float
    t_done: float
    http_status: int | None = None
    error: str | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    tpot_ms: float | None = None
    output_tokens: int | None = None
    delivered_hit_tokens: int | None = None
    t_first_token: float | None = None
    admission_wait_ms: float | None = None
    prefill_leg_ms: float | None = None

    def row(self, d: Decision, run_id: str) -> dict[str, Any]:
        """The ``outcomes`` table row (store/schema.py), with the decision columns it repeats."""
        r = d.request
        return {
            "run_id": run_id, "ts": self.t_done, "request_id": r.request_id, "attempt": d.attempt,
            "instance": d.instance_name, "stream": self.stream, "status": self.status,
            "http_status": self.http_status, "error": self.error, "ttft_ms": self.ttft_ms,
            "e2e_ms": self.e2e_ms, "tpot_ms": self.tpot_ms, "output_tokens": self.output_tokens,
            "delivered_hit_tokens": self.delivered_hit_tokens, "t_recv": self.t_recv,
            "t_first_token": self.t_first_token, "t_done": self.t_done,
            "admission_wait_ms": self.admission_wait_ms, "prefill_leg_ms": self.prefill_leg_ms,
            "session_id": r.session_id, "turn": d.turn, "policy": d.slot.policy.name,
            "policy_version": d.slot.version, "route_class": d.extra.get("route_class", r.route_class),
            "input_tokens": r.input_tokens, "est_hit_tokens": d.est_hit_tokens,
        }


class Sink(Protocol):
    """Where records go: SQLite + event stream + metrics (live), a result list (offline)."""

    def decision(self, d: Decision) -> None: ...

    def outcome(self, d: Decision, o: Outcome) -> None: ...


class Flow:
    """One client request inside the pipeline, across its attempts and legs."""

    __slots__ = ("request", "t_recv", "decision", "legs", "waiting", "wait_since",
                 "wait_ms", "t_prefill_sent", "t_prefill_done", "t_first", "first", "done", "waiter",
                 "held", "pinned")

    def __init__(self, request: RouteRequest, t_recv: float):
        self.request = request
        self.t_recv = t_recv
        self.decision: Decision | None = None
        self.legs: list[Leg] = []  # the current attempt's legs, the next one first
        self.waiting: Ticket | None = None  # the ticket queued at an admission gate
        self.wait_since = 0.0
        self.wait_ms = 0.0  # admission wait, summed over the legs of this attempt
        self.t_prefill_sent: float | None = None
        self.t_prefill_done: float | None = None
        self.t_first: float | None = None
        self.first: Decision | None = None  # attempt 1's decision, once a retry exists
        self.done = False  # the current attempt has its outcome
        self.waiter: Any = None  # the driver's handle for on_admit (a future, an event id)
        #: Rows due while the request is still being counted (``Pipeline.amend``), in order:
        #: (decision, None) for a decision row, (decision, outcome) for an outcome row.
        self.held: list[tuple[Decision, Outcome | None]] = []
        self.pinned: tuple[int, ...] = ()  # instances it must never go to (router/lifecycle.py)

    @property
    def leg(self) -> Leg | None:
        return self.legs[0] if self.legs else None


class Pipeline:
    """The request lifecycle around RoutingCore; shared by the live router and the simulator."""

    def __init__(self, core: RoutingCore, features: Callable[[], Features], sink: Sink, *,
                 clock: Callable[[], float] = time.time,
                 on_admit: Callable[[Flow], None] | None = None, shadows: Any = None,
                 defer: Callable[[Callable[[], None]], Any] | None = None,
                 background: Callable[[Callable[[], bool]], Any] | None = None):
        self.core = core
        self.features = features  # () -> the current Features (a live swap applies at once)
        self.sink = sink
        self.clock = clock
        self.on_admit = on_admit or (lambda flow: None)
        self.queue = AdmissionQueue(len(core.cluster.instances))
        #: Shadow policies (router/shadow.py), asked after the decision row is due; ``defer``
        #: bounds how long that may wait for the attempt to end (live: 50 ms, batched; offline:
        #: no wait), so the picks run after the client's answer, off its path.
        self.shadows = shadows
        self.defer = defer
        #: Live: runs a step function (``fn() -> done``) once per turn of the event loop until it
        #: is done, so long bookkeeping never holds the loop in one piece; offline: None.
        self.background = background
        self._flows: dict[int, Flow] = {}  # id(ticket) -> flow, for tickets at an admission gate
        self.session_order = SessionOrder()  # the priority feature's session ranks (router/priority.py)

    @property
    def cluster(self) -> Cluster:
        return self.core.cluster

    # -- receive and decide ------------------------------------------------------------
    def receive(self, req: RouteRequest, t_recv: float | None = None) -> Flow:
        return Flow(req, self.clock() if t_recv is None else t_recv)

    def route(self, flow: Flow, *, exclude: tuple[int, ...] = ()) -> Leg:
        """Decide (attempt 1, or a retry after ``retry``), plan the offload, charge the tickets.

        Raises NoInstance (nothing charged) when no healthy instance is left."""
        attempt = 1 if flow.decision is None else flow.decision.attempt + 1
        shadows = self.shadows
        d = self.core.decide(flow.request, exclude=exclude, attempt=attempt,
                             lookahead=shadows is not None and shadows.needs_lookahead,
                             reason_override=RETRY if attempt > 1 else None)
        d.extra["t_proxy_recv"] = flow.t_recv
        if flow.first is not None:
            d.turn = flow.first.turn
        flow.decision = d
        flow.done = False
        flow.wait_ms = 0.0
        flow.t_prefill_sent = flow.t_prefill_done = None
        feats = self.features()
        cluster = self.cluster
        off = None
        if attempt == 1 and feats.offload_mode != "off":
            t0 = time.perf_counter()
            cands = [c for c in loads(cluster) if c.index not in exclude or c.index == d.instance]
            off = decide_offload(d.instance, d.new_prefill_tokens, cands, feats.knobs)
            d.decision_us += (time.perf_counter() - t0) * 1e6
            d.extra["offload_reason"] = off.reason
            if off.route_class:
                d.extra["route_class"] = off.route_class
            if off.prefill_instance is not None:
                d.extra["prefill_instance"] = cluster.instances[off.prefill_instance].name
        self.core.dispatch(d, new_turn=attempt == 1, arrival=flow.t_recv)
        if feats.knobs.get("priority", "off") != "off":  # vLLM's priority for the request (router/priority.py)
            d.extra["priority"] = priority_for(feats.knobs["priority"], d, self.session_order)
        serve = Leg(SERVE, d.instance, d.ticket)
        if off is None or not off.offload:
            flow.legs = [serve]
            return serve
        # Elastic P2P: P prefills (a prefill-only ticket), D decodes and owes no prefill.
        req = flow.request
        p = off.prefill_instance
        exact = req.token_source != "text_approx"
        p_hit = cluster.hits(req.blocks, req.input_tokens, exact=exact)[p]
        p_ticket = cluster.dispatch(p, req.input_tokens, p_hit, req.blocks, decode=False, exact=exact)
        self._set_new_prefill(d.ticket, 0)
        d.extra["offload"] = 1
        flow.legs = [Leg(PREFILL, p, p_ticket), serve]
        return flow.legs[0]

    def retry(self, flow: Flow) -> None:
        """Attempt 1 failed before any byte reached the client: the next ``route`` is a retry."""
        if flow.first is None:
            flow.first = flow.decision

    # -- admission ---------------------------------------------------------------------
    def admit(self, flow: Flow) -> bool:
        """May the current leg go upstream now? False: it waits; ``on_admit(flow)`` says when."""
        leg = flow.leg
        feats = self.features()
        if feats.admission == "off" or leg.ticket.new_prefill <= 0:
            return True
        key = id(leg.ticket)
        self._flows[key] = flow
        flow.waiting = leg.ticket
        flow.wait_since = self.clock()
        # in the order vLLM's priority scheduler would serve it (the priority feature's value;
        # 0 without it, or where the client set its own)
        self.queue.enqueue(leg.instance, key, leg.ticket.new_prefill,
                           flow.decision.extra.get("priority") or 0)
        self._pump(leg.instance, notify=flow)
        return flow.waiting is None

    def _pump(self, instance: int, notify: Flow | None = None) -> None:
        now = self.clock()
        for key in self.queue.pump(instance, self.features().knobs):
            flow = self._flows.pop(key, None)
            if flow is None:
                continue
            flow.wait_ms += (now - flow.wait_since) * 1000
            flow.waiting = None
            if flow is not notify:
                self.on_admit(flow)

    def pump_all(self) -> None:
        """Re-evaluate every queue (after a knob change: a larger budget lets waiters through)."""
        for i in range(len(self.queue.waiting)):
            self._pump(i)

    def _prefill_over(self, t: Ticket) -> None:
        """A ticket reached its first token or ended: its gate may admit the next ones."""
        key = id(t)
        self._flows.pop(key, None)
        if self.queue.waiting[t.instance] or key in self.queue.admitted[t.instance]:
            self.queue.remove(t.instance, key)
            self._pump(t.instance)

    # -- legs --------------------------------------------------------------------------
    def sent(self, flow: Flow) -> None:
        """The current leg is on its way upstream. The decision row is written once, when the
        serve leg goes (so serializing it overlaps the backend's work, and an offload's row
        says how its prefill leg ended)."""
        d = flow.decision
        leg = flow.leg
        # The dispatch left its prefix-index insert pending (router/prefix_index.py); any read
        # of the index applies it first, so when it runs changes no decision. Live it starts on
        # the loop's next turn, in steps; a request still being counted (routed early) waits for
        # its count (``amend``: one insert of its whole chain, not two), its answer (``finish``)
        # or the deferred work (at most 50 ms), whichever is first. Offline it runs now.
        if flow.request.counting is not None and self.defer is not None:
            self.defer(self._apply_index)
        else:
            self._apply_index()
        if leg.kind == PREFILL:
            flow.t_prefill_sent = self.clock()
            d.extra["t_prefill_sent"] = flow.t_prefill_sent
        elif not d.recorded:
            d.extra["admission_wait_ms"] = flow.wait_ms
            if flow.request.counting is not None:  # its row says the count: it waits for ``amend``
                d.recorded = True
                flow.held.append((d, None))
            else:
                self._record_decision(d, defer=True)

    def prefill_done(self, flow: Flow, params: dict[str, Any] | None) -> Leg:
        """P answered with its ``kv_transfer_params`` (or failed: None). Returns the serve leg;
        after a failure D prefills itself and may have to pass its own admission gate."""
        d = flow.decision
        p_leg = flow.legs.pop(0)
        flow.t_prefill_done = self.clock()
        d.extra["t_prefill_done"] = flow.t_prefill_done
        if params is not None:
            self._end_prefill(p_leg.ticket, observed=True)
            self._finish_ticket(p_leg.ticket)
        else:
            self._finish_ticket(p_leg.ticket, error=True)
            self._set_new_prefill(d.ticket, d.new_prefill_tokens)
            d.extra.update(offload=0, offload_reason=PREFILL_FAILED, route_class=HEAVY_COLO)
        return flow.leg

    def first_token(self, flow: Flow, *, observed: bool = True) -> None:
        """The answer's first token: the instance's prefill is over. ``observed`` is False for a
        non-streaming answer, whose first token the router cannot see (its TTFT stays unknown)."""
        if observed and flow.t_first is None:
            flow.t_first = self.clock()
        leg = flow.leg
        if leg is not None:
            self._end_prefill(leg.ticket, observed=observed)

    def finish(self, flow: Flow, status: str, *, http_status: int | None = None, error: str | None = None,
               output_tokens: int | None = None, cached_tokens: int | None = None,
               stream: bool | None = None) -> Outcome | None:
        """End the current attempt: release what it still holds and record its outcome.
        Once per attempt: a second call (an abandon after the finish) changes nothing."""
        if flow.done:
            return None
        flow.done = True
        now = self.clock()
        d = flow.decision
        for leg in flow.legs:
            self._finish_ticket(leg.ticket, error=status not in (OK, CLIENT_GONE))
        flow.legs = []
        if flow.waiting is not None:
            self._flows.pop(id(flow.waiting), None)
            flow.waiting = None
        counting = flow.request.counting is not None
        if not counting:  # the answer is out: nobody waits for the loop on this request
            self._apply_index()
        if not d.recorded:  # it never went upstream (refused, or the client left while queued)
            d.extra["admission_wait_ms"] = flow.wait_ms
            if counting:
                d.recorded = True
                flow.held.append((d, None))
            else:
                self._record_decision(d)
        elif d.view is not None and not counting:  # its shadow picks were waiting: now, before its outcome
            self._shadow_and_record(d)
        o = Outcome(status=status, stream=int(flow.request.stream if stream is None else stream),
                    t_recv=flow.t_recv, t_done=now, http_status=http_status, error=error,
                    output_tokens=output_tokens, delivered_hit_tokens=cached_tokens,
                    admission_wait_ms=flow.wait_ms)
        if flow.t_prefill_sent is not None and flow.t_prefill_done is not None:
            o.prefill_leg_ms = (flow.t_prefill_done - flow.t_prefill_sent) * 1000
        if status == OK:
            o.e2e_ms = (now - flow.t_recv) * 1000
            if flow.t_first is not None:
                o.t_first_token = flow.t_first
                o.ttft_ms = (flow.t_first - flow.t_recv) * 1000
                if output_tokens and output_tokens > 1:
                    o.tpot_ms = (now - flow.t_first) * 1000 / (output_tokens - 1)
        else:
            o.e2e_ms = (now - flow.t_recv) * 1000
        if counting:
            flow.held.append((d, o))
        else:
            self.sink.outcome(d, o)
        return o

    def amend(self, flow: Flow, counted: RouteRequest | None) -> None:
        """The request was routed on an estimate (``RouteRequest.counting``: a returning turn
        sent on before its new text was tokenized) and is counted now: ``counted`` (None if the
        count failed: the estimate stays). Its tickets are charged the counted size, its
        decisions say both figures (``input_tokens`` counted, ``estimated_input_tokens`` what
        the policy saw), and the rows held for the count are written, in order. Once per
        request; any time in its life, before or after ``finish``."""
        req = flow.request
        if req.counting is None:
            return
        req.counting = None
        estimate = req.input_tokens
        if counted is not None:
            req.input_tokens = counted.input_tokens
            req.blocks = counted.blocks
            req.tail_estimate = 0
        first = flow.first if flow.first is not flow.decision else None
        for d in (x for x in (first, flow.decision) if x is not None):
            d.extra["estimated_input_tokens"] = estimate
            d.new_prefill_tokens = max(0, req.input_tokens - d.est_hit_tokens)
            if counted is not None and d.ticket is not None:  # a failed first attempt: totals only
                self.cluster.amend(d.ticket, req.input_tokens, req.blocks, session_id=req.session_id,
                                   cache_blocks=d is flow.decision)
        if flow.done:  # the answer is out (see ``sent``)
            self._apply_index()
        held, flow.held = flow.held, []
        for k, (d, o) in enumerate(held):
            if o is None:
                # an outcome row of the same attempt follows: write the decision first, now
                last = not any(h[0] is d and h[1] is not None for h in held[k + 1:])
                self._record_decision(d, defer=last)
            else:
                self.sink.outcome(d, o)

    def abandon(self, flow: Flow, where: str) -> Outcome | None:
        """The client left: end the attempt as ``client_gone``, whatever it was doing."""
        return self.finish(flow, CLIENT_GONE, error=f"client disconnected {where}")

    # -- bookkeeping -------------------------------------------------------------------
    def _end_prefill(self, t: Ticket, *, observed: bool) -> None:
        """A ticket's prefill is over (its first token, or P's answer): the books move it to
        decode and its admission gate forgets it, together. (P's answer once did only the
        first: its entry stayed admitted and held P's gate shut for good.)"""
        if t.phase == "prefill":
            self.cluster.first_token(t, observed=observed)
            self._prefill_over(t)

    def _finish_ticket(self, t: Ticket, *, error: bool = False) -> None:
        if t.phase == "done":
            return
        was_prefill = t.phase == "prefill"
        self.cluster.finish(t, error=error)
        if was_prefill:
            self._prefill_over(t)

    def _apply_index(self) -> None:
        """Apply the prefix index's pending insert: live, a step per turn of the loop (a cold
        215k-token turn's insert held the loop 7-20 ms in one piece, and /health and small
        requests waited behind it); offline, now."""
        index = self.cluster.index
        if index.settled:  # the usual case at a request's end: nothing to schedule
            return
        if self.background is not None:
            self.background(index.flush_step)
        else:
            index.flush()

    def _set_new_prefill(self, t: Ticket, new_prefill: int) -> None:
        """Change what a not-yet-prefilled ticket owes: 0 when the KV arrives from P, back to
        the full amount when P failed and D prefills itself. The ticket still releases exactly."""
        assert t.phase == "prefill"
        self.cluster.instances[t.instance].pending_prefill_tokens += new_prefill - t.new_prefill
        t.new_prefill = new_prefill

    def _record_decision(self, d: Decision, *, defer: bool = False) -> None:
        """Write the decision once. With shadows on, they pick first, on the decision's own
        view; ``defer`` (the request went upstream) lets that wait until the attempt ends
        (``finish``, after the client has its answer) or the driver's ``defer`` fires,
        whichever comes first."""
        d.recorded = True
        shadows = self.shadows
        if shadows is None or not shadows.active or d.view is None:
            d.view = None
            self.sink.decision(d)
        elif defer and self.defer is not None:
            self.defer(lambda: self._shadow_and_record(d))
        else:
            self._shadow_and_record(d)

    def _shadow_and_record(self, d: Decision) -> None:
        view, d.view = d.view, None
        if view is None:  # already written (finish came first, or no shadows were on)
            return
        if self.shadows is not None and self.shadows.active:
            d.shadow = self.shadows.evaluate(d, view)
        self.sink.decision(d)

    def idle(self) -> bool:
        """Nothing in flight and nothing queued (the counters are then all zero)."""
        return self.cluster.counters_zero() and not any(self.queue.waiting) and not any(self.queue.admitted)
