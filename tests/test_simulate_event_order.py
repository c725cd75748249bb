"""The offline loop's event order: an open loop's arrivals come from a sorted list beside the
event heap (kvtop/simulate.py), and must come in the order the heap gave them: by time, then
by trace index, before any other event of the same time."""

from __future__ import annotations

import random

import pytest

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


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_a_step_end_taken_at_once_leaves_the_heap_order(mode, monkeypatch):
    """kvtop/simulate.py handles a step's end that comes before every other event at once,
    without the heap: the records and decisions must be those of the heap's order, with ties
    between step ends, arrivals, client departures and fleet changes (a drain, a forced remove,
    an add), under two policies."""
    import kvtop.simulate as sim
    from kvtop.fleet_events import FleetEvent

    # engines alike serving alike requests: their steps end at the same times, exact ties
    twins = [TraceRequest(arrival=float(k // 6), session=f"t{k}", turn=0, input_tokens=64 * 30,
                          output_tokens=5 + k % 2, hash_ids=[10_000 + 100 * k + j for j in range(30)],
                          block_size=64) for k in range(24)]
    for reqs in [_trace(seed) for seed in range(3)] + [twins]:
        for policy in ("round_robin", "expected_cost"):
            events = (FleetEvent(0.5, "drain", "i1"), FleetEvent(1.0, "add"),
                      FleetEvent(1.5, "remove", "i0", force=True))
            runs = []
            for at_once in (True, False):
                monkeypatch.setattr(sim, "TAKE_STEP_END_AT_ONCE", at_once)
                decisions: list[dict] = []
                records = simulate(reqs, policy, SimConfig(instances=3, mode=mode, fleet_events=events),
                                   departures={3: 0.2, 11: 1.0, 17: 0.0}, decisions=decisions)
                for d in decisions:
                    d.pop("decision_us")   # the wall time the decision took: differs run to run
                runs.append((records, decisions))
            assert runs[0] == runs[1]
            assert any(r["status"] != "ok" for r in runs[0][0])   # the departures or the remove cut some


def test_a_run_without_tags_is_the_run_with_them(monkeypatch):
    """The simulator turns the prefix index's tags off under a policy that never reads them
    (router/prefix_index.py ``stop_tagging``): the records are those of a run that keeps them;
    under ``expected_cost`` (the lookahead reads them) they stay on."""
    from router.prefix_index import PrefixIndex

    reqs = _trace(1)
    stopped = []
    monkeypatch.setattr(PrefixIndex, "stop_tagging", lambda self, f=PrefixIndex.stop_tagging: (stopped.append(1), f(self)))
    without = simulate(reqs, "leastwork", SimConfig(instances=3))
    assert stopped == [1]
    assert simulate(reqs, "expected_cost", SimConfig(instances=3)) and stopped == [1]
    monkeypatch.setattr(PrefixIndex, "stop_tagging", lambda self: None)
    assert simulate(reqs, "leastwork", SimConfig(instances=3)) == without
