"""The engine's own prefill scale, each request's fixed overheads left out: for backlog seconds.

router/calibration.py measures a request's service time on instance i as a FIFO queue's,
``S = t_first_token - max(t_dispatch, previous first token on i)``. On an idle instance that
``S`` holds the request's fixed overheads too (HTTP, parsing, tokenizing, the router's own
path: paid before the engine starts), so ``sum(q) / sum(S)`` is the right rate for one
request on an idle instance but counts those overheads once per request in a backlog, where
each request's overlap the prefill before it. Here, per instance, two sets of sums:

- first tokens on an IDLE instance (dispatched after the previous first token): a least-squares
  fit of ``S = a + k x T0`` (``T0``: the prior's seconds, calibration.py), ``a`` >= 0;
- first tokens that came while a BACKLOG stood (dispatched before the previous first token):
  their gap is engine time alone, ``S = k x T0`` (two first tokens in one step: a gap of 0,
  their tokens counted, no time).

``scale()`` is ``k`` of one least-squares fit to both. Once the drains number
``MIN_DRAIN_SAMPLES`` and weigh as much as the idle samples (sum of ``T0^2``), ``k`` is
theirs alone: a loaded host's stalls are not all fixed (they grow with the request, as an
idle fit's slope then does), and a drain is what backlog seconds predict. Routing does not
read it (policies price requests with the calibration's own ``seconds``); router/backlog.py
does.
"""

from __future__ import annotations

#: First tokens ``scale`` needs, and how many from drains before it says they are in it.
MIN_FIT_SAMPLES = 4
MIN_DRAIN_SAMPLES = 4


class _Sums:
    __slots__ = ("n", "t", "s", "tt", "ts", "dn", "dtt", "dts")

    def __init__(self) -> None:
        self.n = 0  # idle: count, sum T0, sum S, sum T0^2, sum T0 x S
        self.t = self.s = self.tt = self.ts = 0.0
        self.dn = 0  # drains: count, sum T0^2, sum T0 x S
        self.dtt = self.dts = 0.0


class EngineFit:
    """Per-instance sums for ``S = a + k x T0`` (idle) and ``S = k x T0`` (drains)."""

    def __init__(self, num_instances: int):
        self._inst = [_Sums() for _ in range(num_instances)]

    def observe(self, instance: int, t0: float, service: float, backlog: bool) -> None:
        """One first token: ``t0`` prior seconds, ``service`` its S (>= 0), ``backlog``: it
        was dispatched before the instance's previous first token."""
        u = self._inst[instance]
        if backlog:
            u.dn += 1
            u.dtt += t0 * t0
            u.dts += t0 * service
        elif service > 0:
            u.n += 1
            u.t += t0
            u.s += service
            u.tt += t0 * t0
            u.ts += t0 * service

    def add_instance(self) -> None:
        self._inst.append(_Sums())

    def forget(self, instance: int) -> None:
        self._inst[instance] = _Sums()

    def samples(self, instance: int) -> int:
        u = self._inst[instance]
        return u.n + u.dn

    def scale(self, instance: int | None = None) -> tuple[float, bool] | None:
        """``(k, from_drains)`` on ``instance`` (the fleet's sums: None); None while the samples
        cannot separate ``a`` from ``k`` (fewer than ``MIN_FIT_SAMPLES``, or idle samples all of
        one size and too few drains)."""
        n = dn = 0
        t = s = tt = ts = dtt = dts = 0.0
        for u in self._inst if instance is None else [self._inst[instance]]:
            n, t, s, tt, ts = n + u.n, t + u.t, s + u.s, tt + u.tt, ts + u.ts
            dn, dtt, dts = dn + u.dn, dtt + u.dtt, dts + u.dts
        drained = dn >= MIN_DRAIN_SAMPLES
        if drained and dtt >= tt:
            return (dts / dtt, True) if dts > 0 else None
        if n + dn < MIN_FIT_SAMPLES:
            return None
        all_tt, all_ts = tt + dtt, ts + dts
        det = n * all_tt - t * t
        if n and det > 1e-9 * n * all_tt:
            a = max((s * all_tt - t * all_ts) / det, 0.0)
        elif drained:
            a = 0.0
        else:
            return None  # idle samples all of one size and too few drains: a and k inseparable
        k = (all_ts - a * t) / all_tt
        return (k, drained) if k > 0 else None
