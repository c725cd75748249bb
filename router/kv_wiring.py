"""Wiring KV events into a router: the exact index when any backend publishes, one started
``Subscriber`` per publishing backend, and the control API's view of an instance's events."""

from __future__ import annotations

from typing import Any

from router.exact_index import ExactIndex
from router.kv_events import Subscriber


def attach_index(cluster, backends, *, speculative_ttl_s: float = 2.0) -> ExactIndex | None:
    """Give ``cluster`` an exact index when any backend has a KV-event endpoint."""
    if not any(getattr(b, "kv_events", None) for b in backends):
        return None
    cluster.exact = ExactIndex(len(cluster.instances), cluster.block_size,
                               speculative_ttl_s=speculative_ttl_s)
    cluster.exact.published_mask = sum(1 << i for i, b in enumerate(backends)
                                       if getattr(b, "kv_events", None))
    return cluster.exact


async def start_subscribers(cluster, backends, *, capacity_tokens: int, **kw) -> list[Subscriber | None]:
    """One started Subscriber per backend with a ``kv_events`` endpoint (None for the others)."""
    subs: list[Subscriber | None] = []
    try:
        for i, b in enumerate(backends):
            if not getattr(b, "kv_events", None) or cluster.exact is None:
                subs.append(None)
                continue
            sub = Subscriber(cluster.exact, i, b.kv_events, replay_endpoint=b.kv_replay,
                             resync_tokens=capacity_tokens, **kw)
            await sub.start()
            subs.append(sub)
    except BaseException:
        await stop_subscribers(subs)
        raise
    return subs


async def stop_subscribers(subs: list[Subscriber | None]) -> None:
    for s in subs:
        if s is not None:
            await s.stop()


def instance_json(cluster, subs: list[Subscriber | None], instance: int) -> dict[str, Any] | None:
    """The control API's view of one instance's KV events (None when it has none), with the
    estimate's drift from the truth: over decisions while exact, |estimated - exact| hit tokens."""
    sub = subs[instance] if instance < len(subs) else None
    if sub is None or cluster.exact is None:
        return None
    out = sub.snapshot()
    ib = cluster.exact.instances[instance]
    out["drift"] = {"samples": ib.drift_samples, "tokens": ib.drift_tokens,
                    "share": ib.drift_tokens / ib.drift_input_tokens if ib.drift_input_tokens else None}
    return out
