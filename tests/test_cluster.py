"""Cluster accounting: counters follow DESIGN.md and always return to zero."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from router.cluster import Cluster
from router.core import RoutingCore
from router.policies import POLICIES, build_policy
from router.request import RouteRequest


def req(i, n, session, blocks):
    return RouteRequest(f"r{i}", session, "header", n, blocks, "tokens", "completions", True, 16)


def test_dispatch_first_token_end_match_design():
    c = Cluster(["a", "b"], block_size=4, capacity_blocks=100)
    t = c.dispatch(0, 100, 40, [1, 2, 3])
    a = c.instances[0]
    assert (a.num_requests, a.ongoing_tokens, a.pending_prefill_tokens, a.ongoing_decode_tokens) == (1, 100, 60, 0)
    c.first_token(t)
    assert (a.pending_prefill_tokens, a.ongoing_decode_tokens, a.decode_requests) == (0, 100, 1)
    c.first_token(t)  # a second first-token event changes nothing
    assert a.ongoing_decode_tokens == 100
    c.finish(t)
    c.finish(t)  # ending twice changes nothing
    assert c.counters_zero()


def test_end_before_first_token_releases_prefill():
    c = Cluster(["a"], block_size=4, capacity_blocks=100)
    t = c.dispatch(0, 100, 0, [])
    c.finish(t, error=True)
    assert c.counters_zero() and c.instances[0].errors_total == 1


def test_hit_capped_like_the_engine():
    c = Cluster(["a"], block_size=4, capacity_blocks=100)
    c.index.insert(0, [1, 2, 3])
    # 12 tokens fully cached: vLLM recomputes the last block -> hit 8, not 12
    assert c.hits([1, 2, 3], 12) == [8]
    assert c.hits([1, 2, 3], 13) == [12]


ops = st.lists(st.tuples(st.sampled_from(["new", "first", "ok", "error", "cancel"]),
                         st.integers(0, 50), st.integers(1, 5000), st.integers(0, 3)),
               min_size=1, max_size=120)


@settings(max_examples=150, deadline=None)
@given(ops=ops, policy=st.sampled_from(sorted(POLICIES)), healthy=st.lists(st.booleans(), min_size=3, max_size=3))
def test_random_interleavings_return_counters_to_zero(ops, policy, healthy):
    cluster = Cluster(["a", "b", "c"], block_size=16, capacity_blocks=64)
    for i, h in enumerate(healthy):
        cluster.set_healthy(i, h)
    if not any(healthy):
        cluster.set_healthy(0, True)
    core = RoutingCore(cluster, build_policy(policy))
    live = []
    decisions = []
    outcomes = set()
    for k, (op, which, n, session) in enumerate(ops):
        if op == "new" or not live:
            blocks = list(range(session * 1000, session * 1000 + n // 16))
            d = core.route(req(k, n, f"s{session}", blocks))
            decisions.append(d.request.request_id)
            live.append(d)
            continue
        d = live[which % len(live)]
        if op == "first":
            cluster.first_token(d.ticket)
        else:
            cluster.finish(d.ticket, error=op != "ok")
            outcomes.add(d.request.request_id)
            live.remove(d)
        for s in cluster.instances:
            assert s.num_requests >= 0 and s.pending_prefill_tokens >= 0
            assert s.ongoing_decode_tokens >= 0 and s.ongoing_tokens >= s.ongoing_decode_tokens
    for d in live:  # the remaining requests end (client gone)
        cluster.finish(d.ticket, error=True)
        outcomes.add(d.request.request_id)
    assert cluster.counters_zero()
    assert set(decisions) == outcomes, "every decision has an outcome"


def test_sessions_bounded_and_moves_counted():
    c = Cluster(["a", "b"], max_sessions=3)
    for k in range(5):
        c.bind_session(f"s{k}", 0, 10, 0)
    assert list(c.sessions) == ["s2", "s3", "s4"]
    s = c.bind_session("s4", 1, 10, 0)
    assert (s.moves, s.turns, s.instance) == (1, 2, 1)
    s = c.bind_session("s4", 1, 10, 0, new_turn=False)
    assert s.turns == 2
