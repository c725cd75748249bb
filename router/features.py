"""Router-level features that apply under any policy: elastic P2P offload and prefill admission.

Their knobs live here, next to (not inside) the policy knobs: ``kvtop route --knob``,
``kvtop simulate --knob`` and ``PATCH /kvtop/v1/knobs`` accept both kinds in one object, and
``split_knobs`` sends each name where it belongs. Two names exist in both places:
``heavy_threshold`` and ``prefill_tps`` (unified_ab has them too). They mean the same thing
there (a HEAVY request's size; one instance's prefill rate), so they are SHARED: one value,
applied to the features and to any policy that has the knob. Setting either sets both.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

from router.admission import AdmissionGate
from router.classes import HEAVY_COLO
from router.cluster import Cluster, Ticket
from router.config import Knob, KnobError, KnobSchema
from router.offload import PREFILL_FAILED, decide_offload, loads

OFFLOAD_MODES = ("off", "simple", "cost")
ADMISSION_MODES = ("off", "fifo", "pack")

FEATURE_KNOBS = KnobSchema((
    Knob("offload_mode", str, "off",
         "elastic P2P prefill offload: off | simple (load rules) | cost (seconds saved vs spent)",
         choices=OFFLOAD_MODES),
    Knob("heavy_threshold", int, 20000,
         "estimated new prefill tokens from which a request is HEAVY and may be offloaded "
         "(shared with unified_ab's migration threshold)", min=0, max=10_000_000),
    Knob("p_overload_factor", float, 1.5,
         "simple: never offload to a P whose BS exceeds mean(BS) x this", min=0.0, max=100.0),
    Knob("kv_transfer_s", float, 0.1,
         "cost: seconds to move a HEAVY request's KV from P to D (about 25 GB/s for 20k "
         "tokens of Qwen3-30B-A3B KV, plus setup)", min=0.0, max=600.0),
    Knob("prefill_tps", float, 5000.0,
         "prefill tokens per second of one instance (shared with unified_ab)", min=1.0, max=1e7),
    Knob("disruption_factor", float, 1.0,
         "cost: seconds of decode disruption on D per second of prefill kept there", min=0.0, max=1000.0),
    Knob("admission", str, "off",
         "per-instance prefill admission queue in the router: off | fifo | pack",
         choices=ADMISSION_MODES),
    Knob("admission_budget_tokens", int, 16384,
         "admit while the instance's admitted-but-unprefilled tokens plus this request's fit",
         min=1, max=10_000_000),
    Knob("admission_lookahead", int, 8, "pack: how many waiting requests it may choose from",
         min=1, max=10_000),
    Knob("admission_force_fifo_every", int, 4,
         "pack: every N-th admission round is FIFO so a long prompt cannot starve (0: never)",
         min=0, max=10_000),
))

#: Names both the features and some policies declare; one value feeds both.
SHARED_KNOBS = ("heavy_threshold", "prefill_tps")


def split_knobs(knobs: dict[str, Any], policy_schema: KnobSchema) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split one ``{name: value}`` object into (policy knobs, feature knobs).

    A shared name goes to both (to the policy only when it has it). An unknown name raises
    KnobError listing both sets, so the caller can refuse the whole update.
    """
    if not isinstance(knobs, dict):
        raise KnobError("knobs", "expected an object of knob names to values")
    pol: dict[str, Any] = {}
    feat: dict[str, Any] = {}
    pnames, fnames = set(policy_schema.names()), set(FEATURE_KNOBS.names())
    for name, value in knobs.items():
        if name not in pnames and name not in fnames:
            allowed = ", ".join(policy_schema.names() + FEATURE_KNOBS.names())
            raise KnobError(str(name), f"unknown knob; known knobs: {allowed}")
        if name in pnames:
            pol[name] = value
        if name in fnames:
            feat[name] = value
    return pol, feat


@dataclass(frozen=True, slots=True)
class Features:
    """The validated router-level knobs; replaced whole on every change (like a policy)."""

    knobs: dict[str, Any]

    @classmethod
    def build(cls, values: dict[str, Any] | None = None, base: dict[str, Any] | None = None) -> "Features":
        return cls(FEATURE_KNOBS.validate(values or {}, base))

    @property
    def offload_mode(self) -> str:
        return self.knobs["offload_mode"]

    @property
    def admission(self) -> str:
        return self.knobs["admission"]

    @property
    def active(self) -> bool:
        """Whether any feature needs the request path (else app.py's plain path runs)."""
        return self.knobs["offload_mode"] != "off" or self.knobs["admission"] != "off"

    def shared_for(self, policy_schema: KnobSchema) -> dict[str, Any]:
        """The shared values a freshly built policy must inherit to stay in step."""
        names = set(policy_schema.names())
        return {k: self.knobs[k] for k in SHARED_KNOBS if k in names}


def prefill_leg_body(body: dict[str, Any]) -> dict[str, Any]:
    """The P side of the disaggregated two-step: the client's request, prefill only.

    The one place the router changes a body: one token, no stream, and vLLM's
    ``kv_transfer_params`` asking the instance to keep the KV for a remote decode.
    """
    out = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    return out


def decode_leg_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The D side: the client's original request plus the P side's ``kv_transfer_params``."""
    return {**body, "kv_transfer_params": params}


FEATURE_DOC = """Router-level knobs (any policy): """ + ", ".join(
    f"{k.name} ({k.default})" for k in FEATURE_KNOBS.knobs)


# -- live glue for router/app.py ------------------------------------------------------
# Everything below runs on the router's event loop. app.py calls ``serve`` instead of its
# plain dispatch-and-forward when an offload mode or an admission mode is on.


class ObservedCluster(Cluster):
    """A Cluster that reports when a request's prefill is over on an instance.

    ``on_prefill_over(instance, ticket)`` runs after every first token and every end, which
    are exactly the moments the admission gate must look at its queue again.
    """

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.on_prefill_over = None

    def first_token(self, t: Ticket) -> None:
        super().first_token(t)
        if self.on_prefill_over is not None:
            self.on_prefill_over(t.instance, t)

    def finish(self, t: Ticket, *, error: bool = False) -> None:
        super().finish(t, error=error)
        if self.on_prefill_over is not None:
            self.on_prefill_over(t.instance, t)


def set_new_prefill(cluster: Cluster, t: Ticket, new_prefill: int) -> None:
    """Change what a not-yet-prefilled ticket owes: 0 when the KV arrives from P, back to the
    full amount when P failed and D prefills itself. The ticket keeps releasing exactly."""
    assert t.phase == "prefill"
    cluster.instances[t.instance].pending_prefill_tokens += new_prefill - t.new_prefill
    t.new_prefill = new_prefill


def attach(state) -> AdmissionGate:
    """Give a RouterState its admission gate and wire the cluster's prefill signal to it."""
    gate = AdmissionGate(len(state.cluster.instances), lambda: state.features.knobs)
    state.cluster.on_prefill_over = lambda i, t: gate.release(i, id(t))
    return gate


async def _admit(state, t: Ticket) -> float:
    """Wait for the admission gate when it is on; return the wait in ms (0 when off)."""
    if state.features.admission == "off" or t.new_prefill <= 0:
        return 0.0
    return await state.admission.wait(t.instance, id(t), t.new_prefill)


def _gone(state, d, tickets, where: str) -> None:
    """The client left before any upstream call for ``d``: release and record.

    Not an instance error: as in app._forward, a client that leaves says nothing about it."""
    for t in tickets:
        state.cluster.finish(t)
    state.record_decision(d)
    state.record_outcome(d, {"stream": int(d.request.stream), "status": "client_gone",
                             "error": f"client disconnected {where}", "t_done": time.time()})


async def _prefill_leg(state, p_index: int, request, body: dict, path: str,
                       request_id: str) -> tuple[dict | None, str | None]:
    """POST the prefill-only request to P; return (its kv_transfer_params, None) or (None, why)."""
    import aiohttp

    from router.forward import upstream_headers

    inst = state.cluster.instances[p_index]
    headers = upstream_headers(request.headers, request_id)  # the same id on both legs, as vLLM's P/D proxy does
    try:
        # the leg is one upstream attempt: --total-timeout bounds it like any other
        async with state.http.post(inst.url + path, json=prefill_leg_body(body), headers=headers,
                                   timeout=state.upstream_timeout) as up:
            data = await up.read()
            if up.status != 200:
                return None, f"HTTP {up.status}"
        params = json.loads(data).get("kv_transfer_params")
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError) as exc:
        return None, f"{type(exc).__name__}: {exc}"[:200]
    if not isinstance(params, dict) or not params:
        return None, "the prefill response has no kv_transfer_params"
    return params, None


async def serve(request, state, d, body: dict, raw: bytes, path: str, forward, *, attempt: int,
                new_turn: bool, exclude: tuple[int, ...] = ()):
    """Dispatch ``d`` with the router-level features on, then ``forward`` it (app._forward).

    Offload (first attempts only): P gets a prefill-only ticket (decode=False) and D a ticket
    owing no prefill; both are released on every path. A failed P leg falls back to D.
    Admission: the instance that prefills waits in the gate before the upstream call.
    """
    feats = state.features
    cluster = state.cluster
    req = d.request
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
    if off is None or not off.offload:
        state.core.dispatch(d, new_turn=new_turn)
        try:
            d.extra["admission_wait_ms"] = await _admit(state, d.ticket)
        except BaseException:
            _gone(state, d, [d.ticket], "while waiting for admission")
            raise
        state.record_decision(d)
        return await forward(request, state, d, raw, path, can_retry=attempt == 1)

    # Elastic P2P: P prefills, D decodes.
    p = off.prefill_instance
    p_ticket = cluster.dispatch(p, req.input_tokens, cluster.hits(req.blocks, req.input_tokens)[p],
                                req.blocks, decode=False)
    state.core.dispatch(d, new_turn=new_turn)
    set_new_prefill(cluster, d.ticket, 0)  # the KV arrives from P
    d.extra["offload"] = 1
    try:
        d.extra["admission_wait_ms"] = await _admit(state, p_ticket)
        d.extra["t_prefill_sent"] = time.time()
        params, why = await _prefill_leg(state, p, request, body, path, req.request_id)
        d.extra["t_prefill_done"] = time.time()
    except BaseException:
        _gone(state, d, [p_ticket, d.ticket], "during the prefill leg")
        raise
    if params is not None:
        cluster.first_token(p_ticket)
        cluster.finish(p_ticket)
        raw = json.dumps(decode_leg_body(body, params)).encode()
    else:
        print(f"kvtop route: prefill leg on {cluster.instances[p].name} failed ({why}); "
              f"prefilling on {d.instance_name}", file=sys.stderr)
        cluster.finish(p_ticket, error=True)
        set_new_prefill(cluster, d.ticket, d.new_prefill_tokens)
        d.extra.update(offload=0, offload_reason=PREFILL_FAILED, route_class=HEAVY_COLO)
        try:
            d.extra["admission_wait_ms"] += await _admit(state, d.ticket)
        except BaseException:
            _gone(state, d, [d.ticket], "while waiting for admission")
            raise
    state.record_decision(d)
    return await forward(request, state, d, raw, path, can_retry=True)
