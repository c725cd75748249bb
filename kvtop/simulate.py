"""Offline: run a trace through routing policies over simulated engines, in virtual time.

The router's own code decides (RoutingCore, the policies, the Cluster accounting and the
prefix index, exactly as `kvtop route` runs them) and the simulated vLLM engine serves (the
same Engine class as `kvtop sim`), but no sockets and no clock: a discrete-event loop jumps
from one arrival or engine step to the next. For each policy it prints the seed table
(TTFT mean/p90, E2E mean/p90/p99, TPOT p90, APC, balance) and TTFT per class.

Fidelity trade-off, stated: engines cache in blocks of --engine-block-size tokens (default:
the trace's block size, e.g. 64 for Claude Code traces) instead of vLLM's 16, because trace
hash ids only identify blocks of that size and finer blocks would cost time for nothing.
The engine's KV capacity in tokens is kept the same.

``--from-db kvtop.db`` replays a recorded run instead of a trace (kvtop/whatif.py): its
arrivals, sessions, prompts' block chains and delivered output, under any policies, with the
time scale fitted from the run and a line saying how closely the policy that ran is reproduced.

Modes: open (each request at its trace arrival) or closed (a session's next turn is sent
its think time after the previous answer ended, as agents do; first turns at arrival).

The requests go through the router's own pipeline object (router/pipeline.py), the one
``kvtop route`` drives over HTTP: decide, offload plan, admission queue, first token,
finish, with TTFT and E2E counted from each request's arrival at the router. Router-level
features (router/features.py) come through ``--knob`` like policy knobs: ``offload_mode``
runs vLLM's disaggregated two-step in virtual time (P's engine runs the prefill-only
request; its KV params then go to D's engine, which waits the profile's transfer time and
holds the blocks); ``admission=fifo|pack`` queues requests in the router before they reach
an engine, as the live router does.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from hashlib import blake2b
from itertools import islice
from pathlib import Path
from typing import Any

from kvtop.cli import CliError
from router.blocks import regroup_block_ids
from router.classes import route_class
from router.build import build_router
from router.config import KnobError, parse_knob_args
from router.features import FEATURE_KNOBS
from router.lifecycle import (Admitted, Arrived, ClientGone, Done, Ended, FirstToken, LegFailed, LegSent,
                              PrefillAnswered, Refuse, Send)
from router.pipeline import ERROR, OK, PREFILL, UPSTREAM_ERROR, Flow
from router.policies import DEFAULT_POLICY
from router.request import RouteRequest
from router.settings import Settings, settings_for
from store.results import RequestResult


@dataclass
class SimConfig:
    instances: int = 8
    profile: Any = "h20"  # a profile name or file, or a Profile (kvtop/whatif.py fits one)
    router_block_size: int = 512
    engine_block_size: int | None = None  # default: the trace's block size
    mode: str = "open"
    knobs: dict[str, Any] = field(default_factory=dict)
    max_output_tokens: int | None = None
    admission: str | None = None  # engine waiting-queue hook name (see router/admission.py)
    features: dict[str, Any] = field(default_factory=dict)  # router-level knobs (router/features.py)
    # Run-to-run timing noise of a live path: each engine request reaches its engine u later,
    # u uniform in +-path_jitter_s / 2 around the profile's frontend time, but never before the
    # router sent it (with a frontend time under path_jitter_s / 2, as the built-in profiles'
    # 0, the noise is partly or only a delay); u is a hash of path_seed and the request, the
    # same for every policy. 0 (either) is the noise-free path. kvtop/repeats.py sets the seed
    # to the replica, so replica 0 stays as traced.
    path_jitter_s: float = 0.0
    path_seed: int = 0
    # the engines' --scheduling-policy (vLLM's fcfs or priority); the router's priority feature
    # sets each request's priority, which the engines then honour (kvtop/sim/engine.py)
    scheduling_policy: str = "fcfs"
    # the engines keep a finished request's KV pinned for this many engine seconds (0: vLLM's
    # plain LRU; a feature vLLM lacks, modelled to measure it: kvtop/sim/engine.py, docs/simulator.md)
    kv_pin_ttl_s: float = 0.0
    # which finished requests it pins: "all", or "continuing", only a turn its session follows
    # with another (what a client knows when its answer ends in a tool call: the API hint)
    kv_pin_scope: str = "all"
    # at most this share of an engine's blocks pinned; past it the oldest pins end early
    kv_pin_max_share: float = 1.0
    # fleet changes at their times (kvtop/fleet_events.py: add, cordon, drain, uncordon, remove,
    # fail), applied through the router's own fleet rules; every arm and replica gets the same
    fleet_events: tuple = ()


def _engine_factory(cfg: SimConfig, trace_block_size: int):
    """Engines with the profile's KV capacity in tokens, caching in blocks the trace can express."""
    from kvtop.sim.engine import Engine
    from kvtop.sim.profiles import get_profile

    prof = cfg.profile if not isinstance(cfg.profile, str) else get_profile(cfg.profile)
    ebs = cfg.engine_block_size or max(prof.block_size, trace_block_size)
    capacity_tokens = prof.num_gpu_blocks * prof.block_size
    admission = cfg.admission  # the engine's own waiting queue; the router's is the pipeline's
    if admission:
        from router.admission import engine_hook

        hook_knobs = {**FEATURE_KNOBS.validate(cfg.features), **cfg.knobs}

    def make_hook():  # one per engine: each keeps its own round count
        return engine_hook(admission, hook_knobs) if admission else None

    def make(i: int) -> Engine:
        return Engine(prof, block_size=ebs, num_gpu_blocks=capacity_tokens // ebs, engine_id=str(i),
                      admission=make_hook(), scheduling_policy=cfg.scheduling_policy,
                      kv_pin_ttl_s=cfg.kv_pin_ttl_s, kv_pin_max_share=cfg.kv_pin_max_share)

    return make, ebs, capacity_tokens


class _Results:
    """The pipeline's sink offline: one result record per outcome (the replay results format,
    so kvtop.seedtable reads it unchanged)."""

    def __init__(self, arm: str, decisions: list[dict[str, Any]] | None = None):
        self.arm = arm
        self.records: list[dict[str, Any]] = []
        self.decisions = decisions

    def decision(self, d) -> None:
        if self.decisions is not None:
            self.decisions.append(d.row("simulate"))

    def refused(self, r: RouteRequest, turn: int, t: float, error: str) -> None:
        """No instance could take it (nothing was charged, so no outcome row exists)."""
        self.records.append(RequestResult(
            request_id=r.request_id, session=r.session_id, turn=turn, arrival=t, input_tokens=r.input_tokens,
            output_tokens=0, status="error", error=error, route_class=route_class(r.input_tokens),
            arm=self.arm).as_record())

    def outcome(self, d, o) -> None:
        r = d.request
        ok = o.status == OK
        if d.attempt > 1:  # a retry: the request's record is its last attempt's (as the log's reports)
            self.records = [x for x in self.records if x["request_id"] != r.request_id]
        self.records.append(RequestResult(
            request_id=r.request_id, session=r.session_id, turn=d.turn, arrival=o.t_recv,
            input_tokens=r.input_tokens, output_tokens=o.output_tokens or 0, status=o.status,
            error=o.error, ttft_ms=o.ttft_ms, e2e_ms=o.e2e_ms if ok else None,
            tpot_ms=o.tpot_ms, cached_tokens=o.delivered_hit_tokens, instance=d.instance_name,
            route_class=d.extra.get("route_class", r.route_class),
            prefill_instance=d.extra.get("prefill_instance") if d.extra.get("offload") else None,
            admission_wait_ms=o.admission_wait_ms, prefill_leg_ms=o.prefill_leg_ms,
            arm=self.arm).as_record())


#: The cyclic GC's first threshold while a simulation runs. A run allocates millions of
#: containers that die young (block lists of ~1,000 ids, step results, events); at Python's
#: default of 700, a young collection came every few hundred of them and traversed the block
#: lists alive at that moment, id by id: 0.45 of round_robin's 11 CPU s on the agentic
#: benchmark trace (0.26 at 20,000; garbage held back is a few MB at most).
GC_YOUNG_THRESHOLD = 20_000


#: The lifecycle's events without fields, made once (frozen: one instance serves every request).
ARRIVED, ADMITTED, LEG_SENT, FIRST_TOKEN = Arrived(), Admitted(), LegSent(), FirstToken()

#: A step's end that comes before every other event (the next arrival and the heap's first) is
#: handled at once, not pushed and popped: a heap round trip and a turn of the loop less for
#: 28-34% of a run's step ends (round_robin, leastwork; the agentic trace's first 3,000). The order of events is the heap's (tests/test_simulate_event_order.py
#: compares runs with it off).
TAKE_STEP_END_AT_ONCE = True


def simulate(requests: Sequence[Any], policy: str, cfg: SimConfig, *,
             engines: Sequence[Any] | None = None, departures: dict[int, float] | None = None,
             decisions: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Run ``requests`` (TraceRequest-like) through ``policy``; return result records.

    The router's pipeline (router/pipeline.py) routes, plans offloads, queues admission and
    keeps the books, exactly as in ``kvtop route``; only the clock is virtual and the
    upstream calls are engine requests. ``engines`` replaces the model engines (one per
    instance, the Engine interface; a test's scripted engines), and ``departures`` makes the
    client of trace request k leave ``departures[k]`` seconds after it arrived; ``decisions``,
    when given, receives every decision row (the decision log's shape). ``cfg.fleet_events``
    (kvtop/fleet_events.FleetEvent, checked) change the fleet at their times, through the
    router's own fleet rules (router/build.Router.change_fleet), as the control API does live.
    """
    young, *older = gc.get_threshold()
    gc.set_threshold(max(young, GC_YOUNG_THRESHOLD), *older)
    try:
        return _simulate(requests, policy, cfg, engines, departures or {}, decisions)
    finally:
        gc.set_threshold(young, *older)


def _simulate(requests: Sequence[Any], policy: str, cfg: SimConfig, given: Sequence[Any] | None,
              departures: dict[int, float], decisions: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    from kvtop.sim.engine import EngineFailed, EngineRejected, EngineRequest

    if not requests:
        return []
    fleet_events = cfg.fleet_events
    if fleet_events and given is not None and any(e.action == "add" for e in fleet_events):
        raise ValueError("fleet events that add instances need the simulator's own engines")
    # A built stream can mix sources (64-token Claude Code ids, 512-token Mooncake ids): each
    # line is regrouped from its own block size; engines use the finest one present.
    make_engine, ebs, capacity_tokens = _engine_factory(cfg, min(r.block_size or 16 for r in requests))
    engines = list(given) if given is not None else [make_engine(i) for i in range(cfg.instances)]
    max_len = engines[0].max_model_len
    names = [f"i{i}" for i in range(cfg.instances)]
    sim_time = [0.0]
    clock = lambda: sim_time[0]  # noqa: E731
    results = _Results(policy, decisions)

    # event heap: (time, order, kind, payload)
    heap: list[tuple[float, int, str, Any]] = []
    seq = 0

    def push(t: float, kind: str, payload: Any) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, kind, payload))

    router = build_router(Settings.parse(policy, {**cfg.features, **cfg.knobs}), names, results,
                          block_size=cfg.router_block_size,
                          capacity_blocks=max(1, capacity_tokens // cfg.router_block_size), clock=clock,
                          on_admit=lambda flow: push(sim_time[0], "admitted", flow))
    life = router.lifecycle
    if not router.core.slot.policy.needs_lookahead and router.pipeline.shadows is None:
        router.cluster.index.stop_tagging()   # nothing reads the blocks' sessions in this run

    arrivals: list[int] = []   # open loop: trace indices in arrival order (see below)
    by_session: dict[str, list[int]] = {}
    for k, r in enumerate(requests):
        by_session.setdefault(r.session, []).append(k)
    next_turn: dict[int, int] = {}
    if cfg.mode == "closed":
        for ks in by_session.values():
            for a, b in zip(ks, ks[1:]):
                next_turn[a] = b
            push(requests[ks[0]].arrival, "arrive", ks[0])
    else:
        # The arrivals of an open loop are known up front: they are read from a list sorted as
        # the heap would pop them (by time, then by the order they would have been pushed in,
        # before any other event), not pushed, so the heap holds only the events in flight (a
        # few dozen, not 10,000: each push and pop half the cost).
        arrivals = sorted(range(len(requests)), key=lambda k: requests[k].arrival)
        seq = len(requests)   # the order numbers the arrivals would have taken
    for ev in fleet_events:
        push(ev.t, "fleet", ev)
    dead: set[int] = set()  # instances that failed: an engine request sent there fails at once
    removing: list[Any] = []  # removes waiting for their instance's last request to end

    stepping = [False] * cfg.instances
    # The engines coalesce uneventful decode steps (Engine.step(coalesce=True)); a request
    # sent to an engine inside such a result cuts it short, so each engine's step_end carries
    # a generation and a cut re-schedules it (the stale event is skipped).
    in_flight: list[Any] = [None] * cfg.instances   # the engine's current StepResult
    generation = [0] * cfg.instances
    upstream: dict[str, Flow] = {}  # engine request id -> its flow
    meta: dict[str, tuple[int, int, list[int]]] = {}  # request id -> (trace index, output tokens, engine hashes)
    if cfg.kv_pin_scope not in ("all", "continuing"):
        raise ValueError(f"kv_pin_scope must be 'all' or 'continuing', not {cfg.kv_pin_scope!r}")
    pin_continuing: set[int] | None = None   # kv_pin_scope continuing: the trace indices to pin
    if cfg.kv_pin_ttl_s and cfg.kv_pin_scope == "continuing":
        last_turn: dict[Any, int] = {}
        for r in requests:
            last_turn[r.session] = max(r.turn, last_turn.get(r.session, r.turn))
        pin_continuing = {k for k, r in enumerate(requests) if r.turn < last_turn[r.session]}
    kv_params: dict[str, dict] = {}

    def kick(i: int, t: float) -> None:
        if not stepping[i] and engines[i].has_work():
            stepping[i] = True
            push(t, "step", i)

    if not 0 <= cfg.path_jitter_s < float("inf"):   # a NaN would reach the engines as NaN arrivals
        raise ValueError(f"path_jitter_s must be finite and at least 0, not {cfg.path_jitter_s}")
    half_jitter = cfg.path_jitter_s / 2 if cfg.path_seed else 0.0

    def perform(flow: Flow, act: Any, t: float) -> None:
        """Do what the lifecycle asks (router/lifecycle.py); a Wait needs nothing: the
        admission queue's on_admit schedules the request's ``admitted`` event."""
        if isinstance(act, Send):
            send(flow, act.leg, t)
        elif isinstance(act, (Done, Refuse)):
            k = meta.pop(flow.request.request_id)[0]
            if isinstance(act, Refuse):  # nothing was charged and no outcome exists: say it here
                results.refused(flow.request, requests[k].turn, t, act.message)
                return
            nxt = next_turn.get(k)
            if nxt is not None:  # closed loop: the session's next turn, its think time later
                push(t + (requests[nxt].think_time or 0.0), "arrive", nxt)

    def send(flow: Flow, leg: Any, t: float) -> None:
        """The leg goes upstream: an engine request on its instance."""
        life.step(flow, LEG_SENT)
        rid = flow.request.request_id
        k, out, hashes = meta[rid]
        i = leg.instance
        key = rid + "#p" if leg.kind == PREFILL else rid
        at = t
        if half_jitter:
            # the path's time this once: the engine's frontend time (the fitted mean) plus u,
            # shifted through the arrival, never before the send; u is drawn from the replica's
            # seed and the request, so every policy's replica r gives a request the same u
            # (the comparison stays paired) whatever order its requests are sent in
            d = blake2b(f"{cfg.path_seed}:{key}".encode(), digest_size=8).digest()
            u = (int.from_bytes(d, "big") / 2.0**63 - 1.0) * half_jitter
            eng = engines[i]
            at = t + max(u, -(eng.frontend_overhead_s + eng.profile.frontend_s_per_token * flow.request.input_tokens))
        prio = flow.decision.extra.get("priority") or 0  # the router's priority feature, as live
        pin = None if pin_continuing is None else (cfg.kv_pin_ttl_s if k in pin_continuing else 0.0)
        if leg.kind == PREFILL:  # P prefills (one token, KV kept for a remote decode)
            ereq = EngineRequest(key, flow.request.input_tokens, hashes, 1, at,
                                 kv_transfer_params={"do_remote_decode": True}, priority=prio)
        else:
            ereq = EngineRequest(rid, flow.request.input_tokens, hashes, out, at,
                                 kv_transfer_params=kv_params.pop(rid, None), priority=prio, kv_pin_s=pin)
        res = in_flight[i]
        end = res.end_time if res is not None else None
        try:
            if i in dead:
                raise EngineFailed(f"instance {router.cluster.instances[i].name} failed (fleet event)")
            engines[i].add_request(ereq)
        except EngineRejected as exc:
            # as vLLM's 400: a refused prefill leg sends D to prefill itself, a refused serve
            # leg's error reaches the client (a 4xx is not retried), as live
            perform(flow, life.step(flow, PrefillAnswered(None) if leg.kind == PREFILL
                                    else Ended(ERROR, http_status=400, error=str(exc))), t)
            return
        except EngineFailed as exc:  # as vLLM's 5xx: retried elsewhere where the lifecycle may
            if leg.kind == PREFILL:
                event: Any = PrefillAnswered(None)
            elif life.may_retry(flow):
                event = LegFailed(UPSTREAM_ERROR, str(exc), 500)
            else:
                event = Ended(UPSTREAM_ERROR, http_status=500, error=str(exc))
            perform(flow, life.step(flow, event), t)
            return
        if res is not None and res.end_time != end:   # the coalesced steps were cut
            generation[i] += 1
            push(res.end_time, "step_end", (i, res, generation[i]))
        upstream[key] = flow
        kick(i, t)

    def abort(i: int, key: str, t: float) -> None:
        """Abort engine request ``key`` on instance ``i`` at ``t``. The abort cuts the engine's
        coalesced steps at ``t`` (Engine.abort): the cut result ends earlier, so its step_end is
        re-scheduled, as ``send`` does for an arrival (else every other request on the engine
        would see its tokens at the uncut steps' end)."""
        res = in_flight[i]
        end = res.end_time if res is not None else None
        engines[i].abort(key, t)
        if res is not None and res.end_time != end:
            generation[i] += 1
            push(res.end_time, "step_end", (i, res, generation[i]))

    def fail_in_flight(i: int, t: float, why: str) -> None:
        """Every engine request on instance ``i`` ends as when its backend drops it (the live
        router's forced remove, or a dead engine): a prefill leg sends D to prefill itself, a
        serve leg is retried elsewhere where the lifecycle may, else it fails."""
        for key, flow in list(upstream.items()):
            if flow.leg.instance != i:
                continue
            del upstream[key]
            abort(i, key, t)
            if flow.leg.kind == PREFILL:
                event: Any = PrefillAnswered(None)
            elif life.may_retry(flow):
                event = LegFailed(UPSTREAM_ERROR, why, 502)
            else:
                event = Ended(UPSTREAM_ERROR, http_status=502, error=why)
            perform(flow, life.step(flow, event), t)

    def fleet_event(ev: Any, t: float) -> None:
        """One change to the fleet, through the router's own rules (router/fleet.py)."""
        cl = router.cluster
        if ev.action == "add":
            name = ev.instance or f"i{len(cl.instances)}"
            i = router.add_instance(name, capacity_blocks=max(1, capacity_tokens // cfg.router_block_size))
            if i == len(engines):
                engines.append(make_engine(i))
                stepping.append(False)
                in_flight.append(None)
                generation.append(0)
            else:  # a removed instance comes back: a fresh engine in its place
                engines[i] = make_engine(i)
                stepping[i], in_flight[i] = False, None
                generation[i] += 1
            dead.discard(i)
            return
        i = [s.name for s in cl.instances].index(ev.instance)
        if ev.action == "fail":
            dead.add(i)
            cl.set_healthy(i, False)  # the live router's probes take it out
            fail_in_flight(i, t, f"instance {ev.instance} failed")
            return
        if ev.action == "remove" and not ev.force and cl.instances[i].num_requests:
            removing.append(ev)  # as `kvtop fleet drain --wait` then `remove`
            return
        if ev.action == "remove" and ev.force:
            fail_in_flight(i, t, f"instance {ev.instance} removed with requests in flight")
        router.change_fleet(ev.instance, ev.action, force=ev.force)

    def begin_step(i: int, t: float) -> Any:
        """Engine ``i`` steps at ``t``: its result, now in flight under a new generation, for
        the caller to schedule the end of; None when it was idle (a wake-up scheduled at its
        next event time, if it has work waiting for one)."""
        eng = engines[i]
        res = eng.step(t, coalesce=True)
        if res.idle:
            stepping[i] = False
            nxt = eng.next_event_time()
            if nxt is not None and eng.has_work():
                stepping[i] = True
                push(max(nxt, t), "step", i)
            return None
        in_flight[i] = res
        generation[i] += 1
        return res

    def step(i: int, t: float) -> None:
        res = begin_step(i, t)
        if res is not None:
            push(res.end_time, "step_end", (i, res, generation[i]))

    heappop = heapq.heappop
    arrival_times = [requests[k].arrival for k in arrivals]
    next_arrival = 0
    num_arrivals = len(arrivals)
    # the next arrival's time, inf when none is left
    next_at = arrival_times[0] if num_arrivals else float("inf")
    prefill_leg = PREFILL
    while True:
        if next_arrival < num_arrivals and (not heap or next_at <= heap[0][0]):
            # an arrival is the next event: at a time tie it was pushed before every other one
            t = next_at
            kind, payload = "arrive", arrivals[next_arrival]
            next_arrival += 1
            next_at = arrival_times[next_arrival] if next_arrival < num_arrivals else float("inf")
        elif heap:
            t, _, kind, payload = heappop(heap)
        else:
            break
        sim_time[0] = t
        if removing:  # removes that waited: done once their instance has nothing in flight
            for ev in list(removing):
                i = [s.name for s in router.cluster.instances].index(ev.instance)
                if not router.cluster.instances[i].num_requests:
                    removing.remove(ev)
                    router.change_fleet(ev.instance, "remove")
        if kind == "step_end":   # the most frequent event first
            i, res, gen = payload
            if gen != generation[i]:
                continue   # re-scheduled earlier by a cut
            while True:
                in_flight[i] = None
                if res.first_token:
                    for rid in res.first_token:
                        flow = upstream.get(rid)
                        if flow is not None and flow.leg.kind != prefill_leg:
                            life.step(flow, FIRST_TOKEN)
                if res.finished:
                    for fin in res.finished:
                        flow = upstream.pop(fin.request_id, None)
                        if flow is None:
                            continue
                        if flow.leg.kind == prefill_leg:  # P is done: D pulls the KV (the engine models the transfer)
                            kv_params[flow.request.request_id] = fin.kv_transfer_params
                            perform(flow, life.step(flow, PrefillAnswered(fin.kv_transfer_params or None)), t)
                        else:
                            perform(flow, life.step(flow, Ended(OK, output_tokens=fin.num_output_tokens,
                                                                cached_tokens=fin.num_cached_tokens)), t)
                stepping[i] = False
                if (heap and heap[0][0] <= t) or next_at <= t:
                    kick(i, t)   # an engine with no work waits for the next arrival to kick it
                    break
                if not engines[i].has_work():
                    break
                # the step event kick would push is the next one popped: step now, without it
                stepping[i] = True
                res = begin_step(i, t)
                if res is None:
                    break
                end = res.end_time
                if (heap and heap[0][0] <= end) or next_at <= end or removing or not TAKE_STEP_END_AT_ONCE:
                    push(end, "step_end", (i, res, generation[i]))
                    break
                # This step's end is the next event, before any other (a tie goes to the event
                # already queued, or to the arrival): taken at once, not pushed and popped.
                t = sim_time[0] = end
        elif kind == "step":
            step(payload, t)
        elif kind == "arrive":
            r = requests[payload]
            rid = f"{payload}"
            out = r.output_tokens if cfg.max_output_tokens is None else min(r.output_tokens, cfg.max_output_tokens)
            # like a client that sizes max_tokens to the context left
            out = max(1, min(out, max_len - r.input_tokens))
            tbs = r.block_size or 16
            rreq = RouteRequest(rid, r.session, "header", r.input_tokens,
                                regroup_block_ids(r.hash_ids, tbs, cfg.router_block_size, r.input_tokens),
                                "tokens", "completions", True, out)
            ids = r.hash_ids
            # the engine reads a prompt's hashes and never changes them: the trace's own list when
            # it is already at the engine's block size (no copy of ~3,000 ids per request)
            meta[rid] = (payload, out, ids if tbs == ebs and len(ids) <= r.input_tokens // ebs
                         else regroup_block_ids(ids, tbs, ebs, r.input_tokens))
            flow = life.receive(rreq, t)
            if payload in departures:
                push(t + departures[payload], "leave", flow)
            perform(flow, life.step(flow, ARRIVED), t)
        elif kind == "admitted":  # the router's admission queue let it through
            perform(payload, life.step(payload, ADMITTED), t)
        elif kind == "leave":  # the client gave up: its engine requests are aborted
            flow = payload
            rid = flow.request.request_id
            if rid in meta:
                for key in (rid, rid + "#p"):
                    if upstream.pop(key, None) is not None:
                        abort(flow.leg.instance, key, t)
                perform(flow, life.step(flow, ClientGone("in the simulation")), t)
        else:
            fleet_event(payload, t)
    if not router.pipeline.idle():  # a bug, not a user error: say so loudly
        raise RuntimeError("simulation ended with counters not at zero")
    return results.records


# -- CLI -----------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", nargs="?", default=None,
                   help="normalized trace (kvtop trace convert/build); or --from-db")
    p.add_argument("--policies", default=None,
                   help="comma-separated policies, e.g. lmetric,unified,leastwork (default: "
                        "expected_cost, the router's default; with --from-db, the recorded policy and "
                        "the recorded shadows)")
    p.add_argument("--from-db", default=None, metavar="DB",
                   help="what-if replay: re-run a recorded run's traffic (its arrivals, sessions, "
                        "prompts' block chains and delivered output) from a kvtop decision log, and "
                        "check the recorded policy against the recording (kvtop/whatif.py)")
    p.add_argument("--run", default=None, metavar="RUN_ID", help="with --from-db: which run (default the latest)")
    p.add_argument("--speed", type=float, default=None, metavar="X",
                   help="with --from-db: the recorded engines ran X times the profile's speed (kvtop sim "
                        "--speed X); default: fitted from the run's own TTFTs")
    p.add_argument("--instances", type=int, default=8, help="simulated instances (default 8)")
    from kvtop.sim.profiles import PROFILES

    p.add_argument("--profile", default="h20",
                   help=f"engine profile: {', '.join(sorted(PROFILES))}, or a profile file (.toml, from "
                        "`kvtop sim calibrate`) (default h20; h100 is estimated, see docs/simulator.md)")
    p.add_argument("--mode", choices=("open", "closed"), default="open",
                   help="open: trace arrival times; closed: next turn after the answer + think time")
    p.add_argument("--limit", type=int, default=None, help="first N requests of the trace")
    p.add_argument("--knob", action="append", default=[], metavar="KEY=VALUE",
                   help="policy knob applied to every policy that has it, or a router-level knob "
                        "(offload_mode, offload_threshold, admission, ...; router/features.py) "
                        "applied to every run (repeatable)")
    p.add_argument("--router-block-size", type=int, default=512, help="router prefix-index block (default 512)")
    p.add_argument("--engine-block-size", type=int, default=None,
                   help="engine cache block (default: the trace's block size, at least the profile's)")
    p.add_argument("--max-output-tokens", type=int, default=None, help="cap each request's output")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="the engines' vLLM --scheduling-policy (default fcfs); --knob priority=... needs "
                        "priority, as a live vLLM does")
    p.add_argument("--kv-pin-ttl", type=float, default=0.0, metavar="S",
                   help="model an engine feature vLLM lacks: keep a finished request's KV blocks pinned "
                        "for S engine seconds (a session's tool-call pause): a new request may not take them "
                        "and waits, a running one may (default 0: vLLM's plain LRU; at most 86400; "
                        "docs/simulator.md \"KV pin\")")
    p.add_argument("--kv-pin-scope", choices=("all", "continuing"), default="all",
                   help="with --kv-pin-ttl: pin every finished request (all, default), or only a turn its "
                        "session follows with another (continuing: the per-request hint of a client whose "
                        "answer ends in a tool call)")
    p.add_argument("--engine-admission", choices=("fifo", "pack"), default=None,
                   help="order each simulated engine's own waiting queue with router/admission.py "
                        "(an experiment on the engine; --knob admission=... queues in the router, as live)")
    p.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="run N replicas per policy (replica 0 as traced, the others with each session "
                        "shifted by a seeded offset up to --jitter), in parallel on every core, and report "
                        "means with 95%% confidence intervals and paired differences (kvtop/repeats.py)")
    p.add_argument("--jitter", type=float, default=2.0, metavar="S",
                   help="largest shift of a session's arrivals in a replica, seconds (default 2)")
    p.add_argument("--path-jitter", type=float, default=0.0, metavar="S",
                   help="with --repeats: each request also reaches its engine up to S/2 seconds "
                        "earlier or later than the profile's frontend time says (never before it was "
                        "sent: with the built-in profiles' frontend time of 0, only later), the same "
                        "for every policy in a replica: the run-to-run noise of a live path (measure "
                        "it, docs/simulator.md; default 0)")
    p.add_argument("--fingerprint", action="store_true",
                   help="also print each policy's records as a SHA-256 on stderr (with --repeats, over "
                        "all its replicas): equal on two versions of kvtop that simulate the same thing")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="processes for --repeats (default: one per core; with --ray, one actor per CPU "
                        "of the cluster)")
    p.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="run the --repeats replicas on a Ray cluster (host:port of its head, 'auto', or "
                        "'local' to start one here); needs pip install 'kvtop[ray]'. Same results as local")
    p.add_argument("--plot", default=None, metavar="FILE.svg",
                   help="with --repeats: draw every metric's means and 95%% intervals as an SVG chart")
    p.add_argument("--terminal-plot", choices=("auto", "always", "never"), default="auto",
                   help="with --repeats: forest plots of TTFT p90 and E2E p99 (means and 95%% intervals) "
                        "after the report; auto: when stdout is a terminal and --format is text")
    p.add_argument("--fleet-events", default=None, metavar="FILE",
                   help="change the fleet while the trace runs: JSON Lines of {\"t\": S, \"action\": add|cordon|"
                        "drain|uncordon|remove|fail, \"instance\": NAME, \"force\": true} on the trace's "
                        "clock, applied through the router's own fleet rules (docs/fleet.md); with --from-db "
                        "the run's own recorded fleet changes are replayed instead")
    p.add_argument("--format", choices=("text", "md", "csv"), default="text")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write each policy's results as DIR/<policy>.jsonl (for kvtop report)")


def _policy_knobs(settings: Settings, knobs: dict[str, str]) -> dict[str, str]:
    """The knobs given that are the policy's own (the features travel separately)."""
    return {k: v for k, v in knobs.items() if k in settings.policy_knobs and k not in FEATURE_KNOBS.names()}


def run(args: argparse.Namespace) -> int:
    from kvtop.seedtable import class_rows, format_class_table, format_seed_table, seed_row, session_table
    from kvtop.sim.profiles import get_profile
    from kvtop.traces.loader import dense_ids, iter_trace

    if args.from_db is not None:
        if args.trace is not None:
            raise CliError("give a trace or --from-db, not both")
        if (args.out or args.limit is not None or args.knob or args.workers is not None or args.ray
                or args.path_jitter or args.plot or args.terminal_plot == "always" or args.fleet_events
                or args.fingerprint or args.kv_pin_ttl):
            raise CliError("--from-db takes --policies, --run, --speed, --profile, --mode, --repeats, "
                           "--jitter and --format (the run's own knobs are used)")
        from kvtop.whatif import run as whatif_run

        return whatif_run(args, simulate, SimConfig)
    if args.trace is None:
        raise CliError("a trace is required (or --from-db DB)")
    if args.run is not None or args.speed is not None:
        raise CliError("--run and --speed go with --from-db")
    policies = [p.strip() for p in (args.policies or DEFAULT_POLICY).split(",") if p.strip()]
    if not policies:
        raise CliError("--policies needs at least one policy")
    try:
        knobs = parse_knob_args(args.knob)
        settings = settings_for(policies, knobs)
    except KnobError as exc:
        raise CliError(f"{exc.field}: {exc.message}") from None
    features = {k: v for k, v in knobs.items() if k in FEATURE_KNOBS.names()}
    if features.get("priority", "off") != "off" and args.scheduling_policy != "priority":
        raise CliError("--knob priority sets vLLM's per-request priority, which engines refuse under fcfs: "
                       "give --scheduling-policy priority")
    try:
        get_profile(args.profile)
    except KeyError as exc:
        raise CliError(str(exc.args[0])) from None
    from kvtop.sim.engine import check_kv_pin_ttl

    try:
        check_kv_pin_ttl(args.kv_pin_ttl)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.kv_pin_scope != "all" and not args.kv_pin_ttl:
        raise CliError("--kv-pin-scope chooses what --kv-pin-ttl pins: give --kv-pin-ttl S too")
    for flag, value in (("--instances", args.instances), ("--limit", args.limit),
                        ("--router-block-size", args.router_block_size),
                        ("--engine-block-size", args.engine_block_size),
                        ("--max-output-tokens", args.max_output_tokens)):
        if value is not None and value < 1:
            raise CliError(f"{flag} must be at least 1")
    # flags first: a bad one is refused before a 10,000-request trace is read
    if args.repeats < 1 or (args.workers is not None and args.workers < 1) \
            or not 0 <= args.jitter < float("inf") or not 0 <= args.path_jitter < float("inf"):
        raise CliError("--repeats and --workers must be at least 1, --jitter and --path-jitter finite "
                       "and at least 0")
    if args.path_jitter and args.repeats < 2:
        raise CliError("--path-jitter varies the replicas of --repeats: give --repeats 2 or more")
    if args.plot and args.repeats < 2:
        raise CliError("--plot draws the intervals of --repeats: give --repeats 2 or more "
                       "(kvtop report --plot draws one run's TTFT CDFs)")
    if args.plot:   # before the simulations, not after them
        folder = Path(args.plot).resolve().parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise CliError(f"cannot write --plot {args.plot}: {folder} is not a writable folder")
    if args.ray is not None and args.repeats < 2:
        raise CliError("--ray runs --repeats replicas: give --repeats 2 or more")
    fleet_events: tuple = ()
    names = [f"i{i}" for i in range(args.instances)]
    if args.fleet_events:  # checked against the router's fleet rules before the trace is read
        from kvtop.fleet_events import load

        events, names = load(args.fleet_events, names)
        fleet_events = tuple(events)
    # the same results, cheaper to simulate (see dense_ids); converted as the lines are read,
    # so the trace's own ids are not all alive beside the dense ones (peak 227 MB, not 312)
    requests = dense_ids(islice(iter_trace(args.trace), args.limit))
    # The trace lives as long as this process: keep it out of the GC's full collections (a
    # 10,000-request trace is 11.7M ids in 10,000 lists to traverse each time) and, with
    # --repeats, out of the pages forked workers would copy when a collection touches them.
    gc.collect()
    gc.freeze()
    if not requests:
        raise CliError(f"{args.trace}: the trace has no requests")
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CliError(f"cannot create --out {out_dir}: {exc.strerror or exc}") from None
    if args.repeats > 1:
        if out_dir:
            raise CliError("--out writes one run's records; use it without --repeats")
        from kvtop.repeats import fingerprints, format_report, run_replicas, task_progress, terminal_plot, write_svg

        configs = {pol: SimConfig(instances=args.instances, profile=args.profile, mode=args.mode,
                                  router_block_size=args.router_block_size,
                                  engine_block_size=args.engine_block_size, knobs=_policy_knobs(settings[pol], knobs),
                                  max_output_tokens=args.max_output_tokens, features=features,
                                  admission=args.engine_admission, path_jitter_s=args.path_jitter,
                                  scheduling_policy=args.scheduling_policy, fleet_events=fleet_events,
                                  kv_pin_ttl_s=args.kv_pin_ttl, kv_pin_scope=args.kv_pin_scope)
                   for pol in policies}
        t0 = time.time()
        try:
            with task_progress(len(configs) * args.repeats, "simulating") as progress:
                runs = run_replicas(simulate, requests, configs, args.repeats, args.jitter, args.workers,
                                    args.ray, progress, fingerprint=args.fingerprint)
        except ValueError as exc:
            raise CliError(str(exc)) from None
        print(f"simulated {len(policies)} policies x {args.repeats} replicas in {time.time() - t0:.1f} s wall",
              file=sys.stderr)
        from kvtop.ceiling import of_requests

        report = format_report(runs, args.repeats, args.jitter, args.format, args.path_jitter,
                               ceiling=of_requests(requests))
        print(report)
        if args.fingerprint:
            for pol, digest in fingerprints(runs).items():
                print(f"fingerprint {pol} {digest} ({args.repeats} replicas)", file=sys.stderr)
        if args.terminal_plot == "always" or (args.terminal_plot == "auto" and args.format == "text"
                                              and sys.stdout.isatty()):
            print(terminal_plot(runs))
        if args.plot:
            try:
                write_svg(args.plot, runs, f"kvtop simulate {Path(args.trace).name}: {report.splitlines()[0]}")
            except OSError as exc:
                raise CliError(f"cannot write --plot {args.plot}: {exc.strerror or exc}") from None
            print(f"wrote {args.plot}", file=sys.stderr)
        return 0
    rows, classes, arms = [], [], []
    from kvtop.ceiling import of_requests

    ceiling = of_requests(requests)  # APC is shown against it
    for pol in policies:
        cfg = SimConfig(instances=args.instances, profile=args.profile, mode=args.mode,
                        router_block_size=args.router_block_size, engine_block_size=args.engine_block_size,
                        knobs=_policy_knobs(settings[pol], knobs), max_output_tokens=args.max_output_tokens,
                        features=features, admission=args.engine_admission,
                        scheduling_policy=args.scheduling_policy, fleet_events=fleet_events,
                        kv_pin_ttl_s=args.kv_pin_ttl, kv_pin_scope=args.kv_pin_scope)
        t0 = time.process_time()
        try:
            records = simulate(requests, pol, cfg)
        except ValueError as exc:
            raise CliError(str(exc)) from None
        cpu = time.process_time() - t0
        print(f"simulated {pol}: {len(records)} requests in {cpu:.1f} CPU s", file=sys.stderr)
        if args.fingerprint:
            from kvtop.repeats import records_digest

            print(f"fingerprint {pol} {records_digest(records)}", file=sys.stderr)
        rows.append((pol, seed_row(records, instances=names, ceiling=ceiling)))
        classes.append((pol, class_rows(records)))
        arms.append((pol, records))
        if out_dir:
            with open(out_dir / f"{pol}.jsonl", "w") as f:
                f.write(json.dumps({"kvtop_results": 1, "arm": pol, "target": f"simulate:{args.profile}",
                                    "trace": args.trace, "mode": args.mode, "instances": args.instances}) + "\n")
                for rec in records:
                    f.write(json.dumps(rec) + "\n")
    print(format_seed_table(rows, args.format))
    print()
    print(format_class_table(classes, args.format))
    table = session_table(arms, args.format)
    if table:
        print()
        print(table)
    return 0
