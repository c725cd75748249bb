"""Each instance's prefill speed, measured online from its first tokens, with a profile prior.

Every policy or rule that turns tokens into seconds (``expected_cost``, ``unified_ab``,
offload's ``cost`` mode) reads its rate here, per instance, instead of a fixed knob.

The model of one request's prefill, ``q`` new tokens after ``h`` cached ones, is the
engine model's own (reference/vllm-engine-model.md, kvtop/sim/profiles.py: linear layers
``b`` per token plus causal attention ``c x (2qh + q^2)``), written as::

    T0(q, h) = (q + (2qh + q^2) / (2 x attention_tokens)) / tokens_per_s

with ``tokens_per_s = 1/b`` and ``attention_tokens = b / 2c`` (the context at which a
token's attention costs as much as its linear layers). Those two numbers are the PRIOR:
``DEFAULT_PRIOR`` is the h20 profile's (Qwen3-30B-A3B on an H20; a test derives it from the
profile), ``kvtop route --assumed-prefill-tps`` replaces its rate. What is MEASURED is the
scale: ``T(q, h) = scale_i x T0(q, h)``.

Measurement: a request's service time on instance i is taken the way a FIFO queue's is
recovered from its departures, ``S = t_first_token - max(t_dispatch, previous first token
on i)``: time it spent at the head of i's prefill queue, including the decode steps that
interleave with its chunks. Only first tokens the router saw count (a non-streaming
answer's is not observable), and only requests with something to prefill (q > 0).

Estimate, in two levels. The fleet's scale counts the prior as one observation::

    k_fleet = (1 + N x sum(S) / sum(T0)) / (N + 1)        over all N samples
    tps_fleet = (q_mean + sum(q)) / (q_mean / prior_tps + sum(S))

and each instance's is shrunk toward it by how much of the spread between instances is
real (empirical Bayes on x = ln(S / T0)): with s_w^2 the variance of x within instances and
tau^2 = var(instance means) - s_w^2 x mean(1 / n_i) the part left for real differences,
an instance with n_i samples weighs its own ratio w_i = n_i / (n_i + s_w^2 / tau^2)::

    scale_i = (1 - w_i) x k_fleet + w_i x sum_i(S) / sum_i(T0)

w_i = 0 (every instance takes the fleet's value) while tau^2 <= 0 or there are too few
samples to tell; a fleet of identical GPUs therefore gets one well-measured rate rather than
n noisy ones, and a mixed fleet separates as soon as its measurements do. ``tps_i`` (for
rules that take one rate) is shrunk the same way; the state shows each instance's raw
``prefill_tps_measured`` = sum_i(q) / sum_i(S).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from router.engine_fit import EngineFit


@dataclass(frozen=True, slots=True)
class PrefillPrior:
    """What an instance is assumed to do before anything is measured."""

    tokens_per_s: float  # 1 / b: the linear layers' prefill rate
    attention_tokens: float  # b / 2c: context where attention costs as much as the linear layers

    def seconds(self, q: int, h: int) -> float:
        """T0(q, h): seconds to prefill ``q`` tokens after ``h`` cached ones, by the prior."""
        if q <= 0:
            return 0.0
        return (q + (2.0 * q * h + q * q) / (2.0 * self.attention_tokens)) / self.tokens_per_s


#: The h20 profile's b = 187e-6 s/token and c = 2.8e-9 s/token^2 (kvtop/sim/profiles.py H20,
#: fitted to Qwen's H20 speed table): 1/b = 5,348 tokens/s, b/2c = 33,393 tokens. The router
#: already assumes this GPU for its default cache capacity (265,000 tokens).
DEFAULT_PRIOR = PrefillPrior(tokens_per_s=1 / 187e-6, attention_tokens=187e-6 / (2 * 2.8e-9))


class _Instance:
    __slots__ = ("n", "sum_q", "sum_s", "sum_t0", "sum_x", "sum_xx", "last_first")

    def __init__(self) -> None:
        self.n = 0
        self.sum_q = 0
        self.sum_s = 0.0
        self.sum_t0 = 0.0
        self.sum_x = 0.0  # ln(S / T0) per sample, for the spread within and between instances
        self.sum_xx = 0.0
        self.last_first = float("-inf")


class Calibration:
    """Per-instance prefill measurements. Pure bookkeeping: the caller passes the times."""

    def __init__(self, num_instances: int, prior: PrefillPrior = DEFAULT_PRIOR):
        self.prior = prior
        self._inst = [_Instance() for _ in range(num_instances)]
        self._samples = 0  # over every instance: ``measured`` is read per decision
        self.engine = EngineFit(num_instances)  # the engine's scale without per-request overheads
        self._scale: list[float] | None = None  # computed on first read after a change
        self._tps: list[float] = []
        self._weight: list[float] = []

    def observe(self, instance: int, new_tokens: int, cached_tokens: int, dispatched: float,
                first_token: float) -> float | None:
        """A first token seen on ``instance``; returns the service time recorded, if any."""
        st = self._inst[instance]
        start = max(dispatched, st.last_first)
        if new_tokens > 0:
            # the engine's own scale, for backlog seconds (router/engine_fit.py): was a backlog
            # standing (this request waiting while the previous first token came)?
            t0 = self.prior.seconds(new_tokens, cached_tokens)
            self.engine.observe(instance, t0, max(first_token - start, 0.0), dispatched < st.last_first)
        st.last_first = max(st.last_first, first_token)
        if new_tokens <= 0:
            return None
        service = first_token - start
        if service <= 0:  # overtaken inside one step: no time of its own to attribute
            return None
        x = math.log(service / t0)
        st.n += 1
        self._samples += 1
        st.sum_q += new_tokens
        st.sum_s += service
        st.sum_t0 += t0
        st.sum_x += x
        st.sum_xx += x * x
        self._scale = None
        return service

    def add_instance(self) -> None:
        """A new instance, measured from nothing (the fleet's estimate until it has samples)."""
        self._inst.append(_Instance())
        self.engine.add_instance()
        self._scale = None

    def forget(self, instance: int) -> None:
        """Start over on ``instance`` (it restarted: its speed may have changed)."""
        self._samples -= self._inst[instance].n
        self._inst[instance] = _Instance()
        self.engine.forget(instance)
        self._scale = None

    def _refresh(self) -> None:
        """The fleet's estimate (the prior as one observation), then each instance's, shrunk
        toward the fleet's by its share of the evidence (empirical Bayes, see the module doc).
        Run on the first read after a sample, so once per streamed request: each sum is sum()
        over a list gathered in one pass, the same values in the same order as a generator
        over the instances would give it (the same floats), at less cost."""
        insts = self._inst
        r0 = self.prior.tokens_per_s
        ns: list[int] = []
        qs: list[int] = []
        ss: list[float] = []
        t0s: list[float] = []
        for st in insts:
            ns.append(st.n)
            qs.append(st.sum_q)
            ss.append(st.sum_s)
            t0s.append(st.sum_t0)
        big_n = sum(ns)
        if big_n == 0:
            self._scale = [1.0] * len(insts)
            self._tps = [r0] * len(insts)
            self._weight = [0.0] * len(insts)
            return
        sum_q = sum(qs)
        sum_s = sum(ss)
        sum_t0 = sum(t0s)
        k_fleet = (1.0 + big_n * sum_s / sum_t0) / (big_n + 1)
        q_mean = sum_q / big_n
        tps_fleet = (q_mean + sum_q) / (q_mean / r0 + sum_s)
        sampled = [k for k, n in enumerate(ns) if n]
        weights = [0.0] * len(insts)
        dof = big_n - len(sampled)
        if len(sampled) >= 2 and dof >= 1:
            spread: list[float] = []  # sum_xx - sum_x^2 / n: each instance's within-variance sum
            means: list[float] = []
            inverse: list[float] = []
            for k in sampled:
                st = insts[k]
                # never below 0: identical samples leave a rounding error of either sign, and a
                # negative within-variance made m = -n (a division by zero) or a weight past 1
                d = st.sum_xx - st.sum_x * st.sum_x / st.n
                spread.append(d if d > 0.0 else 0.0)
                means.append(st.sum_x / st.n)
                inverse.append(1.0 / st.n)
            within = sum(spread) / dof
            mu = sum(means) / len(means)
            between = sum([(m - mu) ** 2 for m in means]) / (len(means) - 1)
            tau2 = between - within * sum(inverse) / len(sampled)
            if tau2 > 0:
                m = within / tau2  # pseudo-samples of the fleet's value each instance starts with
                for k in sampled:
                    weights[k] = ns[k] / (ns[k] + m)
        scale: list[float] = []
        tps: list[float] = []
        for st, w in zip(insts, weights):
            if w > 0:
                scale.append((1 - w) * k_fleet + w * st.sum_s / st.sum_t0)
                tps.append((1 - w) * tps_fleet + w * st.sum_q / st.sum_s)
            else:
                scale.append(k_fleet)
                tps.append(tps_fleet)
        self._scale, self._tps, self._weight = scale, tps, weights

    # -- what policies read ----------------------------------------------------------
    def last_first(self, instance: int) -> float:
        """When ``instance`` last produced a first token (-inf before any)."""
        return self._inst[instance].last_first

    def samples(self, instance: int) -> int:
        return self._inst[instance].n

    @property
    def measured(self) -> bool:
        """Has any instance a sample yet (before that, every rate is the prior)?"""
        return self._samples > 0

    def scale(self, instance: int) -> float:
        """Measured seconds per prior second on ``instance`` (1.0 before any sample anywhere)."""
        if self._scale is None:
            self._refresh()
        return self._scale[instance]

    def own_weight(self, instance: int) -> float:
        """How much of ``instance``'s scale is its own measurement (0: the fleet's)."""
        if self._scale is None:
            self._refresh()
        return self._weight[instance]

    def seconds(self, instance: int, new_tokens: int, cached_tokens: int) -> float:
        """T(q, h) on ``instance``: the prior's shape at the measured scale."""
        return self.scale(instance) * self.prior.seconds(new_tokens, cached_tokens)

    def tps(self, instance: int) -> float:
        """Prefill tokens per second on ``instance`` (shrunk toward the fleet's like ``scale``)."""
        if self._scale is None:
            self._refresh()
        return self._tps[instance]

    def rates(self) -> tuple[list[float], list[float]]:
        """Every instance's ``(scale, tps)`` as two lists by instance index, what ``scale`` and
        ``tps`` give one by one (a decision reads them once, not per candidate). Read only: a
        change of the measurements replaces them, so a reader holds the ones it was given."""
        if self._scale is None:
            self._refresh()
        return self._scale, self._tps

    def measured_tps(self, instance: int) -> float | None:
        """sum(q) / sum(S) over the instance's own samples alone; None before the first."""
        st = self._inst[instance]
        if st.n == 0 or st.sum_s <= 0:
            return None
        return st.sum_q / st.sum_s

    def snapshot(self, instance: int) -> dict[str, float | int | None]:
        tps = self.measured_tps(instance)
        return {"prefill_tps_measured": round(tps, 1) if tps is not None else None,
                "prefill_tps_samples": self.samples(instance)}
