"""A request's end schedules no prefix-index step when nothing is left to apply
(router/pipeline.py ``_apply_index``, router/prefix_index.py ``settled``)."""

from __future__ import annotations

from router.cluster import Cluster
from router.core import RoutingCore
from router.features import Features
from router.lifecycle import Arrived, Ended, FirstToken, LegSent, Lifecycle
from router.pipeline import OK, Pipeline
from router.policies import build_policy
from router.prefix_index import PrefixIndex
from router.request import RouteRequest


class _Sink:
    def decision(self, d):
        pass

    def outcome(self, d, o):
        pass


def test_settled_says_whether_an_insert_waits():
    idx = PrefixIndex(1, 100, 16)
    assert idx.settled
    idx.insert(0, [1, 2, 3])
    assert not idx.settled
    idx.flush()
    assert idx.settled
    idx.insert(0, list(range(10, 70)))
    assert not idx.flush_step(step=8)  # in steps: the rest still waits
    assert not idx.settled
    while not idx.flush_step(step=8):
        pass
    assert idx.settled


def test_a_request_schedules_one_index_step_not_two():
    """Its dispatch leaves an insert pending: the step scheduled when it goes upstream applies
    it; at its end there is nothing left, and nothing is scheduled (two were, one a no-op)."""
    scheduled = []
    cluster = Cluster(["a", "b"], block_size=16, capacity_blocks=10_000, clock=lambda: 0.0)
    pipe = Pipeline(RoutingCore(cluster, build_policy("leastwork", {}), clock=lambda: 0.0),
                    lambda: Features.build({}), _Sink(), clock=lambda: 0.0,
                    background=lambda fn: scheduled.append(fn) or fn())
    life = Lifecycle(pipe)
    flow = life.receive(RouteRequest("r1", "s", "header", 64, [1, 2, 3, 4], "tokens", "chat", False, 1))
    life.step(flow, Arrived())
    life.step(flow, LegSent())
    assert len(scheduled) == 1 and cluster.index.settled
    life.step(flow, FirstToken(observed=False))
    life.step(flow, Ended(OK, http_status=200))
    assert len(scheduled) == 1
    assert cluster.counters_zero()
