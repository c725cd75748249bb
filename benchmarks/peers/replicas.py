"""Router replicas on the same engines: one kvtop router against three, with and without the
shared view (router/replicas.py: the in-flight load, and the session records of
router/replica_sessions.py), clients split by session or spread per request.

    python benchmarks/peers/replicas.py --out replicas-out            # 5 arms x 2 runs; --help

Every run starts a fresh ``kvtop sim`` (``--instances`` engines, KV events on, so every
decision is exact: token-id prompts, the engine's block size), then the arm's routers
(``kvtop route --policy expected_cost`` each, following every engine's KV events; with the
shared view each also ``--replica-bind`` / ``--replica-peer`` the others), then replays the
trace closed loop (a session's next turn its think time after the previous answer) through
them, from one client process:

- ``1``: one router (the reference);
- ``3-session-own`` / ``3-session-shared``: each session to one router (sessions dealt round
  robin in order of first arrival), as a load balancer with session affinity does;
- ``3-request-own`` / ``3-request-shared``: each request to the next
  router in turn, as a plain round-robin load balancer does;
- ``3-one-own`` (a control, not in the default arms): three routers running, following every
  engine's KV events, but every request to the first: what running three routers costs the
  host (on 2 cores the engines' simulation shares the CPU with them), without any routing
  effect.

It prints, per arm and run, TTFT p50/p90 and E2E p99 (seconds), APC (the engines' prefix-cache
hits over queries, scraped before and after) and errors, and each 3-router run's TTFT p90 and
E2E p99 as a ratio to the mean of the one-router runs. Results (``kvtop report`` reads them),
router and sim logs and each router's last state go to ``--out``. The trace is the one
benchmarks/peers/run.py builds from the Claude Code sessions (its ``build_trace``), or
``--trace``. Everything listens on 127.0.0.1; every process is stopped by pid.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

from run import DEFAULT_CACHE, build_trace, log, stop, wait_http  # noqa: E402  (benchmarks/peers/run.py)

from store.stats import percentile  # noqa: E402

ARMS = ("1", "3-session-own", "3-session-shared", "3-request-own", "3-request-shared")


def parse_arm(label: str) -> tuple[int, str, bool]:
    """``1`` or ``N-session|request|one-own|shared`` -> (routers, spread, shared)."""
    if label.isdigit():
        return int(label), "session", False
    n, spread, view = label.split("-")
    if spread not in ("session", "request", "one") or view not in ("own", "shared") or not n.isdigit():
        raise SystemExit(f"bad arm {label!r}: want 1 or N-session|request|one-own|shared")
    return int(n), spread, view == "shared"


def replay_spread(trace: str, targets: list[str], spread: str, args: argparse.Namespace, label: str,
                  scrape: list[str], model: str) -> dict:
    """kvtop replay's closed loop, with each request sent to one of ``targets``: per session
    (sessions dealt round robin by first arrival) or per request (the next router in turn)."""
    from kvtop import replay as rp

    class Spread(rp._Runner):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.by_session: dict[str, str] = {}
            self.turn = 0

        async def _request(self, index, req, payload):
            if spread == "request":
                target = targets[self.turn % len(targets)]
                self.turn += 1
            elif spread == "one":
                target = targets[0]
            else:
                target = self.by_session.setdefault(str(req.session), targets[len(self.by_session) % len(targets)])
            # _Runner._request reads self.url before its first await: this request's router
            self.url = target + rp.APIS[self.cfg.api]
            return await super()._request(index, req, payload)

    requests = rp._load(trace, None)
    cfg = rp.ReplayConfig(target=targets[0], speed=args.speed, mode="closed", prompt_format="tokens",
                          arm=label, model=model, timeout=args.timeout, scrape=scrape, trace=trace)
    plain, rp._Runner = rp._Runner, Spread
    try:
        result = asyncio.run(rp.replay(requests, cfg))
    finally:
        rp._Runner = plain
    out = Path(args.out) / f"{label}.jsonl"
    rp.write_results(str(out), result)
    ok = [r for r in result.records if r["status"] == "ok"]
    eng = result.header.get("engine_prefix_cache") or {}
    return {
        "arm": label, "requests": len(result.records), "errors": len(result.records) - len(ok),
        "ttft_p50_s": percentile([r["ttft_ms"] / 1e3 for r in ok], 50),
        "ttft_p90_s": percentile([r["ttft_ms"] / 1e3 for r in ok], 90),
        "e2e_p99_s": percentile([r["e2e_ms"] / 1e3 for r in ok], 99),
        "apc": eng["hits"] / eng["queries"] if eng.get("queries") else None,
        "wall_s": round(result.ended_at - result.started_at, 1),
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_shared(url: str, peers: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url, timeout=5) as r:
            if (json.loads(r.read()).get("replicas") or {}).get("peers_fresh") == peers:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url}: not every replica peer heard after {timeout} s")


def run_once(label: str, rep: int, trace: str, args: argparse.Namespace) -> dict:
    n_routers, spread, shared = parse_arm(label)
    out = Path(args.out)
    run_label = f"{label}-r{rep}"
    n = args.instances
    base = args.port_base
    kv_base = base + n
    urls = [f"http://127.0.0.1:{base + i}" for i in range(n)]
    backends = [f"i{i}={urls[i]}@kv=tcp://127.0.0.1:{kv_base + 2 * i}@kv-replay=tcp://127.0.0.1:{kv_base + 2 * i + 1}"
                for i in range(n)]
    procs: list[tuple[subprocess.Popen, object]] = []
    sim_log = open(out / "logs" / f"{run_label}.sim.log", "w")
    sim = subprocess.Popen([sys.executable, "-m", "kvtop", "sim", "--instances", str(n), "--port-base", str(base),
                            "--kv-events-port-base", str(kv_base), "--profile", args.profile,
                            "--speed", str(args.speed), "--stream-interval-ms", str(args.stream_interval_ms)],
                           stdout=sim_log, stderr=subprocess.STDOUT)
    procs.append((sim, sim_log))
    try:
        for u in urls:
            wait_http(u + "/health", 60, sim)
        model = json.loads(urllib.request.urlopen(urls[0] + "/v1/models", timeout=5).read())["data"][0]["id"]
        ports = [args.router_port + k for k in range(n_routers)]
        binds = [f"tcp://127.0.0.1:{args.replica_port + k}" for k in range(n_routers)]
        for k, port in enumerate(ports):
            cmd = [sys.executable, "-m", "kvtop", "route", "--host", "127.0.0.1", "--port", str(port),
                   "--policy", args.policy, "--db", "none", "--block-size", str(args.block_size),
                   "--capacity-tokens", str(args.capacity_tokens), "--state-dir", str(out / "state")]
            for b in backends:
                cmd += ["--backend", b]
            if shared:
                cmd += ["--replica-bind", binds[k]]
                for j in range(n_routers):
                    if j != k:
                        cmd += ["--replica-peer", binds[j]]
            rlog = open(out / "logs" / f"{run_label}.router{k}.log", "w")
            procs.append((subprocess.Popen(cmd, stdout=rlog, stderr=subprocess.STDOUT), rlog))
        for (p, _), port in zip(procs[1:], ports):
            wait_http(f"http://127.0.0.1:{port}/v1/models", 90, p, want=model)
        if shared:  # every replica hears every peer before the first request
            for port in ports:
                wait_shared(f"http://127.0.0.1:{port}/kvtop/v1/state", n_routers - 1)
        log(f"{run_label}: {n_routers} router(s), spread {spread}, shared view {shared}; replaying")
        row = replay_spread(trace, [f"http://127.0.0.1:{p}" for p in ports], spread, args, run_label, urls, model)
        row["router_cpu_s"] = round(sum(cpu_seconds(p.pid) for p, _ in procs[1:]), 1)  # all routers together
        for k, port in enumerate(ports):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/kvtop/v1/state", timeout=10) as r:
                st = json.loads(r.read())
            (out / f"{run_label}.router{k}.state.json").write_text(json.dumps(st, indent=1))
            if st.get("replicas"):
                row.setdefault("replicas", []).append({k2: st["replicas"][k2] for k2 in ("mode", "peers_fresh",
                                                                                          "published", "dropped")})
        return row
    finally:
        for p, f in reversed(procs):
            stop(p)
            f.close()


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    ones = [r for r in rows if r["arm"].startswith("1-")]
    ref_t = sum(r["ttft_p90_s"] for r in ones) / len(ones) if ones else None
    ref_e = sum(r["e2e_p99_s"] for r in ones) / len(ones) if ones else None
    lines = ["| arm / run | requests | TTFT p50 s | TTFT p90 s | E2E p99 s | APC | errors | TTFT p90 / 1 router "
             "| E2E p99 / 1 router |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        rt = r["ttft_p90_s"] / ref_t if ref_t and r["ttft_p90_s"] is not None else None
        re_ = r["e2e_p99_s"] / ref_e if ref_e and r["e2e_p99_s"] is not None else None
        lines.append(f"| {r['arm']} | {r['requests']} | {fmt(r['ttft_p50_s'], '.3f')} | {fmt(r['ttft_p90_s'], '.3f')} "
                     f"| {fmt(r['e2e_p99_s'], '.2f')} | {fmt(r['apc'] and r['apc'] * 100, '.1f')}% | {r['errors']} "
                     f"| {fmt(rt, '.2f')}x | {fmt(re_, '.2f')}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("replicas-out"))
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--weka", default="/work/shared/traces/weka_claude_code")
    p.add_argument("--trace", type=Path, default=None, help="use this built trace instead of building one")
    p.add_argument("--max-input", type=int, default=200_000)
    p.add_argument("--sessions", type=int, default=24)
    p.add_argument("--stagger", type=float, default=5.0)
    p.add_argument("--max-gap", type=float, default=20.0)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--seed", type=int, default=23)
    p.add_argument("--instances", type=int, default=8)
    p.add_argument("--profile", default="h20")
    p.add_argument("--speed", type=float, default=10.0)
    p.add_argument("--stream-interval-ms", type=float, default=20.0,
                   help="the sim's SSE coalescing (default 20: saves the routers' CPU on 2 cores)")
    p.add_argument("--policy", default="expected_cost")
    p.add_argument("--block-size", type=int, default=16, help="the engine's (kvtop sim: 16): hits exact")
    p.add_argument("--capacity-tokens", type=int, default=265_000)
    p.add_argument("--port-base", type=int, default=18500)
    p.add_argument("--router-port", type=int, default=18480)
    p.add_argument("--replica-port", type=int, default=18470)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated; default all five")
    p.add_argument("--repeats", type=int, default=2, help="runs per arm, interleaved (default 2)")
    args = p.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    for a in arms:
        parse_arm(a)
    args.cache.mkdir(parents=True, exist_ok=True)
    if args.out.exists():
        shutil.rmtree(args.out)
    (args.out / "logs").mkdir(parents=True)
    trace = str(args.trace or build_trace(args, args.out))
    rows = []
    for rep in range(1, args.repeats + 1):
        for a in arms:
            t0 = time.monotonic()
            load = os.getloadavg()[0]
            row = run_once(a, rep, trace, args)
            row["arm"] = f"{a}-r{rep}"
            row["load_before"] = round(load, 2)
            row["load_after"] = round(os.getloadavg()[0], 2)
            rows.append(row)
            log(f"{row['arm']}: {json.dumps(row)} ({time.monotonic() - t0:.0f} s)")
            (args.out / "rows.json").write_text(json.dumps(rows, indent=1))
    rows.sort(key=lambda r: (arms.index(r["arm"].rsplit("-r", 1)[0]), r["arm"]))
    text = table(rows)
    (args.out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
