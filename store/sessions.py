"""Agent sessions as the unit of service: how long each session's whole task took, and where.

An agent's user waits for the session, not for one request. Per session, from its requests'
times (the router's receipt ``t_recv`` and the answer's end ``t_done``):

``completion_s``  first arrival to last answer end
``fleet_s``       time with at least one of its requests in the fleet (queued, prefilling or
                  decoding): the union of its requests' [arrival, end] intervals, so two
                  requests in flight together (an agent's sub-agents) count once
``client_s``      the rest, ``completion_s - fleet_s``: the client's own time between an
                  answer and its next turn (the model's tool calls running, the user thinking)

and over a set of sessions each figure's mean, p50, p90 and max (``store.stats.percentile``).

Sources: a decision log (``from_db``: per policy segment, a request's segment being the one its
final attempt was decided in, so a session that spans a policy change is counted in each
segment as far as it ran there) and result records (``from_records``: ``kvtop replay``'s,
whose start is ``sent_at``, and ``kvtop simulate``'s, whose start is ``arrival``). Requests
their client cut off (``client_gone``) are left out, as in the seed table; failed requests
count with the time they took (an error that ended at once adds only its arrival).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from store.logs import CANCELLED
from store.stats import percentile

#: The figures of one session, in report order.
FIGURES = ("completion_s", "fleet_s", "client_s")
#: The statistics of each figure over sessions, in report order.
STATS = ("mean", "p50", "p90", "max")


@dataclass(frozen=True, slots=True)
class Session:
    """One session's service, in seconds."""

    session: str
    requests: int
    errors: int
    start: float       # its first request's arrival
    end: float         # its last answer's end
    fleet_s: float     # union of its requests' [arrival, end]

    @property
    def completion_s(self) -> float:
        return self.end - self.start

    @property
    def client_s(self) -> float:
        return max(0.0, self.completion_s - self.fleet_s)


def sessions(spans: Iterable[tuple[Any, float, float | None, bool]]) -> list[Session]:
    """Sessions from one ``(session, start, end, ok)`` per request, in order of first arrival.

    ``end`` None (or before ``start``) is a request that took no time: it marks the session's
    span at its arrival only."""
    by: dict[Any, list[tuple[float, float]]] = {}
    errors: dict[Any, int] = {}
    for ses, start, end, ok in spans:
        if start is None:
            continue
        if end is None or end < start:
            end = start
        by.setdefault(ses, []).append((start, end))
        if not ok:
            errors[ses] = errors.get(ses, 0) + 1
    out = []
    for ses, iv in by.items():
        iv.sort()
        fleet = 0.0
        cur_lo, cur_hi = iv[0]
        for lo, hi in iv[1:]:
            if lo > cur_hi:
                fleet += cur_hi - cur_lo
                cur_lo, cur_hi = lo, hi
            elif hi > cur_hi:
                cur_hi = hi
        fleet += cur_hi - cur_lo
        out.append(Session(str(ses), len(iv), errors.get(ses, 0), iv[0][0],
                           max(hi for _, hi in iv), fleet))
    out.sort(key=lambda s: (s.start, s.session))
    return out


def summarize(items: Sequence[Session]) -> dict[str, Any]:
    """``{"sessions": n, "requests": n, <figure>: {mean, p50, p90, max}}``; None stats when empty."""
    out: dict[str, Any] = {"sessions": len(items), "requests": sum(s.requests for s in items)}
    for fig in FIGURES:
        values = [getattr(s, fig) for s in items]
        out[fig] = {
            "mean": math.fsum(values) / len(values) if values else None,
            "p50": percentile(values, 50),
            "p90": percentile(values, 90),
            "max": max(values) if values else None,
        }
    return out


def from_records(records: Iterable[Mapping[str, Any]]) -> list[Session]:
    """Sessions from result records (``kvtop replay --out``, ``kvtop simulate``).

    A record's start is ``sent_at`` when it has one (replay: seconds since the replay began),
    else ``arrival`` (simulate: the router's receipt in virtual seconds); its end is the start
    plus ``e2e_ms``. Records without a session or a start are skipped."""
    spans = []
    for r in records:
        ses = r.get("session")
        start = r.get("sent_at")
        if start is None:
            start = r.get("arrival")
        if ses is None or start is None or r.get("status") == "cancelled":
            continue
        e2e = r.get("e2e_ms")
        end = start + e2e / 1000.0 if e2e is not None else None
        spans.append((ses, float(start), end, r.get("status") == "ok"))
    return sessions(spans)


def from_db(db: Any, run_id: str) -> dict[tuple[str, int | None], list[Session]]:
    """Per policy segment ``(policy, policy_version)`` of one run, its sessions.

    ``db``: a read-only log (``store.logs.open_logs``; several logs merged read as one, their
    run id the merged one) and a resolved ``run_id``. A request is its outcome rows (a retry's
    attempts together: the first receipt to the last end) in the segment of its final attempt.
    Outcomes written before they carried their decision's columns take them from the decision.
    """
    conn = db.conn
    flat = conn.execute("SELECT 1 FROM outcomes WHERE run_id = ? AND (session_id IS NULL OR policy IS NULL) "
                        "LIMIT 1", (run_id,)).fetchone() is None
    if flat:
        sql = ("SELECT request_id, attempt, session_id, policy, policy_version, status, t_recv, t_done, e2e_ms "
               "FROM outcomes WHERE run_id = ?")
    else:
        sql = ("SELECT o.request_id, o.attempt, COALESCE(o.session_id, d.session_id), COALESCE(o.policy, d.policy), "
               "COALESCE(o.policy_version, d.policy_version), o.status, o.t_recv, o.t_done, o.e2e_ms "
               "FROM outcomes o LEFT JOIN decisions d ON d.request_id = o.request_id AND d.attempt = o.attempt "
               "AND d.run_id = o.run_id WHERE o.run_id = ?")
    # request id -> [final attempt, session, policy, version, status, start, end]
    reqs: dict[str, list] = {}
    for rid, att, ses, pol, ver, status, t_recv, t_done, e2e in conn.execute(sql, (run_id,)):
        if t_recv is None:
            continue
        end = t_done if t_done is not None else (t_recv + e2e / 1000.0 if e2e is not None else None)
        att = att or 1
        r = reqs.get(rid)
        if r is None:
            reqs[rid] = [att, ses, pol, ver, status, t_recv, end]
            continue
        if att >= r[0]:
            r[0:5] = [att, ses, pol, ver, status]
        r[5] = min(r[5], t_recv)
        if end is not None and (r[6] is None or end > r[6]):
            r[6] = end
    spans: dict[tuple[str, int | None], list] = {}
    for att, ses, pol, ver, status, start, end in reqs.values():
        if status in CANCELLED or ses is None:
            continue
        spans.setdefault((pol, ver), []).append((ses, start, end, status == "ok"))
    return {key: sessions(rows) for key, rows in spans.items()}
