"""What the fleet's exclusion costs a request: one request's whole lifecycle (route, send, first
token, end) through router/lifecycle.py, on 8 instances, with every instance active, and with
one cordoned and one draining (the rule then builds a tuple per request).

Usage: python benchmarks/bench_fleet.py [--requests 20000] [--repeat 5]

Runs on a tree without router/fleet.py too (the "all active" line only), for a before/after
on the same machine. Prints microseconds per request, the median of the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

from router.build import build_router
from router.lifecycle import Arrived, Ended, FirstToken, LegSent
from router.request import RouteRequest
from router.settings import Settings


class Sink:
    def decision(self, d):
        pass

    def outcome(self, d, o):
        pass


def run(n_requests: int, fleet_states: dict[int, str]) -> float:
    r = build_router(Settings.parse("leastwork"), [f"i{k}" for k in range(8)], Sink(), block_size=16,
                     capacity_blocks=4096, clock=time.time)
    for i, action in fleet_states.items():
        r.fleet.apply(r.fleet.plan(i, action), 0.0)
    life = r.lifecycle
    reqs = [RouteRequest(f"r{k}", f"s{k % 64}", "header", 64 * 16, [(k % 64) * 1000 + b for b in range(64)],
                         "tokens", "completions", True, 4) for k in range(n_requests)]
    t0 = time.perf_counter()
    for req in reqs:
        flow = life.receive(req)
        life.step(flow, Arrived())
        life.step(flow, LegSent())
        life.step(flow, FirstToken())
        life.step(flow, Ended())
    elapsed = time.perf_counter() - t0
    assert r.cluster.counters_zero()
    return elapsed / n_requests * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    cases = {"all active": {}, "one cordoned, one draining": {1: "cordon", 2: "drain"}}
    try:
        run(10, cases["one cordoned, one draining"])
    except AttributeError:  # a tree before the fleet existed
        del cases["one cordoned, one draining"]
    for name, states in cases.items():
        us = [run(args.requests, states) for _ in range(args.repeat)]
        print(f"{name:28s} {statistics.median(us):7.2f} us/request (min {min(us):.2f}, max {max(us):.2f})")


if __name__ == "__main__":
    main()
