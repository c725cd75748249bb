"""load_only: the instance with the fewest requests in flight. No knobs."""

from __future__ import annotations

from router.policies.base import Pick, Policy, argmin_first, terms_of


class LoadOnly(Policy):
    """load_only: argmin BS_i (requests in flight); ties go to the first instance in order,
    as in the seed study. Cache-blind. No knobs."""

    name = "load_only"

    def pick(self, req, view):
        cands = view.candidates
        scores = [c.num_requests for c in cands]
        k, reason = argmin_first(scores)
        return Pick(cands[k].index, reason, [terms_of(c, s) for c, s in zip(cands, scores)])
