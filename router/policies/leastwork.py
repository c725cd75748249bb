"""leastwork (alias lpwl): least prefill work, counting the cache. No knobs."""

from __future__ import annotations

from router.policies.base import Pick, Policy, argmin_with_ties, terms_of


class LeastWork(Policy):
    """leastwork (alias lpwl, least pending work with locality): argmin P_i + new_i, the
    prefill tokens queued on i plus what this request would add there. Ties by fewest BS_i,
    then the global round-robin counter. A returning session's instance wins while its
    backlog is smaller than the cache saving (P_a < hit_a + P_j) and loses beyond it.
    No knobs."""

    name = "leastwork"
    aliases = ("lpwl",)

    def pick(self, req, view):
        cands = view.candidates
        scores = [c.pending_prefill + c.new for c in cands]
        k, reason, used = argmin_with_ties(cands, scores, (lambda c: c.num_requests,), view.rr_counter)
        return Pick(cands[k].index, reason, [terms_of(c, s) for c, s in zip(cands, scores)], uses_rr=used)
