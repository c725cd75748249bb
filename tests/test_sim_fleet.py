"""Fleet changes in the offline simulator (kvtop/fleet_events.py, kvtop/simulate.py): events applied
at their simulated time through the router's own fleet rules, and what-if's replay of a recorded
run's fleet changes."""

from __future__ import annotations

import json

import pytest

from kvtop.fleet_events import FleetEvent, check, from_config_events, parse
from kvtop.simulate import SimConfig, simulate
from kvtop.traces.loader import TraceRequest, write_trace
from store.errors import CliError


def trace(sessions=8, turns=6, base=6_000, growth=1_000, gap=4.0, bs=64):
    reqs = []
    for s in range(sessions):
        ids = [s * 10**6 + k for k in range((base + growth * turns) // bs)]
        for t in range(turns):
            n = base + growth * t
            reqs.append(TraceRequest(arrival=s * 0.5 + t * gap, session=f"s{s}", turn=t + 1, input_tokens=n,
                                     output_tokens=200, hash_ids=ids[: n // bs], block_size=bs, source="test"))
    return sorted(reqs, key=lambda r: r.arrival)


def run(reqs, events, policy="leastwork", instances=2):
    decisions: list[dict] = []
    recs = simulate(reqs, policy, SimConfig(instances=instances, fleet_events=tuple(events)), decisions=decisions)
    return recs, decisions


def test_drain_and_add_at_their_simulated_time():
    """A drain of i0 at t=8: no decision goes to i0 after it; the requests in flight there finish;
    each session homed there moves at its next turn; the instance added at t=10 takes requests
    only from then on; counters end at zero (simulate raises otherwise)."""
    reqs = trace()
    events = [FleetEvent(8.0, "drain", "i0"), FleetEvent(10.0, "add")]
    recs, decisions = run(reqs, events)
    assert all(r["status"] == "ok" for r in recs) and len(recs) == len(reqs)
    on_i0_after = [d for d in decisions if d["instance"] == "i0" and d["ts"] > 8.0]
    assert on_i0_after == [] and any(d["instance"] == "i0" for d in decisions if d["ts"] <= 8.0)
    running_at_drain = [r for r in recs if r["instance"] == "i0" and r["arrival"] <= 8.0
                        and r["arrival"] + r["e2e_ms"] / 1000 > 8.0]
    assert running_at_drain  # the drain found requests in flight on i0: they finished there, ok
    on_i2 = [d["ts"] for d in decisions if d["instance"] == "i2"]
    assert on_i2 and min(on_i2) >= 10.0
    # without the events the same trace keeps i0 busy after t=8: the test can fail
    _, plain = run(reqs, [])
    assert any(d["instance"] == "i0" and d["ts"] > 8.0 for d in plain)


def test_remove_waits_for_the_drain_and_force_fails_over():
    reqs = trace()
    # a remove while requests run there waits until they end, as kvtop fleet drain --wait, then remove
    recs, decisions = run(reqs, [FleetEvent(8.0, "drain", "i0"), FleetEvent(8.0, "remove", "i0")])
    assert all(r["status"] == "ok" for r in recs)
    assert not [d for d in decisions if d["instance"] == "i0" and d["ts"] > 8.0]
    # forced: what was in flight on i0 is retried on i1 (a second attempt) and answered
    recs, decisions = run(reqs, [FleetEvent(8.0, "remove", "i0", force=True)])
    assert all(r["status"] == "ok" for r in recs) and len(recs) == len(reqs)
    retried = [d for d in decisions if d["attempt"] == 2]
    assert retried and all(d["instance"] == "i1" and d["ts"] == 8.0 for d in retried)


def test_fail_retries_in_flight_elsewhere_and_takes_the_instance_out():
    reqs = trace()
    recs, decisions = run(reqs, [FleetEvent(8.0, "fail", "i1")])
    assert all(r["status"] == "ok" for r in recs)
    assert [d for d in decisions if d["attempt"] == 2]
    assert not [d for d in decisions if d["instance"] == "i1" and d["ts"] > 8.0]


@pytest.mark.parametrize("text,words", [
    ('{"t": 5, "action": "evict", "instance": "i0"}', "action must be one of add, cordon"),
    ('{"t": -1, "action": "drain", "instance": "i0"}', "t must be a number of seconds, at least 0"),
    ('{"t": 5, "action": "drain"}', "drain needs an instance"),
    ('{"t": 5, "action": "drain", "instance": "i0", "when": 3}', "unknown key(s) when"),
    ('{"t": 5, "action": "drain", "instance": "i0", "force": true}', "force goes with remove"),
    ('{"t": 5, "action": "drain", "instance": "i9"}', "unknown instance 'i9'; known then: i0, i1"),
    # the router's own rule: the last active instance is not drained
    ('{"t": 5, "action": "drain", "instance": "i0"}\n{"t": 6, "action": "cordon", "instance": "i1"}',
     "cordon would leave no active instance"),
    ('{"t": 5, "action": "add", "instance": "i1"}', "i1 is in the fleet already"),
    ('{"t": 5, "action": "remove", "instance": "i0"}\n{"t": 6, "action": "drain", "instance": "i0"}',
     "the instance was removed; add it again instead"),
    ("not json", "line 1: not valid JSON"),
    ('[{"t": 1, "action": "add"}, 3]', "item 2: expected an object"),
])
def test_bad_events_are_one_line_errors(text, words):
    with pytest.raises(CliError) as exc:
        check(parse(text), ["i0", "i1"])
    assert words in str(exc.value)


def test_names_follow_adds_and_revivals():
    events = parse('# a comment\n{"t": 1, "action": "add"}\n{"t": 2, "action": "remove", "instance": "i0"}\n'
                   '{"t": 3, "action": "add", "instance": "i0"}\n{"t": 0.5, "action": "add", "instance": "x"}\n')
    assert [e.t for e in events] == [0.5, 1, 2, 3]  # sorted by time
    assert check(events, ["i0", "i1"]) == ["i0", "i1", "x", "i3"]


def test_cli_fleet_events(tmp_path, capsys):
    from kvtop.cli import main

    tr = tmp_path / "t.jsonl"
    write_trace(tr, trace(sessions=3, turns=3))
    ev = tmp_path / "ev.jsonl"
    ev.write_text('{"t": 2, "action": "add"}\n{"t": 3, "action": "drain", "instance": "i0"}\n')
    assert main(["simulate", str(tr), "--instances", "2", "--policies", "leastwork", "--fleet-events", str(ev),
                 "--out", str(tmp_path / "out")]) == 0
    recs = [json.loads(x) for x in (tmp_path / "out" / "leastwork.jsonl").read_text().splitlines()[1:]]
    assert any(r["instance"] == "i2" for r in recs)  # the added instance served
    assert not [r for r in recs if r["instance"] == "i0" and r["arrival"] > 3]
    capsys.readouterr()
    ev.write_text('{"t": 3, "action": "drain", "instance": "i7"}\n')
    assert main(["simulate", str(tr), "--instances", "2", "--fleet-events", str(ev)]) == 2
    err = capsys.readouterr().err
    assert "unknown instance 'i7'" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("rows,start,events,names", [
    # the runs row lists the added instances too: a name whose first change is an add was not there
    ([(110.0, {"instance": "i2", "action": "add"}), (112.0, {"instance": "i0", "action": "drain"}),
      (113.0, {"instance": "i0", "action": "remove", "force": False})],
     ["i0", "i1"], [(20.0, "add", "i2"), (24.0, "drain", "i0"), (26.0, "remove", "i0")], ["i0", "i1", "i2"]),
    # named instances map to the simulator's i<k> in the router's order; a revival keeps its place
    ([(101.0, {"instance": "b", "action": "remove", "force": True}), (102.0, {"instance": "b", "action": "add"})],
     ["a", "b"], [(2.0, "remove", "i1"), (4.0, "add", "i1")], ["a", "b"]),
])
def test_what_if_reads_the_recorded_fleet_changes(rows, start, events, names):
    recorded_backends = list(names)  # as the runs row keeps them at the end of the run
    got, got_start, got_names = from_config_events(rows, 100.0, 2.0, recorded_backends)
    assert [(e.t, e.action, e.instance) for e in got] == events
    assert got_start == start and got_names == names
    assert any(e.force for e in got) == any(r[1].get("force") for r in rows)
