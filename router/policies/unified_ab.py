"""unified_ab: unified with a cost in seconds (A) and heavy-session migration (B)."""

from __future__ import annotations

from router.config import Knob, KnobSchema
from router.policies.base import AFFINITY_STICK, MIGRATE, Pick, Policy, argmin_with_ties, terms_of
from router.policies.unified import affinity_gate


class UnifiedAB(Policy):
    """unified_ab: unified plus two changes.

    B, before the gate: a HEAVY request (input >= heavy_threshold) whose session has cache on
    its instance a (hit_a / input > cache_ratio_gate) migrates when
    BS_a > mean(BS) x migration_request_factor and the least-loaded other instance t has
    BS_t < BS_a - migration_min_gap; it goes to t (reason migrate, migrated_from a).

    Then the unified gate (stick while hit_a / input > cache_ratio_gate and
    BS_a <= mean(BS) x overload_factor).

    A, the fallback: argmin of the cost in seconds
    BS_i x decode_iteration_s + (P_i + new_i) / prefill_tps
    + lmetric_decode_weight x D_i / prefill_tps - discount_i,
    with discount_i = min(turn - 1, migration_discount_cap) x decode_iteration_s for i != a
    on turn >= 2 (a long session has already paid for its cache; moving it costs less than a
    fresh start suggests). Ties by new_i, then BS_i, then round-robin. prefill_tps here is
    instance i's measured rate once the fleet has a sample (router/calibration.py; the rate used is
    each candidate's ``tps`` term), the knob before that. Decode tokens are
    turned into seconds through prefill_tps, so lmetric_decode_weight is "a decoding token
    costs this fraction of a prefill token" (our reading of the seed knob).

    Knobs: overload_factor (1.3), cache_ratio_gate (0.5), lmetric_decode_weight (0.01),
    decode_iteration_s (0.05), prefill_tps (5000), migration_discount_cap (5),
    migration_request_factor (1.5), heavy_threshold (20000), migration_min_gap (2)."""

    name = "unified_ab"
    needs_session = True
    schema = KnobSchema((
        Knob("overload_factor", float, 1.3,
             "stick only while the session's instance has BS <= mean(BS) x this", min=0.0, max=100.0),
        Knob("cache_ratio_gate", float, 0.5,
             "stick (or migrate) only while more than this share of the prompt is cached", min=0.0, max=1.0),
        Knob("lmetric_decode_weight", float, 0.01,
             "a decoding token's cost as a fraction of a prefill token", min=0.0, max=1e3),
        Knob("decode_iteration_s", float, 0.05, "seconds one decode step costs per request in the batch",
             min=0.0, max=10.0),
        Knob("prefill_tps", float, 5000.0,
             "prefill tokens per second of one instance, until its own rate is measured", min=1.0, max=1e7),
        Knob("migration_discount_cap", int, 5, "turns of discount a non-owner instance can earn",
             min=0, max=1000),
        Knob("migration_request_factor", float, 1.5,
             "migrate when the owner's BS exceeds mean(BS) x this", min=0.0, max=100.0),
        Knob("heavy_threshold", int, 20000, "input tokens from which a request can migrate",
             min=0, max=10_000_000),
        Knob("migration_min_gap", int, 2, "the target's BS must be below the owner's by more than this",
             min=0, max=10_000),
    ))

    def pick(self, req, view):
        kn = self.knobs
        cands = view.candidates
        owner = view.candidate(view.session_instance)
        if owner is not None and view.input_tokens >= kn["heavy_threshold"] \
                and owner.hit / view.input_tokens > kn["cache_ratio_gate"] and len(cands) > 1:
            mean_bs = sum(c.num_requests for c in cands) / len(cands)
            if owner.num_requests > mean_bs * kn["migration_request_factor"]:
                others = [c for c in cands if c.index != owner.index]
                target = min(others, key=lambda c: c.num_requests)  # first in order on ties
                if target.num_requests < owner.num_requests - kn["migration_min_gap"]:
                    terms = [terms_of(c, c.num_requests) for c in cands]
                    return Pick(target.index, MIGRATE, terms, migrated_from=owner.index)
        stick, why = affinity_gate(view, kn)
        dit, tps = kn["decode_iteration_s"], kn["prefill_tps"]
        w = kn["lmetric_decode_weight"]
        discount = 0.0
        if view.session_turn >= 2:
            discount = min(view.session_turn - 1, kn["migration_discount_cap"]) * dit
        a = view.session_instance
        rates = [c.prefill_tps or tps for c in cands]  # measured once sampled, else the knob
        scores = [
            c.num_requests * dit + (c.pending_prefill + c.new) / r + w * c.decode_tokens / r
            - (discount if c.index != a else 0.0)
            for c, r in zip(cands, rates)
        ]
        terms = [terms_of(c, s) for c, s in zip(cands, scores)]
        for t, r in zip(terms, rates):
            t["tps"] = round(r, 1)
        if stick is not None:  # every candidate's terms, as unified records them
            return Pick(stick.index, AFFINITY_STICK, terms)
        k, _, used = argmin_with_ties(cands, scores, (lambda c: c.new, lambda c: c.num_requests),
                                      view.rr_counter)
        return Pick(cands[k].index, why, terms, uses_rr=used)
