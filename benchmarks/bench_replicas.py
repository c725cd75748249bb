"""What the replicas' shared view costs and how stale it is (router/replicas.py).

    python benchmarks/bench_replicas.py            # about 15 s

- staleness: replica A decides and dispatches a request, or finishes one (each publishes at
  once: the load snapshot with the session facts, router/replica_sessions.py); the wall time until
  replica B's view shows it, over real ZeroMQ sockets on loopback, p50/p99/max;
- a snapshot's cost: A building and encoding one, B decoding and matching it, at 8 and 32
  instances (per message, and its size);
- a decision's cost: ``Replicas.apply`` on a view of 8 and 32 candidates with two peers fresh;
- session records (router/replica_sessions.py): a request's facts built, encoded and applied.
"""

from __future__ import annotations

import asyncio
import random
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from router import replicas as rp  # noqa: E402
from router.cluster import Cluster  # noqa: E402
from router.core import RoutingCore  # noqa: E402
from router.request import RouteRequest  # noqa: E402
from router.settings import Settings  # noqa: E402
from router.supervise import Supervisor  # noqa: E402
from store.stats import percentile  # noqa: E402


def free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def cluster(n: int) -> Cluster:
    return Cluster([f"i{k}" for k in range(n)], urls=[f"http://10.0.0.{k}:8000" for k in range(n)])


async def staleness(changes: int = 100) -> tuple[list[float], list[float]]:
    """Seconds from A's change to B's view: after a decision and its dispatch (published at
    once), and after a finish (published at once too: its session's end is a fact to share)."""
    a_cl, b_cl = cluster(8), cluster(8)
    bind = free_endpoint()
    a = rp.Replicas(a_cl, "A", bind=bind, peers=[])
    b = rp.Replicas(b_cl, "B", bind=None, peers=[bind])
    core = RoutingCore(a_cl, Settings.parse("leastwork", {}).build_policy())
    core.peers = a
    a.open_publisher()
    await a.start(Supervisor())
    await b.start(Supervisor())
    dispatched, finished = [], []
    tickets = []

    def seen() -> int:
        return sum(int(v[1]) for v in b._sum.values())

    async def wait_for(want: int, into: list[float], t0: float) -> None:
        while seen() != want:
            await asyncio.sleep(0.0005)
        into.append(time.perf_counter() - t0)

    try:
        while b.mode != rp.SHARED:
            await asyncio.sleep(0.01)
        for k in range(changes):
            req = RouteRequest(f"r{k}", f"s{k}", "header", 10_000, [], "tokens", "completions", True, 16)
            t0 = time.perf_counter()
            d = core.decide(req)
            tickets.append(core.dispatch(d))
            await wait_for(k % 4 + 1, dispatched, t0)
            if k % 4 == 3:  # four in flight: finish them, one at a time
                for left in (3, 2, 1, 0):
                    await asyncio.sleep(random.uniform(0, 0.05))  # at any phase of the heartbeat
                    t0 = time.perf_counter()
                    a_cl.finish(tickets.pop())
                    await wait_for(left, finished, t0)
            await asyncio.sleep(0.003)
    finally:
        await a.stop()
        await b.stop()
    return dispatched, finished


def snapshot_cost(n: int, rounds: int = 2000) -> tuple[float, float, int]:
    a = rp.Replicas(cluster(n), "A", bind=None, peers=[])
    b = rp.Replicas(cluster(n), "B", bind=None, peers=["tcp://127.0.0.1:1"])
    for k in range(n):
        a.cluster.dispatch(k, 20_000, 0, [])
    t0 = time.process_time()  # CPU seconds: on a shared host wall time measures the neighbours
    for _ in range(rounds):
        msg = a.message(a.own_loads())
    enc = (time.process_time() - t0) / rounds
    peer = b.peers[0]
    t0 = time.process_time()  # CPU seconds: on a shared host wall time measures the neighbours
    for _ in range(rounds):
        peer.seq = -1
        b.receive(peer, [rp.TOPIC, msg])
    dec = (time.process_time() - t0) / rounds
    return enc, dec, len(msg)


def apply_cost(n: int, rounds: int = 20_000) -> float:
    b = rp.Replicas(cluster(n), "B", bind=None, peers=["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"])
    for k, p in enumerate(b.peers):
        a = rp.Replicas(cluster(n), f"P{k}", bind=None, peers=[])
        for i in range(n):
            a.cluster.dispatch(i, 20_000, 0, [])
        b.receive(p, [rp.TOPIC, a.message(a.own_loads())])
    b.clock = lambda: 0.0  # fresh for the whole loop
    for p in b.peers:
        p.received_at = 0.0
    b.refresh()
    view = b.cluster.view([], 1000, None, lookahead=True)
    t0 = time.process_time()  # CPU seconds: on a shared host wall time measures the neighbours
    for _ in range(rounds):
        b.apply(view)
    return (time.process_time() - t0) / rounds


def session_cost(rounds: int = 5000) -> tuple[float, float, int]:
    """Session records (router/replica_sessions.py): A's facts for one request (its bind and
    its end) recorded and encoded into one message, and B applying them; CPU seconds per request."""
    a = rp.Replicas(cluster(8), "A", bind="tcp://127.0.0.1:1", peers=[])  # publishing, never opened
    b = rp.Replicas(cluster(8), "B", bind=None, peers=["tcp://127.0.0.1:1"])
    share = a.share
    msgs = []
    t0 = time.process_time()  # CPU seconds: on a shared host wall time measures the neighbours
    for k in range(rounds):
        sid = f"session-{k % 50:04d}-0123456789abcdef"
        share.bound(sid, k % 8, 30_000 + k, 20_000, True, None)
        share.done(sid)
        msgs.append(share.message())
    enc = (time.process_time() - t0) / rounds
    peer = b.peers[0]
    t0 = time.process_time()
    for m in msgs:
        b.receive(peer, [rp.TOPIC, m])
    dec = (time.process_time() - t0) / rounds
    return enc, dec, max(len(m) for m in msgs)


def main() -> int:
    dispatched, finished = asyncio.run(staleness())
    for what, lat in (("a decision (published at once)", dispatched),
                      ("a finish (published at once with its session's end)", finished)):
        ms = [x * 1e3 for x in lat]
        print(f"staleness after {what}, A's change -> B's view, {len(ms)} changes: p50 "
              f"{percentile(ms, 50):.1f} ms  p99 {percentile(ms, 99):.1f} ms  max {max(ms):.1f} ms")
    for n in (8, 32):
        enc, dec, size = snapshot_cost(n)
        print(f"snapshot at {n} instances: {size} bytes; build+encode {enc * 1e6:.0f} us, decode+match {dec * 1e6:.0f} us")
        print(f"apply() on a view of {n} candidates, 2 fresh peers: {apply_cost(n) * 1e6:.2f} us per decision")
    enc, dec, size = session_cost()
    print(f"session records, a request's bind and end in one message (up to {size} bytes): record+encode "
          f"{enc * 1e6:.1f} us, decode+apply {dec * 1e6:.1f} us at the peer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
