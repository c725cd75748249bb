"""The offline simulator: the router's policies over simulated engines in virtual time."""

from __future__ import annotations

import pytest

from kvtop.cli import main
from kvtop.simulate import SimConfig, simulate
from kvtop.traces.loader import TraceRequest, dense_ids, write_trace
from router.blocks import regroup_block_ids


def session_trace(sessions=6, turns=4, base=20_000, growth=2_000, gap=5.0, bs=64):
    reqs = []
    for s in range(sessions):
        ids = [s * 10**6 + k for k in range((base + growth * turns) // bs)]
        for t in range(turns):
            n = base + growth * t
            reqs.append(TraceRequest(arrival=s * 1.0 + t * gap, session=f"s{s}", turn=t + 1, input_tokens=n,
                                     output_tokens=20, hash_ids=ids[: n // bs], block_size=bs,
                                     think_time=2.0, parent=None, source="test"))
    return sorted(reqs, key=lambda r: r.arrival)


@pytest.mark.parametrize("policy", ["round_robin", "lmetric", "sticky", "unified", "unified_ab", "leastwork"])
def test_every_request_has_a_record_and_counters_end_at_zero(policy):
    reqs = session_trace()
    recs = simulate(reqs, policy, SimConfig(instances=3))  # raises if counters are not zero
    assert len(recs) == len(reqs) and all(r["status"] == "ok" for r in recs)
    assert all(r["ttft_ms"] > 0 and r["e2e_ms"] >= r["ttft_ms"] for r in recs)


def test_cache_affinity_shows_in_delivered_hits():
    reqs = session_trace()
    sticky = simulate(reqs, "sticky", SimConfig(instances=3))
    rr = simulate(reqs, "round_robin", SimConfig(instances=3))
    hits = lambda recs: sum(r["cached_tokens"] or 0 for r in recs)
    # sticky keeps every later turn on its session's engine: turn t+1 hits all of turn t's full blocks
    assert hits(sticky) > hits(rr)
    later = [r for r in sticky if r["turn"] > 1]
    assert all(r["cached_tokens"] >= r["input_tokens"] - 2_000 - 64 for r in later)


def test_closed_loop_waits_for_the_answer_and_think_time():
    reqs = session_trace(sessions=1, turns=3, gap=0.0)
    recs = sorted(simulate(reqs, "unified", SimConfig(instances=1, mode="closed")), key=lambda r: r["turn"])
    for prev, nxt in zip(recs, recs[1:]):
        assert nxt["arrival"] == pytest.approx(prev["arrival"] + prev["e2e_ms"] / 1000 + 2.0)


@pytest.mark.parametrize("policy", ["round_robin", "sticky", "leastwork", "expected_cost"])
def test_dense_ids_change_no_record(policy):
    # kvtop simulate numbers the trace's ids densely (kvtop/traces/loader.py dense_ids): the
    # records must be the ones the trace's own ids give. Ids past 64 bits' small ints, and two
    # sessions sharing a prefix, so that both the values and the sharing change.
    reqs = session_trace(sessions=5, turns=4)
    shared = [7 * 10**17 + k for k in range(40)]
    reqs = [TraceRequest(**{**{f: getattr(r, f) for f in r.__slots__},
                            "hash_ids": shared[:20] + [x * 9_973 + 10**18 for x in r.hash_ids[20:]]})
            for r in reqs]
    assert simulate(dense_ids(reqs), policy, SimConfig(instances=3)) == simulate(reqs, policy, SimConfig(instances=3))


def test_deterministic():
    reqs = session_trace()
    a = simulate(reqs, "leastwork", SimConfig(instances=3))
    b = simulate(reqs, "leastwork", SimConfig(instances=3))
    assert a == b


def test_path_jitter_is_seeded_noise():
    reqs = session_trace()
    plain = simulate(reqs, "leastwork", SimConfig(instances=3, mode="closed"))
    # seed 0 (replica 0) and jitter 0 are the noise-free path
    assert simulate(reqs, "leastwork", SimConfig(instances=3, mode="closed", path_jitter_s=0.5)) == plain
    assert simulate(reqs, "leastwork", SimConfig(instances=3, mode="closed", path_seed=4)) == plain
    noisy = SimConfig(instances=3, mode="closed", path_jitter_s=0.5, path_seed=4)
    a, b = simulate(reqs, "leastwork", noisy), simulate(reqs, "leastwork", noisy)
    assert a == b and a != plain
    other = simulate(reqs, "leastwork", SimConfig(instances=3, mode="closed", path_jitter_s=0.5, path_seed=5))
    assert other != a
    assert all(r["ttft_ms"] > 0 for r in a)


def test_a_nan_path_jitter_is_refused():
    # through the library too (the CLIs check it): a NaN reached the engines as NaN arrivals
    # and simulate() never returned
    with pytest.raises(ValueError, match="path_jitter_s must be finite"):
        simulate(session_trace(), "leastwork", SimConfig(instances=2, path_jitter_s=float("nan"), path_seed=1))


def test_path_jitter_gives_a_request_the_same_noise_under_every_policy(monkeypatch):
    # open loop, no router queue: each request is sent at its trace arrival, so what its engine
    # request carries beyond that is its path noise, which must not depend on the policy (the
    # replicas of two policies stay paired) nor on the order requests are sent in
    import kvtop.sim.engine as eng

    seen: dict[str, dict[str, float]] = {}
    real = eng.Engine.add_request

    def spy(self, request):
        seen[current][request.request_id] = request.arrival_time
        return real(self, request)

    monkeypatch.setattr(eng.Engine, "add_request", spy)
    reqs = session_trace()
    arrival = {str(k): r.arrival for k, r in enumerate(reqs)}
    for current in ("round_robin", "leastwork"):
        seen[current] = {}
        simulate(reqs, current, SimConfig(instances=3, path_jitter_s=0.5, path_seed=3))
    noise = {p: {rid: at - arrival[rid] for rid, at in seen[p].items()} for p in seen}
    assert noise["round_robin"] == pytest.approx(noise["leastwork"])
    assert all(0 <= u <= 0.25 + 1e-9 for u in noise["leastwork"].values())   # h20: frontend 0, so a delay
    assert len({round(u, 9) for u in noise["leastwork"].values()}) > len(reqs) // 2   # one draw each


@pytest.mark.parametrize("ids,ibs,bs,n,expected", [
    ([1, 2, 3, 4], 64, 128, 256, [2, 4]),
    ([1, 2, 3, 4], 64, 128, 250, [2]),
    ([1, 2], 64, 64, 100, [1]),
    ([7], 64, 32, 64, [hash((7, 0)), hash((7, 1))]),
])
def test_regroup_block_ids(ids, ibs, bs, n, expected):
    assert regroup_block_ids(ids, ibs, bs, n) == expected


def test_cli_prints_seed_table(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    write_trace(path, session_trace())
    assert main(["simulate", str(path), "--policies", "lmetric,leastwork", "--instances", "2",
                 "--out", str(tmp_path / "res")]) == 0
    out = capsys.readouterr().out
    assert "lmetric" in out and "leastwork" in out and "HEAVY" in out
    assert (tmp_path / "res" / "leastwork.jsonl").exists()


@pytest.mark.parametrize("args,msg", [
    (["--policies", "nope"], "unknown policy"),
    (["--policies", "unified", "--knob", "kappa=1e-6"], "no chosen policy has this knob"),
    (["--policies", "unified", "--profile", "a100"], "unknown profile"),
    # 0 used to mean "no limit" and -5 "all but the last 5" (a bare slice)
    (["--policies", "lmetric", "--limit", "0"], "--limit must be at least 1"),
    (["--policies", "lmetric", "--limit", "-5"], "--limit must be at least 1"),
    # 0 was a ZeroDivisionError traceback
    (["--policies", "lmetric", "--router-block-size", "0"], "--router-block-size must be at least 1"),
    # 0 was silently replaced by the default
    (["--policies", "lmetric", "--engine-block-size", "0"], "--engine-block-size must be at least 1"),
    # 0 was silently run as 1
    (["--policies", "lmetric", "--max-output-tokens", "0"], "--max-output-tokens must be at least 1"),
    # an unusable --out was a FileExistsError/PermissionError traceback
    (["--policies", "lmetric", "--out", "{tmp}/t.jsonl"], "cannot create --out"),
    # the path noise varies replicas: alone it would do nothing
    (["--policies", "lmetric", "--path-jitter", "0.3"], "give --repeats 2 or more"),
    (["--policies", "lmetric", "--repeats", "2", "--path-jitter", "-1"], "--path-jitter finite and at least 0"),
    (["--policies", "lmetric", "--repeats", "2", "--path-jitter", "nan"], "--path-jitter finite and at least 0"),
    (["--policies", "lmetric", "--repeats", "2", "--jitter", "inf"], "--path-jitter finite and at least 0"),
    # the engines would refuse every request's priority, as a live vLLM under fcfs does
    (["--policies", "lmetric", "--knob", "priority=session_fcfs"], "give --scheduling-policy priority"),
    # unified_ab's own threshold, not the offload's: under lmetric it is no knob at all
    (["--policies", "lmetric", "--knob", "heavy_threshold=5000"], "offload_threshold"),
])
def test_cli_errors(tmp_path, capsys, args, msg):
    path = tmp_path / "t.jsonl"
    write_trace(path, session_trace(sessions=1, turns=1))
    assert main(["simulate", str(path), *[a.format(tmp=tmp_path) for a in args]]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1
