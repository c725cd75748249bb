"""Decision latency per policy, and block hashing, on warm realistic cluster state.

Usage: python benchmarks/bench_decision.py [--iterations 2000]

The cluster is prepared as a router would see it mid-run: every instance holds many
sessions' blocks in its estimated cache (at capacity), counters are non-zero, and the
measured request is a returning session's next turn (its prefix cached on one instance),
which is the slowest case for the prefix walk. "pick" is RoutingCore.decide: the view
(hits for all instances in one pass + candidates) and the policy. Hashing is separate.
Targets (issue "Router core"): pick <= 50 us p99 at 8 instances, <= 250 us at 64;
hashing a 200k-token prompt <= 2 ms.
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


def bench_pick(policy: str, n: int, prompt_tokens: int, iterations: int) -> tuple[float, float]:
    rng = random.Random(42)
    cluster, sessions = warm_cluster(n, prompt_tokens, rng)
    core = RoutingCore(cluster, build_policy(policy))
    samples = []
    gc.disable()
    try:
        for k in range(iterations):
            s = rng.randrange(len(sessions))
            req = RouteRequest(f"r{k}", f"s{s}", "header", prompt_tokens, sessions[s], "tokens",
                               "completions", True, 16)
            t0 = time.perf_counter_ns()
            core.decide(req)
            samples.append((time.perf_counter_ns() - t0) / 1000)
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
    args = ap.parse_args()
    print("pick latency (RoutingCore.decide), microseconds")
    print(f"{'policy':16} {'inst':>4} {'prompt':>7} {'p50':>8} {'p99':>8}")
    for n in (8, 64):
        for tokens in (16_000, 200_000):
            for policy in sorted(POLICIES):
                p50, p99 = bench_pick(policy, n, tokens, args.iterations)
                print(f"{policy:16} {n:>4} {tokens // 1000:>6}k {p50:>8.1f} {p99:>8.1f}")
    print()
    print("block hashing (512-token blocks), milliseconds")
    for tokens in (16_000, 200_000):
        p50, p99 = bench_hash(tokens, 200)
        print(f"{tokens // 1000:>6}k tokens  p50 {p50:.3f}  p99 {p99:.3f}")


if __name__ == "__main__":
    main()
