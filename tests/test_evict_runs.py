"""The lookahead's eviction walk read as runs of equal tags (issue 38): ``oldest_tags`` answers
from a per-instance list of runs kept until the instance's LRU or a tag of a block it holds
changes, instead of a walk of every block per candidate per decision. Its answers, and
expected_cost's picks, are those of the walk it replaced (copied below as the reference)."""

from __future__ import annotations

import random

import pytest

from router.cluster import Cluster
from router.policies.expected_cost import ExpectedCost, queued_behind_s, return_odds, session_odds
from router.prefix_index import PrefixIndex

from ref_expected_cost import RefExpectedCost

BS = 512


def ref_oldest_tags(index: PrefixIndex, instance: int, count: int, skip: str | None = None) -> dict:
    """The walk before issue 38, as it was."""
    index._settle()
    out: dict = {}
    if count <= 0:
        return out
    tags = index._tags
    for h in index._lru[instance]:
        t = tags.get(h)
        if t is not None and t == skip:
            continue
        out[t] = out.get(t, 0) + 1
        count -= 1
        if count == 0:
            break
    return out


def ref_future(c, la, p_next, length, today, odds_of=None):
    """ExpectedCost._future before issue 38, as it was (no memo of odds, cal.seconds per term)."""
    cal = la.calibration
    i = c.index
    own = today["own_s"]
    wait = today["wait_s"]
    now = la.now
    fleet_gap = la.fleet_gap_s
    queue = 0.0
    demand = la.settled(i)
    for s in la.bound(i):
        g = s.gap_sum / s.gaps if s.gaps else fleet_gap
        odds = return_odds(s.turns, s.gap_sum, s.gaps, s.idle_s(now), fleet_gap)
        if own > 0 and g:
            held = queued_behind_s(wait, own, g)
            queue += odds * min(held, cal.seconds(i, s.last_input_tokens, 0))
        demand += odds * s.last_input_tokens
    evict = 0.0
    for s, lost in la.victims(i):
        ctx = s.last_input_tokens
        lost = min(lost, ctx)
        evict += session_odds(s, la) * cal.seconds(i, lost, ctx - lost)
    keep = 0.0
    if p_next > 0:
        lost = min(length, max(0, int(demand + length - la.capacity_tokens[i])))
        if lost:
            keep = p_next * cal.seconds(i, lost, length - lost)
    return {"queue_s": queue, "evict_s": evict, "keep_s": keep}


def _check_all(index: PrefixIndex, rng: random.Random, tags: list[str]) -> int:
    checked = 0
    for i in range(index.num_instances):
        for _ in range(3):
            count = rng.randrange(0, index.capacity[i] + 5)
            skip = rng.choice(tags + [None])
            want = ref_oldest_tags(index, i, count, skip)
            got = index.oldest_tags(i, count, skip)
            # the same counts in the same order (the order fixes the evict term's float sum)
            assert list(got.items()) == list(want.items())
            checked += 1
    return checked


@pytest.mark.parametrize("seed", range(10))
def test_oldest_tags_equal_the_walk_under_random_changes(seed):
    """Chains of several sessions, some sharing a prefix (a sub-agent's, a common system
    prompt: a retag elsewhere must reach the instances holding it), untagged inserts, steps,
    resets and a new instance, each followed by reads of every instance."""
    rng = random.Random(seed)
    n = rng.choice((2, 3, 5))
    index = PrefixIndex(n, rng.choice((40, 120, 400)), BS)
    sessions = [f"s{k}" for k in range(8)]
    shared = [10**9 + k for k in range(rng.randrange(1, 30))]
    chains = {s: (shared if rng.random() < 0.5 else []) + [hash((s, k)) for k in range(200)]
              for s in sessions}
    checked = 0
    for step in range(150):
        op = rng.random()
        i = rng.randrange(index.num_instances)
        s = rng.choice(sessions)
        blocks = chains[s][:rng.randrange(1, len(chains[s]))]
        if op < 0.55:
            index.insert(i, blocks, s)
        elif op < 0.65:
            index.insert(i, blocks)  # no tag: the blocks keep the one they had
        elif op < 0.75:
            index.insert(i, blocks, s)
            while not index.flush_step(rng.choice((8, 32))):
                if rng.random() < 0.5:
                    checked += _check_all(index, rng, sessions)
        elif op < 0.82:
            index.extend(i, chains[s][:len(blocks) + rng.randrange(1, 20)], s)
        elif op < 0.87:
            index.insert(i, [rng.getrandbits(40) for _ in range(rng.randrange(1, 30))], s)  # not a chain
        elif op < 0.92:
            index.forget_instance(i)
        elif op < 0.93 and index.num_instances < 6:
            index.add_instance(rng.choice((40, 120)))
        checked += _check_all(index, rng, sessions)
    assert checked >= 150 * 6


class _CountingDict(dict):
    def __init__(self, *a):
        super().__init__(*a)
        self.gets = 0

    def get(self, *a):
        self.gets += 1
        return super().get(*a)


def test_a_read_of_an_unchanged_instance_looks_up_no_tag(monkeypatch):
    """The point of the runs: the second read of an instance nothing changed reads no block's
    tag (the walk read one per block, every read); an insert elsewhere that retags none of its
    blocks keeps them; a retag of one it holds drops them. (Reads of up to DIRECT_WALK_BLOCKS
    walk instead: off here.)"""
    import router.prefix_index as pi

    monkeypatch.setattr(pi, "DIRECT_WALK_BLOCKS", 0)
    index = PrefixIndex(2, 100, BS)
    index._tags = _CountingDict()
    index.insert(0, list(range(100)), "a")
    index.insert(1, list(range(1000, 1050)), "b")
    assert index.oldest_tags(0, 60) == {"a": 60}
    index._tags.gets = 0
    assert index.oldest_tags(0, 60, skip="x") == {"a": 60}
    index.insert(1, list(range(2000, 2030)), "c")
    assert index.oldest_tags(0, 80) == {"a": 80}
    assert index._tags.gets == 0
    index.insert(1, list(range(10)), "c")  # instance 0's first blocks, now last inserted by c
    got = index.oldest_tags(0, 100)
    assert index._tags.gets > 0
    assert got == ref_oldest_tags(index, 0, 100)


def _chain(s: int, n: int) -> list[int]:
    return [s * 1_000_000 + k for k in range(n)]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize("seed", range(6))
def test_expected_cost_picks_equal_the_walks(seed):
    """expected_cost over an agentic run (sessions returning with growing contexts, requests in
    flight, instances full), each decision taken twice on the same cluster: as it is now, and
    with the old walk and the old future terms. Picks, reasons and every term are identical,
    to the bit."""
    rng = random.Random(seed)
    n = rng.choice((4, 8, 16))
    clock = Clock()
    c = Cluster([f"i{i}" for i in range(n)], block_size=BS, capacity_blocks=rng.choice((100, 300, 518)),
                clock=clock)
    pol = ExpectedCost()
    ref_pol = RefExpectedCost()  # the policy's readable form (tests/ref_expected_cost.py)
    ref_pol._future = ref_future
    sessions = 3 * n
    size = {s: rng.randrange(5, 150) for s in range(sessions)}
    turns = {s: 0 for s in range(sessions)}
    in_flight: list = []
    index = c.index
    new_reader = index.oldest_tags
    moved = evicting = 0
    for step in range(250):
        clock.t += rng.expovariate(1.0)
        for t in list(in_flight):
            if rng.random() < 0.4:
                c.first_token(t)
                c.finish(t)
                in_flight.remove(t)
        s = rng.randrange(sessions)
        turns[s] += 1
        blocks = _chain(s, size[s] + 3 * turns[s])
        inp = len(blocks) * BS - rng.randrange(BS)
        sid = f"s{s}"
        picks = []
        for policy, reader in ((pol, new_reader),
                               (ref_pol, lambda i, k, skip=None: ref_oldest_tags(index, i, k, skip))):
            index.oldest_tags = reader
            view = c.view(blocks, inp, sid, lookahead=True)
            picks.append((policy.pick(None, view), view))
        index.oldest_tags = new_reader
        (got, view), (want, _) = picks
        assert (got.index, got.reason, got.uses_rr) == (want.index, want.reason, want.uses_rr), (seed, step)
        assert got.terms == want.terms, (seed, step)
        evicting += any(t.get("evict_s", 0) > 0 for t in got.terms)
        if got.uses_rr:
            c.rr_counter += 1
        sess = c.sessions.get(sid)
        moved += sess is not None and sess.instance != got.index
        t = c.dispatch(got.index, inp, view.hits[got.index], blocks, session_id=sid)
        c.bind_session(sid, got.index, inp, view.hits[got.index])
        in_flight.append(t)
    for t in in_flight:
        c.finish(t)
    assert c.counters_zero()
    assert evicting > 10 and moved > 0, (evicting, moved)  # the run prices evictions and moves sessions
