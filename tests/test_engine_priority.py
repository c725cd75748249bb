"""The simulated engine's priority scheduling (vLLM's ``--scheduling-policy priority``), against
schedules worked out by hand from vllm/v1/core/sched/scheduler.py and request_queue.py."""

from __future__ import annotations

import pytest

from kvtop.sim.engine import Engine, EngineRejected, check_priority
from tests.test_engine import check_invariants, req, run_until_idle


def _finish_order(policy: str) -> list[str]:
    # One request runs at a time (max_num_seqs 1) and each ends in its prefill step, so the
    # order they finish in is the order the waiting queue gives them.
    e = Engine("h20", max_num_seqs=1, scheduling_policy=policy)
    for rid, priority, arrival in (("a", 1, 0.0), ("d", 1, 0.05), ("c", 0, 0.1), ("b", 0, 0.2)):
        e.add_request(req(rid, 32, max_tokens=1, arrival=arrival, priority=priority))
    _, results = run_until_idle(e, 0.3)   # all four are queued by the first step
    return [f.request_id for r in results for f in r.finished]


@pytest.mark.parametrize("policy, order", [
    ("fcfs", ["a", "d", "c", "b"]),       # arrival order; priority ignored
    ("priority", ["c", "b", "a", "d"]),   # (priority, arrival): 0 before 1, then earlier first
])
def test_waiting_queue_order(policy, order):
    assert _finish_order(policy) == order


def _preempting_step(policy: str, c_priority: int | None = None):
    """9 blocks of 16 tokens. a (72 tokens: 5 blocks) runs alone in step 1; b (64: 4 blocks)
    joins it in step 2 and the cache is full. In step 3 a's next token still fits its 5th
    block; b's 65th token needs a 5th block and none is free. fcfs: the newest running request,
    b itself, is preempted and a decodes. priority with a at 1 and b at 0: the victim is the
    running request of largest (priority, arrival), a, already scheduled in this step: its
    token goes back to the budget, its 5 blocks are freed, and b takes one."""
    e = Engine("h20", num_gpu_blocks=9, max_num_seqs=2, scheduling_policy=policy)
    prio = policy == "priority"
    e.add_request(req("a", 72, max_tokens=20, seed=1, priority=1 if prio else 0))
    t = e.step(0.0).end_time
    e.add_request(req("b", 64, max_tokens=20, seed=2, arrival=t))
    if c_priority is not None:   # waits: max_num_seqs is 2
        e.add_request(req("c", 16, max_tokens=1, seed=3, arrival=t, priority=c_priority if prio else 0))
    t = e.step(t).end_time
    assert [x.id for x in e.running] == ["a", "b"] and e.num_free_blocks == 0
    r = e.step(t)
    check_invariants(e)
    return e, r


def test_fcfs_preempts_the_newest_running_request():
    e, r = _preempting_step("fcfs")
    assert r.preempted == ["b"]
    assert list(r.emitted) == ["a"] and r.num_scheduled_tokens == 1
    assert [x.id for x in e.running] == ["a"]


def test_priority_preempts_the_lowest_priority_and_gives_its_tokens_back():
    e, r = _preempting_step("priority")
    assert r.preempted == ["a"]
    assert list(r.emitted) == ["b"]                 # a's token of this step was given back
    assert r.num_scheduled_tokens == 1 and r.num_scheduled_reqs == 1
    assert [x.id for x in e.running] == ["b"] and [x.id for x in e.waiting] == ["a"]
    assert e.num_free_blocks == 4                   # a's 5 freed, b took 1


@pytest.mark.parametrize("policy, c_priority, waiting", [
    ("fcfs", 0, ["b", "c"]),          # the preempted request goes back to the head
    ("priority", 0, ["c", "a"]),      # ... by (priority, arrival): c (0) before a (1)
    ("priority", 2, ["a", "c"]),      # c (2) after a (1)
])
def test_a_preempted_request_requeues_by_policy(policy, c_priority, waiting):
    e, r = _preempting_step(policy, c_priority)
    assert [x.id for x in e.waiting] == waiting
    _, results = run_until_idle(e, r.end_time)
    assert e.request_success["length"] == 3 and e.num_allocated_blocks() == 0


def test_a_waiting_request_never_preempts_a_running_one():
    # vLLM v1 preempts only for RUNNING requests that need blocks: a priority-0 arrival waits
    # for room behind a running priority-5 request that holds the cache.
    e = Engine("h20", num_gpu_blocks=8, scheduling_policy="priority")
    e.add_request(req("low", 100, max_tokens=10, seed=1, priority=5))
    t = e.step(0.0).end_time
    e.add_request(req("high", 100, max_tokens=1, seed=2, arrival=t, priority=0))
    r = e.step(t)
    assert not r.preempted and [x.id for x in e.running] == ["low"] and [x.id for x in e.waiting] == ["high"]
    _, results = run_until_idle(e, r.end_time)
    assert [f.request_id for x in results for f in x.finished] == ["low", "high"]


@pytest.mark.parametrize("value, policy, expected", [
    (None, "fcfs", 0), (0, "fcfs", 0), (3, "priority", 3), (-2, "priority", -2),
    (3, "fcfs", "Got priority 3 but Priority scheduling is not enabled."),   # vLLM's 400
    ("1", "priority", "priority must be an integer"), (True, "priority", "priority must be an integer"),
    (1.5, "priority", "priority must be an integer"),
])
def test_check_priority(value, policy, expected):
    if isinstance(expected, str):
        with pytest.raises(EngineRejected, match=expected):
            check_priority(value, policy)
    else:
        assert check_priority(value, policy) == expected


def test_unknown_scheduling_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        Engine("h20", scheduling_policy="sjf")


def test_kvtop_sim_flag_builds_priority_engines_and_passes_it_to_child_processes():
    import argparse

    from kvtop.sim.cli import _child_argv, add_arguments, build_instances

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--instances", "2", "--scheduling-policy", "priority"])
    assert [i.engine.scheduling_policy for i in build_instances(args)] == ["priority", "priority"]
    assert _child_argv(args, 1)[-2:] == ["--scheduling-policy", "priority"]
    assert build_instances(p.parse_args([]))[0].engine.scheduling_policy == "fcfs"
    with pytest.raises(SystemExit):
        p.parse_args(["--scheduling-policy", "sjf"])
