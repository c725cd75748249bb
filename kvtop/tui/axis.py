"""Readable y-axis ticks for the dashboard's plotext charts: round steps, compact labels.

plotext spaces its own ticks evenly between the data's minimum and maximum and labels them
with as many digits as it takes to tell them apart, so a token backlog reads ``139925.0`` and
``116604.2``. Here ticks fall on 1, 2, 2.5 or 5 times a power of ten, and labels drop a
trailing ``.0`` and use the unit a reader expects: ``62.5k`` tokens, ``1.5s``, ``50%``.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Iterator, Literal

Unit = Literal["count", "ms", "%"]

_MANTISSAS = (1.0, 2.0, 2.5, 5.0)
# (axis top from, divisor, suffix); k only from 10,000: 9500 reads fine as it is
_SUFFIXES = ((1e9, 1e9, "G"), (1e6, 1e6, "M"), (1e4, 1e3, "k"))


def nice_ticks(lo: float, hi: float, max_ticks: int = 7, integer: bool = False) -> list[float]:
    """Evenly spaced round ticks covering ``[lo, hi]``: at most ``max_ticks`` (at least 2), the
    first at or below ``lo`` and the last at or above ``hi``. ``integer`` keeps the step a
    whole number, for quantities that come in whole units (tokens)."""
    max_ticks = max(2, max_ticks)
    if lo > hi:
        lo, hi = hi, lo
    if lo == hi:  # a flat line still gets an axis around it
        pad = abs(lo) / 2 or 1.0
        lo, hi = (lo - pad, hi + pad) if lo else (0.0, 1.0)
    for step in _round_steps((hi - lo) / (max_ticks - 1)):
        if integer and step != math.floor(step):
            continue
        first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
        if last - first + 1 <= max_ticks:  # floor/ceil at the ends can add a tick: next step
            break
    # round away float noise (0.30000000000000004) so labels and positions agree
    digits = max(0, _decimals(step))
    return [round(k * step, digits) + 0.0 for k in range(first, last + 1)]


def tick_labels(ticks: list[float], unit: Unit = "count") -> list[str]:
    """Labels for ``ticks`` (as from :func:`nice_ticks`), one scale for the whole axis.

    ``count``: plain up to 9,999, then k, M, G. ``ms``: milliseconds below one second, seconds
    from there. ``%``: the number and a percent sign. Zero is ``0`` whatever the unit."""
    if not ticks:
        return []
    top = max(abs(t) for t in ticks)
    step = min((abs(b - a) for a, b in zip(ticks, ticks[1:]) if b != a), default=top or 1.0)
    scale, suffix = 1.0, ""
    if unit == "count":
        scale, suffix = next(((d, x) for s, d, x in _SUFFIXES if top >= s), (1.0, ""))
    elif unit == "ms":
        scale, suffix = (1000.0, "s") if top >= 1000 else (1.0, "ms")
    elif unit == "%":
        suffix = "%"
    decimals = max(0, _decimals(step / scale))
    labels = []
    for t in ticks:
        text = f"{t / scale:.{decimals}f}"
        if "." in text:
            text = text.rstrip("0").rstrip(".")
        labels.append("0" if text in ("0", "-0") else text + suffix)
    return labels


def set_y_ticks(plt: Any, values: Iterable[float], unit: Unit = "count", rows: int = 0,
                lo: float | None = None, hi: float | None = None, integer: bool = False) -> None:
    """Give a plotext figure round y ticks for ``values`` (everything plotted on the axis), with
    plotext's own API: ``ylim`` to the outer ticks, ``yticks(ticks, labels)``. ``rows`` is the
    chart widget's height (0: not laid out yet); about five rows go to the title, the frame and
    the x axis, and ticks stay at least two rows apart. ``lo``/``hi`` pin an end of the axis (a
    percentage is 0 to 100 whatever the data)."""
    values = list(values)
    if not values and (lo is None or hi is None):
        return  # nothing drawn: plotext draws no y axis labels either
    low = min(values) if lo is None else lo
    high = max(values) if hi is None else hi
    max_ticks = 7 if rows <= 0 else max(2, min(7, (rows - 5) // 2 + 1))
    ticks = nice_ticks(low, high, max_ticks, integer=integer)
    plt.ylim(ticks[0], ticks[-1])
    plt.yticks(ticks, tick_labels(ticks, unit))


def _round_steps(smallest: float) -> Iterator[float]:
    """1, 2, 2.5 and 5 times ascending powers of ten, from the first one >= ``smallest``."""
    exponent = math.floor(math.log10(smallest))
    while True:
        for mantissa in _MANTISSAS:
            step = mantissa * 10.0 ** exponent
            if step >= smallest:
                yield step
        exponent += 1


def _decimals(step: float) -> int:
    """Decimal places that write ``step`` (and so every multiple of it) exactly, up to 6."""
    for d in range(7):
        if abs(round(step, d) - step) <= 1e-9 * max(1.0, abs(step)):
            return d
    return 6
