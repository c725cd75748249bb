"""Shadow policies: what another policy would have picked, for every request, off the client's path.

A shadow is a policy object asked for its pick on the SAME cluster view the active policy
saw (the view is a snapshot taken before the request was charged), after the real pick and
after the request went upstream. It never changes counters, the session binding or the
round-robin counter: its pick is recorded and counted, nothing else.

Per decision a shadow records (the ``shadows`` column, a JSON list, one object per shadow)::

    {"policy": "leastwork", "instance": "i2", "reason": "argmin",
     "saved": 3584,            # est. prefill tokens the shadow's pick would have saved
                               #   (its instance's estimated hit minus the real one's; < 0: lost)
     "cost_real": 1.92,        # when it disagrees: the real pick's score under its own model,
     "cost_own": 0.41,         #   and its own pick's score (absent for a policy without scores)
     "us": 18.0}               # how long its pick took, microseconds

and the summary (``Shadows.summary``; GET /kvtop/v1/shadows, the state, the dashboard) counts
agreement with the active policy, disagreements by route class and by instance, the
estimated prefill tokens saved or lost, and the mean score gap.

What this is not: a counterfactual trajectory. The shadow's picks are never applied, so its
later views are the active policy's cluster, not the one it would have made. ``kvtop simulate
--from-db`` runs the full counterfactual offline.

A shadow that raises, or whose pick takes longer than ``budget_ms`` twice in a row (or five
times ``budget_ms`` once), is dropped from shadowing with an event (``on_drop``); routing is
never affected.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from router.config import KnobError
from router.policies import build_policy, policy_class
from router.policies.base import Policy


class ShadowError(ValueError):
    """A shadow spec that cannot be used (unknown policy, bad knobs)."""


def parse_specs(specs: Any) -> list[tuple[str, dict[str, Any]]]:
    """``"a,b"``, ``["a", {"policy": "b", "knobs": {...}}]`` -> [(canonical name, knobs)].

    Raises ShadowError with a message for the client."""
    if specs is None:
        return []
    if isinstance(specs, str):
        specs = [s.strip() for s in specs.split(",") if s.strip()]
    if not isinstance(specs, list):
        raise ShadowError('expected a list of policy names or {"policy": NAME, "knobs": {...}} objects')
    out: list[tuple[str, dict[str, Any]]] = []
    for s in specs:
        if isinstance(s, str):
            name, knobs = s, {}
        elif isinstance(s, dict) and isinstance(s.get("policy"), str):
            extra = sorted(set(s) - {"policy", "knobs"})
            if extra:
                raise ShadowError(f"unknown field {extra[0]!r} in a shadow; allowed: policy, knobs")
            name, knobs = s["policy"], s.get("knobs") or {}
            if not isinstance(knobs, dict):
                raise ShadowError("a shadow's knobs must be an object")
        else:
            raise ShadowError('each shadow is a policy name or {"policy": NAME, "knobs": {...}}')
        try:
            cls = policy_class(name)
            build_policy(cls.name, knobs)
        except KnobError as exc:
            where = "" if exc.field == "policy" else f"knobs.{exc.field}: "
            raise ShadowError(f"shadow {name!r}: {where}{exc.message}") from None
        if any(n == cls.name for n, _ in out):
            raise ShadowError(f"shadow {cls.name!r} is listed twice")
        out.append((cls.name, knobs))
    if len(out) > 8:
        raise ShadowError("at most 8 shadow policies")
    return out


class _Shadow:
    __slots__ = ("policy", "picks", "agree", "by_class", "real_at", "shadow_at", "saved", "gap_sum",
                 "gap_n", "us_sum", "us_max", "slow_run", "added_at", "against")

    def __init__(self, policy: Policy, now: float, against: str | None = None):
        self.policy = policy
        self.against = against  # the active policy@version its counts compare with (None: not known)
        self.picks = 0
        self.agree = 0
        self.by_class: dict[str, int] = {}  # disagreements per route class
        self.real_at: dict[str, int] = {}  # disagreements per instance the active policy chose
        self.shadow_at: dict[str, int] = {}  # ... per instance the shadow chose instead
        self.saved = 0  # est. prefill tokens the shadow's picks would have saved (< 0: lost)
        self.gap_sum = 0.0  # sum of cost_real - cost_own over disagreements with both scores
        self.gap_n = 0
        self.us_sum = 0.0
        self.us_max = 0.0
        self.slow_run = 0
        self.added_at = now

    def json(self) -> dict[str, Any]:
        p = self.policy
        return {
            "policy": p.name, "knobs": dict(p.knobs), "since": self.added_at, "against": self.against,
            "picks": self.picks,
            "agree": self.agree, "agreement": self.agree / self.picks if self.picks else None,
            "disagree": self.picks - self.agree, "disagree_by_class": dict(self.by_class),
            "disagree_real_instance": dict(self.real_at), "disagree_shadow_instance": dict(self.shadow_at),
            "saved_prefill_tokens": self.saved,
            "mean_cost_gap": self.gap_sum / self.gap_n if self.gap_n else None,
            "pick_us_mean": self.us_sum / self.picks if self.picks else None, "pick_us_max": self.us_max,
        }


def _score(terms: list[dict[str, Any]], name: str) -> float | None:
    for t in terms:
        if t.get("instance") == name:
            s = t.get("score")
            return float(s) if isinstance(s, (int, float)) else None
    return None


class Shadows:
    """The shadow policies of one router (or one offline run), and their running summary."""

    def __init__(self, specs: list[tuple[str, dict[str, Any]]] | None = None, *, budget_ms: float = 5.0,
                 on_drop: Callable[[str, str], None] | None = None, clock: Callable[[], float] = time.time):
        self.budget_s = budget_ms / 1000
        self.on_drop = on_drop or (lambda name, why: None)
        self.clock = clock
        self.shadows: dict[str, _Shadow] = {}
        self.against: str | None = None  # the active policy@version the counts compare with
        self.dropped: list[dict[str, Any]] = []  # {"policy", "why", "ts"}, the latest last
        self.set(specs or [])

    @property
    def active(self) -> bool:
        return bool(self.shadows)

    def names(self) -> list[str]:
        return list(self.shadows)

    @property
    def needs_lookahead(self) -> bool:
        """A shadow reads ``view.lookahead`` (router/cluster.py): the view must carry it."""
        return any(sh.policy.needs_lookahead for sh in self.shadows.values())

    def set(self, specs: list[tuple[str, dict[str, Any]]]) -> None:
        """Replace the set. A shadow kept with the same knobs keeps its counts."""
        now = self.clock()
        new: dict[str, _Shadow] = {}
        for name, knobs in specs:
            policy = build_policy(name, knobs)
            old = self.shadows.get(name)
            new[name] = old if old is not None and old.policy.knobs == policy.knobs else _Shadow(policy, now,
                                                                                                 self.against)
        self.shadows = new

    def restart(self, against: str) -> None:
        """The active policy (or its knobs) changed: agreement with the old one says nothing
        about the new one, so every shadow counts again from now, against ``against``."""
        self.against = against
        now = self.clock()
        self.shadows = {name: _Shadow(sh.policy, now, against) for name, sh in self.shadows.items()}

    def evaluate(self, d: Any, view: Any) -> list[dict[str, Any]]:
        """Ask every shadow for its pick on ``view`` (the one decision ``d`` was made on)."""
        out: list[dict[str, Any]] = []
        hits = view.hits
        real = d.instance
        perf = time.perf_counter
        for name, sh in tuple(self.shadows.items()):
            t0 = perf()
            try:
                pick = sh.policy.pick(d.request, view)
                idx = pick.index
                cand = view.candidate(idx)
                if cand is None:
                    raise ValueError(f"picked instance {idx}, not a candidate")
            except Exception as exc:  # a shadow must never break routing
                self._drop(name, f"raised {type(exc).__name__}: {exc}"[:300])
                continue
            dt = perf() - t0
            sh.picks += 1
            sh.us_sum += dt * 1e6
            if dt * 1e6 > sh.us_max:
                sh.us_max = dt * 1e6
            saved = hits[idx] - hits[real]
            rec: dict[str, Any] = {"policy": name, "instance": cand.name, "reason": pick.reason,
                                   "saved": saved, "us": round(dt * 1e6, 1)}
            if idx == real:
                sh.agree += 1
            else:
                real_name = d.instance_name
                cls = d.extra.get("route_class", d.request.route_class)
                sh.by_class[cls] = sh.by_class.get(cls, 0) + 1
                sh.real_at[real_name] = sh.real_at.get(real_name, 0) + 1
                sh.shadow_at[cand.name] = sh.shadow_at.get(cand.name, 0) + 1
                sh.saved += saved
                cost_real, cost_own = _score(pick.terms, real_name), _score(pick.terms, cand.name)
                if cost_real is not None and cost_own is not None:
                    rec["cost_real"], rec["cost_own"] = round(cost_real, 6), round(cost_own, 6)
                    sh.gap_sum += cost_real - cost_own
                    sh.gap_n += 1
            out.append(rec)
            if dt > self.budget_s:
                sh.slow_run += 1
                if sh.slow_run >= 2 or dt > 5 * self.budget_s:
                    self._drop(name, f"slow: a pick took {dt * 1000:.1f} ms (budget {self.budget_s * 1000:g} ms)")
            else:
                sh.slow_run = 0
        return out

    def _drop(self, name: str, why: str) -> None:
        if self.shadows.pop(name, None) is None:
            return
        self.dropped.append({"policy": name, "why": why, "ts": self.clock()})
        del self.dropped[:-20]
        self.on_drop(name, why)

    def summary(self) -> dict[str, Any]:
        return {"budget_ms": self.budget_s * 1000, "shadows": [sh.json() for sh in self.shadows.values()],
                "dropped": list(self.dropped)}
