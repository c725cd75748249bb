"""Prefill admission packing: which waiting requests an instance takes now (pure core + a gate).

``admit`` is the whole rule. The routing pipeline (router/pipeline.py) keeps one
``AdmissionQueue`` per router, for the live router and the offline simulator alike; an
experiment can also drive the simulated engine's own waiting queue with it (``engine_hook``).

- An instance with nothing pending always admits one (the head), so nothing stalls forever.
- ``fifo`` takes the head while pending + cost fits ``budget``, and stops at the first misfit.
- ``pack`` looks at the first ``lookahead`` waiting, greedily takes the cheapest that fit,
  and returns them in arrival order.
- The queue is in service order: priority (lower first), then arrival (``AdmissionQueue``).
- Round ``round_no`` with ``round_no % force_fifo_every == 0`` is FIFO. The caller moves to
  the next round only after a round admitted something, so a forced-FIFO round that cannot
  admit its head holds everyone behind it until the head fits (or nothing is pending): a long
  prompt cannot starve behind a stream of short ones.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

MODES = ("off", "fifo", "pack")


def is_fifo_round(mode: str, round_no: int, force_fifo_every: int) -> bool:
    return mode != "pack" or (force_fifo_every > 0 and round_no % force_fifo_every == 0)


def admit(queue: Sequence[int], pending_prefill: int, budget: int, lookahead: int, mode: str,
          round_no: int, force_fifo_every: int) -> list[int]:
    """Indices into ``queue`` (each entry a request's prefill cost in tokens) to admit now."""
    if not queue:
        return []
    room = budget - pending_prefill
    taken: list[int] = []
    if is_fifo_round(mode, round_no, force_fifo_every):
        for k, cost in enumerate(queue):
            if cost > room:
                break
            taken.append(k)
            room -= cost
    else:
        window = range(min(len(queue), max(1, lookahead)))
        for k in sorted(window, key=lambda k: (queue[k], k)):
            cost = queue[k]
            if cost > room:
                break  # sorted by cost: nothing later fits either
            taken.append(k)
            room -= cost
        taken.sort()
    if not taken and pending_prefill <= 0:
        taken = [0]
    return taken


def engine_hook(name: str, knobs: dict[str, Any] | None = None):
    """An ``Engine(admission=...)`` hook running ``admit`` over the engine's waiting queue.

    The engine's own room is the step's remaining token budget, and chunked prefill lets
    vLLM start a prompt larger than that: a FIFO round (``fifo``, or pack's forced round)
    returns the window in arrival order, which is vLLM's own behaviour (the engine chunks the
    last one into what is left). A pack round passes pending 0 and the step budget to
    ``admit``. ``admission_lookahead`` and ``admission_force_fifo_every`` come from ``knobs``.
    """
    if name not in ("fifo", "pack"):
        raise ValueError(f"unknown admission {name!r}; expected fifo or pack")
    knobs = knobs or {}
    lookahead = int(knobs.get("admission_lookahead", 8))
    every = int(knobs.get("admission_force_fifo_every", 4))
    state = {"round": 1}

    def hook(views, budget: int) -> list[int]:
        if is_fifo_round(name, state["round"], every):
            picked = list(range(len(views)))
        else:
            picked = admit([v.cost for v in views], 0, budget, lookahead, name, state["round"], every)
        if picked:
            state["round"] += 1
        return picked

    return hook


class AdmissionQueue:
    """Per-instance waiting lists and admitted-but-unprefilled tokens, without any clock.

    A waiting list is in service order: by priority (lower first, as vLLM's priority
    scheduler orders its own waiting queue), then arrival. Without the ``priority`` feature
    every request has priority 0 and the order is arrival order (router/priority.py)."""

    def __init__(self, num_instances: int):
        self.waiting: list[list[tuple[Any, int]]] = [[] for _ in range(num_instances)]
        self.ranks: list[list[tuple[int, int]]] = [[] for _ in range(num_instances)]  # (priority, arrival)
        self.admitted: list[dict[Any, int]] = [{} for _ in range(num_instances)]
        self.rounds = [1] * num_instances
        self._arrivals = 0

    def add_instance(self) -> None:
        self.waiting.append([])
        self.ranks.append([])
        self.admitted.append({})
        self.rounds.append(1)

    def pending(self, instance: int) -> int:
        return sum(self.admitted[instance].values())

    def enqueue(self, instance: int, key: Any, cost: int, priority: int = 0) -> None:
        self._arrivals += 1
        rank = (priority, self._arrivals)
        ranks = self.ranks[instance]
        k = bisect.bisect(ranks, rank)  # after every earlier arrival of the same priority
        ranks.insert(k, rank)
        self.waiting[instance].insert(k, (key, cost))

    def _keep(self, instance: int, keep) -> None:
        pairs = [(e, r) for k, (e, r) in enumerate(zip(self.waiting[instance], self.ranks[instance])) if keep(k, e)]
        self.waiting[instance] = [e for e, _ in pairs]
        self.ranks[instance] = [r for _, r in pairs]

    def remove(self, instance: int, key: Any) -> None:
        """Forget ``key`` whether it waits or is admitted (it reached its first token or ended)."""
        if any(e[0] == key for e in self.waiting[instance]):
            self._keep(instance, lambda k, e: e[0] != key)
        self.admitted[instance].pop(key, None)

    def pump(self, instance: int, knobs: dict[str, Any]) -> list[Any]:
        """Admit what the rule allows now; return the admitted keys in arrival order."""
        q = self.waiting[instance]
        if not q:
            return []
        mode = knobs["admission"]
        if mode == "off":  # switched off live: let everyone through
            picked = list(range(len(q)))
        else:
            picked = admit([c for _, c in q], self.pending(instance), knobs["admission_budget_tokens"],
                           knobs["admission_lookahead"], mode, self.rounds[instance],
                           knobs["admission_force_fifo_every"])
        if not picked:
            return []
        self.rounds[instance] += 1
        chosen = set(picked)
        out = []
        for k in picked:
            key, cost = q[k]
            self.admitted[instance][key] = cost
            out.append(key)
        self._keep(instance, lambda k, e: k not in chosen)
        return out
