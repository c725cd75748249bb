"""sticky: a session stays on the instance its first request went to. No knobs."""

from __future__ import annotations

from router.policies.base import (AFFINITY_LOST, AFFINITY_NEW, AFFINITY_STICK, Pick, Policy,
                                  argmin_first, terms_of)


class Sticky(Policy):
    """sticky: a session's requests always go to its bound instance; a session's first
    request goes to argmin BS_i (ties to the first instance). If the bound instance is
    unhealthy the session is rebound the same way (reason affinity_lost). Highest cache
    reuse, worst balance. No knobs."""

    name = "sticky"
    needs_session = True

    def pick(self, req, view):
        cands = view.candidates
        scores = [c.num_requests for c in cands]
        terms = [terms_of(c, s) for c, s in zip(cands, scores)]
        bound = view.candidate(view.session_instance)
        if bound is not None:  # every candidate's terms: the receipt shows what staying cost
            return Pick(bound.index, AFFINITY_STICK, terms)
        k, _ = argmin_first(scores)
        reason = AFFINITY_NEW if view.session_instance is None else AFFINITY_LOST
        return Pick(cands[k].index, reason, terms)
