"""load_trace shares a session's repeated hash ids between its turns (one int object per
distinct id of a session), without changing any value."""

from __future__ import annotations

import pytest

from kvtop.traces.loader import TraceRequest, _share_prefix, load_trace, write_trace

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
