"""The one settings object (router/settings.py) and the one composition root (router/build.py)."""

from __future__ import annotations

import pytest

from router.build import build_router
from router.config import KnobError
from router.settings import Settings, from_recorded, settings_for


class Sink:
    def decision(self, d):
        pass

    def outcome(self, d, o):
        pass


@pytest.mark.parametrize("policy,knobs,policy_knobs,features,why", [
    ("unified_ab", {"heavy_threshold": "30000", "offload_threshold": "9000"},
     {"heavy_threshold": 30000}, {"offload_threshold": 9000},
     "two thresholds, two names: each goes to its own owner"),
    ("unified_ab", {"prefill_tps": "8000"}, {"prefill_tps": 8000.0}, {"prefill_tps": 8000.0},
     "prefill_tps is shared: one value feeds the policy and the features"),
    ("leastwork", {"admission": "fifo", "offload_mode": "simple"}, {},
     {"admission": "fifo", "offload_mode": "simple"}, "a policy with no knobs still takes features"),
    ("lpwl", {}, {}, {}, "an alias resolves to the canonical policy"),
])
def test_parse_splits_and_validates(policy, knobs, policy_knobs, features, why):
    s = Settings.parse(policy, knobs)
    for k, v in policy_knobs.items():
        assert s.policy_knobs[k] == v, why
    for k, v in features.items():
        assert s.features.knobs[k] == v, why
    assert s.build_policy().name == s.policy


@pytest.mark.parametrize("policy,knobs,field", [
    ("expected_cost", {"heavy_threshold": 1}, "heavy_threshold"),  # unified_ab's, not a feature any more
    ("unified", {"admission": "sometimes"}, "admission"),
    ("unified", {"overload_factor": "x"}, "overload_factor"),
    ("nope", {}, "policy"),
])
def test_parse_refuses_naming_the_field(policy, knobs, field):
    with pytest.raises(KnobError) as e:
        Settings.parse(policy, knobs)
    assert e.value.field == field


def test_update_merges_knobs_and_keeps_features_across_a_switch():
    s = Settings.parse("unified", {"overload_factor": "1.7", "admission": "pack"})
    merged = s.update(knobs={"cache_ratio_gate": 0.3}, merge=True)
    assert merged.policy_knobs["overload_factor"] == 1.7 and merged.policy_knobs["cache_ratio_gate"] == 0.3
    switched = s.update("unified_ab", {"prefill_tps": 7000})
    # a switch starts from the new policy's defaults; features carry over; the shared name feeds both
    assert switched.policy == "unified_ab" and switched.policy_knobs["overload_factor"] == 1.3
    assert switched.features.admission == "pack"
    assert switched.policy_knobs["prefill_tps"] == 7000 == switched.features.knobs["prefill_tps"]
    back = switched.update("unified")  # the shared value stays with the features
    assert back.features.knobs["prefill_tps"] == 7000


def test_settings_for_gives_each_policy_its_knobs_and_every_run_the_features():
    got = settings_for(["unified", "leastwork"], {"overload_factor": "1.1", "offload_mode": "cost"})
    assert got["unified"].policy_knobs["overload_factor"] == 1.1
    assert got["leastwork"].policy_knobs == {}
    assert got["unified"].features.offload_mode == got["leastwork"].features.offload_mode == "cost"
    with pytest.raises(KnobError) as e:
        settings_for(["leastwork"], {"overload_factor": "1.1"})  # no chosen policy has it
    assert e.value.field == "overload_factor"


def test_recorded_knobs_of_an_older_log_keep_their_meaning():
    # before the split, heavy_threshold set the offload threshold (and unified_ab's)
    assert from_recorded({"heavy_threshold": "5000"}) == {"heavy_threshold": "5000", "offload_threshold": "5000"}
    assert from_recorded({"heavy_threshold": "5", "offload_threshold": "7"})["offload_threshold"] == "7"


def test_describe_features_says_what_runs():
    assert Settings.parse("leastwork").describe_features() == "none"
    s = Settings.parse("leastwork", {"offload_mode": "simple", "admission": "fifo"})
    assert s.describe_features() == "offload simple (threshold 20000), admission fifo (budget 16384)"


def test_router_apply_is_all_or_nothing():
    r = build_router(Settings.parse("unified"), ["a", "b"], Sink(), clock=lambda: 0.0)
    assert r.slot.version == 1 and r.pipeline.features() is r.settings.features
    new = r.settings.update(knobs={"admission": "fifo"}, merge=True)
    slot = r.apply(new)
    assert slot.version == 2 and r.pipeline.features().admission == "fifo"
    with pytest.raises(KnobError):
        r.apply(r.settings.update(knobs={"overload_factor": -1}, merge=True))
    assert r.slot.version == 2 and r.settings is new  # nothing half-applied
