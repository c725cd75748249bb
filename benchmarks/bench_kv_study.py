"""Estimate mode against event mode (vLLM KV events), live, under capacity pressure.

For each policy and each mode, a fresh ``kvtop sim`` fleet (its engines publish KV events on
loopback, with a small KV cache so that the sessions' KV is well above the fleet's), a fresh
``kvtop route`` in front of it (``@kv=`` and ``@kv-replay=`` in event mode, nothing in
estimate mode; ``--capacity-tokens`` is the engines' true KV size either way, so the estimate
gets every advantage it can; ``--block-size 16``, the engines' own, so that both modes
count hits at the granularity vLLM delivers them), and a closed-loop replay of Claude Code sessions sent as token
ids (exact blocks; text prompts could not use the events). Per arm it prints:

- hit-prediction error: sum over requests of |router's estimated hit - vLLM's delivered cached
  tokens|, as a share of prompt tokens (first attempts; from the router's decision log), and
  the share of requests whose estimate was off at all;
- APC (delivered cached / prompt tokens) and TTFT p50 / p90, E2E p99 from the client side.

    python benchmarks/bench_kv_study.py --seeds 7 11 --out /tmp/kvstudy   # ~15 min on 2 cores

The trace is the peers benchmark's (benchmarks/peers/run.py build_trace: the Claude Code
sessions under ../shared/traces/weka_claude_code, input capped at 200k), built per seed.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "peers"))
import run as peers  # noqa: E402  (build_trace, wait_http)

from kvtop.procs import free_port_run, stop_process  # noqa: E402
from store.stats import percentile  # noqa: E402

KVTOP = [sys.executable, "-m", "kvtop"]
ENGINE_BLOCK = 16




def run_arm(trace: Path, policy: str, events: bool, args, out: Path) -> dict:
    n = args.instances
    label = f"{policy}-{'events' if events else 'estimate'}"
    base = free_port_run(3 * n + 1)
    kv_base, rport = base + n, base + 3 * n
    sim = subprocess.Popen([*KVTOP, "sim", "--instances", str(n), "--port-base", str(base),
                            "--profile", args.profile, "--speed", str(args.speed),
                            "--num-gpu-blocks", str(args.num_gpu_blocks), "--stream-interval-ms", "20",
                            "--kv-events-port-base", str(kv_base), "--duration", str(args.timeout)],
                           stdout=subprocess.DEVNULL, stderr=open(out / f"{label}.sim.log", "w"))
    router = None
    try:
        engines = [f"http://127.0.0.1:{base + i}" for i in range(n)]
        for u in engines:
            peers.wait_http(u + "/health", 60, sim)
        backends = []
        for i, u in enumerate(engines):
            b = f"i{i}={u}"
            if events:  # instance i publishes on kv_base + 2i, replays on kv_base + 2i + 1
                b += f"@kv=tcp://127.0.0.1:{kv_base + 2 * i}@kv-replay=tcp://127.0.0.1:{kv_base + 2 * i + 1}"
            backends += ["--backend", b]
        db = out / f"{label}.db"
        db.unlink(missing_ok=True)
        router = subprocess.Popen([*KVTOP, "route", "--port", str(rport), "--policy", policy,
                                   "--block-size", str(ENGINE_BLOCK), "--capacity-tokens", str(args.num_gpu_blocks * ENGINE_BLOCK),
                                   "--db", str(db), "--state-dir", str(out / f"{label}.state"), *backends],
                                  stdout=subprocess.DEVNULL, stderr=open(out / f"{label}.router.log", "w"))
        url = f"http://127.0.0.1:{rport}"
        peers.wait_http(url + "/health", 60, router)
        results = out / f"{label}.jsonl"
        scrape = [a for u in engines for a in ("--scrape", u)]
        subprocess.run([*KVTOP, "replay", str(trace), "--target", url, "--mode", "closed",
                        "--speed", str(args.speed), "--arm", label, "--out", str(results),
                        "--timeout", str(args.timeout), "--no-progress", *scrape], check=True)
    finally:
        stop_process(router, grace_s=15)
        stop_process(sim, grace_s=15)
    return measure(db, results, label)


def measure(db: Path, results: Path, label: str) -> dict:
    con = sqlite3.connect(db)
    rows = con.execute(
        "SELECT d.est_hit_tokens, o.delivered_hit_tokens, o.input_tokens, d.index_source "
        "FROM decisions d JOIN outcomes o ON o.request_id = d.request_id AND o.attempt = d.attempt "
        "WHERE d.attempt = 1 AND o.status = 'ok' AND o.delivered_hit_tokens IS NOT NULL").fetchall()
    con.close()
    err = sum(abs(e - d) for e, d, _, _ in rows)
    prompt = sum(n for _, _, n, _ in rows)
    off = sum(1 for e, d, _, _ in rows if e != d)
    sources = sorted({s for *_, s in rows})
    recs = [json.loads(line) for line in results.read_text().splitlines()[1:] if line.strip()]
    ok = [r for r in recs if not r.get("error")]
    ttft = [r["ttft_ms"] / 1000 for r in ok if r.get("ttft_ms") is not None]
    e2e = [r["e2e_ms"] / 1000 for r in ok if r.get("e2e_ms") is not None]
    return {"arm": label, "requests": len(recs), "errors": len(recs) - len(ok), "compared": len(rows),
            "hit_error_share": err / prompt if prompt else None, "requests_off": off / len(rows) if rows else None,
            "apc": sum(d for _, d, _, _ in rows) / prompt if prompt else None, "index_source": sources,
            "ttft_p50": percentile(ttft, 50), "ttft_p90": percentile(ttft, 90), "e2e_p99": percentile(e2e, 99)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("kv-study"))
    ap.add_argument("--policies", default="leastwork,unified,expected_cost")
    ap.add_argument("--modes", default="estimate,events", help="which arms per policy (default both)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[7])
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--max-turns", type=int, default=10)
    ap.add_argument("--stagger", type=float, default=5.0)
    ap.add_argument("--num-gpu-blocks", type=int, default=13_000,
                    help="KV per engine in 16-token blocks (default 13,000 = 208k tokens: a 200k "
                         "prompt fits, and 8 engines hold well under 24 sessions' KV)")
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
        for policy in args.policies.split(","):
            for events in [m == "events" for m in args.modes.split(",")]:
                t0 = time.monotonic()
                r = run_arm(trace, policy, events, args, tdir)
                r["seed"] = seed
                r["wall_s"] = round(time.monotonic() - t0, 1)
                rows.append(r)
                print(json.dumps(r), flush=True)
    (args.out / "study.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{'seed':>4} {'arm':<26} {'req':>5} {'err':>3} {'hit error':>9} {'off':>6} {'APC':>6} "
          f"{'TTFT p50':>9} {'TTFT p90':>9} {'E2E p99':>8}")
    for r in rows:
        print(f"{r['seed']:>4} {r['arm']:<26} {r['requests']:>5} {r['errors']:>3} {r['hit_error_share']:>9.2%} "
              f"{r['requests_off']:>6.1%} {r['apc']:>6.1%} {r['ttft_p50']:>8.2f}s {r['ttft_p90']:>8.2f}s "
              f"{r['e2e_p99']:>7.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
