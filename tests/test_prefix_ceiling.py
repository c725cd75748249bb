"""prefix_ceiling's shortcut (a session's turn takes the keys of the prefix it shares with the
session's previous turn) gives the figures of the plain walk over every id."""

import random

from kvtop.traces.loader import TraceRequest
from kvtop.traces.stats import _prefix_ceiling_walk, prefix_ceiling


def _req(session: str, turn: int, ids: list[int], bs: int = 64) -> TraceRequest:
    return TraceRequest(arrival=float(turn), session=session, turn=turn, input_tokens=len(ids) * bs + 7,
                        output_tokens=10, hash_ids=ids, block_size=bs)


def _trace(seed: int) -> list[TraceRequest]:
    """Sessions that grow turn by turn, some with a shared system prompt, some that rewrite
    their history (compaction: a turn that is no extension of the last), empty prompts,
    sessions interleaved."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 50) for _ in range(rng.randint(0, 6))]
    next_id = iter(range(1000, 10**9))
    ctx: dict[str, list[int]] = {}
    turns: dict[str, int] = {}
    out = []
    for _ in range(rng.randint(1, 60)):
        s = f"s{rng.randrange(8)}"
        prev = ctx.get(s)
        roll = rng.random()
        if prev is None:
            ids = (list(system) if rng.random() < 0.5 else []) + [next(next_id) for _ in range(rng.randint(0, 5))]
        elif roll < 0.15:   # compaction: a prefix of the history and a new summary
            ids = prev[:rng.randint(0, len(prev))] + [next(next_id) for _ in range(rng.randint(0, 4))]
        elif roll < 0.25:   # a turn from another session's blocks (a fork)
            other = ctx[rng.choice(sorted(ctx))]
            ids = other[:rng.randint(0, len(other))] + [rng.randrange(1, 50)]
        else:
            ids = prev + [next(next_id) if rng.random() < 0.8 else rng.randrange(1, 50)
                          for _ in range(rng.randint(0, 6))]
        ctx[s] = ids
        turns[s] = turns.get(s, 0) + 1
        out.append(_req(s, turns[s], ids))
    return out


def test_equals_the_walk_over_every_id():
    for seed in range(300):
        reqs = _trace(seed)
        assert prefix_ceiling(reqs) == _prefix_ceiling_walk(reqs), seed


def test_a_returning_turn_and_a_shared_prefix():
    a1 = _req("a", 1, [1, 2, 3])
    a2 = _req("a", 2, [1, 2, 3, 4, 5])       # 3 of 5 blocks seen before
    b1 = _req("b", 1, [1, 2, 9])             # another session: 2 of 3
    a3 = _req("a", 3, [1, 2, 9, 10])         # not an extension of a's last turn: 3 of 4 (b's)
    blocks, _ = prefix_ceiling([a1, a2, b1, a3])
    assert blocks == _prefix_ceiling_walk([a1, a2, b1, a3])[0] == (0 + 3 + 2 + 3) / 15
