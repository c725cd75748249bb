"""Decision latency per policy, and block hashing, on warm realistic cluster state.

Usage: python benchmarks/bench_decision.py [--iterations 2000] [--instances 8,64]
       [--prompts 16000,200000] [--policies a,b] [--agentic [--sessions-per-instance 3]]
       [--clock wall|cpu] [--no-hash]

The cluster is prepared as a router would see it mid-run: every instance holds many
sessions' blocks in its estimated cache (at capacity), counters are non-zero, and the
measured request is a returning session's next turn (its prefix cached on one instance),
which is the slowest case for the prefix walk. "pick" is RoutingCore.decide: the view
(hits for all instances in one pass + candidates) and the policy. Hashing is separate.

``--agentic`` (issue 38) prepares the state the way a run leaves it instead: sessions
(``--sessions-per-instance`` x instances, 96 at 32 instances) have each sent several turns
through the policy itself, on a virtual clock with think times between them, so they are
bound where the policy put them, have gaps (the lookahead prices them one by one) and a
third of them have a request in flight; the measured request is a session's next turn
(its context plus a few new blocks). Prompts of 200k tokens are the Claude Code traces'
capped contexts.
Targets (issue "Router core"): pick <= 50 us p99 at 8 instances, <= 250 us at 64;
hashing a 200k-token prompt <= 2 ms. Issue 38: expected_cost p99 < 1 ms at 32 instances.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from router.blocks import hash_token_blocks
from router.cluster import Cluster
from router.core import RoutingCore
from router.policies import POLICIES, build_policy
from router.request import RouteRequest


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def warm_cluster(n: int, prompt_tokens: int, rng: random.Random) -> tuple[Cluster, list[list[int]]]:
    cluster = Cluster([f"i{k}" for k in range(n)], block_size=512, capacity_blocks=518)
    sessions = []
    nblocks = prompt_tokens // 512
    for s in range(n * 4):
        blocks = [rng.getrandbits(62) for _ in range(nblocks)]
        sessions.append(blocks)
        cluster.index.insert(s % n, blocks)
        cluster.bind_session(f"s{s}", s % n, prompt_tokens, 0)
    for inst in cluster.instances:
        inst.num_requests = rng.randint(0, 12)
        inst.pending_prefill_tokens = rng.randint(0, 200_000)
        inst.ongoing_decode_tokens = rng.randint(0, 2_000_000)
    return cluster, sessions


class VirtualClock:
    def __init__(self) -> None:
        self.t = 1_000.0

    def __call__(self) -> float:
        return self.t


def agentic_cluster(policy: str, n: int, sessions: int, prompt_tokens: int, rng: random.Random,
                    ) -> tuple[RoutingCore, list[list[int]]]:
    """A cluster as a run leaves it: each session's turns routed by ``policy`` itself on a
    virtual clock (prefill at ~5,000 tokens/s of new tokens, think times of 2-30 s), contexts
    growing to ``prompt_tokens``; then a third of the sessions send a turn left in flight."""
    clock = VirtualClock()
    cluster = Cluster([f"i{k}" for k in range(n)], block_size=512, capacity_blocks=518, clock=clock)
    core = RoutingCore(cluster, build_policy(policy), clock=clock)
    nblocks = prompt_tokens // 512
    turns = 4
    chains = [[rng.getrandbits(62) for _ in range(nblocks)] for _ in range(sessions)]
    # every session's turn k holds (k + 1) / turns of its final context
    events = sorted((rng.uniform(0, 30) + k * 40 + rng.uniform(0, 20), s, k)
                    for s in range(sessions) for k in range(turns))
    live: list = []
    k_req = 0
    for t, s, k in events:
        clock.t = 1_000.0 + t
        while live and live[0][0] <= clock.t:  # requests that end before this arrival
            _, t_first, d, ticket = live.pop(0)
            cluster.first_token(ticket)
            cluster.finish(ticket)
        length = max(1, (k + 1) * nblocks // turns)
        req = RouteRequest(f"w{k_req}", f"s{s}", "header", length * 512, chains[s][:length], "tokens",
                           "completions", True, 16)
        k_req += 1
        d = core.route(req)
        cost = d.new_prefill_tokens / 5_000 + 1.0
        live.append((clock.t + cost, clock.t + cost / 2, d, d.ticket))
        live.sort(key=lambda x: x[0])
    clock.t += 60.0
    for _, _, d, ticket in live:
        cluster.first_token(ticket)
        cluster.finish(ticket)
    for s in rng.sample(range(sessions), sessions // 3):  # a third in flight when we measure
        clock.t += rng.uniform(0.5, 3.0)
        req = RouteRequest(f"f{s}", f"s{s}", "header", nblocks * 512, chains[s], "tokens",
                           "completions", True, 16)
        d = core.route(req)
        if rng.random() < 0.5:
            cluster.first_token(d.ticket)
    clock.t += 5.0
    return core, chains


def bench_pick(policy: str, n: int, prompt_tokens: int, iterations: int, *,
               sessions: int | None = None, clock=time.perf_counter_ns) -> tuple[float, float]:
    rng = random.Random(42)
    if sessions is None:
        cluster, chains = warm_cluster(n, prompt_tokens, rng)
        core = RoutingCore(cluster, build_policy(policy))
        extra = 0
    else:
        core, chains = agentic_cluster(policy, n, sessions, prompt_tokens, rng)
        extra = 4  # a turn adds a few blocks to its session's context
    samples = []
    gc.disable()
    try:
        for k in range(iterations):
            s = rng.randrange(len(chains))
            blocks = chains[s] + [rng.getrandbits(62) for _ in range(rng.randint(0, extra))]
            req = RouteRequest(f"r{k}", f"s{s}", "header", len(blocks) * 512, blocks, "tokens",
                               "completions", True, 16)
            t0 = clock()
            core.decide(req)
            samples.append((clock() - t0) / 1000)
    finally:
        gc.enable()
    return statistics.median(samples), pct(samples, 99)


def bench_hash(tokens: int, iterations: int) -> tuple[float, float]:
    prompt = list(range(tokens))
    samples = []
    for _ in range(iterations):
        t0 = time.perf_counter_ns()
        hash_token_blocks(prompt, 512)
        samples.append((time.perf_counter_ns() - t0) / 1e6)
    return statistics.median(samples), pct(samples, 99)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=2000)
    ap.add_argument("--instances", default="8,64", help="comma-separated fleet sizes (default 8,64)")
    ap.add_argument("--prompts", default="16000,200000", help="comma-separated prompt tokens")
    ap.add_argument("--policies", default=",".join(sorted(POLICIES)), help="comma-separated policies")
    ap.add_argument("--agentic", action="store_true",
                    help="sessions routed through the policy turn by turn, with think times (see above)")
    ap.add_argument("--sessions-per-instance", type=int, default=3,
                    help="--agentic: sessions per instance (default 3: 96 at 32 instances)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="time each pick by the wall clock (default) or by this thread's CPU time, "
                         "which other processes on a shared host do not inflate")
    ap.add_argument("--no-hash", action="store_true", help="skip the block-hashing table")
    args = ap.parse_args()
    try:
        sizes = [int(x) for x in args.instances.split(",")]
        prompts = [int(x) for x in args.prompts.split(",")]
    except ValueError:
        ap.error("--instances and --prompts take comma-separated integers")
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or any(n < 1 for n in sizes) or any(t < 512 for t in prompts):
        ap.error(f"unknown policy {unknown[0]!r}" if unknown else "instances >= 1, prompts >= 512 tokens")
    clock = time.thread_time_ns if args.clock == "cpu" else time.perf_counter_ns
    print("pick latency (RoutingCore.decide), microseconds"
          + (", agentic state" if args.agentic else "") + (", thread CPU time" if args.clock == "cpu" else ""))
    print(f"{'policy':16} {'inst':>4} {'sess':>5} {'prompt':>7} {'p50':>8} {'p99':>8}")
    for n in sizes:
        sessions = n * args.sessions_per_instance if args.agentic else None
        for tokens in prompts:
            for policy in policies:
                p50, p99 = bench_pick(policy, n, tokens, args.iterations, sessions=sessions, clock=clock)
                shown = sessions if sessions is not None else n * 4
                print(f"{policy:16} {n:>4} {shown:>5} {tokens // 1000:>6}k {p50:>8.1f} {p99:>8.1f}",
                      flush=True)
    if args.no_hash:
        return
    print()
    print("block hashing (512-token blocks), milliseconds")
    for tokens in (16_000, 200_000):
        p50, p99 = bench_hash(tokens, 200)
        print(f"{tokens // 1000:>6}k tokens  p50 {p50:.3f}  p99 {p99:.3f}")


if __name__ == "__main__":
    main()
