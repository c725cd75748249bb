"""The router's settings: the policy, its knobs and the router-level features, split, named
and validated in ONE place.

``kvtop route --knob``, ``PATCH /kvtop/v1/knobs``, ``kvtop simulate --knob``, what-if and the
sweep spec all hand a flat ``{name: value}`` object; ``Settings`` decides which names are
the policy's and which the router's (router/features.py), validates both completely before
anything changes, and is replaced whole on every change, like a policy.

One name is SHARED: ``prefill_tps`` (one instance's prefill rate) is a router feature (the
prior the calibration starts from) and a ``unified_ab`` knob; setting it sets both. The two
size thresholds have two names because they measure two things: ``offload_threshold`` is
estimated NEW prefill tokens on the decode instance (router/offload.py), ``heavy_threshold``
is ``unified_ab``'s migration threshold on INPUT tokens (router/policies/unified_ab.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from router.config import KnobError, KnobSchema
from router.features import FEATURE_KNOBS, SHARED_KNOBS, Features
from router.policies import Policy, build_policy, policy_class

#: Knob names of earlier kvtop versions, read from recorded runs (what-if): name -> the
#: router feature it meant. ``heavy_threshold`` was shared by offload and unified_ab until
#: the two thresholds got two names; a recorded value meant both.
LEGACY_FEATURE_NAMES = {"heavy_threshold": "offload_threshold"}


def _hint(name: str) -> str:
    if name == "heavy_threshold":
        return ("unified_ab's migration threshold (input tokens); the offload threshold "
                "(estimated new prefill tokens) is offload_threshold")
    return ""


def split_knobs(knobs: dict[str, Any], policy_schema: KnobSchema) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split one ``{name: value}`` object into (policy knobs, feature knobs).

    A shared name goes to both (to the policy only when it has it). An unknown name raises
    KnobError listing both sets, so the caller can refuse the whole update.
    """
    if not isinstance(knobs, dict):
        raise KnobError("knobs", "expected an object of knob names to values")
    pol: dict[str, Any] = {}
    feat: dict[str, Any] = {}
    pnames, fnames = set(policy_schema.names()), set(FEATURE_KNOBS.names())
    for name, value in knobs.items():
        if name not in pnames and name not in fnames:
            hint = _hint(str(name))
            allowed = ", ".join(policy_schema.names() + FEATURE_KNOBS.names())
            raise KnobError(str(name), f"unknown knob{' (it is ' + hint + ')' if hint else ''}; "
                                       f"known knobs: {allowed}")
        if name in pnames:
            pol[name] = value
        if name in fnames:
            feat[name] = value
    return pol, feat


@dataclass(frozen=True, slots=True)
class Settings:
    """A validated (policy, policy knobs, features) triple; build a policy from it at will."""

    policy: str  # the canonical policy name
    policy_knobs: dict[str, Any] = field(default_factory=dict)  # complete: defaults filled in
    features: Features = field(default_factory=Features.build)

    @classmethod
    def parse(cls, policy: str, knobs: dict[str, Any] | None = None) -> "Settings":
        """From a policy name and one flat knob object (raises KnobError naming the field)."""
        if not isinstance(policy, str):
            raise KnobError("policy", "expected a policy name")
        pcls = policy_class(policy)
        pol, feat = split_knobs(knobs or {}, pcls.schema)
        features = Features.build(feat)
        return cls(pcls.name, pcls.schema.validate({**features.shared_for(pcls.schema), **pol}), features)

    def update(self, policy: str | None = None, knobs: dict[str, Any] | None = None, *,
               merge: bool = False) -> "Settings":
        """The settings after a control-API change; nothing changes unless all of it is valid.

        ``merge`` keeps the current policy knobs and changes only those given (PATCH);
        feature knobs always merge; a policy switch without ``merge`` starts from the new
        policy's defaults (the features and shared names carry over)."""
        if knobs is not None and not isinstance(knobs, dict):
            raise KnobError("knobs", "expected an object of knob names to values")
        if policy is not None and not isinstance(policy, str):
            raise KnobError("policy", "expected a policy name")
        pcls = policy_class(policy or self.policy)
        pol, feat = split_knobs(knobs or {}, pcls.schema)
        features = Features.build(feat, base=self.features.knobs)
        base = self.policy_knobs if merge and pcls.name == self.policy else None
        values = {**features.shared_for(pcls.schema), **pol}
        return Settings(pcls.name, pcls.schema.validate(values, base), features)

    def build_policy(self) -> Policy:
        return build_policy(self.policy, self.policy_knobs)

    def flat(self) -> dict[str, Any]:
        """Every knob in one object (what ``Settings.parse`` takes back)."""
        return {**self.features.knobs, **self.policy_knobs}

    def describe_features(self) -> str:
        """The router features that change what happens to a request, in words: ``offload
        simple (threshold 20000), admission fifo (budget 16384)``, or ``none``."""
        k = self.features.knobs
        parts = []
        if k["offload_mode"] != "off":
            parts.append(f"offload {k['offload_mode']} (threshold {k['offload_threshold']})")
        if k["admission"] != "off":
            parts.append(f"admission {k['admission']} (budget {k['admission_budget_tokens']})")
        return ", ".join(parts) or "none"


def settings_for(policies: list[str], knobs: dict[str, Any] | None = None) -> dict[str, Settings]:
    """One Settings per policy from one flat knob object (``kvtop simulate --knob``, a sweep,
    what-if): each policy takes the knobs it has, every run takes the features. A name that
    no chosen policy has and that is no feature is refused (KnobError)."""
    knobs = dict(knobs or {})
    fnames = set(FEATURE_KNOBS.names())
    known = set(fnames)
    out: dict[str, Settings] = {}
    for name in policies:
        pcls = policy_class(name)
        known |= set(pcls.schema.names())
        mine = {k: v for k, v in knobs.items() if k in fnames or k in pcls.schema.names()}
        out[name] = Settings.parse(name, mine)
    unknown = sorted(set(knobs) - known)
    if unknown:
        hint = _hint(unknown[0])
        raise KnobError(unknown[0], "no chosen policy has this knob, nor is it a router-level knob"
                                    + (f" (it is {hint})" if hint else ""))
    return out


def from_recorded(knobs: dict[str, Any]) -> dict[str, Any]:
    """A recorded run's knobs in today's names (a what-if of an older log)."""
    out = dict(knobs)
    for old, new in LEGACY_FEATURE_NAMES.items():
        if old in out and new not in out:
            out[new] = out[old]
    return out


__all__ = ["Settings", "SHARED_KNOBS", "from_recorded", "settings_for", "split_knobs"]
