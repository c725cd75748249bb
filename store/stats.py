"""The one percentile every kvtop figure uses: the decision log's summaries, the seed table,
trace stats and the TUI all call this module, so a p90 means the same thing everywhere.

Convention: linear interpolation between the closest ranks, numpy's default
(``numpy.percentile(values, q)``, ``method="linear"``). With the n values sorted, the q-th
percentile (q in 0-100) sits at position ``(n - 1) * q / 100``; between the two ranks around
it the value is interpolated linearly. So p0 is the minimum, p100 the maximum, one value is
every percentile, and p50 of an even count is the mean of the middle two. No values: None.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0-100) of ``values`` (any order), by the module's convention."""
    data = sorted(values)
    return ranked_percentile(len(data), q, lambda lo, hi: (data[lo], data[hi]))


def ranked_percentile(n: int, q: float, ranks: Callable[[int, int], tuple[float, float]]
                      ) -> float | None:
    """``percentile`` of n values known by rank, for sources that can read a rank without
    holding every value (an index walk in SQLite, a sorted list).

    ``ranks(lo, hi)`` returns the lo-th and hi-th smallest values (from 0); ``hi`` is ``lo``
    or ``lo + 1``, so a source reads at most two neighbouring ranks, and only one when the
    position falls on a rank.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if n <= 0:
        return None
    pos = (n - 1) * q / 100.0
    lo = math.floor(pos)
    frac = pos - lo
    hi = lo + 1 if frac and lo + 1 < n else lo
    low, high = ranks(lo, hi)
    return low if hi == lo else low + (high - low) * frac
