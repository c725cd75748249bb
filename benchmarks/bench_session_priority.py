"""Session priority (issue 39): does setting vLLM's priority per session shorten agent sessions?

Per seed, the peers benchmark's Claude Code trace (benchmarks/peers/run.py build_trace: the
sessions under ../shared/traces/weka_claude_code, input capped at 200k, ``--sessions`` sessions
of at most ``--max-turns`` turns), two arms on the same fleet shape:

- ``off``: ``kvtop route`` with the ``priority`` feature off (every request priority 0);
- ``on``:  ``--knob priority=session_fcfs`` (a session's rank in the order sessions arrived).

Live (default): per arm a fresh ``kvtop sim`` fleet of ``--instances`` engines started with
``--scheduling-policy priority`` (both arms: with every priority 0 it is FCFS by arrival), a
fresh ``kvtop route`` in front of it, and a closed-loop ``kvtop replay`` at ``--speed``.
Offline (``--offline``): the same two arms through ``kvtop simulate``'s pipeline in virtual
time. kvtop/simulate.py does not yet pass the decision's priority to its engines or build
them with the priority policy (the two lines are in docs/experiments.md); until it does, this
script threads both through by wrapping ``router.pipeline.priority_for`` and the engine
classes, which is the same value the live router sets.

Per arm: session completion mean / p90 / max (store/sessions.py: first arrival to last answer
end, engine seconds), TTFT p90 of returning turns (turn >= 2), and per session the ratio of
its completion with priority on to off (the worst is the starvation check).

    python benchmarks/bench_session_priority.py --seeds 23 29 31 --out /tmp/sesprio          # live
    python benchmarks/bench_session_priority.py --seeds 23 29 31 --out /tmp/sesprio --offline

Every process binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "peers"))
import run as peers  # noqa: E402  (build_trace, wait_http)

from kvtop.procs import free_port_run, stop_process  # noqa: E402
from store import sessions  # noqa: E402
from store.stats import percentile  # noqa: E402

KVTOP = [sys.executable, "-m", "kvtop"]
ARMS = {"off": "off", "on": "session_fcfs"}


def run_live(trace: Path, arm: str, args, out: Path) -> list[dict]:
    from kvtop.sim.profiles import get_profile

    n = args.instances
    base = free_port_run(n + 1)
    rport = base + n
    prof = get_profile(args.profile)
    blocks = args.num_gpu_blocks or prof.num_gpu_blocks   # the offline arms' KV: the profile's
    sim = subprocess.Popen([*KVTOP, "sim", "--instances", str(n), "--port-base", str(base),
                            "--profile", args.profile, "--speed", str(args.speed),
                            "--num-gpu-blocks", str(blocks), "--scheduling-policy", "priority",
                            "--no-kv-events", "--stream-interval-ms", "20", "--duration", str(args.timeout)],
                           stdout=subprocess.DEVNULL, stderr=open(out / f"{arm}.sim.log", "w"))
    router = None
    try:
        engines = [f"http://127.0.0.1:{base + i}" for i in range(n)]
        for u in engines:
            peers.wait_http(u + "/health", 60, sim)
        db = out / f"{arm}.db"
        db.unlink(missing_ok=True)
        router = subprocess.Popen([*KVTOP, "route", "--port", str(rport), "--policy", args.policy,
                                   "--block-size", str(prof.block_size),
                                   "--capacity-tokens", str(blocks * prof.block_size),
                                   "--knob", f"priority={ARMS[arm]}", "--db", str(db),
                                   "--state-dir", str(out / f"{arm}.state"),
                                   *[a for i, u in enumerate(engines) for a in ("--backend", f"i{i}={u}")]],
                                  stdout=subprocess.DEVNULL, stderr=open(out / f"{arm}.router.log", "w"))
        url = f"http://127.0.0.1:{rport}"
        peers.wait_http(url + "/health", 60, router)
        results = out / f"{arm}.jsonl"
        subprocess.run([*KVTOP, "replay", str(trace), "--target", url, "--mode", "closed",
                        "--speed", str(args.speed), "--arm", arm, "--out", str(results),
                        "--timeout", str(args.timeout), "--no-progress"], check=True)
    finally:
        stop_process(router, grace_s=15)
        stop_process(sim, grace_s=15)
    recs = [json.loads(line) for line in results.read_text().splitlines()[1:] if line.strip()]
    # replay's times are wall seconds at --speed: back to engine seconds
    for r in recs:
        for k in ("sent_at", "arrival"):
            if r.get(k) is not None:
                r[k] *= args.speed
        for k in ("ttft_ms", "e2e_ms"):
            if r.get(k) is not None:
                r[k] *= args.speed
    return recs


def run_offline(trace: Path, arm: str, args) -> list[dict]:
    import functools

    import kvtop.sim.engine as engine_mod
    import router.pipeline as pipeline_mod
    from kvtop.simulate import SimConfig, simulate
    from kvtop.traces.loader import dense_ids, iter_trace

    set_by_router: dict[str, int] = {}
    real_priority_for = pipeline_mod.priority_for

    def priority_for(mode, d, order):
        p = real_priority_for(mode, d, order)
        set_by_router[d.request.request_id] = p
        return p

    class PriorityRequest(engine_mod.EngineRequest):
        def __init__(self, request_id, *a, **kw):
            super().__init__(request_id, *a, **kw)
            self.priority = set_by_router.get(request_id.split("#")[0]) or 0

    real = (engine_mod.Engine, engine_mod.EngineRequest, pipeline_mod.priority_for)
    engine_mod.Engine = functools.partial(real[0], scheduling_policy="priority")
    engine_mod.EngineRequest = PriorityRequest
    pipeline_mod.priority_for = priority_for
    try:
        requests = dense_ids(iter_trace(trace))
        cfg = SimConfig(instances=args.instances, profile=args.profile, mode="closed",
                        features={"priority": ARMS[arm]})
        return simulate(requests, args.policy, cfg)
    finally:
        engine_mod.Engine, engine_mod.EngineRequest, pipeline_mod.priority_for = real


def figures(recs: list[dict]) -> dict:
    ses = sessions.from_records(recs)
    s = sessions.summarize(ses)
    ok = [r for r in recs if r.get("status") == "ok"]
    back = [r["ttft_ms"] / 1000 for r in ok if (r.get("turn") or 1) >= 2 and r.get("ttft_ms") is not None]
    return {"requests": len(recs), "errors": len(recs) - len(ok), "sessions": s["sessions"],
            "done_mean": s["completion_s"]["mean"], "done_p90": s["completion_s"]["p90"],
            "done_max": s["completion_s"]["max"], "fleet_mean": s["fleet_s"]["mean"],
            "client_mean": s["client_s"]["mean"], "ttft_p90_returning": percentile(back, 90),
            "per_session": {x.session: x.completion_s for x in ses}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("session-priority"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[23, 29, 31])
    ap.add_argument("--offline", action="store_true", help="kvtop simulate's pipeline in virtual time")
    ap.add_argument("--policy", default="expected_cost")
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--max-turns", type=int, default=12)
    ap.add_argument("--stagger", type=float, default=5.0)
    ap.add_argument("--num-gpu-blocks", type=int, default=None,
                    help="live: KV per engine in the profile's blocks (default the profile's: h20 265k tokens)")
    ap.add_argument("--profile", default="h20")
    ap.add_argument("--speed", type=float, default=10.0)
    ap.add_argument("--timeout", type=float, default=900.0)
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
        got = {}
        for arm in ARMS:
            t0 = time.monotonic()
            recs = run_offline(trace, arm, args) if args.offline else run_live(trace, arm, args, tdir)
            got[arm] = figures(recs)
            got[arm]["wall_s"] = round(time.monotonic() - t0, 1)
        off, on = got["off"], got["on"]
        ratios = [on["per_session"][s] / off["per_session"][s] for s in off["per_session"]
                  if off["per_session"][s] > 0 and s in on["per_session"]]
        row = {"seed": seed, "mode": "offline" if args.offline else "live",
               **{f"{arm}_{k}": v for arm in ARMS for k, v in got[arm].items() if k != "per_session"},
               "worst_session_ratio": max(ratios) if ratios else None}
        rows.append(row)
        print(json.dumps(row), flush=True)
    (args.out / ("offline.json" if args.offline else "live.json")).write_text(json.dumps(rows, indent=1))
    print(f"\n{'seed':>4} {'mode':<7} {'done mean off/on s':>19} {'done p90 off/on s':>18} "
          f"{'done max off/on s':>18} {'TTFT p90 ret off/on s':>22} {'worst ratio':>11} {'errors':>7}")
    for r in rows:
        print(f"{r['seed']:>4} {r['mode']:<7} {r['off_done_mean']:>9.1f}/{r['on_done_mean']:<9.1f}"
              f"{r['off_done_p90']:>9.1f}/{r['on_done_p90']:<8.1f} {r['off_done_max']:>9.1f}/{r['on_done_max']:<8.1f}"
              f" {r['off_ttft_p90_returning']:>10.2f}/{r['on_ttft_p90_returning']:<10.2f}"
              f" {r['worst_session_ratio']:>11.2f} {r['off_errors']:>3}/{r['on_errors']:<3}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
