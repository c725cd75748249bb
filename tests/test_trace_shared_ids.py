"""load_trace shares a session's repeated hash ids between its turns (one int object per
distinct id of a session), without changing any value."""

from __future__ import annotations

import pytest

from kvtop.traces.loader import TraceRequest, _share_prefix, dense_ids, load_trace, write_trace

BIG = 10**15   # ids past the small-int cache, so every parsed id is its own object


def _req(session: str, turn: int, ids: list[int]) -> TraceRequest:
    return TraceRequest(arrival=float(turn), session=session, turn=turn, input_tokens=64 * len(ids),
                        output_tokens=10, hash_ids=ids, block_size=64)


def test_turns_of_a_session_share_the_prefix_objects(tmp_path):
    a1 = [BIG + k for k in range(5)]
    a2 = a1 + [BIG + 100]
    b1 = [2 * BIG + k for k in range(3)]
    path = tmp_path / "t.jsonl.gz"
    # b's turn 2 repeats a's ids: another session, so nothing is shared with a
    write_trace(path, [_req("a", 1, a1), _req("b", 1, b1), _req("a", 2, a2), _req("b", 2, a1[:2])])
    r = load_trace(path)
    assert [x.hash_ids for x in r] == [a1, b1, a2, a1[:2]]
    assert all(x is y for x, y in zip(r[2].hash_ids[:5], r[0].hash_ids))   # a's turn 2 reuses turn 1's
    assert r[2].hash_ids[5] == BIG + 100
    assert r[3].hash_ids[0] is not r[0].hash_ids[0]   # b's ids stay b's
    assert r[2].hash_ids is not r[0].hash_ids         # lists stay separate


@pytest.mark.parametrize("prev, ids, shared", [
    ([1, 2, 3], [1, 2, 3, 4], 3),     # a returning turn: the whole previous list
    ([1, 2, 3, 4], [1, 2], 2),        # a shorter turn (a cap, a restart)
    ([1, 2, 3, 4], [1, 2, 9, 4], 2),  # diverges: only the prefix checked equal
    ([1, 2, 3], [9, 2, 3], 0),        # a different first block: nothing
    ([], [1], 0),
])
def test_share_prefix_keeps_values_and_shares_only_equal_ones(prev, ids, shared):
    prev = [BIG + x for x in prev]
    ids = [BIG + x for x in ids]
    copy = [x + 0 for x in ids]      # equal values, other objects
    before = list(ids)
    _share_prefix(prev, ids)
    assert ids == before == copy
    same = 0
    while same < min(len(ids), len(prev)) and ids[same] is prev[same]:
        same += 1
    assert same == shared


def test_dense_ids_keep_equality_and_share_each_turns_prefix():
    a1 = [BIG + k for k in range(5)]
    a2 = a1 + [BIG + 100]
    b1 = [2 * BIG + k for k in range(3)]
    b2 = a1[:2] + [3 * BIG]             # another session repeating a's first ids, then its own
    reqs = [_req("a", 1, a1), _req("b", 1, b1), _req("a", 2, a2), _req("b", 2, b2)]
    before = [list(r.hash_ids) for r in reqs]
    d = dense_ids(reqs)
    assert [r.hash_ids for r in reqs] == before          # the input is left as it was
    # numbered 1, 2, ... in order of first appearance; an equal id is the same number anywhere
    assert [r.hash_ids for r in d] == [[1, 2, 3, 4, 5], [6, 7, 8], [1, 2, 3, 4, 5, 9], [1, 2, 10]]
    assert all(x is y for x, y in zip(d[2].hash_ids[:5], d[0].hash_ids))
    assert d[2].hash_ids is not d[0].hash_ids
    for old, new in zip(reqs, d):   # nothing but the ids changes
        assert (old.arrival, old.session, old.turn, old.input_tokens, old.block_size) == \
            (new.arrival, new.session, new.turn, new.input_tokens, new.block_size)


def test_dense_ids_after_a_divergent_turn():
    # a turn that rewrites the middle of its context (compaction): only the shared prefix is
    # taken from the previous turn; the rest is numbered by value, old ids keeping their numbers
    t1 = [BIG + k for k in range(6)]
    t2 = t1[:3] + [BIG + 50] + t1[4:]
    d = dense_ids([_req("a", 1, t1), _req("a", 2, t2)])
    assert d[1].hash_ids == [1, 2, 3, 7, 5, 6]
