"""unified: session affinity behind a cache gate and an overload bound, else a load score."""

from __future__ import annotations

from router.config import Knob, KnobSchema
from router.policies.base import (AFFINITY_LOST, AFFINITY_NEW, AFFINITY_STICK, CACHE_GATE_MISS,
                                  OVERLOAD_BREAK, Pick, Policy, argmin_with_ties, terms_of)

UNIFIED_KNOBS = KnobSchema((
    Knob("overload_factor", float, 2.0,
         "stick only while the session's instance has BS <= mean(BS) x this", min=0.0, max=100.0),
    Knob("cache_ratio_gate", float, 0.5,
         "stick only while more than this share of the prompt is cached there", min=0.0, max=1.0),
    Knob("lmetric_decode_weight", float, 0.0,
         "weight of decoding tokens D_i added to the fallback score", min=0.0, max=1e6),
))


def affinity_gate(view, knobs):
    """Return (candidate to stick to or None, reason when not sticking)."""
    if view.session_instance is None:
        return None, AFFINITY_NEW
    owner = view.candidate(view.session_instance)
    if owner is None:
        return None, AFFINITY_LOST
    if owner.hit / view.input_tokens <= knobs["cache_ratio_gate"]:
        return None, CACHE_GATE_MISS
    cands = view.candidates
    mean_bs = sum(c.num_requests for c in cands) / len(cands)
    if owner.num_requests > mean_bs * knobs["overload_factor"]:
        return None, OVERLOAD_BREAK
    return owner, AFFINITY_STICK


class Unified(Policy):
    """unified: stick to the session's instance a while hit_a / input > cache_ratio_gate and
    BS_a <= mean(BS) x overload_factor. Otherwise argmin of
    (P_i + new_i) x BS_i + lmetric_decode_weight x D_i, ties by new_i, then BS_i, then the
    global round-robin counter; the reason says why it did not stick (affinity_new,
    affinity_lost, cache_gate_miss, overload_break).
    Knobs: overload_factor (2.0), cache_ratio_gate (0.5), lmetric_decode_weight (0)."""

    name = "unified"
    needs_session = True
    schema = UNIFIED_KNOBS

    def pick(self, req, view):
        owner, why = affinity_gate(view, self.knobs)
        cands = view.candidates
        w = self.knobs["lmetric_decode_weight"]
        scores = [(c.pending_prefill + c.new) * c.num_requests + w * c.decode_tokens for c in cands]
        terms = [terms_of(c, s) for c, s in zip(cands, scores)]
        if owner is not None:
            # Every candidate's terms, the fallback's score included: the receipt shows what
            # sticking was weighed against. The same O(n) a fallback decision already costs.
            return Pick(owner.index, AFFINITY_STICK, terms)
        k, _, used = argmin_with_ties(cands, scores, (lambda c: c.new, lambda c: c.num_requests),
                                      view.rr_counter)
        return Pick(cands[k].index, why, terms, uses_rr=used)
