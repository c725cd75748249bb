"""lmetric: LMetric's product of prefill work and batch size. No knobs."""

from __future__ import annotations

from router.policies.base import Pick, Policy, argmin_first, terms_of


class LMetric(Policy):
    """lmetric: argmin (P_i + new_i) x BS_i, where P_i is pending prefill tokens, new_i the
    tokens this request would prefill on i, BS_i requests in flight. Strict ``<``: the first
    instance seen wins a tie. An idle instance (BS_i = 0) scores 0 whatever it must prefill,
    which is LMetric's known weakness on long prompts. No knobs."""

    name = "lmetric"

    def pick(self, req, view):
        cands = view.candidates
        scores = [(c.pending_prefill + c.new) * c.num_requests for c in cands]
        k, reason = argmin_first(scores)
        return Pick(cands[k].index, reason, [terms_of(c, s) for c, s in zip(cands, scores)])
