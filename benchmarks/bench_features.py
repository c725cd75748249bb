"""Decision latency the router-level features add on top of the policy pick.

For each request of a synthetic agentic mix on an 8-instance cluster already holding load
and cache, time (1) the policy's decide (prefix match + pick), (2) the offload decision
(router.offload: one pass over the instances' counters) and (3) one admission round
(router.admission.admit over the instance's queue, and AdmissionQueue.pump). Prints p50 and
p99 in microseconds. Run: python benchmarks/bench_features.py [N_REQUESTS] (default 20000).
"""

from __future__ import annotations

import random
import sys
import time

from router.admission import AdmissionQueue, admit
from router.cluster import Cluster
from router.core import RoutingCore
from router.features import FEATURE_KNOBS
from router.offload import decide_offload, loads
from router.policies import build_policy
from router.request import RouteRequest


def pct(values: list[float], p: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(round((len(v) - 1) * p / 100)))]


def main(n: int) -> None:
    rng = random.Random(1)
    names = [f"i{i}" for i in range(8)]
    knobs = FEATURE_KNOBS.validate({"offload_mode": "cost", "admission": "pack"})
    for policy in ("lmetric", "unified", "unified_ab"):
        cluster = Cluster(names, block_size=512, capacity_blocks=518)
        core = RoutingCore(cluster, build_policy(policy))
        tickets = []
        sessions = [(f"s{k}", rng.randrange(1 << 40)) for k in range(64)]
        pick_us, off_us, adm_us, pump_us = [], [], [], []
        queue = AdmissionQueue(len(names))
        admitted: list[tuple[int, int]] = []
        for k in range(n):
            sid, base = sessions[rng.randrange(len(sessions))]
            ntok = rng.choice((2_000, 8_000, 30_000, 90_000))
            blocks = [base + b for b in range(ntok // 512)]
            req = RouteRequest(str(k), sid, "header", ntok, blocks, "tokens", "completions", True, 100)
            t0 = time.perf_counter()
            d = core.decide(req)
            t1 = time.perf_counter()
            decide_offload(d.instance, d.new_prefill_tokens, loads(cluster), knobs)
            t2 = time.perf_counter()
            costs = [rng.choice((500, 2_000, 9_000, 30_000)) for _ in range(16)]
            admit(costs, rng.randrange(20_000), knobs["admission_budget_tokens"], knobs["admission_lookahead"],
                  "pack", k + 1, knobs["admission_force_fifo_every"])
            t3 = time.perf_counter()
            queue.enqueue(d.instance, k, d.new_prefill_tokens)
            t4 = time.perf_counter()
            admitted.extend((d.instance, key) for key in queue.pump(d.instance, knobs))
            t5 = time.perf_counter()
            for _ in range(2):  # admitted requests reach their first token, about as fast as they come
                if admitted:
                    queue.remove(*admitted.pop(0))
            pick_us.append((t1 - t0) * 1e6)
            off_us.append((t2 - t1) * 1e6)
            adm_us.append((t3 - t2) * 1e6)
            pump_us.append((t5 - t4) * 1e6)
            core.dispatch(d)
            tickets.append(d.ticket)
            if len(tickets) > 48:  # keep ~48 requests in flight
                t = tickets.pop(rng.randrange(len(tickets)))
                cluster.first_token(t)
                cluster.finish(t)
        for label, v in (("policy decide", pick_us), ("+ offload decision", off_us),
                         ("+ admission admit() (16 queued)", adm_us), ("+ AdmissionQueue.pump", pump_us)):
            print(f"{policy:11s} {label:34s} p50 {pct(v, 50):7.1f} us  p99 {pct(v, 99):7.1f} us")
        print(f"{policy:11s} queue length at the end: {sum(len(w) for w in queue.waiting)} waiting")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20_000)
