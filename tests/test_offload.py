"""The offload decision (router/offload.py) and the router-level knobs (router/features.py)."""

from __future__ import annotations

import pytest

from router.cluster import Candidate
from router.config import KnobError
from router.features import FEATURE_KNOBS, Features, prefill_leg_body
from router.settings import split_knobs
from router.offload import OFFLOAD_REASONS, decide_offload
from router.policies import build_policy


def c(i, *, P=0, BS=0, D=0):
    return Candidate(i, f"i{i}", 0, 0, P, BS, D)


def knobs(**kw):
    return FEATURE_KNOBS.validate(kw)


# (mode, D index, new tokens, candidates, knobs, offload, reason, P, why)
CASES = [
    ("simple", 0, 19_999, [c(0, BS=3, D=5000), c(1)], {}, False, "below_threshold", None,
     "one token under offload_threshold: not a candidate"),
    ("simple", 0, 20_000, [c(0, BS=3, D=5000)], {}, False, "no_peer", None,
     "single healthy instance: nowhere to prefill"),
    ("simple", 0, 30_000, [c(0, P=0, BS=1, D=5000), c(1, P=0, BS=1)], {}, False, "p_more_loaded", 1,
     "equal pending prefill and BS: P is at least as loaded"),
    ("simple", 0, 30_000, [c(0, P=10_000, BS=2, D=5000), c(1, P=40_000, BS=0), c(2, P=20_000, BS=9)], {},
     False, "p_more_loaded", 2, "P is the least pending prefill among others (20k) but D has 10k"),
    ("simple", 0, 30_000, [c(0, P=5000, BS=4, D=5000), c(1, P=0, BS=5), c(2, P=9000, BS=0)], {},
     False, "p_overloaded", 1, "P (least pending) has BS 5 > 1.5 x mean 3"),
    ("simple", 0, 30_000, [c(0, P=5000, BS=4, D=5000), c(1, P=0, BS=2), c(2, P=9000, BS=0)], {},
     True, "p_idle_d_busy", 1, "P lighter, under the bound, D decoding 5000 tokens"),
    ("simple", 0, 30_000, [c(0, P=5000, BS=4, D=0), c(1, P=0, BS=2)], {},
     False, "d_idle", 1, "D has nothing decoding: a local prefill disrupts nobody"),
    ("cost", 0, 30_000, [c(0, BS=1, D=0), c(1)], {}, False, "d_idle", 1,
     "cost mode keeps it too when D is not decoding"),
    ("cost", 0, 30_000, [c(0, BS=2, D=4000), c(1, P=10_000, BS=1)], {}, True, "cost_offload", 1,
     "saved 30000/5000 = 6 s > 10000/5000 + 0.1 = 2.1 s"),
    ("cost", 0, 30_000, [c(0, BS=2, D=4000), c(1, P=40_000, BS=1)], {}, False, "cost_keep", 1,
     "saved 6 s < 40000/5000 + 0.1 = 8.1 s"),
    ("cost", 0, 30_000, [c(0, BS=2, D=4000), c(1, P=10_000, BS=1)], {"kv_transfer_s": 4.0},
     False, "cost_keep", 1, "a slow link: 2 + 4 s > 6 s saved"),
    ("cost", 0, 30_000, [c(0, BS=2, D=4000), c(1, P=10_000, BS=1)], {"disruption_factor": 0.3},
     False, "cost_keep", 1, "disruption worth 0.3: 1.8 s saved < 2.1 s"),
    ("off", 0, 90_000, [c(0, BS=9, D=5000), c(1)], {}, False, "below_threshold", None,
     "mode off never offloads"),
]


@pytest.mark.parametrize("mode,d,new,cands,kn,offload,reason,p,why", CASES,
                         ids=[f"{x[0]}-{x[6]}-{k}" for k, x in enumerate(CASES)])
def test_offload_table(mode, d, new, cands, kn, offload, reason, p, why):
    o = decide_offload(d, new, cands, knobs(offload_mode=mode, **kn))
    assert (o.offload, o.reason, o.prefill_instance) == (offload, reason, p), why
    assert reason in OFFLOAD_REASONS
    if reason not in ("below_threshold",):
        assert o.route_class == ("HEAVY_P2P" if offload else "HEAVY_COLO")
    else:
        assert o.route_class is None


def test_p_is_never_d_and_ties_go_to_first_in_order():
    o = decide_offload(1, 50_000, [c(0, BS=1), c(1, BS=3, D=100, P=9000), c(2, BS=1)],
                       knobs(offload_mode="simple"))
    assert o.prefill_instance == 0 and o.offload


def test_split_knobs_shares_only_prefill_tps():
    ab = build_policy("unified_ab").schema
    pol, feat = split_knobs({"heavy_threshold": 30000, "offload_mode": "cost", "overload_factor": 1.1,
                             "prefill_tps": 8000, "offload_threshold": 9000}, ab)
    assert pol == {"heavy_threshold": 30000, "overload_factor": 1.1, "prefill_tps": 8000}
    assert feat == {"offload_mode": "cost", "prefill_tps": 8000, "offload_threshold": 9000}
    # heavy_threshold is unified_ab's alone now: under another policy it is unknown, and the
    # error points at the offload threshold's own name
    with pytest.raises(KnobError) as e:
        split_knobs({"heavy_threshold": 30000}, build_policy("lmetric").schema)
    assert "offload_threshold" in e.value.message
    with pytest.raises(KnobError) as e:
        split_knobs({"nope": 1}, ab)
    assert e.value.field == "nope" and "offload_mode" in e.value.message


@pytest.mark.parametrize("kw,field", [
    ({"offload_mode": "always"}, "offload_mode"),
    ({"admission": "lifo"}, "admission"),
    ({"admission_lookahead": 0}, "admission_lookahead"),
    ({"kv_transfer_s": -1}, "kv_transfer_s"),
])
def test_bad_feature_knobs_name_the_field(kw, field):
    with pytest.raises(KnobError) as e:
        Features.build(kw)
    assert e.value.field == field


def test_prefill_leg_body_is_one_token_no_stream():
    body = {"prompt": [1, 2], "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True},
            "max_completion_tokens": 50}
    p = prefill_leg_body(body)
    assert p == {"prompt": [1, 2], "max_tokens": 1, "stream": False,
                 "kv_transfer_params": {"do_remote_decode": True}}
    assert body["max_tokens"] == 50  # the client's body is untouched


def _trace(n_short=30, heavy_every=5, bs=64):
    from kvtop.traces.loader import TraceRequest

    reqs = []
    for k in range(n_short):
        n = 40_000 if k % heavy_every == 0 else 2_000
        reqs.append(TraceRequest(arrival=k * 0.3, session=f"s{k}", turn=1, input_tokens=n, output_tokens=200,
                                 hash_ids=[k * 10**6 + j for j in range(n // bs)], block_size=bs,
                                 think_time=0.0, parent=None, source="test"))
    return reqs


@pytest.mark.parametrize("mode", ["simple", "cost"])
def test_simulate_offload_runs_the_two_step_in_virtual_time(mode):
    from kvtop.simulate import SimConfig, simulate

    recs = simulate(_trace(), "round_robin", SimConfig(instances=3, features={"offload_mode": mode}))
    assert len(recs) == 30 and all(r["status"] == "ok" for r in recs)  # counters end at 0 or it raises
    p2p = [r for r in recs if r["route_class"] == "HEAVY_P2P"]
    assert p2p, "some heavy request was offloaded"
    for r in p2p:
        assert r["prefill_instance"] not in (None, r["instance"])
        assert r["cached_tokens"] >= 40_000 - 64  # D held P's blocks: nothing left to prefill
        assert r["output_tokens"] == 200


def test_simulate_admission_knob_queues_in_the_router_as_the_live_router_does():
    from kvtop.simulate import SimConfig, simulate

    fifo = simulate(_trace(), "round_robin", SimConfig(instances=1, features={"admission": "fifo"}))
    waited = [r for r in fifo if r["admission_wait_ms"] > 0]
    assert waited, "a 40k prompt behind another waits in the router's queue"
    for r in waited:  # TTFT counts from the arrival at the router: the wait is inside it
        assert r["ttft_ms"] >= r["admission_wait_ms"]
    none = simulate(_trace(), "round_robin", SimConfig(instances=1))
    assert all(r["admission_wait_ms"] == 0 for r in none)
    # the engine's own waiting queue (SimConfig.admission) in FIFO order is vLLM's order
    engine_fifo = simulate(_trace(), "round_robin", SimConfig(instances=1, admission="fifo"))
    assert [r["ttft_ms"] for r in engine_fifo] == [r["ttft_ms"] for r in none]
    pack = simulate(_trace(), "round_robin", SimConfig(instances=1, features={"admission": "pack"}))
    assert len(pack) == 30 and all(r["status"] == "ok" for r in pack)
