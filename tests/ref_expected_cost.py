"""expected_cost's pick as it was before its per-request CPU was cut (issue 37, helper ecpick),
copied verbatim from router/policies/expected_cost.py (only the class renamed and its long
docstring left out): the reference the differential tests compare today's policy with, term by
term and bit for bit (tests/test_expected_cost_identity.py, tests/test_evict_runs.py). Do not
"improve" it: it is the specification of what the fast code must reproduce."""

from __future__ import annotations

import math

from router.calibration import DEFAULT_PRIOR, Calibration
from router.cluster import Candidate, ClusterView
from router.lookahead import Lookahead, SessionInfo
from router.policies.base import (AFFINITY_LOST, AFFINITY_NEW, AFFINITY_STICK, Pick, Policy,
                                  argmin_with_ties, terms_of)


def return_odds(turns: int, gap_sum: float, gaps: int, idle_s: float, fleet_gap_s: float | None) -> float:
    """Probability that a session seen for ``turns`` turns sends another one.

    Laplace's rule on its own history (k turns, k - 1 of them continuations, none seen
    ending): pi = k / (k + 1). Its gaps before a turn (from its last answer's end: an agent
    sends the next turn after reading the answer) are taken as exponential with its own
    mean gap (the fleet's mean while it has none); having been idle ``idle_s`` seconds, Bayes
    gives pi e^(-idle/g) / (pi e^(-idle/g) + 1 - pi)."""
    pi = turns / (turns + 1.0)
    g = gap_sum / gaps if gaps else fleet_gap_s
    if not g or g <= 0:
        return pi
    alive = pi * math.exp(-max(idle_s, 0.0) / g)
    return alive / (alive + 1.0 - pi)


def session_odds(s: SessionInfo, la: Lookahead) -> float:
    return return_odds(s.turns, s.gap_sum, s.gaps, s.idle_s(la.now), la.fleet_gap_s)


def queued_behind_s(wait: float, own: float, gap: float) -> float:
    """Expected seconds a session that returns after an exponential gap of mean ``gap`` (from
    now) waits longer because a prefill of ``own`` seconds starts on its instance after
    ``wait``: all of ``own`` if it arrives before that prefill starts, what is left of it if it
    arrives during it, nothing after: own - gap e^(-wait/gap) (1 - e^(-own/gap))."""
    if own <= 0:
        return 0.0
    return own - gap * math.exp(-wait / gap) * -math.expm1(-own / gap)


class RefExpectedCost(Policy):
    """expected_cost as it was before its per-request cost was cut (see the module doc)."""

    name = "expected_cost"
    needs_session = True
    needs_lookahead = True

    def pick(self, req, view: ClusterView) -> Pick:
        cands = view.candidates
        la = view.lookahead
        turn = view.session_turn
        p_next = turn / (turn + 1.0)
        length = view.input_tokens
        # Today's terms for every candidate; the future terms (evict, keep: never negative, and
        # a walk of the LRU each) only where today's alone do not already exceed the best full
        # cost: skipping the others cannot change the pick or its tie-breaks.
        parts = [self._today(c, la) for c in cands]
        lower = [sum(p.values()) for p in parts]
        best = float("inf")
        odds_of: dict[str, float] = {}
        for k in sorted(range(len(cands)), key=lower.__getitem__):
            if lower[k] > best:
                break
            parts[k].update(self._future(cands[k], la, p_next, length, parts[k], odds_of))
            best = min(best, sum(parts[k].values()))
        scores: list[float] = []
        terms: list[dict] = []
        for c, part in zip(cands, parts):
            score = sum(part.values())
            complete = "evict_s" in part
            scores.append(score if complete else float("inf"))
            t = terms_of(c, round(score, 4))
            # the rate this decision used: i's calibrated prefill tokens/s (the prior before samples)
            t["tps"] = round(la.calibration.tps(c.index) if la is not None else c.prefill_tps, 1)
            t.update({k: round(v, 4) for k, v in part.items()})
            if not complete:
                t["bound"] = True  # score is today's terms only, a lower bound above the best
            terms.append(t)
        k, reason, used = argmin_with_ties(cands, scores, (lambda c: c.new, lambda c: c.num_requests),
                                           view.rr_counter)
        chosen = cands[k]
        if view.session_instance is None:
            reason = AFFINITY_NEW
        elif chosen.index == view.session_instance:
            reason = AFFINITY_STICK
        elif view.candidate(view.session_instance) is None:
            reason = AFFINITY_LOST
        return Pick(chosen.index, reason, terms, uses_rr=used)

    @staticmethod
    def _today(c: Candidate, la: Lookahead | None) -> dict[str, float]:
        if la is None:  # asked as a shadow of a policy without lookahead: counters only
            tps = c.prefill_tps or DEFAULT_PRIOR.tokens_per_s
            own = c.new / tps
            return {"wait_s": c.pending_prefill / tps, "own_s": own, "interf_s": c.num_requests * own}
        own = la.calibration.seconds(c.index, c.new, c.hit)
        return {"wait_s": la.wait_s.get(c.index, 0.0), "own_s": own, "interf_s": c.num_requests * own}

    @staticmethod
    def _future(c: Candidate, la: Lookahead | None, p_next: float, length: int,
                today: dict[str, float], odds_of: dict[str, float] | None = None) -> dict[str, float]:
        """The terms of the next turns on ``c``. ``odds_of`` memoises each session's odds of
        return for one decision (a session bound to i is priced in queue_i, keep_i and evict_i;
        its odds depend on it and the decision's time alone)."""
        if la is None:
            return {"queue_s": 0.0, "evict_s": 0.0, "keep_s": 0.0}
        if odds_of is None:
            odds_of = {}
        cal = la.calibration
        i = c.index
        scale = cal.scale(i)
        prior = cal.prior.seconds  # cal.seconds(i, q, h) is scale * prior(q, h): the same product
        own = today["own_s"]
        wait = today["wait_s"]
        now = la.now
        fleet_gap = la.fleet_gap_s
        # one pass over the sessions priced one by one (la.bound), the rest as one sum
        queue = 0.0
        demand = la.settled(i)
        for s in la.bound(i):
            g = s.gap_sum / s.gaps if s.gaps else fleet_gap
            odds = odds_of.get(s.session_id)
            if odds is None:
                odds = odds_of[s.session_id] = return_odds(s.turns, s.gap_sum, s.gaps, s.idle_s(now), fleet_gap)
            if own > 0 and g:  # no gap seen anywhere yet: no evidence of returns to price
                held = queued_behind_s(wait, own, g)
                queue += odds * min(held, scale * prior(s.last_input_tokens, 0))
            demand += odds * s.last_input_tokens
        evict = 0.0
        for s, lost in la.victims(i):
            ctx = s.last_input_tokens
            lost = min(lost, ctx)
            odds = odds_of.get(s.session_id)
            if odds is None:
                odds = odds_of[s.session_id] = session_odds(s, la)
            evict += odds * (scale * prior(lost, ctx - lost))
        keep = 0.0
        if p_next > 0:
            lost = min(length, max(0, int(demand + length - la.capacity_tokens[i])))
            if lost:
                keep = p_next * (scale * prior(lost, length - lost))
        return {"queue_s": queue, "evict_s": evict, "keep_s": keep}


def ref_wait_s(cluster, cands, now: float) -> dict[int, float]:
    """``Cluster.lookahead``'s queued seconds per candidate as they were computed before (router/
    cluster.py), verbatim: each pending request's calibrated T(q, h), the head's service taken off."""
    cal = cluster.calibration
    wait: dict[int, float] = {}
    for c in cands:
        i = c.index
        tickets = cluster._prefilling[i]
        if tickets:
            total = 0.0
            head = None
            for t in tickets.values():
                total += cal.seconds(i, t.new_prefill, t.input_tokens - t.new_prefill)
                if head is None or t.started < head.started:
                    head = t
            # the head has been served since it arrived or the last first token, whichever is later
            done = now - max(head.started, cal.last_first(i))
            head_s = cal.seconds(i, head.new_prefill, head.input_tokens - head.new_prefill)
            total -= min(max(done, 0.0), head_s)
            wait[i] = max(total, 0.0)
        else:
            wait[i] = 0.0
    return wait


class RefCalibration(Calibration):
    """router/calibration.py's Calibration with its estimate (``_refresh``) as it was, verbatim."""

    def _refresh(self) -> None:
        insts = self._inst
        big_n = sum(st.n for st in insts)
        r0 = self.prior.tokens_per_s
        if big_n == 0:
            self._scale = [1.0] * len(insts)
            self._tps = [r0] * len(insts)
            self._weight = [0.0] * len(insts)
            return
        sum_q = sum(st.sum_q for st in insts)
        sum_s = sum(st.sum_s for st in insts)
        sum_t0 = sum(st.sum_t0 for st in insts)
        k_fleet = (1.0 + big_n * sum_s / sum_t0) / (big_n + 1)
        q_mean = sum_q / big_n
        tps_fleet = (q_mean + sum_q) / (q_mean / r0 + sum_s)
        sampled = [st for st in insts if st.n]
        weights = {id(st): 0.0 for st in insts}
        dof = big_n - len(sampled)
        if len(sampled) >= 2 and dof >= 1:
            within = sum(max(0.0, st.sum_xx - st.sum_x * st.sum_x / st.n) for st in sampled) / dof  # (the fix: never below 0)
            means = [st.sum_x / st.n for st in sampled]
            mu = sum(means) / len(means)
            between = sum((m - mu) ** 2 for m in means) / (len(means) - 1)
            tau2 = between - within * sum(1.0 / st.n for st in sampled) / len(sampled)
            if tau2 > 0:
                m = within / tau2  # pseudo-samples of the fleet's value each instance starts with
                for st in sampled:
                    weights[id(st)] = st.n / (st.n + m)
        self._scale, self._tps, self._weight = [], [], []
        for st in insts:
            w = weights[id(st)]
            self._weight.append(w)
            if w > 0:
                self._scale.append((1 - w) * k_fleet + w * st.sum_s / st.sum_t0)
                self._tps.append((1 - w) * tps_fleet + w * st.sum_q / st.sum_s)
            else:
                self._scale.append(k_fleet)
                self._tps.append(tps_fleet)
