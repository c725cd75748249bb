"""Elastic P2P prefill offload: should a HEAVY request prefill on another instance? (pure)

The policy's pick is the decode instance D. For a HEAVY request (estimated new tokens on D
>= ``offload_threshold``) the prefill instance P is the other healthy instance with the least
pending prefill (ties: fewer requests in flight, then instance order). Offload is a
preference, not a mandate; ``offload_mode``:

- ``simple``: keep on D if P is at least as loaded as D (pending prefill, then BS:
  ``p_more_loaded``), or P's BS > ``p_overload_factor`` x mean(BS) (``p_overloaded``);
  offload if D is decoding (``p_idle_d_busy``); else keep (``d_idle``: nothing to disrupt).
- ``cost``: keep if D is not decoding (``d_idle``); offload when the disruption saved on D,
  new_D / tps_D x disruption_factor, exceeds P's queue time P_P / tps_P plus
  ``kv_transfer_s`` (``cost_offload``), else keep (``cost_keep``). tps_X is X's measured
  prefill rate (router/calibration.py) once the fleet has a sample, else the ``prefill_tps`` knob.

Below the threshold the reason is ``below_threshold``; a cluster with no other healthy
instance gives ``no_peer``. Offloaded requests are route class HEAVY_P2P, kept HEAVY ones
HEAVY_COLO.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from router.cluster import Candidate, Cluster
from router.classes import HEAVY_COLO, HEAVY_P2P

BELOW_THRESHOLD = "below_threshold"
NO_PEER = "no_peer"
P_MORE_LOADED = "p_more_loaded"
P_OVERLOADED = "p_overloaded"
P_IDLE_D_BUSY = "p_idle_d_busy"
D_IDLE = "d_idle"
COST_OFFLOAD = "cost_offload"
COST_KEEP = "cost_keep"
PREFILL_FAILED = "prefill_failed"  # live only: P's leg failed, the request colocated on D

OFFLOAD_REASONS: dict[str, str] = {
    BELOW_THRESHOLD: "estimated new tokens below offload_threshold; not a candidate",
    NO_PEER: "no other healthy instance to prefill on",
    P_MORE_LOADED: "simple: P is at least as loaded as D (pending prefill, then BS); kept",
    P_OVERLOADED: "simple: P's BS is above p_overload_factor x mean(BS); kept",
    P_IDLE_D_BUSY: "simple: P is less loaded and D is decoding; offloaded",
    D_IDLE: "D has nothing decoding, so a local prefill disrupts nobody; kept",
    COST_OFFLOAD: "cost: disruption saved on D exceeds P's queue time plus the KV transfer; offloaded",
    COST_KEEP: "cost: P's queue time plus the KV transfer exceeds the disruption saved; kept",
    PREFILL_FAILED: "the prefill leg on P failed; fell back to prefilling on D",
}


@dataclass(slots=True)
class OffloadDecision:
    offload: bool
    reason: str
    prefill_instance: int | None  # P when one was considered, else None
    route_class: str | None  # HEAVY_P2P / HEAVY_COLO for a heavy request, None otherwise
    terms: dict[str, Any] = field(default_factory=dict)


def loads(cluster: Cluster) -> list[Candidate]:
    """Each healthy instance's load as a Candidate (hit/new unused here), without a prefix match."""
    cal = cluster.calibration
    return [Candidate(s.index, s.name, 0, 0, s.pending_prefill_tokens, s.num_requests,
                      s.ongoing_decode_tokens, s.decode_requests,
                      cal.tps(s.index) if cal.measured else 0.0)
            for s in cluster.instances if s.healthy]


def decide_offload(d_index: int, new_tokens: int, candidates: Sequence[Candidate],
                   knobs: dict[str, Any]) -> OffloadDecision:
    """Offload or keep a request the policy sent to ``d_index`` with ``new_tokens`` to prefill."""
    mode = knobs["offload_mode"]
    if mode == "off" or new_tokens < knobs["offload_threshold"]:
        return OffloadDecision(False, BELOW_THRESHOLD, None, None)
    d = next((c for c in candidates if c.index == d_index), None)
    others = [c for c in candidates if c.index != d_index]
    if d is None or not others:
        return OffloadDecision(False, NO_PEER, None, HEAVY_COLO)
    p = min(others, key=lambda c: (c.pending_prefill, c.num_requests))  # first in order on ties
    d_busy = d.decode_tokens > 0
    terms: dict[str, Any] = {"D": d.name, "P": p.name, "new": new_tokens, "P_D": d.pending_prefill,
                             "P_P": p.pending_prefill, "BS_D": d.num_requests,
                             "BS_P": p.num_requests, "Dtok_D": d.decode_tokens}
    if mode == "simple":
        mean_bs = sum(c.num_requests for c in candidates) / len(candidates)
        terms["mean_BS"] = mean_bs
        if (p.pending_prefill, p.num_requests) >= (d.pending_prefill, d.num_requests):
            reason = P_MORE_LOADED
        elif p.num_requests > knobs["p_overload_factor"] * mean_bs:
            reason = P_OVERLOADED
        elif d_busy:
            reason = P_IDLE_D_BUSY
        else:
            reason = D_IDLE
        offload = reason == P_IDLE_D_BUSY
    else:  # cost
        # each instance's measured rate once the fleet has one (router/calibration.py), else the knob
        tps_d = d.prefill_tps or knobs["prefill_tps"]
        tps_p = p.prefill_tps or knobs["prefill_tps"]
        saved = new_tokens / tps_d * knobs["disruption_factor"]
        cost = p.pending_prefill / tps_p + knobs["kv_transfer_s"]
        terms.update(saved_s=round(saved, 4), cost_s=round(cost, 4), tps_D=round(tps_d, 1),
                     tps_P=round(tps_p, 1))
        if not d_busy:
            reason = D_IDLE
        else:
            reason = COST_OFFLOAD if saved > cost else COST_KEEP
        offload = reason == COST_OFFLOAD
    return OffloadDecision(offload, reason, p.index, HEAVY_P2P if offload else HEAVY_COLO, terms)
