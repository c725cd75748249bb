"""A client that leaves cuts its engine's coalesced steps short (kvtop/sim/engine.py
``abort``): the other requests on that engine must see their first tokens and ends when the
engine, stepped one step at a time, gives them, not at the end the uncut steps had."""

from __future__ import annotations

import pytest

from kvtop.simulate import SimConfig, simulate
from kvtop.traces.loader import TraceRequest


def _reqs() -> list[TraceRequest]:
    # on one instance: long decodes side by side, so that the engine coalesces their steps
    return [TraceRequest(arrival=0.01 * k, session=f"s{k}", turn=0, input_tokens=64 * (4 + k),
                         output_tokens=400 + 37 * k, hash_ids=[1000 * k + j for j in range(4 + k)],
                         block_size=64) for k in range(4)]


def _run(monkeypatch, coalesce: bool, departures: dict[int, float], instances: int = 1):
    from kvtop.sim.engine import Engine

    if not coalesce:
        step = Engine.step
        monkeypatch.setattr(Engine, "step", lambda self, now, coalesce=False: step(self, now, coalesce=False))
    records = simulate(_reqs(), "round_robin", SimConfig(instances=instances), departures=departures)
    monkeypatch.undo()
    return records


@pytest.mark.parametrize("departures", [{1: 0.9}, {0: 0.3, 2: 1.7}, {3: 0.05}])
def test_a_client_leaving_mid_stretch_moves_no_other_request(monkeypatch, departures):
    cut = _run(monkeypatch, True, departures)
    stepwise = _run(monkeypatch, False, departures)
    assert [r["status"] for r in cut] == [r["status"] for r in stepwise]
    assert any(r["status"] == "client_gone" for r in cut)   # the departure did happen mid-run
    assert cut == stepwise


def test_a_cut_on_one_engine_leaves_the_other_engines_alone(monkeypatch):
    departures = {0: 0.4, 3: 1.1}
    cut = _run(monkeypatch, True, departures, instances=2)
    assert cut == _run(monkeypatch, False, departures, instances=2)
