"""expected_cost: the instance with the least expected cost in seconds, now and next turn. No knobs."""

from __future__ import annotations

import math
from math import exp, expm1

from router.calibration import DEFAULT_PRIOR
from router.cluster import Candidate, ClusterView
from router.lookahead import Lookahead, SessionInfo
from router.policies.base import (AFFINITY_LOST, AFFINITY_NEW, AFFINITY_STICK, ARGMIN, TIE_RR, Pick, Policy,
                                  argmin_with_ties)

INF = float("inf")
NO_FUTURE = (0.0, 0.0, 0.0)  # the future terms without a lookahead
#: Ties by new_i, then BS_i, then the round-robin counter.
TIE_ATTRS = ("new", "num_requests")
TIE_KEYS = (lambda c: c.new, lambda c: c.num_requests)


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


class ExpectedCost(Policy):
    """expected_cost: argmin over healthy instances i of the expected seconds this placement
    costs, everyone's, now and at the next turns:

        cost_i = wait_i + own_i + interference_i + queue_i + evict_i + keep_i

    - wait_i: the prefill queued on i ahead of this request, each pending request's T_i(q, h)
      summed, less the service the head has had (chunked prefill serves the queue in order);
    - own_i = T_i(new_i, hit_i): this request's prefill of its uncached tokens after its
      cached ones, attention included (T grows with context);
    - interference_i = BS_i x own_i: every request in flight on i decodes while this prefill
      runs (those decoding now, and those prefilling ahead of it once they finish), one token
      per chunk, so each is held up by about the length of this prefill (only one with
      fewer tokens left to decode than the prefill has steps, new_i / the token budget, at
      most 25 on an H20, is held up less: docs/policies.md);
    - queue_i = sum over the other sessions bound to i of
      p_return(s) x min(queued_behind(wait_i, own_i, g_s), T_i(context_s, 0)): the turns
      that will arrive at i while this request waits or prefills there, each held up by
      the part of own_i still ahead of it (queued_behind, with s's return after an
      exponential gap of its own mean g_s from now), but never longer than re-prefilling
      its whole context elsewhere would cost it (it would move);
    - evict_i = sum over the sessions whose blocks this request's new blocks would evict
      from i (the estimated LRU's oldest end, sessions still bound to i) of
      p_return(s) x T_i(evicted_s, context_s - evicted_s): their tail re-prefilled if they return;
    - keep_i = p_next x T_i(lost_i, L - lost_i): this session's own prefix lost on i before its
      next turn, lost_i = min(L, max(0, demand_i + L - capacity_i)), where demand_i is the
      context of the other sessions bound to i weighted by their p_return and L this
      request's input: the value of keeping the prefix where it will stay.

    T_i(q, h) = scale_i x (q + (2qh + q^2) / (2 A)) / R: the prior's shape (R prefill tokens/s
    of the linear layers, A = the context where attention costs as much; from the engine
    profile) at i's measured scale (router/calibration.py). p_return(s): Laplace's rule on
    the session's turns, k / (k + 1), discounted by its idle time (since its last answer
    ended; none while a request of its is in flight) against its own mean gap from an
    answer's end to its next turn (the fleet's while it has none). p_next = turn / (turn + 1).

    The sessions bound to i are those the lookahead lists (``Lookahead.bound``: the ones in
    flight there and at most ``LOOKAHEAD_IDLE`` idle ones, the most recently active) and,
    while no session has returned yet, the rest as one prior-weighted sum
    (``Lookahead.settled``): a decision costs O(the fleet + the request's blocks), not
    O(sessions held) (docs/policies.md, "What a decision costs").

    Ties by new_i, then BS_i, then the global round-robin counter. Reasons: affinity_stick
    (stayed on the session's instance), affinity_new (first turn), affinity_lost (its instance
    is unhealthy), argmin / tie_rr (moved). Nothing is tuned: the constants are the profile's
    or measured. No knobs."""

    name = "expected_cost"
    needs_session = True
    needs_lookahead = True

    def __init__(self, knobs=None):
        super().__init__(knobs)
        self._tps_rounded: dict[float, float] = {}  # a rate -> round(rate, 1), as the record shows it

    def pick(self, req, view: ClusterView) -> Pick:
        # Per candidate, today's terms (wait, own, interference); the future terms (queue,
        # evict, keep: never negative, and a walk of the LRU each) only where today's alone do
        # not already exceed the best full cost: skipping the others cannot change the pick or
        # its tie-breaks. A score is sum() over the terms in the record's order, the same float
        # on every Python. tests/ref_expected_cost.py is the readable form of what this
        # computes, bit for bit: here with tuples, no min()/max() and no call per term (each
        # costs more than the arithmetic it does).
        cands = view.candidates
        la = view.lookahead
        turn = view.session_turn
        p_next = turn / (turn + 1.0)
        n = len(cands)
        today, lower, scales = self._today(cands, la)
        order = sorted(range(n), key=lower.__getitem__) if n > 1 else range(n)
        future: list[tuple[float, float, float] | None] = [None] * n
        full = [INF] * n  # inf: today's terms only, a lower bound above the best
        best = INF
        odds_of: dict[str, float] = {}
        for k in order:
            if lower[k] > best:
                break
            if la is None:
                f = NO_FUTURE
            else:
                f = self._next_turns(cands[k].index, la, scales[k], p_next, view.input_tokens, today[k], odds_of)
            future[k] = f
            full[k] = score = sum(today[k] + f)
            if score < best:  # best = min(best, score)
                best = score
        tps_of = self._tps_rounded
        if len(tps_of) > n:  # rates the calibration no longer gives: at most one per instance is live
            tps_of.clear()
        rates = la.calibration.rates()[1] if la is not None else None
        terms: list[dict] = []
        for k, c in enumerate(cands):
            wait, own, interf = today[k]
            # the rate this decision used: i's calibrated prefill tokens/s (the prior before samples)
            tps = rates[c.index] if rates is not None else c.prefill_tps
            tps_r = tps_of.get(tps)
            if tps_r is None:
                tps_r = tps_of[tps] = round(tps, 1)
            # round(0.0, 4) is 0.0 (and -0.0 stays -0.0): zeros skip the call
            f = future[k]
            if f is None:  # score is today's terms only, a lower bound above the best
                score = lower[k]
                terms.append({"instance": c.name, "hit": c.hit, "new": c.new, "P": c.pending_prefill,
                              "BS": c.num_requests, "D": c.decode_tokens,
                              "score": round(score, 4) if score else score, "tps": tps_r,
                              "wait_s": round(wait, 4) if wait else wait, "own_s": round(own, 4) if own else own,
                              "interf_s": round(interf, 4) if interf else interf, "bound": True})
            else:
                score = full[k]
                queue, evict, keep = f
                terms.append({"instance": c.name, "hit": c.hit, "new": c.new, "P": c.pending_prefill,
                              "BS": c.num_requests, "D": c.decode_tokens,
                              "score": round(score, 4) if score else score, "tps": tps_r,
                              "wait_s": round(wait, 4) if wait else wait, "own_s": round(own, 4) if own else own,
                              "interf_s": round(interf, 4) if interf else interf,
                              "queue_s": round(queue, 4) if queue else queue,
                              "evict_s": round(evict, 4) if evict else evict,
                              "keep_s": round(keep, 4) if keep else keep})
        k, reason, used = _argmin(cands, full, view.rr_counter)
        chosen = cands[k]
        if view.session_instance is None:
            reason = AFFINITY_NEW
        elif chosen.index == view.session_instance:
            reason = AFFINITY_STICK
        elif view.candidate(view.session_instance) is None:
            reason = AFFINITY_LOST
        return Pick(chosen.index, reason, terms, uses_rr=used)

    @staticmethod
    def _today(cands: list[Candidate], la: Lookahead | None
               ) -> tuple[list[tuple[float, float, float]], list[float], list[float]]:
        """Each candidate's (wait_i, own_i, interference_i), their sums (the lower bounds of
        the scores), and the calibrated scales they used (none without a lookahead)."""
        today: list[tuple[float, float, float]] = []
        lower: list[float] = []
        scales: list[float] = []
        if la is None:  # asked as a shadow of a policy without lookahead: counters only
            for c in cands:
                tps = c.prefill_tps or DEFAULT_PRIOR.tokens_per_s
                own = c.new / tps
                t = (c.pending_prefill / tps, own, c.num_requests * own)
                today.append(t)
                lower.append(sum(t))
            return today, lower, scales
        cal = la.calibration
        scale_of = cal.rates()[0]  # scale_of[i] is cal.scale(i)
        seconds = cal.prior.seconds
        wait_of = la.wait_s
        for c in cands:
            i = c.index
            scale = scale_of[i]
            own = scale * seconds(c.new, c.hit)  # cal.seconds(i, new, hit), the same product
            t = (wait_of.get(i, 0.0), own, c.num_requests * own)
            today.append(t)
            lower.append(sum(t))
            scales.append(scale)
        return today, lower, scales

    @staticmethod
    def _next_turns(i: int, la: Lookahead, scale: float, p_next: float, length: int,
                    today: tuple[float, float, float], odds_of: dict[str, float]) -> tuple[float, float, float]:
        """(queue_i, evict_i, keep_i): the terms of the next turns on instance ``i``, whose
        calibrated scale is ``scale``. ``odds_of`` memoises each session's odds of return for
        one decision (a session bound to i is priced in queue_i, keep_i and evict_i; its odds
        depend on it and the decision's time alone). Per session, ``return_odds`` and
        ``queued_behind_s`` are written out inline, the same expressions in the same order
        (a call each was most of a walk's time), and the latter is computed once per gap."""
        seconds = la.calibration.prior.seconds  # cal.seconds(i, q, h) is scale * prior.seconds(q, h): the same product
        now = la.now
        fleet_gap = la.fleet_gap_s
        # one pass over the sessions priced one by one (la.bound), the rest as one sum
        queue = 0.0
        # settled(i) is 0.0 once the fleet has a gap, bound(i) empty before: neither is asked then
        demand = 0.0 if fleet_gap else la.settled(i)
        bound = la.bound(i) if fleet_gap else None
        if bound:
            wait, own = today[0], today[1]
            held_of: dict[float, float] = {}  # gap -> queued_behind_s(wait, own, gap)
            for s in bound:
                gaps = s.gaps
                g = s.gap_sum / gaps if gaps else fleet_gap
                odds = odds_of.get(s.session_id)
                if odds is None:  # return_odds(s.turns, s.gap_sum, s.gaps, s.idle_s(now), fleet_gap)
                    turns = s.turns
                    odds = turns / (turns + 1.0)
                    if g and g > 0:
                        idle = 0.0 if s.in_flight > 0 else now - (s.last_done if s.last_done > s.last_seen
                                                                  else s.last_seen)
                        if idle < 0.0:  # max(idle, 0.0)
                            idle = 0.0
                        alive = odds * exp(-idle / g)
                        odds = alive / (alive + 1.0 - odds)
                    odds_of[s.session_id] = odds
                ctx = s.last_input_tokens
                if own > 0 and g:  # no gap seen anywhere yet: no evidence of returns to price
                    held = held_of.get(g)
                    if held is None:  # queued_behind_s(wait, own, g), own > 0
                        held = held_of[g] = own - g * exp(-wait / g) * -expm1(-own / g)
                    move = scale * seconds(ctx, 0)  # re-prefilling its context elsewhere
                    queue += odds * (move if move < held else held)  # min(held, move)
                demand += odds * ctx
        evict = 0.0
        for s, lost in la.victims(i):
            ctx = s.last_input_tokens
            if ctx < lost:  # min(lost, ctx)
                lost = ctx
            odds = odds_of.get(s.session_id)
            if odds is None:  # session_odds(s, la), as above
                gaps = s.gaps
                g = s.gap_sum / gaps if gaps else fleet_gap
                turns = s.turns
                odds = turns / (turns + 1.0)
                if g and g > 0:
                    idle = 0.0 if s.in_flight > 0 else now - (s.last_done if s.last_done > s.last_seen
                                                              else s.last_seen)
                    if idle < 0.0:
                        idle = 0.0
                    alive = odds * exp(-idle / g)
                    odds = alive / (alive + 1.0 - odds)
                odds_of[s.session_id] = odds
            evict += odds * (scale * seconds(lost, ctx - lost))
        keep = 0.0
        if p_next > 0:
            # lost = min(length, max(0, int(demand + length - capacity_i)))
            lost = int(demand + length - la.capacity_tokens[i])
            if lost > length:
                lost = length
            if lost > 0:
                keep = p_next * (scale * seconds(lost, length - lost))
        return queue, evict, keep


def _argmin(cands: list[Candidate], scores: list[float], rr_counter: int) -> tuple[int, str, bool]:
    """``argmin_with_ties(cands, scores, (new_i, BS_i), rr_counter)`` (router/policies/base.py)
    written out without its generators: the lowest score; ties by new_i, then BS_i, then the
    round-robin counter."""
    best = min(scores)
    if best != best:  # NaN: the general form, as it always was
        return argmin_with_ties(cands, scores, TIE_KEYS, rr_counter)
    if scores.count(best) == 1:  # one lowest score (list methods, not a Python loop)
        return scores.index(best), ARGMIN, False
    tied = []
    for k, s in enumerate(scores):
        if s == best:
            tied.append(k)
    if len(tied) == 1:
        return tied[0], ARGMIN, False
    for attr in TIE_ATTRS:
        low = None
        kept: list[int] = []
        for k in tied:  # the lowest value of the key (all ints), in candidate order
            v = getattr(cands[k], attr)
            if low is None or v < low:
                low = v
                kept = [k]
            elif v == low:
                kept.append(k)
        tied = kept
        if len(tied) == 1:
            return tied[0], ARGMIN, False
    return tied[rr_counter % len(tied)], TIE_RR, True
