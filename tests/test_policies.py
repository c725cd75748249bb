"""Each policy on crafted cluster states: the formula, the tie-breaks and the reason."""

from __future__ import annotations

import pytest

from router.cluster import Candidate, ClusterView
from router.config import KnobError
from router.policies import POLICIES, build_policy


def cand(i, *, hit=0, P=0, BS=0, D=0, inp=10_000):
    return Candidate(i, f"i{i}", hit, max(0, inp - hit), P, BS, D)


def view(cands, *, inp=10_000, session=None, turn=1, rr=0):
    hits = [c.hit for c in cands]
    return ClusterView(list(cands), inp, session, turn, rr, hits)


def pick(name, v, **knobs):
    return build_policy(name, knobs).pick(None, v)


# (policy, candidates, view kwargs, expected instance, expected reason, why)
CASES = [
    ("round_robin", [cand(0), cand(1), cand(2)], dict(rr=4), 1, "round_robin", "4 mod 3 = 1"),
    ("load_only", [cand(0, BS=3), cand(1, BS=1), cand(2, BS=2)], {}, 1, "argmin", "fewest in flight"),
    ("load_only", [cand(0, BS=2), cand(1, BS=1), cand(2, BS=1)], {}, 1, "tie_first",
     "seed behaviour: a tie goes to the first instance"),
    ("lmetric", [cand(0, P=1000, BS=2), cand(1, P=0, BS=3)], {}, 0, "argmin",
     "(1000+10000)*2=22000 < (0+10000)*3=30000"),
    ("lmetric", [cand(0, BS=1, hit=0), cand(1, BS=0, hit=0), cand(2, BS=0, hit=9000)], {}, 1, "tie_first",
     "x num_requests: both idle instances score 0 whatever their cache; strict < keeps the first"),
    ("lmetric", [cand(0, BS=4, D=100_000, hit=9984), cand(1, BS=1, hit=0)], {}, 0, "argmin",
     "(0+16)*4=64 beats (0+10000)*1: a full cache hit makes a decoding host nearly free"),
    ("leastwork", [cand(0, P=5000), cand(1, P=0), cand(2, P=0, hit=4096)], {}, 2, "argmin",
     "P+new: 15000, 10000, 5904"),
    ("leastwork", [cand(0, BS=2), cand(1, BS=1), cand(2, BS=1)], dict(rr=1), 2, "tie_rr",
     "equal work, fewest BS ties 1 and 2, round-robin counter 1 picks the second"),
    ("leastwork", [cand(0, BS=2), cand(1, BS=1), cand(2, BS=3)], {}, 1, "argmin",
     "equal work: fewest BS breaks the tie, no round-robin needed"),
    ("leastwork_kappa", [cand(0, P=0, D=400_000), cand(1, P=1000)], {}, 1, "argmin",
     "10000*(1+2.5e-6*400000)=20000 > 11000*(1+0)=11000"),
    ("sticky", [cand(0, BS=9), cand(1, BS=0)], dict(session=0, turn=3), 0, "affinity_stick",
     "bound sessions stay, whatever the load"),
    ("sticky", [cand(0, BS=2), cand(1, BS=1)], dict(session=None), 1, "affinity_new",
     "a first turn goes to fewest in flight"),
    ("sticky", [cand(1, BS=2), cand(2, BS=1)], dict(session=0, turn=2), 2, "affinity_lost",
     "the bound instance 0 is unhealthy (not a candidate): rebind"),
]


@pytest.mark.parametrize("name,cands,kw,expected,reason,why", CASES,
                         ids=[f"{c[0]}-{k}" for k, c in enumerate(CASES)])
def test_policy_table(name, cands, kw, expected, reason, why):
    p = pick(name, view(cands, **kw))
    assert (p.index, p.reason) == (expected, reason), why
    assert len(p.terms) >= 1


# unified: (candidates, view kwargs, knobs, expected, reason, why)
UNIFIED = [
    ([cand(0, hit=8000, BS=2), cand(1, BS=1), cand(2, BS=1)], dict(session=0, turn=2), {}, 0,
     "affinity_stick", "80% cached > gate 0.5 and BS 2 <= mean 1.33 x 2"),
    ([cand(0, hit=8000, BS=4), cand(1, BS=1), cand(2, BS=1)], dict(session=0, turn=2), {}, 0,
     "affinity_stick", "BS 4 <= mean 2 x 2: the bound is inclusive"),
    ([cand(0, hit=8000, BS=6), cand(1, BS=1), cand(2, BS=1)], dict(session=0, turn=2), {}, 1,
     "overload_break", "BS 6 > mean 2.67 x 2: fall back; 2000*6 > 10000*1; 1 and 2 tie, rr 0 picks 1"),
    ([cand(0, hit=4000, BS=0), cand(1, BS=0)], dict(session=0, turn=2), {}, 0,
     "cache_gate_miss", "40% cached <= gate: fall back, where instance 0 still has least new"),
    ([cand(0, hit=8000, BS=6), cand(1, BS=1), cand(2, BS=1)], dict(session=0, turn=2),
     {"overload_factor": 3.0}, 0, "affinity_stick", "raising overload_factor keeps the session"),
    ([cand(0, BS=1), cand(1, BS=1)], dict(session=None), {}, 0, "affinity_new",
     "first turn: fallback score ties on everything, rr 0 picks the first"),
    ([cand(0, BS=1), cand(1, BS=1)], dict(session=None, rr=1), {}, 1, "affinity_new",
     "the global round-robin counter spreads exact ties"),
    ([cand(0, BS=1, D=1000), cand(1, BS=1, D=0)], dict(session=None), {"lmetric_decode_weight": 1.0}, 1,
     "affinity_new", "decode weight: +1000 on instance 0"),
]


@pytest.mark.parametrize("cands,kw,knobs,expected,reason,why", UNIFIED)
def test_unified(cands, kw, knobs, expected, reason, why):
    p = pick("unified", view(cands, **kw), **knobs)
    assert (p.index, p.reason) == (expected, reason), why


def test_unified_fallback_tie_order_new_then_bs():
    # equal score 0 (both idle) -> fewer new tokens wins before BS or round robin
    cs = [cand(0, BS=0, hit=0), cand(1, BS=0, hit=4096)]
    p = pick("unified", view(cs, session=None))
    assert p.index == 1 and not p.uses_rr


@pytest.mark.parametrize("backlog,expected,why", [
    (0, 0, "owner has 8k cached and no backlog: 2000 vs 10000"),
    (7_999, 0, "P_a + new_a = 7999 + 2000 = 9999 < 10000: still under the cache saving"),
    (8_001, 1, "10001 > 10000: the backlog now exceeds the cache saving, the idle instance wins"),
])
def test_lpwl_owner_wins_until_backlog_exceeds_cache_saving(backlog, expected, why):
    cs = [cand(0, hit=8000, P=backlog, BS=1), cand(1, hit=0, P=0, BS=1)]
    p = pick("lpwl", view(cs, session=0, turn=2))
    assert p.index == expected, why


def test_lmetric_idle_host_scores_zero():
    p = pick("lmetric", view([cand(0, BS=0, P=50_000, hit=0), cand(1, BS=2, hit=9984)]))
    scores = {t["instance"]: t["score"] for t in p.terms}
    assert scores["i0"] == 0 and p.index == 0


# unified_ab: (cands, view kwargs, knobs, expected, reason, why)
AB = [
    ([cand(0, hit=30_000, BS=8, inp=40_000), cand(1, BS=1, inp=40_000), cand(2, BS=2, inp=40_000)],
     dict(session=0, turn=3, inp=40_000), {}, 1, "migrate",
     "HEAVY, 75% cached, BS 8 > mean 3.67 x 1.5, target BS 1 < 8 - 2"),
    ([cand(0, hit=30_000, BS=10, inp=40_000), cand(1, BS=6, inp=40_000), cand(2, BS=7, inp=40_000)],
     dict(session=0, turn=3, inp=40_000), {}, 1, "overload_break",
     "BS 10 <= mean 7.67 x 1.5: no migration; then 10 > 7.67 x 1.3 breaks affinity"),
    ([cand(0, hit=8_000, BS=8), cand(1, BS=1), cand(2, BS=2)],
     dict(session=0, turn=3), {}, 1, "overload_break",
     "10k input is below heavy_threshold: no migration, then overload breaks"),
]


def test_unified_ab_migration_conditions():
    p = pick("unified_ab", view(AB[0][0], **AB[0][1]))
    assert (p.index, p.reason, p.migrated_from) == (1, "migrate", 0)
    p = pick("unified_ab", view(AB[1][0], **AB[1][1]))
    assert p.reason == "overload_break" and p.migrated_from is None
    p = pick("unified_ab", view(AB[2][0], **AB[2][1]))
    assert p.reason == "overload_break" and p.migrated_from is None
    # each of the four conditions, removed alone, stops the migration
    base_c, base_kw = AB[0][0], AB[0][1]
    p = pick("unified_ab", view(base_c, **base_kw), heavy_threshold=50_000)
    assert p.reason != "migrate", "input under heavy_threshold"
    p = pick("unified_ab", view(base_c, **base_kw), cache_ratio_gate=0.8)
    assert p.reason != "migrate", "cached share at or under the gate"
    p = pick("unified_ab", view(base_c, **base_kw), migration_request_factor=3.0)
    assert p.reason != "migrate", "owner not loaded enough"
    p = pick("unified_ab", view(base_c, **base_kw), migration_min_gap=7)
    assert p.reason != "migrate", "target not light enough"


def test_unified_ab_discount_favours_moving_long_sessions():
    # Owner 0 has little cache (gate miss) and equal load; on turn 6 the discount (5 x 0.05 s)
    # makes the other instance cheaper even though it must prefill 1000 more tokens (0.2 s).
    cs = [cand(0, hit=1000, BS=1), cand(1, hit=0, BS=1)]
    assert pick("unified_ab", view(cs, session=0, turn=1)).index == 0
    assert pick("unified_ab", view(cs, session=0, turn=6)).index == 1


@pytest.mark.parametrize("name,knobs,field", [
    ("nope", {}, "policy"),
    ("unified", {"bogus": 1}, "bogus"),
    ("unified", {"overload_factor": "high"}, "overload_factor"),
    ("unified", {"cache_ratio_gate": 1.5}, "cache_ratio_gate"),
    ("unified_ab", {"migration_min_gap": 2.5}, "migration_min_gap"),
    ("leastwork_kappa", {"kappa": -1}, "kappa"),
    ("leastwork_kappa", {"kappa": True}, "kappa"),
    ("lmetric", {"kappa": 1e-6}, "kappa"),
])
def test_bad_knobs_name_the_field(name, knobs, field):
    with pytest.raises(KnobError) as exc:
        build_policy(name, knobs)
    assert exc.value.field == field


def test_every_policy_documents_formula_and_knobs():
    for name, cls in POLICIES.items():
        doc = cls.__doc__ or ""
        assert name in doc, f"{name}: docstring must state the policy"
        for knob in cls.schema.knobs:
            assert knob.name in doc, f"{name}: knob {knob.name} undocumented"
            assert knob.doc


def test_alias_builds_the_same_policy():
    assert build_policy("lpwl").name == "leastwork"


def test_knobs_accept_cli_strings():
    p = build_policy("unified", {"overload_factor": "1.5", "cache_ratio_gate": "0.25"})
    assert p.knobs["overload_factor"] == 1.5 and p.knobs["cache_ratio_gate"] == 0.25


def test_docs_list_every_reason_and_policy():
    from pathlib import Path

    from router.policies import REASONS

    text = (Path(__file__).resolve().parents[1] / "docs" / "policies.md").read_text()
    for reason in REASONS:
        assert f"`{reason}`" in text, f"docs/policies.md lacks reason {reason}"
    for name in POLICIES:
        assert f"`{name}`" in text, f"docs/policies.md lacks policy {name}"


# unified_ab migration fires only when all four DESIGN.md conditions hold; each boundary case
# sits exactly on a condition's edge. Base: owner 0 with 75% of a 40k prompt cached, BS 8;
# others BS 1 and 2 -> mean 11/3, 8 > 3.67 x 1.5 = 5.5, target BS 1 < 8 - 2.
@pytest.mark.parametrize("inp,hit,owner_bs,knobs,migrates,why", [
    (40_000, 30_000, 8, {}, True, "all four hold"),
    (20_000, 15_000, 8, {}, True, "input == heavy_threshold counts as HEAVY (>=)"),
    (19_999, 15_000, 8, {}, False, "one token under heavy_threshold"),
    (40_000, 20_000, 8, {}, False, "cached share exactly 0.5 is not above the gate (>)"),
    (40_000, 20_032, 8, {}, True, "just above the gate"),
    (40_000, 30_000, 8, {"migration_request_factor": 8 / (11 / 3)}, False,
     "BS_a == mean x factor is not above it"),
    (40_000, 30_000, 8, {"migration_min_gap": 6}, True, "target BS 1 < 8 - 6 = 2"),
    (40_000, 30_000, 8, {"migration_min_gap": 7}, False, "target BS 1 == 8 - 7: not strictly below"),
])
def test_unified_ab_migration_boundaries(inp, hit, owner_bs, knobs, migrates, why):
    cs = [cand(0, hit=hit, BS=owner_bs, inp=inp), cand(1, BS=1, inp=inp), cand(2, BS=2, inp=inp)]
    p = pick("unified_ab", view(cs, session=0, turn=3, inp=inp), **knobs)
    assert (p.reason == "migrate") == migrates, why
    if migrates:
        assert (p.index, p.migrated_from) == (1, 0)


def test_unified_ab_never_migrates_without_a_healthy_owner_or_a_peer():
    inp = 40_000
    # owner 0 unhealthy (not a candidate): nothing to migrate from
    p = pick("unified_ab", view([cand(1, BS=1, inp=inp), cand(2, BS=9, inp=inp)], session=0, turn=3, inp=inp))
    assert p.reason != "migrate"
    # a single instance: nowhere to go
    p = pick("unified_ab", view([cand(0, hit=30_000, BS=8, inp=inp)], session=0, turn=3, inp=inp))
    assert p.reason != "migrate"
