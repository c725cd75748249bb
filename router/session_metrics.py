"""Session metrics, live (issue 39): per session the router holds, its completion time, its
time in the fleet and the client's own time (``SessionInfo.figures``), and over all of them
each figure's mean, p50, p90 and max, as store/sessions.py computes them from the log.

The router counts the requests it dispatched, from their receipt (``t_recv``) to the end of
their answer; the log's figures differ only where the two sets differ: requests the client
cut off (``client_gone``) are counted here and left out there, and requests refused before
dispatch are counted there (at their arrival) and not here. A session the router forgot
(``max_sessions``) or a router restart starts over here; the log keeps them."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from router.lookahead import SessionInfo
from store.stats import percentile

#: The figures of a session, in the order of ``SessionInfo.figures`` (store/sessions.py's).
FIGURES = ("completion_s", "fleet_s", "client_s")


def row(s: SessionInfo, now: float) -> dict[str, Any]:
    """The figures of one session for a sessions row, with its requests in flight."""
    return {**dict(zip(FIGURES, s.figures(now))), "in_flight": s.in_flight}


def summary(sessions: Iterable[SessionInfo], now: float) -> dict[str, Any]:
    """``{"sessions": n, <figure>: {mean, p50, p90, max}}`` over ``sessions`` (None stats when
    there are none): store/sessions.py's ``summarize`` shape, less its request count."""
    cols: tuple[list[float], ...] = ([], [], [])
    for s in sessions:
        for col, v in zip(cols, s.figures(now)):
            col.append(v)
    out: dict[str, Any] = {"sessions": len(cols[0])}
    for fig, values in zip(FIGURES, cols):
        out[fig] = {
            "mean": math.fsum(values) / len(values) if values else None,
            "p50": percentile(values, 50),
            "p90": percentile(values, 90),
            "max": max(values) if values else None,
        }
    return out
