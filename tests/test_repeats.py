"""kvtop simulate --repeats: perturbed replicas, confidence intervals, paired differences."""

from __future__ import annotations

import math

import pytest

from kvtop.repeats import interval, paired, perturb, run_replicas, t95
from kvtop.simulate import SimConfig, simulate
from kvtop.traces.loader import TraceRequest


def trace(sessions=6, turns=3):
    out = []
    for s in range(sessions):
        for t in range(turns):
            n = 6_000 + 3_000 * t
            out.append(TraceRequest(arrival=1.5 * s + 6.0 * t, session=f"s{s}", turn=t + 1, input_tokens=n,
                                    output_tokens=16, hash_ids=[s * 10**6 + k for k in range(n // 64)],
                                    block_size=64, think_time=None, parent=None, source="test"))
    return sorted(out, key=lambda r: r.arrival)


@pytest.mark.parametrize("values,mean,half", [
    ([5.0], 5.0, 0.0),  # one replica: no interval
    ([1.0, 3.0], 2.0, 12.706 * math.sqrt(2) / math.sqrt(2)),  # sd sqrt(2), t(1) = 12.706
    ([2.0, 2.0, 2.0], 2.0, 0.0),
])
def test_interval_is_students_t(values, mean, half):
    m, h = interval(values)
    assert m == pytest.approx(mean) and h == pytest.approx(half)
    assert t95(40) == 1.96 and t95(4) == 2.776


def test_perturb_keeps_each_session_in_order_and_replica_0_as_traced():
    reqs = trace()
    assert perturb(reqs, 0, 2.0) == reqs
    a, b = perturb(reqs, 3, 2.0), perturb(reqs, 3, 2.0)
    assert a == b and a != reqs  # seeded: every policy sees the same replica
    for s in {r.session for r in reqs}:
        orig = [r.arrival for r in reqs if r.session == s]
        new = [r.arrival for r in a if r.session == s]
        shifts = {round(n - o, 9) for n, o in zip(new, orig) if o > 2.0}
        assert len(shifts) <= 1 and all(abs(x) <= 2.0 for x in shifts)  # one offset per session


def test_replicas_are_the_same_in_parallel_and_paired_differences_are_signed():
    reqs = trace()
    cfgs = {p: SimConfig(instances=2, profile="h20") for p in ("leastwork", "round_robin")}
    serial = run_replicas(simulate, reqs, cfgs, 3, 2.0, workers=1)
    parallel = run_replicas(simulate, reqs, cfgs, 3, 2.0, workers=2)
    assert serial == parallel
    best, diffs = paired(serial, "ttft_mean_ms")
    assert best in cfgs and len(diffs) == 1 and diffs[0][1] >= 0  # the others are worse, or equal


def test_path_jitter_varies_replicas_after_the_first():
    # session shifts off (jitter 0): what differs between replicas is the path noise alone,
    # seeded with the replica (kvtop/repeats.py run_task), the same in workers as in one process
    reqs = trace()
    quiet = {"leastwork": SimConfig(instances=2, mode="closed")}
    noisy = {"leastwork": SimConfig(instances=2, mode="closed", path_jitter_s=1.0)}
    q = run_replicas(simulate, reqs, quiet, 3, 0.0, workers=1)["leastwork"]
    n = run_replicas(simulate, reqs, noisy, 3, 0.0, workers=1)["leastwork"]
    assert q[0] == q[1] == q[2]          # nothing perturbs them
    assert n[0] == q[0]                  # replica 0 keeps the noise-free path
    assert n[1] != q[1] and n[2] != q[2] and n[1] != n[2]
    assert run_replicas(simulate, reqs, noisy, 3, 0.0, workers=2)["leastwork"] == n


def test_cli_repeats_reports_intervals(tmp_path, capsys):
    import json

    from kvtop.cli import main

    path = tmp_path / "t.jsonl"
    with open(path, "w") as f:
        for r in trace():
            f.write(json.dumps({"arrival": r.arrival, "session": r.session, "turn": r.turn,
                                "input_tokens": r.input_tokens, "output_tokens": r.output_tokens,
                                "hash_ids": r.hash_ids, "block_size": r.block_size}) + "\n")
    assert main(["simulate", str(path), "--policies", "leastwork,round_robin", "--instances", "2",
                 "--repeats", "3", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "3 replicas per policy" in out and "±" in out and "paired by replica" in out
    assert main(["simulate", str(path), "--policies", "leastwork", "--instances", "2", "--repeats", "2",
                 "--workers", "1", "--path-jitter", "0.4"]) == 0
    assert "each request's path time varied by up to ±0.2 s around the profile's frontend time, never before its send" \
        in capsys.readouterr().out
    assert main(["simulate", str(path), "--policies", "leastwork", "--repeats", "2", "--out",
                 str(tmp_path / "o")]) == 2
    # the intervals drawn: an SVG of every metric, forest plots in the terminal
    svg = tmp_path / "r.svg"
    capsys.readouterr()
    assert main(["simulate", str(path), "--policies", "leastwork,round_robin", "--instances", "2",
                 "--repeats", "3", "--workers", "1", "--plot", str(svg), "--terminal-plot", "always"]) == 0
    out = capsys.readouterr().out
    assert "TTFT p90 s: mean and 95% interval over 3 replicas" in out and "E2E p99 s: mean" in out
    import xml.etree.ElementTree as ET
    root = ET.parse(svg).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    bars = [r for r in root.iter(ns + "rect") if r.find(ns + "title") is not None]
    assert len(bars) == 6 * 2   # every metric, every policy, each with its mean ± half-width
    assert len(root.findall(f".//{ns}line")) == 12   # and its interval drawn through it
    titles = [b.find(ns + "title").text for b in bars]
    assert all(" ± " in t for t in titles) and sum("(best)" in t for t in titles) == 6
    assert main(["simulate", str(path), "--policies", "leastwork", "--plot", str(svg)]) == 2
    assert "--plot draws the intervals of --repeats" in capsys.readouterr().err
    assert main(["simulate", str(path), "--policies", "leastwork", "--repeats", "2", "--workers", "1",
                 "--plot", str(tmp_path / "no" / "such" / "dir.svg")]) == 2
    err = capsys.readouterr().err   # refused before any simulation ran
    assert err.startswith("kvtop simulate: cannot write --plot") and err.count("\n") == 1


def test_fingerprint_is_each_replicas_records_digest_and_the_cli_prints_it(tmp_path, capsys):
    # `kvtop simulate --repeats N --fingerprint`: what shows that two versions of kvtop simulate
    # the same thing over a whole --repeats run, not only replica 0 (issue 37's must-hold)
    import json

    from kvtop.cli import main
    from kvtop.repeats import fingerprints, records_digest

    reqs = trace()
    cfg = SimConfig(instances=2, profile="h20")
    runs = run_replicas(simulate, reqs, {"leastwork": cfg}, 2, 2.0, workers=1, fingerprint=True)
    rows = runs["leastwork"]
    assert rows[0]["sha256"] == records_digest(simulate(reqs, "leastwork", cfg))
    assert rows[1]["sha256"] == records_digest(simulate(perturb(reqs, 1, 2.0), "leastwork", cfg))
    assert rows[0]["sha256"] != rows[1]["sha256"]   # the replicas differ, and so do their prints
    assert run_replicas(simulate, reqs, {"leastwork": cfg}, 2, 2.0, workers=2, fingerprint=True) == runs
    other = run_replicas(simulate, reqs, {"leastwork": SimConfig(instances=3, profile="h20")}, 2, 2.0,
                         workers=1, fingerprint=True)
    assert fingerprints(other) != fingerprints(runs)   # another simulation, another print
    assert "sha256" not in run_replicas(simulate, reqs, {"leastwork": cfg}, 1, 2.0, workers=1)["leastwork"][0]

    path = tmp_path / "t.jsonl"
    with open(path, "w") as f:
        for r in reqs:
            f.write(json.dumps({"arrival": r.arrival, "session": r.session, "turn": r.turn,
                                "input_tokens": r.input_tokens, "output_tokens": r.output_tokens,
                                "hash_ids": r.hash_ids, "block_size": r.block_size}) + "\n")
    capsys.readouterr()
    assert main(["simulate", str(path), "--policies", "leastwork", "--instances", "2", "--repeats", "2",
                 "--workers", "1", "--fingerprint"]) == 0
    out = capsys.readouterr()
    assert f"fingerprint leastwork {fingerprints(runs)['leastwork']} (2 replicas)" in out.err
    assert "fingerprint" not in out.out   # the report itself is unchanged
    assert main(["simulate", str(path), "--policies", "leastwork", "--instances", "2", "--fingerprint"]) == 0
    assert f"fingerprint leastwork {rows[0]['sha256']}" in capsys.readouterr().err
    # what-if (--from-db) has no fingerprint: refused with the flags it takes, not ignored
    assert main(["simulate", "--from-db", str(tmp_path / "none.db"), "--fingerprint"]) == 2
    assert "--from-db takes --policies" in capsys.readouterr().err
