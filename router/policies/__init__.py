"""The policy registry: every routing policy by name, and the one way to build one.

``build_policy`` validates the knobs completely before returning, so a swap that fails
leaves the running policy untouched.
"""

from __future__ import annotations

from typing import Any

from router.config import KnobError
from router.policies.base import REASONS, Pick, Policy
from router.policies.cache_aware import CacheAware
from router.policies.expected_cost import ExpectedCost
from router.policies.leastwork import LeastWork
from router.policies.leastwork_kappa import LeastWorkKappa
from router.policies.lmetric import LMetric
from router.policies.load_only import LoadOnly
from router.policies.round_robin import RoundRobin
from router.policies.sticky import Sticky
from router.policies.unified import Unified
from router.policies.unified_ab import UnifiedAB

#: The policy `kvtop route`, `kvtop simulate` and `kvtop demo` use unless told otherwise
#: (docs/policies.md says why, and when another policy is the better choice).
DEFAULT_POLICY = "expected_cost"

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (RoundRobin, LoadOnly, LMetric, Sticky, Unified, UnifiedAB, LeastWork, LeastWorkKappa,
                ExpectedCost)
}
ALIASES: dict[str, str] = {alias: cls.name for cls in POLICIES.values() for alias in cls.aliases}
#: Models of the peer routers' policies, to compare with them offline (`kvtop simulate
#: --policies expected_cost,cache_aware`; docs/peers.md). They build and run like any policy
#: but are not kvtop's own: not listed in POLICIES (GET policies, the dashboard, sweeps).
PEER_MODELS: dict[str, type[Policy]] = {cls.name: cls for cls in (CacheAware,)}


def policy_class(name: str) -> type[Policy]:
    canonical = ALIASES.get(name, name)
    try:
        return POLICIES.get(canonical) or PEER_MODELS[canonical]
    except KeyError:
        known = ", ".join(sorted(POLICIES) + sorted(ALIASES))
        raise KnobError("policy", f"unknown policy {name!r}; known policies: {known}") from None


def build_policy(name: str, knobs: dict[str, Any] | None = None) -> Policy:
    """A ready policy, or KnobError naming the bad field."""
    if not isinstance(name, str):
        raise KnobError("policy", "expected a policy name")
    return policy_class(name)(knobs)


__all__ = ["DEFAULT_POLICY", "POLICIES", "PEER_MODELS", "ALIASES", "REASONS", "Pick", "Policy", "build_policy", "policy_class"]
