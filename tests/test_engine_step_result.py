"""StepResult's __init__ is written out (the simulator makes one result per engine step, and the
dataclass's generated one calls a factory per list): it must stay the dataclass's, field for
field, and give each result its own lists."""

import dataclasses
import inspect

from kvtop.sim.engine import StepResult


def test_init_matches_the_fields():
    params = list(inspect.signature(StepResult.__init__).parameters.values())[1:]
    fields = dataclasses.fields(StepResult)
    assert [p.name for p in params] == [f.name for f in fields]
    for p, f in zip(params, fields):
        if f.default is not dataclasses.MISSING:
            assert p.default == f.default, f.name
        elif f.default_factory is not dataclasses.MISSING:
            assert p.default is None, f.name
            assert getattr(StepResult(0.0), f.name) == f.default_factory(), f.name
        else:
            assert p.default is inspect.Parameter.empty, f.name


def test_each_result_has_its_own_containers():
    a, b = StepResult(1.0), StepResult(1.0)
    assert a == b
    for name in ("first_token", "emitted", "finished", "preempted", "transfers_started"):
        assert getattr(a, name) is not getattr(b, name)
    a.first_token.append("x")
    a.emitted["x"] = 1
    assert b.first_token == [] and b.emitted == {}


def test_given_values_are_kept():
    ft, em = ["r"], {"r": 2}
    r = StepResult(2.0, 0.5, 2.5, 10, 1, 3, ft, em, preempted=["p"])
    assert (r.now, r.duration, r.end_time, r.num_scheduled_tokens, r.num_scheduled_reqs,
            r.num_steps) == (2.0, 0.5, 2.5, 10, 1, 3)
    assert r.first_token is ft and r.emitted is em and r.preempted == ["p"]
    assert r.finished == [] and r.transfers_started == []
    assert not r.idle
    assert StepResult(0.0).idle
    moved = dataclasses.replace(r, now=3.0)   # replace() goes through __init__ by field name
    assert moved.now == 3.0 and moved.end_time == 2.5 and moved.first_token is ft
