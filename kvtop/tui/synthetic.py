"""Deterministic router-shaped data (state snapshots, decisions, outcomes, policies, sessions).

Tests, snapshot baselines, screenshots and benchmarks feed the dashboard from here through
``FakeFeed``; the shapes follow docs/control-api.md.
"""

from __future__ import annotations

import math
import random
from typing import Any

POLICIES = {
    "current": {"name": "unified", "version": 3, "policy": "unified@3",
                "knobs": {"overload_factor": 2.0, "cache_ratio_gate": 0.5, "lmetric_decode_weight": 0.0}},
    "policies": [
        {"name": "lmetric", "aliases": [], "doc": "argmin (P_i + new_i) x BS_i.", "needs_session": False,
         "knobs": [], "current": False},
        {"name": "round_robin", "aliases": [], "doc": "Next instance in turn.", "needs_session": False,
         "knobs": [], "current": False},
        {"name": "unified", "aliases": [], "doc": "Stick when the cache pays, else lmetric with decode weight.",
         "needs_session": True, "current": True, "knobs": [
             {"name": "overload_factor", "type": "float", "default": 2.0, "min": 1.0, "max": 10.0,
              "choices": None, "range": "1 <= x <= 10", "doc": "break affinity above mean(BS) x this"},
             {"name": "cache_ratio_gate", "type": "float", "default": 0.5, "min": 0.0, "max": 1.0,
              "choices": None, "range": "0 <= x <= 1", "doc": "stick only if hit/input is above this"},
             {"name": "lmetric_decode_weight", "type": "float", "default": 0.0, "min": 0.0, "max": 1.0,
              "choices": None, "range": "0 <= x <= 1", "doc": "weight of decode tokens in the fallback"}]},
    ],
}


def snapshot(n: int = 4, t: float = 0.0, *, start: float = 1_700_000_000.0, sessions: int = 120,
             seed: int = 1, gpu: bool = False, readonly: bool = False, policy: str = "unified@3",
             fleet: dict[int, str] | None = None) -> dict[str, Any]:
    """A router state snapshot at ``t`` seconds after ``start``; loads move smoothly with t.
    ``fleet``: instance index -> fleet state (cordoned, draining, removed), as router/fleet.py
    reports it; the others active."""
    rng = random.Random(seed * 1000 + int(t * 10))
    instances = []
    tot = {"num_requests": 0, "pending_prefill_tokens": 0, "decode_requests": 0, "decode_tokens": 0,
           "routed_total": 0, "input_tokens_total": 0, "est_hit_tokens_total": 0, "errors_total": 0,
           "request_rate": 0.0, "healthy_instances": 0}
    for i in range(n):
        phase = i * 1.7 + t / 6
        busy = 0.5 + 0.5 * math.sin(phase)
        pending = int(60_000 * busy ** 2) if i != 2 else int(140_000 * busy)
        reqs = int(2 + 30 * busy) + (40 if i == 2 and busy > 0.6 else 0)
        routed = int(50 + 12 * t + 7 * i)
        inp = routed * 40_000
        hit = int(inp * (0.55 + 0.3 * math.cos(i)))
        healthy = not (i == 3 and n > 3 and 20 <= t % 60 < 30)
        inst = {
            "name": f"vllm-{i}", "url": f"http://127.0.0.1:{8100 + i}", "healthy": healthy,
            "num_requests": reqs, "pending_prefill_tokens": pending, "backlog_s": pending / 5000,
            "decode_requests": max(0, reqs - 2), "decode_tokens": (reqs - 2) * 38_000 if reqs > 2 else 0,
            "ongoing_tokens": reqs * 40_000, "routed_total": routed, "input_tokens_total": inp,
            "est_hit_tokens_total": hit, "est_hit_rate": hit / inp, "est_hit_rate_recent": 0.5 + 0.4 * busy,
            "request_rate": 1.5 + busy,
            "engine": {"running": reqs, "waiting": 1, "kv_usage": min(0.99, 0.35 + 0.64 * busy),
                       "prefix_hit_rate": 0.6, "prefix_hit_rate_recent": 0.45 + 0.4 * busy + rng.random() * 0.02,
                       "busy_ratio": busy, "metric_names": {}, "scraped_at": start + t, "age_s": 0.3,
                       "error": None, "errors_total": 0},
            "gpu": ({"util_pct": 40 + 58 * busy, "mem_used_bytes": 70e9, "mem_total_bytes": 80e9, "source": "nvml",
                     "note": None, "error": None, "index": i} if gpu else
                    {"util_pct": None, "mem_used_bytes": None, "mem_total_bytes": None, "source": None,
                     "note": "n/a: no NVIDIA driver", "error": None, "index": None}),
            "errors": {"requests_total": 0, "scrape": None, "scrape_total": 0, "gpu": None},
        }
        instances.append(inst)
        for k in ("num_requests", "pending_prefill_tokens", "decode_requests", "decode_tokens", "routed_total",
                  "input_tokens_total", "est_hit_tokens_total"):
            tot[k] += inst[k]
        tot["request_rate"] += inst["request_rate"]
        tot["healthy_instances"] += healthy
    tot["est_hit_rate"] = tot["est_hit_tokens_total"] / tot["input_tokens_total"]
    tot["backlog_s"] = tot["pending_prefill_tokens"] / 5000
    tot["in_flight"] = tot["num_requests"]
    name, _, version = policy.partition("@")
    per = {f"vllm-{i}": sessions // n + (1 if i < sessions % n else 0) for i in range(n)}
    for i, state in (fleet or {}).items():
        inst = instances[i]
        inst["fleet_state"], inst["fleet_since"] = state, start + t - 42
        if state == "draining":
            inst["drain"] = {"sessions_homed": per[inst["name"]], "in_flight": inst["num_requests"],
                             "drained": not inst["num_requests"]}
        if state == "removed":
            inst["healthy"] = False
    if fleet:
        for inst in instances:
            inst.setdefault("fleet_state", "active")
            inst.setdefault("fleet_since", None)
            inst.setdefault("drain", None)
    return {
        "schema_version": 1, "ts": start + t,
        "router": {"url": "http://127.0.0.1:8000", "uptime_s": 3723 + t, "started_at": start - 3723,
                   "run_id": "20240101-000000-abcdef", "policy": policy, "policy_name": name,
                   "policy_version": int(version or 1), "knobs": dict(POLICIES["current"]["knobs"]),
                   "readonly": readonly, "draining": False, "assumed_prefill_tps": 5000.0, "block_size": 512,
                   "viewers": 1},
        "instances": instances, "totals": tot,
        "affinity": {"sessions": sessions, "per_instance": per, "moves": 7, "moved_sessions": 5,
                     "computed_at": start + t},
        "requests": {"requests": tot["routed_total"]},
        "decisions_by_reason": {"affinity_stick": 410, "argmin": 120, "overload_break": 9, "tie_rr": 3},
        "outcomes_by_status": {"ok": tot["routed_total"] - 2, "error": 2},
        "hit_tokens": {},
    }


REASONS = ["affinity_stick", "affinity_stick", "argmin", "affinity_new", "overload_break", "cache_gate_miss"]


def decision(k: int, n: int = 4, *, start: float = 1_700_000_000.0, seconds: bool = False) -> dict[str, Any]:
    """A decision event; ``seconds``: expected_cost's terms (seconds with several magnitudes)."""
    rng = random.Random(k)
    inst = rng.randrange(n)
    inp = rng.choice([3_000, 12_000, 45_000, 90_000, 160_000])
    terms = []
    for i in range(n):
        hit = int(inp * 0.9) if i == inst else rng.randrange(0, inp // 3)
        terms.append({"instance": f"vllm-{i}", "hit": hit, "new": inp - hit, "P": rng.randrange(0, 80_000),
                      "BS": rng.randrange(1, 30), "D": rng.randrange(0, 900_000), "score": rng.random() * 1e6})
        if seconds:
            t = terms[-1]
            del t["score"]
            t["tps"] = 5_000.0
            t.update(wait_s=t["P"] / 5_000, own_s=t["new"] / 5_000, interf_s=t["BS"] * t["new"] / 5_000,
                     queue_s=0.0 if i == inst else rng.random() * 3, evict_s=rng.random() / 20)
            t["cost"] = t["wait_s"] + t["own_s"] + t["interf_s"] + t["queue_s"] + t["evict_s"]
    cls = "WARM" if inp < 5000 else "MEDIUM" if inp < 20000 else "HEAVY" if inp < 50000 else "HEAVY+"
    return {"ts": start + k * 0.25, "request_id": f"req-{k:06d}", "attempt": 0, "session": f"sess-{k % 37:03d}",
            "turn": 1 + k // 37, "class": cls, "input_tokens": inp, "instance": f"vllm-{inst}",
            "reason": REASONS[k % len(REASONS)], "policy": "unified@3", "est_hit": int(inp * 0.9),
            "best_hit": int(inp * 0.9), "best_hit_instance": f"vllm-{inst}", "new_prefill": inp - int(inp * 0.9),
            "migrated_from": None, "decision_us": 41.5, "terms": terms}


def outcome(k: int, n: int = 4, *, start: float = 1_700_000_000.0) -> dict[str, Any]:
    """The outcome of ``decision(k, n)``, on the instance that decision chose."""
    rng = random.Random(-k)
    return {"ts": start + k * 0.25, "request_id": f"req-{k:06d}", "status": "ok",
            "instance": f"vllm-{random.Random(k).randrange(n)}",
            "ttft_ms": 300 + 2500 * rng.random() ** 3, "e2e_ms": 4000.0}


def sessions(count: int = 60, n: int = 4) -> dict[str, Any]:
    rows = []
    for k in range(count):
        rows.append({"session": f"sess-{k:03d}", "instance": f"vllm-{k % n}", "turns": 40 - k // 2,
                     "tokens": 9_000_000 - k * 120_000, "last_input_tokens": 150_000, "last_est_hit_tokens": 140_000,
                     "est_hit_rate": 0.93 - k * 0.01, "first_seen": 0, "last_seen": 0, "idle_s": k * 3.0,
                     "bound_since": 0, "bound_for_s": 1800 - k * 25.0, "moves": k % 3,
                     "completion_s": 1900 - k * 20.0, "fleet_s": 1200 - k * 15.0, "client_s": 700 - k * 5.0,
                     "in_flight": k % 2})
    # the summary of a router holding these sessions (GET sessions's, issue 39)
    summary: dict[str, Any] = {"sessions": count}
    for fig in ("completion_s", "fleet_s", "client_s"):
        values = sorted(r[fig] for r in rows)
        summary[fig] = {"mean": sum(values) / count, "p50": values[int(0.5 * (count - 1))],
                        "p90": values[int(0.9 * (count - 1))], "max": values[-1]} if values else \
            {"mean": None, "p50": None, "p90": None, "max": None}
    return {"total": count, "sort": "tokens", "sessions": rows, "summary": summary}
