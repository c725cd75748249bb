"""Router-level features that apply under any policy: elastic P2P offload, prefill admission
and program-level priority (router/priority.py).

Their knobs live here, next to (not inside) the policy knobs; router/settings.py splits one
flat knob object between the two and validates both. ``prefill_tps`` is the one name shared
with a policy (unified_ab): one value, applied to both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router.config import Knob, KnobSchema
from router.priority import PRIORITY_MODES

OFFLOAD_MODES = ("off", "simple", "cost")
ADMISSION_MODES = ("off", "fifo", "pack")

FEATURE_KNOBS = KnobSchema((
    Knob("offload_mode", str, "off",
         "elastic P2P prefill offload: off | simple (load rules) | cost (seconds saved vs spent)",
         choices=OFFLOAD_MODES),
    Knob("offload_threshold", int, 20000,
         "estimated new prefill tokens on the decode instance from which a request may be "
         "offloaded (unified_ab's heavy_threshold is another thing: input tokens)", min=0, max=10_000_000),
    Knob("p_overload_factor", float, 1.5,
         "simple: never offload to a P whose BS exceeds mean(BS) x this", min=0.0, max=100.0),
    Knob("kv_transfer_s", float, 0.1,
         "cost: seconds to move a HEAVY request's KV from P to D (about 25 GB/s for 20k "
         "tokens of Qwen3-30B-A3B KV, plus setup)", min=0.0, max=600.0),
    Knob("prefill_tps", float, 5000.0,
         "prefill tokens per second of one instance, used until the router has measured the "
         "instances' own rates (router/calibration.py; shared with unified_ab)", min=1.0, max=1e7),
    Knob("disruption_factor", float, 1.0,
         "cost: seconds of decode disruption on D per second of prefill kept there", min=0.0, max=1000.0),
    Knob("admission", str, "off",
         "per-instance prefill admission queue in the router: off | fifo | pack",
         choices=ADMISSION_MODES),
    Knob("admission_budget_tokens", int, 16384,
         "admit while the instance's admitted-but-unprefilled tokens plus this request's fit",
         min=1, max=10_000_000),
    Knob("admission_lookahead", int, 8, "pack: how many waiting requests it may choose from",
         min=1, max=10_000),
    Knob("admission_force_fifo_every", int, 4,
         "pack: every N-th admission round is FIFO so a long prompt cannot starve (0: never)",
         min=0, max=10_000),
    Knob("priority", str, "off",
         "set vLLM's per-request priority (every backend must run --scheduling-policy priority): "
         "off | session_fcfs (sessions in the order they first arrived: an agent's later turns "
         "before new sessions) | cost (fewer new prefill tokens first); a client's own is kept",
         choices=PRIORITY_MODES),
))

#: Names both the features and some policies declare; one value feeds both.
SHARED_KNOBS = ("prefill_tps",)


@dataclass(frozen=True, slots=True)
class Features:
    """The validated router-level knobs; replaced whole on every change (like a policy)."""

    knobs: dict[str, Any]

    @classmethod
    def build(cls, values: dict[str, Any] | None = None, base: dict[str, Any] | None = None) -> "Features":
        return cls(FEATURE_KNOBS.validate(values or {}, base))

    @property
    def offload_mode(self) -> str:
        return self.knobs["offload_mode"]

    @property
    def admission(self) -> str:
        return self.knobs["admission"]

    def shared_for(self, policy_schema: KnobSchema) -> dict[str, Any]:
        """The shared values a freshly built policy must inherit to stay in step."""
        names = set(policy_schema.names())
        return {k: self.knobs[k] for k in SHARED_KNOBS if k in names}


def prefill_leg_body(body: dict[str, Any]) -> dict[str, Any]:
    """The P side of the disaggregated two-step: the client's request, prefill only.

    The one place the router changes a body: one token, no stream, and vLLM's
    ``kv_transfer_params`` asking the instance to keep the KV for a remote decode.
    """
    out = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    return out


def decode_leg_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The D side: the client's original request plus the P side's ``kv_transfer_params``."""
    return {**body, "kv_transfer_params": params}
