"""round_robin: the next healthy instance in turn. No knobs.

Ignores load and cache; the baseline every other policy is measured against.
"""

from __future__ import annotations

from router.policies.base import ROUND_ROBIN, Pick, Policy, terms_of


class RoundRobin(Policy):
    """round_robin: candidates[rr_counter mod n] over healthy instances. No knobs."""

    name = "round_robin"

    def pick(self, req, view):
        cands = view.candidates
        k = view.rr_counter % len(cands)
        return Pick(cands[k].index, ROUND_ROBIN, [terms_of(c, 0) for c in cands], uses_rr=True)
