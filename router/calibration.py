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
interleave with its chunks. Then, with one pseudo-observation at the prior::

    scale_i = (1 + n x sum(S) / sum(T0)) / (n + 1)
    tps_i   = (n0_tokens + sum(q)) / (n0_tokens / prior_tps + sum(S)),  n0_tokens = sum(q) / n

``tps_i`` is the plain tokens-per-second figure (for rules that take one rate; shown in the
state as ``prefill_tps_measured`` = sum(q) / sum(S), without the prior). Only first tokens
the router saw count (a non-streaming answer's is not observable), and only requests with
something to prefill (q > 0).
"""

from __future__ import annotations

from dataclasses import dataclass


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
    __slots__ = ("n", "sum_q", "sum_s", "sum_t0", "last_first")

    def __init__(self) -> None:
        self.n = 0
        self.sum_q = 0
        self.sum_s = 0.0
        self.sum_t0 = 0.0
        self.last_first = float("-inf")


class Calibration:
    """Per-instance prefill measurements. Pure bookkeeping: the caller passes the times."""

    def __init__(self, num_instances: int, prior: PrefillPrior = DEFAULT_PRIOR):
        self.prior = prior
        self._inst = [_Instance() for _ in range(num_instances)]

    def observe(self, instance: int, new_tokens: int, cached_tokens: int, dispatched: float,
                first_token: float) -> float | None:
        """A first token seen on ``instance``; returns the service time recorded, if any."""
        st = self._inst[instance]
        start = max(dispatched, st.last_first)
        st.last_first = max(st.last_first, first_token)
        if new_tokens <= 0:
            return None
        service = first_token - start
        if service <= 0:  # overtaken inside one step: no time of its own to attribute
            return None
        st.n += 1
        st.sum_q += new_tokens
        st.sum_s += service
        st.sum_t0 += self.prior.seconds(new_tokens, cached_tokens)
        return service

    def forget(self, instance: int) -> None:
        """Start over on ``instance`` (it restarted: its speed may have changed)."""
        self._inst[instance] = _Instance()

    # -- what policies read ----------------------------------------------------------
    def last_first(self, instance: int) -> float:
        """When ``instance`` last produced a first token (-inf before any)."""
        return self._inst[instance].last_first

    def samples(self, instance: int) -> int:
        return self._inst[instance].n

    def scale(self, instance: int) -> float:
        """Measured seconds per prior second on ``instance`` (1.0 before any sample)."""
        st = self._inst[instance]
        if st.n == 0 or st.sum_t0 <= 0:
            return 1.0
        return (1.0 + st.n * st.sum_s / st.sum_t0) / (st.n + 1)

    def seconds(self, instance: int, new_tokens: int, cached_tokens: int) -> float:
        """T(q, h) on ``instance``: the prior's shape at the measured scale."""
        return self.scale(instance) * self.prior.seconds(new_tokens, cached_tokens)

    def tps(self, instance: int) -> float:
        """Prefill tokens per second on ``instance``, the prior counted as one observation."""
        st = self._inst[instance]
        if st.n == 0 or st.sum_s <= 0:
            return self.prior.tokens_per_s
        n0 = st.sum_q / st.n
        return (n0 + st.sum_q) / (n0 / self.prior.tokens_per_s + st.sum_s)

    def measured_tps(self, instance: int) -> float | None:
        """sum(q) / sum(S) over the samples alone; None before the first."""
        st = self._inst[instance]
        if st.n == 0 or st.sum_s <= 0:
            return None
        return st.sum_q / st.sum_s

    def snapshot(self, instance: int) -> dict[str, float | int | None]:
        tps = self.measured_tps(instance)
        return {"prefill_tps_measured": round(tps, 1) if tps is not None else None,
                "prefill_tps_samples": self.samples(instance)}
