"""Decisions as sessions accumulate: pick time, throughput and router memory to 100k sessions.

Two trivial backends (bench_overhead.py's, each its own process) answer instantly; one
``kvtop route`` per policy (``--db none``) sits in front of both, on loopback. Every request is
a new session (its own ``X-Session-ID``, its own prompt: about 1,000 tokens, two router blocks,
so each instance's estimated cache fills and evicts), non-streaming, from ``--concurrency``
clients in a closed loop. The routers grow side by side, taking turns every ``--chunk``
requests, so that a noisy minute hits every policy alike.

Per checkpoint and policy it prints: sessions held (the router's ``GET state``), the pick time
p50/p99 (``decision_us`` of the router's last ``--window`` decisions, ``GET decisions``: view +
policy, measured inside the router), the throughput of the step (requests/s) and the router's
RSS. The first checkpoint, ``100``, is the ``--window`` requests after a 100-session warm-up
(sessions 101 to 100 + window); the others are the last ``--window`` decisions of each step of
``--step`` sessions. Beside the router's figures, the same decision in this process
(``InProcess``: CPU time of view + pick) over the last ``--cpu-samples`` picks up to N
sessions and, in the same minutes, alternating every 50 picks, as many on a reference that
holds 100 sessions with its caches full and smaller than their contexts, so that its
decisions price evictions and the keep term too: on a shared machine the load moves more
between minutes than these figures do between 100 and 100k sessions, and a cache still
filling (the router's first checkpoint) prices no eviction at all.

    python benchmarks/bench_sessions.py                       # 100k sessions, ~10 minutes on 2 cores
    python benchmarks/bench_sessions.py --sessions 20000 --step 5000
    python benchmarks/bench_sessions.py --policies expected_cost,leastwork --json out.json

It ends with the issue-37 checks, each true or false: expected_cost's pick p50 and p99 at the
last checkpoint within 1.2x of its figure at 100 sessions (the router's against its first
checkpoint; in-process against the reference of the same minutes), leastwork's own ratios
beside them (it walks no session: they are what the machine and the process size moved), its
throughput over the whole run within 10% of leastwork's, and its RSS at the last checkpoint
under 300 MB.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_overhead import free_port, wait_ready  # noqa: E402

from kvtop.procs import stop_process  # noqa: E402

BENCH_OVERHEAD = Path(__file__).resolve().parent / "bench_overhead.py"
WARMUP = 100


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] if xs else float("nan")


def prompt(n: int) -> str:
    """About 1,000 tokens (4 characters each, the router's text estimate), unique to session n
    from its first characters, so no two sessions share a block."""
    head = f"session {n:08d}: "
    return head + ("the agent reads the repository and edits a file. " * 80)[: 4000 - len(head)]


async def send(base: str, first: int, count: int, concurrency: int, tag: str) -> float:
    """``count`` requests, sessions ``first`` .. ``first + count - 1``, from ``concurrency``
    clients; returns the seconds they took."""
    import aiohttp

    todo = iter(range(first, first + count))
    errors: list[str] = []

    async def worker(http: aiohttp.ClientSession) -> None:
        for n in todo:
            body = {"model": "tiny", "prompt": prompt(n), "max_tokens": 8}
            async with http.post(base + "/v1/completions", json=body,
                                 headers={"X-Session-ID": f"{tag}-{n}"}) as r:
                await r.read()
                if r.status != 200:
                    errors.append(f"{r.status}")

    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        took = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. HTTP {errors[0]}")
    return took


def get_json(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def checkpoint(base: str, pid: int, window: int) -> dict[str, float]:
    dec = get_json(f"{base}/kvtop/v1/decisions?limit={window}")["decisions"]
    us = [d["decision_us"] for d in dec]
    state = get_json(base + "/kvtop/v1/state")
    return {"sessions": state["affinity"]["sessions"], "pick_p50_us": pct(us, 0.5),
            "pick_p99_us": pct(us, 0.99), "rss_mb": rss_mb(pid)}


class InProcess:
    """The same decision in this process, with no server around it: one ``Cluster`` (two
    instances, the router's default capacity) and the policy, fed the same kind of sessions
    (two blocks of their own, 1,000 tokens, each request finished at once). The pick time is
    the CPU time of this thread (``time.thread_time``) over ``Cluster.view`` + ``pick``: what a
    decision costs, without the waits other processes on a shared machine add to a wall clock.
    ``max_sessions``: the records it holds; ``capacity_blocks``: each instance's cache."""

    def __init__(self, policy: str, max_sessions: int = 200_000, tag: str = "s", capacity_blocks: int = 518):
        from router.cluster import Cluster
        from router.policies import build_policy

        self.policy = build_policy(policy, {})
        self.cluster = Cluster(["a", "b"], block_size=512, capacity_blocks=capacity_blocks,
                               max_sessions=max_sessions)
        self.tag = tag
        self.next = 0

    def grow(self, count: int) -> list[float]:
        """``count`` requests of new sessions; their pick times, CPU microseconds."""
        c, pol = self.cluster, self.policy
        cpu = time.thread_time
        out = []
        for n in range(self.next, self.next + count):
            sid = f"{self.tag}{n}"
            blocks = [2 * n + 1, 2 * n + 2]
            t0 = cpu()
            view = c.view(blocks, 1000, sid, lookahead=pol.needs_lookahead)
            pick = pol.pick(None, view)
            out.append((cpu() - t0) * 1e6)
            if pick.uses_rr:
                c.rr_counter += 1
            hit = view.hits[pick.index]
            t = c.dispatch(pick.index, 1000, hit, blocks, session_id=sid)
            c.bind_session(sid, pick.index, 1000, hit)
            c.first_token(t)
            c.finish(t)
        self.next += count
        return out


def side_by_side(big: InProcess, small: InProcess, count: int, chunk: int = 50) -> tuple[list[float], list[float]]:
    """``count`` picks on each, alternating every ``chunk``, so that what the machine does in
    these seconds weighs on both alike."""
    b: list[float] = []
    s: list[float] = []
    while len(b) < count:
        n = min(chunk, count - len(b))
        b += big.grow(n)
        s += small.grow(n)
    return b, s


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=100_000, help="sessions to grow each router to")
    p.add_argument("--step", type=int, default=10_000, help="sessions between checkpoints")
    p.add_argument("--window", type=int, default=1000,
                   help="decisions a checkpoint's pick time is taken over (at most 2000, the router's ring)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--cpu-samples", type=int, default=5000,
                   help="in-process picks a checkpoint's CPU figures are taken over, on each side")
    p.add_argument("--chunk", type=int, default=1000,
                   help="requests sent to one router before the next one's turn, within a step")
    p.add_argument("--policies", default="expected_cost,leastwork",
                   help="one router each, grown side by side (the checks need expected_cost and leastwork)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    if not 1 <= args.window <= 2000:
        p.error("--window must be in [1, 2000]")
    if args.step < max(args.window, args.cpu_samples) or args.sessions < WARMUP + args.window:
        p.error("--step must be at least --window and --cpu-samples, and --sessions at least 100 + --window")
    if args.cpu_samples < 1:
        p.error("--cpu-samples must be 1 or more")
    if args.concurrency < 1 or args.chunk < 1:
        p.error("--concurrency and --chunk must be 1 or more")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    policies = args.policies.split(",")
    tmp = tempfile.mkdtemp(prefix="kvtop-sessions-")
    procs: list[subprocess.Popen] = []
    routers: dict[str, tuple[str, subprocess.Popen]] = {}
    rows: dict[str, list[dict[str, float]]] = {p: [] for p in policies}
    local = {p: InProcess(p) for p in policies}
    # The same decision at 100 sessions, measured in the same minutes as each checkpoint's. Its
    # caches are full (40 blocks: the last 20 sessions of each instance, all of them held) and
    # smaller than what the sessions bound there want (as agentic contexts are, and as the grown
    # one's are from a few hundred sessions on), so its decisions price evictions and the keep
    # term as the grown one's do: what differs is the sessions held.
    reference = {p: InProcess(p, max_sessions=WARMUP, tag="r", capacity_blocks=40) for p in policies}
    try:
        backends = []
        for _ in range(2):
            port = free_port()
            procs.append(subprocess.Popen([sys.executable, str(BENCH_OVERHEAD), "--serve-backend", str(port)]))
            backends.append(f"http://127.0.0.1:{port}")
            wait_ready(backends[-1] + "/v1/models", procs[-1])
        for policy in policies:
            port = free_port()
            cmd = [sys.executable, "-m", "kvtop", "route", "--host", "127.0.0.1", "--port", str(port),
                   "--policy", policy, "--db", "none", "--state-dir", tmp]
            for b in backends:
                cmd += ["--backend", b]
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(proc)
            base = f"http://127.0.0.1:{port}"
            wait_ready(base + "/v1/models", proc)
            routers[policy] = (base, proc)
        # checkpoints: (sessions before the step, requests in it)
        marks = [(0, WARMUP), (WARMUP, args.window)]
        done = WARMUP + args.window
        while done < args.sessions:
            n = min(args.step - done % args.step, args.sessions - done)
            marks.append((done, n))
            done += n
        print(f"{len(policies)} routers, 2 backends, {args.concurrency} clients, a new session per request; "
              f"in-process pick at N sessions beside the same at 100, in the same minutes", flush=True)
        print(f"{'':>9} {'':<14} {'':>8} {'router, wall us':^19} {'in-process, CPU us':^19} "
              f"{'same, 100 sessions':^19}", flush=True)
        print(f"{'sessions':>9} {'policy':<14} {'held':>8} {'p50':>9} {'p99':>9} {'p50':>9} {'p99':>9} "
              f"{'p50':>9} {'p99':>9} {'req/s':>8} {'RSS MB':>7}", flush=True)
        for k, (first, count) in enumerate(marks):
            took = dict.fromkeys(policies, 0.0)
            for start in range(first, first + count, args.chunk):  # the routers take turns
                n = min(args.chunk, first + count - start)
                for policy in policies:
                    took[policy] += asyncio.run(send(routers[policy][0], start, n, args.concurrency, policy))
            for policy in policies:
                base, proc = routers[policy]
                window = min(args.window, count)
                samples = min(args.cpu_samples, count)
                local[policy].grow(count - samples)
                cpu_us, ref_us = side_by_side(local[policy], reference[policy], samples)
                if k == 0:
                    continue  # the warm-up
                row = checkpoint(base, proc.pid, window)
                row["cpu_p50_us"], row["cpu_p99_us"] = pct(cpu_us, 0.5), pct(cpu_us, 0.99)
                row["ref_p50_us"], row["ref_p99_us"] = pct(ref_us, 0.5), pct(ref_us, 0.99)
                row["at"] = first + count if k > 1 else WARMUP
                row["requests"] = count
                row["seconds"] = took[policy]
                row["req_s"] = count / took[policy]
                rows[policy].append(row)
                print(f"{row['at']:>9,} {policy:<14} {row['sessions']:>8,} {row['pick_p50_us']:>9.1f} "
                      f"{row['pick_p99_us']:>9.1f} {row['cpu_p50_us']:>9.1f} {row['cpu_p99_us']:>9.1f} "
                      f"{row['ref_p50_us']:>9.1f} {row['ref_p99_us']:>9.1f} "
                      f"{row['req_s']:>8.0f} {row['rss_mb']:>7.0f}", flush=True)
    finally:
        for proc in reversed(procs):
            stop_process(proc)
    checks = {}
    ec, lw = rows.get("expected_cost"), rows.get("leastwork")
    if ec and lw:
        print()
        first, last = ec[0], ec[-1]
        tput = {p: sum(r["requests"] for r in rs) / sum(r["seconds"] for r in rs) for p, rs in
                (("expected_cost", ec), ("leastwork", lw))}
        checks = {
            "pick_p50_ratio": last["pick_p50_us"] / first["pick_p50_us"],
            "pick_p99_ratio": last["pick_p99_us"] / first["pick_p99_us"],
            "cpu_p50_ratio": last["cpu_p50_us"] / last["ref_p50_us"],
            "cpu_p99_ratio": last["cpu_p99_us"] / last["ref_p99_us"],
            "throughput_ratio": tput["expected_cost"] / tput["leastwork"],
            "rss_mb": last["rss_mb"],
        }
        # leastwork walks no session: its own drift is what the machine and the process size
        # added over the run
        p50, p99 = checks["pick_p50_ratio"], checks["pick_p99_ratio"]
        print(f"expected_cost pick (router, wall) at {last['at']:,} sessions against its first checkpoint: "
              f"p50 x{p50:.2f}, p99 x{p99:.2f} (must be <= 1.2: {p50 <= 1.2 and p99 <= 1.2}); leastwork's: "
              f"p50 x{lw[-1]['pick_p50_us'] / lw[0]['pick_p50_us']:.2f}, "
              f"p99 x{lw[-1]['pick_p99_us'] / lw[0]['pick_p99_us']:.2f}")
        p50, p99 = checks["cpu_p50_ratio"], checks["cpu_p99_ratio"]
        print(f"expected_cost pick (in-process, CPU) at {last['at']:,} sessions against 100, same minutes: "
              f"p50 x{p50:.2f}, p99 x{p99:.2f} (must be <= 1.2: {p50 <= 1.2 and p99 <= 1.2}); leastwork's: "
              f"p50 x{lw[-1]['cpu_p50_us'] / lw[-1]['ref_p50_us']:.2f}, "
              f"p99 x{lw[-1]['cpu_p99_us'] / lw[-1]['ref_p99_us']:.2f}")
        print(f"throughput over the run (the routers taking turns every --chunk requests): "
              f"expected_cost {tput['expected_cost']:.0f} req/s, "
              f"leastwork {tput['leastwork']:.0f}: x{checks['throughput_ratio']:.3f} "
              f"(must be >= 0.9: {checks['throughput_ratio'] >= 0.9})")
        print(f"expected_cost router RSS at {last['at']:,} sessions: {last['rss_mb']:.0f} MB "
              f"(must be < 300: {last['rss_mb'] < 300})")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows, "checks": checks}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
