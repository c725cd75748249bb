"""cache_aware, the model of sglang-router's and vllm-router's policy (issue 38): its three
branches, its own tree that never hears of evictions, and its place beside kvtop's policies."""

from __future__ import annotations

import pytest

from router.cluster import Cluster
from router.config import KnobError
from router.core import RoutingCore
from router.policies import PEER_MODELS, POLICIES, build_policy, policy_class
from router.request import RouteRequest


def req(sid: str, blocks: list[int]) -> RouteRequest:
    return RouteRequest(f"r-{sid}-{len(blocks)}", sid, "header", len(blocks) * 512, blocks, "tokens",
                        "completions", True, 16)


def chain(s: int, n: int) -> list[int]:
    return [s * 10_000 + k for k in range(n)]


def setup(n: int = 3, capacity: int = 100, **knobs):
    cluster = Cluster([f"i{k}" for k in range(n)], block_size=512, capacity_blocks=capacity)
    return cluster, RoutingCore(cluster, build_policy("cache_aware", knobs))


def test_a_peer_model_builds_like_a_policy_but_is_not_listed():
    assert "cache_aware" in PEER_MODELS and "cache_aware" not in POLICIES
    assert policy_class("cache_aware").name == "cache_aware"
    with pytest.raises(KnobError):
        build_policy("cache_aware", {"cache_threshold": 2})


@pytest.mark.parametrize("prior, blocks, loads, want, reason", [
    # nothing in any tree: the smallest tree, the first on a tie
    ([], chain(1, 10), [0, 0, 0], 0, "smallest_tree"),
    # i0 and i1 hold other sessions' prompts (20 and 5 blocks): the smallest tree is i2's (0)
    ([(0, chain(2, 20)), (1, chain(3, 5))], chain(1, 10), [0, 0, 0], 2, "smallest_tree"),
    # 4 of 10 blocks in i1's tree (40% > 30%): i1, however busy, within the balance bounds
    ([(1, chain(1, 4))], chain(1, 10), [0, 60, 0], 1, "cache_match"),
    # 3 of 10 (30%, not over it): the smallest tree, which is i0 (i1 holds those 3)
    ([(1, chain(1, 3))], chain(1, 10), [0, 0, 0], 0, "smallest_tree"),
    # a spread of 70 requests and 71 > 1 x 1.5: the least loaded, whatever the trees hold
    ([(1, chain(1, 10))], chain(1, 10), [40, 71, 1], 2, "load_balance"),
    # a spread of 64 is not over 64: the match still wins
    ([(1, chain(1, 10))], chain(1, 10), [1, 65, 1], 1, "cache_match"),
])
def test_branches(prior, blocks, loads, want, reason):
    cluster, core = setup()
    for i, b in prior:
        core.slot.policy._tree_for(3).insert(i, b)
    for i, bs in enumerate(loads):
        cluster.instances[i].num_requests = bs
    d = core.decide(req("s", blocks))
    assert (d.instance, d.reason) == (want, reason)


def test_the_tree_is_its_own_picks_and_never_hears_of_evictions():
    """Session a on i0, then enough other sessions on i0's engine to evict it from the router's
    estimate (100 blocks): cache_aware still sends a's next turn to i0 (its tree kept it), where
    kvtop's estimate says nothing of a is cached any more."""
    cluster, core = setup(n=2, capacity=100)
    d = core.route(req("a", chain(1, 60)))
    assert (d.instance, d.reason) == (0, "smallest_tree")
    d = core.route(req("b", chain(2, 60)))
    assert d.instance == 1  # i0's tree holds 60 blocks, i1's none
    cluster.index.insert(0, chain(3, 100), "c")  # the estimate of i0 now holds only c's blocks
    d = core.decide(req("a", chain(1, 64)))
    assert (d.instance, d.reason) == (0, "cache_match")
    assert d.est_hit_tokens == 0  # what the cluster's estimate says i0 still holds of it


def test_a_new_policy_object_starts_with_an_empty_tree():
    _, core = setup()
    core.route(req("a", chain(1, 10)))
    core.swap(build_policy("cache_aware"))
    assert core.decide(req("b", chain(2, 10))).instance == 0  # every tree empty again: the first
