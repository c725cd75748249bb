"""store.stats: the one percentile (linear interpolation between closest ranks, numpy's default)."""

from __future__ import annotations

import pytest

from store.stats import percentile, ranked_percentile


@pytest.mark.parametrize("values,q,expected", [
    ([1, 2, 3, 4], 90, 3.7),  # position 3 * 0.9 = 2.7: 3 + 0.7 * (4 - 3)
    ([4, 1, 3, 2], 90, 3.7),  # order of input does not matter
    ([1, 2, 3, 4, 5], 50, 3.0),  # odd count: the middle value exactly
    ([1, 2, 3, 4], 50, 2.5),  # even count: halfway between the two middle values
    (list(range(1, 11)), 90, 9.1),  # position 8.1 -> 9 + 0.1; numpy.percentile agrees
    (list(range(1, 11)), 99, 9.91),  # position 8.91
    ([15, 20, 35, 40, 50], 40, 29.0),  # position 1.6: 20 + 0.6 * 15
    ([7], 90, 7.0),  # one value is every percentile
    ([1, 2], 0, 1.0), ([1, 2], 100, 2.0),  # the ends are min and max, not extrapolated
    ([], 50, None),  # nothing to summarize
    (iter([3.0, 1.0, 2.0]), 50, 2.0),  # any iterable, read once
])
def test_percentile_matches_numpy_linear(values, q, expected):
    got = percentile(values, q)
    assert got == expected if expected is None else got == pytest.approx(expected)


@pytest.mark.parametrize("q", [-1, 100.5, 101])
def test_percentile_rejects_out_of_range_q(q):
    with pytest.raises(ValueError):
        percentile([1, 2], q)


@pytest.mark.parametrize("n,q,reads", [
    (10, 90, (8, 9)),  # position 8.1: the two ranks around it
    (11, 90, (9, 9)),  # position 9.0 falls on a rank: one read
    (10, 100, (9, 9)),  # the maximum: no rank past the end
    (1, 50, (0, 0)),
])
def test_ranked_percentile_reads_only_the_neighbouring_ranks(n, q, reads):
    seen = []

    def ranks(lo, hi):
        seen.append((lo, hi))
        return float(lo), float(hi)

    assert ranked_percentile(n, q, ranks) == pytest.approx((n - 1) * q / 100)  # rank k holds k
    assert seen == [reads]


def test_ranked_percentile_of_nothing_reads_nothing():
    assert ranked_percentile(0, 50, lambda lo, hi: pytest.fail("read a rank of nothing")) is None
