"""The offline loop's event order: an open loop's arrivals come from a sorted list beside the
event heap (kvtop/simulate.py), and must come in the order the heap gave them: by time, then
by trace index, before any other event of the same time."""

from __future__ import annotations

import random

from kvtop.simulate import SimConfig, simulate
from kvtop.traces.loader import TraceRequest


def _trace(seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    reqs = []
    for k in range(40):
        n = rng.choice([64 * 4, 64 * 20, 64 * 60])
        # few distinct times, so that many arrivals tie, with each other and with steps' ends
        reqs.append(TraceRequest(arrival=rng.choice([0.0, 0.5, 1.0, 1.5, 3.0]), session=f"s{k % 7}", turn=k,
                                 input_tokens=n, output_tokens=rng.randint(1, 30),
                                 hash_ids=[k % 3 * 1000 + j for j in range(n // 64)], block_size=64))
    return reqs   # not sorted by arrival


def test_arrivals_are_received_by_time_then_trace_order():
    for seed in range(3):
        reqs = _trace(seed)
        decisions: list[dict] = []
        records = simulate(reqs, "round_robin", SimConfig(instances=3), decisions=decisions)
        assert len(records) == len(reqs)
        first = [d["request_id"] for d in decisions if d.get("attempt", 1) == 1]
        want = sorted(range(len(reqs)), key=lambda k: (reqs[k].arrival, k))
        assert [int(r) for r in first] == want
