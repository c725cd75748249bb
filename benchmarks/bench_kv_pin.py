"""KV pin (issue 39, "tool-call pauses"): what would pinning a session's KV for a TTL gain?

vLLM has no such pin; the simulated engine models one (``kv_pin_ttl_s``, kvtop/sim/engine.py,
docs/simulator.md "KV pin"). Per seed, the session-priority study's Claude Code trace
(benchmarks/peers/run.py build_trace: ``--sessions`` sessions of ../shared/traces/weka_claude_code,
input capped at 200k, at most ``--max-turns`` turns), run offline through ``kvtop simulate``'s
pipeline in closed loop (next turn = the answer's end + the trace's think/tool time), one arm
per TTL: 0 (today's vLLM), and the TTLs given as multiples of the trace's median pause between
a session's answer and its next turn (``--ttl-x``, default 1 and 2), each with two scopes
(``--scopes``): ``all`` finished requests pinned (an engine-wide TTL), or only ``continuing``
ones, the turns their session follows with another (a per-request hint: a client whose answer
ends in a tool call knows it will be back).

Per arm: APC (cached / input tokens), TTFT p50 / p90 of returning turns (turn >= 2), session
completion mean / p90 (store/sessions.py: first arrival to last answer end, engine seconds),
and "moved": the share of returning turns the router sent to another instance than their
previous turn (whose pin, if any, it left behind).

    python benchmarks/bench_kv_pin.py --seeds 23 29 31 --sessions 48 --out /tmp/kvpin
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "peers"))
import run as peers  # noqa: E402  (build_trace)

from store import sessions  # noqa: E402
from store.stats import percentile  # noqa: E402


def pauses(requests) -> list[float]:
    """Each returning turn's pause: the client's think/tool time after the previous answer."""
    return [r.think_time for r in requests if r.turn >= 2 and r.think_time is not None]


def run_arm(requests, ttl: float, scope: str, args, share: float = 1.0) -> dict:
    from kvtop.sim.profiles import get_profile
    from kvtop.simulate import SimConfig, simulate

    prof = get_profile(args.profile)
    if args.num_gpu_blocks:
        prof = prof.with_overrides(num_gpu_blocks=args.num_gpu_blocks)
    cfg = SimConfig(instances=args.instances, profile=prof, mode="closed", kv_pin_ttl_s=ttl,
                    kv_pin_scope=scope, kv_pin_max_share=share)
    t0 = time.process_time()
    recs = simulate(requests, args.policy, cfg)
    cpu = time.process_time() - t0
    ok = [r for r in recs if r.get("status") == "ok"]
    back = [r["ttft_ms"] / 1000 for r in ok if (r.get("turn") or 1) >= 2 and r.get("ttft_ms") is not None]
    s = sessions.summarize(sessions.from_records(recs))
    # returning turns served on another instance than their previous turn: a pin left behind
    where = {(r.get("session"), r.get("turn")): r.get("instance") for r in ok}
    ret = [(k, v) for k, v in where.items() if (k[1] or 1) >= 2 and (k[0], k[1] - 1) in where]
    moved = sum(1 for (ses, turn), inst in ret if where[(ses, turn - 1)] != inst)
    return {"ttl_s": ttl, "scope": scope, "share": share, "requests": len(recs), "errors": len(recs) - len(ok),
            "apc": sum(r.get("cached_tokens") or 0 for r in ok) / max(1, sum(r["input_tokens"] for r in ok)),
            "ttft_p50_ret": percentile(back, 50), "ttft_p90_ret": percentile(back, 90),
            "done_mean": s["completion_s"]["mean"], "done_p90": s["completion_s"]["p90"],
            "moved": moved / max(1, len(ret)), "cpu_s": round(cpu, 1)}


def main() -> int:
    from kvtop.traces.loader import dense_ids, iter_trace

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("kv-pin"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[23, 29, 31])
    ap.add_argument("--policy", default="expected_cost")
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--sessions", type=int, default=48)
    ap.add_argument("--max-turns", type=int, default=12)
    ap.add_argument("--stagger", type=float, default=5.0)
    ap.add_argument("--ttl-x", type=float, nargs="+", default=[1.0, 2.0],
                    help="TTLs as multiples of the trace's median pause (default 1 2)")
    ap.add_argument("--scopes", nargs="+", default=["all", "continuing"], choices=("all", "continuing"),
                    help="which finished requests are pinned: all, or only turns their session continues "
                         "after (the per-request hint; default both)")
    ap.add_argument("--max-shares", type=float, nargs="+", default=[1.0],
                    help="kv_pin_max_share values: at most this share of an engine's blocks pinned, "
                         "the oldest pins ending early past it (default 1: no cap)")
    ap.add_argument("--num-gpu-blocks", type=int, default=None,
                    help="KV per engine in the profile's blocks (default the profile's: h20 265k tokens)")
    ap.add_argument("--profile", default="h20")
    ap.add_argument("--weka", default=str(Path(__file__).resolve().parents[2] / "shared" / "traces" / "weka_claude_code"))
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "kvtop-peers")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.cache.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in args.seeds:
        tdir = args.out / f"trace-{seed}"
        tdir.mkdir(exist_ok=True)
        targs = argparse.Namespace(cache=args.cache, weka=args.weka, max_input=200_000, sessions=args.sessions,
                                   stagger=args.stagger, max_gap=20.0, seed=seed, max_turns=args.max_turns)
        trace = peers.build_trace(targs, tdir)
        requests = dense_ids(iter_trace(trace))
        gaps = pauses(requests)
        med = statistics.median(gaps)
        print(f"seed {seed}: {len(requests)} requests, pause median {med:.2f} s p90 "
              f"{percentile(gaps, 90):.2f} s", file=sys.stderr, flush=True)
        arms = [(0.0, "all", 1.0), *[(x, sc, sh) for sh in args.max_shares for sc in args.scopes
                                     for x in args.ttl_x]]
        for x, scope, share in arms:
            row = {"seed": seed, "pause_median_s": round(med, 2), "pause_p90_s": round(percentile(gaps, 90), 2),
                   "ttl_x": x, **run_arm(requests, round(x * med, 2), scope, args, share)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    (args.out / "kv_pin.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{'seed':>4} {'scope':<10} {'share':>5} {'TTL s':>6} {'APC':>6} {'TTFT p50/p90 ret s':>19} {'done mean/p90 s':>16} {'moved':>6} {'err':>4}")
    for r in rows:
        print(f"{r['seed']:>4} {r['scope']:<10} {r['share']:>5.2f} {r['ttl_s']:>6.2f} {r['apc']:>6.3f} {r['ttft_p50_ret']:>8.2f}/{r['ttft_p90_ret']:<9.2f}"
              f" {r['done_mean']:>7.1f}/{r['done_p90']:<7.1f} {r['moved']:>6.2f} {r['errors']:>4}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
