"""cache_aware: a model of sglang-router's (and vllm-router's, its fork's) cache_aware policy,
for comparing with the peers offline (`kvtop simulate --policies expected_cost,cache_aware`)."""

from __future__ import annotations

from router.cluster import ClusterView
from router.config import Knob, KnobSchema
from router.policies.base import CACHE_MATCH, LOAD_BALANCE, SMALLEST_TREE, Pick, Policy, terms_of
from router.prefix_index import PrefixIndex

#: sglang-router 0.3.2's defaults (sglang_router/router_args.py; vllm-router 0.1.17 has the same).
CACHE_AWARE_KNOBS = KnobSchema((
    Knob("cache_threshold", float, 0.3,
         "route to the instance with the longest prefix match when it covers more than this share",
         min=0.0, max=1.0),
    Knob("balance_abs_threshold", int, 64,
         "imbalanced when max(BS) - min(BS) exceeds this (and the relative bound holds)", min=0, max=10**9),
    Knob("balance_rel_threshold", float, 1.5,
         "imbalanced when max(BS) exceeds min(BS) x this (and the absolute bound holds)", min=0.0, max=1e6),
    Knob("tree_blocks", int, 2**26 // 4 // 512,
         "the approximate tree's size per instance, in router blocks (sglang's max_tree_size is "
         "2^26 characters: 2^24 tokens of 4 characters, 32,768 blocks of 512 tokens)", min=1, max=10**12),
))

class CacheAware(Policy):
    """cache_aware (a peer model, not one of kvtop's own policies): sglang-router's rule.

    If the fleet is imbalanced, max(BS) - min(BS) > ``balance_abs_threshold`` and
    max(BS) > min(BS) x ``balance_rel_threshold`` (BS_i: requests in flight on i, the router's
    own count, as sglang's), the least-loaded instance (first in order on a tie). Otherwise the
    instance whose approximate tree holds the longest prefix of the prompt when that prefix is
    more than ``cache_threshold`` of it, else the instance whose tree is smallest (first in
    order on a tie). Either way the prompt is inserted into the chosen instance's tree.

    The tree is the router's own record of what it sent where, never told of the engines'
    evictions: here a ``PrefixIndex`` per policy object of ``tree_blocks`` per instance at the
    router's block size, the match rate in whole blocks (sglang's tree is of characters and evicts by LRU every 60 s down to
    its bound; at the sizes studied here it never reaches it). It is the one policy with state
    of its own, filled by its picks: a new policy object (a swap, a knob change) starts empty,
    as a restarted sglang-router does. Knobs: cache_threshold (0.3), balance_abs_threshold
    (64), balance_rel_threshold (1.5), tree_blocks (32,768)."""

    name = "cache_aware"
    schema = CACHE_AWARE_KNOBS

    def __init__(self, knobs=None):
        super().__init__(knobs)
        self._tree: PrefixIndex | None = None

    def _tree_for(self, instances: int) -> PrefixIndex:
        tree = self._tree
        if tree is None:
            # the block size only labels the index; it counts and matches whole blocks
            tree = self._tree = PrefixIndex(instances, self.knobs["tree_blocks"], 1)
        while tree.num_instances < instances:  # the fleet grew
            tree.add_instance(self.knobs["tree_blocks"])
        return tree

    def pick(self, req, view: ClusterView) -> Pick:
        cands = view.candidates
        blocks = getattr(req, "blocks", None) or []
        tree = self._tree_for(len(view.hits))
        loads = [c.num_requests for c in cands]
        hi, lo = max(loads), min(loads)
        k = 0
        if hi - lo > self.knobs["balance_abs_threshold"] and hi > lo * self.knobs["balance_rel_threshold"]:
            k = loads.index(lo)
            reason = LOAD_BALANCE
            matched = [0] * len(cands)
        else:
            depth = tree.match(blocks) if blocks else [0] * tree.num_instances
            matched = [depth[c.index] for c in cands]
            best = max(matched)
            # sglang's match rate is matched characters over the prompt's; here whole blocks
            if best and best / len(blocks) > self.knobs["cache_threshold"]:
                k = matched.index(best)
                reason = CACHE_MATCH
            else:
                sizes = [tree.cached_blocks(c.index) for c in cands]
                k = sizes.index(min(sizes))
                reason = SMALLEST_TREE
        chosen = cands[k]
        if blocks:
            tree.insert(chosen.index, blocks)
        terms = []
        for c, m in zip(cands, matched):
            t = terms_of(c, float(c is not chosen))
            t["tree_blocks"] = m
            terms.append(t)
        return Pick(chosen.index, reason, terms)
