"""leastwork_kappa: leastwork with decode load inflating the prefill cost."""

from __future__ import annotations

from router.config import Knob, KnobSchema
from router.policies.base import Pick, Policy, argmin_with_ties, terms_of


class LeastWorkKappa(Policy):
    """leastwork_kappa: argmin (P_i + new_i) x (1 + kappa x D_i), where D_i is the tokens of
    requests decoding on i: prefill on a busy decoder runs slower and stalls its decodes.
    Ties by fewest BS_i, then the global round-robin counter.
    Knobs: kappa (2.5e-6 per decode token)."""

    name = "leastwork_kappa"
    schema = KnobSchema((
        Knob("kappa", float, 2.5e-6, "weight of decoding tokens on the prefill cost, per token",
             min=0.0, max=1.0),
    ))

    def pick(self, req, view):
        cands = view.candidates
        kappa = self.knobs["kappa"]
        scores = [(c.pending_prefill + c.new) * (1.0 + kappa * c.decode_tokens) for c in cands]
        k, reason, used = argmin_with_ties(cands, scores, (lambda c: c.num_requests,), view.rr_counter)
        return Pick(cands[k].index, reason, [terms_of(c, s) for c, s in zip(cands, scores)], uses_rr=used)
