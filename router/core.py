"""The routing step, without I/O: request + cluster + policy -> a dispatched decision.

The live router and the offline simulator both call ``RoutingCore.route``; the live router
adds HTTP around it, the simulator adds virtual time. Holding the current policy here makes
a swap one reference assignment: a request keeps the policy object it was routed with.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from router.cluster import Cluster, ClusterView, Ticket
from router.policies import Policy
from router.request import RouteRequest


class NoInstance(RuntimeError):
    """No healthy instance can take the request."""


@dataclass(slots=True)
class PolicySlot:
    """The active policy and its version; replaced whole on every change."""

    policy: Policy
    version: int

    @property
    def label(self) -> str:
        return f"{self.policy.name}@{self.version}"


@dataclass(slots=True)
class Decision:
    request: RouteRequest
    slot: PolicySlot
    instance: int
    instance_name: str
    reason: str
    turn: int
    est_hit_tokens: int
    best_hit_tokens: int
    best_hit_instance: str
    new_prefill_tokens: int
    terms: list[dict[str, Any]]
    decision_us: float
    ts: float
    attempt: int = 1
    migrated_from: str | None = None
    ticket: Ticket | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # offload / admission fields
    recorded: bool = False  # the decision row has been written (Pipeline.sent or finish)
    index_source: str = "estimate"  # the chosen hit's source: exact (KV events) | estimate
    #: With ``index_source`` exact: the hit the router's own estimate gave the chosen instance
    #: (its drift from the events is est_hit_tokens - this); None when the hit is the estimate.
    estimate_hit_tokens: int | None = None
    view: ClusterView | None = None  # what the policy saw; kept until shadows have seen it too
    shadow: list[dict[str, Any]] | None = None  # each shadow policy's pick (router/shadow.py)

    def row(self, run_id: str) -> dict[str, Any]:
        """The ``decisions`` table row (store/schema.py)."""
        r = self.request
        row = {
            "run_id": run_id, "ts": self.ts, "request_id": r.request_id, "attempt": self.attempt,
            "session_id": r.session_id, "session_source": r.session_source, "turn": self.turn,
            "policy": self.slot.policy.name, "policy_version": self.slot.version,
            "instance": self.instance_name, "instance_index": self.instance, "reason": self.reason,
            "route_class": self.extra.get("route_class", r.route_class),
            "input_tokens": r.input_tokens, "token_source": r.token_source,
            "est_hit_tokens": self.est_hit_tokens, "best_hit_tokens": self.best_hit_tokens,
            "best_hit_instance": self.best_hit_instance,
            "new_prefill_tokens": self.new_prefill_tokens, "offload": 0,
            "migrated_from": self.migrated_from, "decision_us": round(self.decision_us, 2),
            "scores": self.terms, "index_source": self.index_source,
            "estimate_hit_tokens": self.estimate_hit_tokens, "shadows": self.shadow,
        }
        row.update(self.extra)
        return row

    def event(self) -> dict[str, Any]:
        """A compact form for the control API's decision ring and event stream."""
        r = self.request
        return {
            "ts": self.ts, "request_id": r.request_id, "attempt": self.attempt,
            "session": r.session_id, "turn": self.turn, "class": self.extra.get("route_class", r.route_class),
            "input_tokens": r.input_tokens, "token_source": r.token_source, "instance": self.instance_name,
            "reason": self.reason,
            "policy": self.slot.label, "est_hit": self.est_hit_tokens, "best_hit": self.best_hit_tokens,
            "best_hit_instance": self.best_hit_instance, "new_prefill": self.new_prefill_tokens,
            "migrated_from": self.migrated_from, "decision_us": round(self.decision_us, 2),
            "index_source": self.index_source, "estimate_hit": self.estimate_hit_tokens,
            "terms": self.terms, "shadow": self.shadow, **{k: v for k, v in self.extra.items() if k != "route_class"},
        }


class RoutingCore:
    def __init__(self, cluster: Cluster, policy: Policy, *, clock=time.time):
        self.cluster = cluster
        self.slot = PolicySlot(policy, 1)
        self.clock = clock
        #: router/replicas.Replicas: adds the peer replicas' in-flight load to every view; None alone
        self.peers: Any = None

    def swap(self, policy: Policy) -> PolicySlot:
        """Install a fully built policy; the version goes up by one."""
        self.slot = PolicySlot(policy, self.slot.version + 1)
        return self.slot

    def view(self, req: RouteRequest, exclude: tuple[int, ...] = (), *,
             lookahead: bool = False) -> ClusterView:
        view = self.cluster.view(req.blocks, req.input_tokens, req.session_id,
                                 exact=req.token_source != "text_approx", lookahead=lookahead)
        if exclude:
            view.candidates = [c for c in view.candidates if c.index not in exclude]
        if self.peers is not None:
            self.peers.apply(view)
        return view

    def decide(self, req: RouteRequest, *, exclude: tuple[int, ...] = (), attempt: int = 1,
               reason_override: str | None = None, lookahead: bool = False) -> Decision:
        """Pick an instance (no counters change). Raises NoInstance when none is healthy.
        ``lookahead`` builds the view's lookahead even if the policy does not ask for it (a
        shadow policy that does will read the same view)."""
        slot = self.slot
        t0 = time.perf_counter()
        view = self.view(req, exclude, lookahead=lookahead or slot.policy.needs_lookahead)
        if not view.candidates:
            raise NoInstance("no healthy instance available")
        pick = slot.policy.pick(req, view)
        elapsed_us = (time.perf_counter() - t0) * 1e6
        if lookahead and view.lookahead is not None:
            # built for a shadow that may read it after dispatch (deferred): fix it now
            view.lookahead.freeze([c.index for c in view.candidates])
        if pick.uses_rr:
            self.cluster.rr_counter += 1
        hits = view.hits
        best = max(range(len(hits)), key=hits.__getitem__)
        names = self.cluster.instances
        est = hits[pick.index]
        source = self.cluster.index_source(pick.index, exact=req.token_source != "text_approx")
        estimate = view.estimate_hits[pick.index] if source == "exact" and view.estimate_hits else None
        return Decision(
            request=req, slot=slot, instance=pick.index, instance_name=names[pick.index].name,
            reason=reason_override or pick.reason, turn=view.session_turn, est_hit_tokens=est,
            best_hit_tokens=hits[best], best_hit_instance=names[best].name,
            new_prefill_tokens=max(0, req.input_tokens - est), terms=pick.terms,
            decision_us=elapsed_us, ts=self.clock(), attempt=attempt,
            migrated_from=names[pick.migrated_from].name if pick.migrated_from is not None else None,
            index_source=source, estimate_hit_tokens=estimate, view=view,
            extra={} if self.peers is None else {"replica_view": self.peers.mode},
        )

    def dispatch(self, d: Decision, *, new_turn: bool = True, arrival: float | None = None) -> Ticket:
        """Charge the chosen instance and bind the session: the request has started.

        ``new_turn`` is False for a retry, which is the same turn on another instance;
        ``arrival`` the request's receipt (``Cluster.bind_session``).
        """
        r = d.request
        d.ticket = self.cluster.dispatch(d.instance, r.input_tokens, d.est_hit_tokens, r.blocks,
                                         session_id=r.session_id, exact=r.token_source != "text_approx")
        self.cluster.bind_session(r.session_id, d.instance, r.input_tokens, d.est_hit_tokens,
                                  new_turn=new_turn, arrival=arrival)
        if self.peers is not None:  # router replicas share the session's record (router/replica_sessions.py)
            self.peers.bound(r.session_id, d.instance, r.input_tokens, d.est_hit_tokens, new_turn, arrival)
        return d.ticket

    def route(self, req: RouteRequest, **kw) -> Decision:
        d = self.decide(req, **kw)
        self.dispatch(d)
        return d
