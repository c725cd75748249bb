"""One request's result, the record every report reads (the replay results format).

``kvtop replay`` makes one per request it sends, ``kvtop simulate`` one per simulated
request, what-if one per recorded request it re-runs, and the decision log's report contract
(store/arms.py) one per request's final attempt. kvtop/seedtable.py computes every figure from
them; a results file is a header line and then one ``as_record()`` per line.

Every record has the core fields; the others belong to some producers only (replay's
``sent_at`` and ``http_status``, the simulator's offload and admission timings, what-if's
``stream`` and ``t_done``) and are left out of the record where the producer does not set
them, so each producer's records keep their keys and order. All latencies are milliseconds
from the moment the request was received (by the router) or sent (by replay).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any, Final


class _Absent:
    """The value of a field its producer does not report: left out of the record."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT: Final = _Absent()


@dataclass(slots=True, kw_only=True)
class RequestResult:
    """One request's result. Fields in record order; ``ABSENT`` ones are not in the record."""

    request_id: str
    session: str
    turn: int | None
    #: seconds from the run's start (replay: the trace's arrival; simulate, what-if: arrival)
    arrival: float | None | _Absent = ABSENT
    #: replay: seconds from the run's start when the request went out
    sent_at: float | None | _Absent = ABSENT
    input_tokens: int
    output_tokens: int | None
    #: ok | error (replay, the decision log) or the router's outcome status (simulate)
    status: str | None
    http_status: int | None | _Absent = ABSENT
    error: str | None | _Absent = ABSENT
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    tpot_ms: float | None = None
    #: prompt tokens the engine served from its prefix cache (usage.cached_tokens), None: unknown
    cached_tokens: int | None = None
    instance: str | None = None
    route_class: str | None = None
    #: simulate: the instance that ran an offloaded prefill
    prefill_instance: str | None | _Absent = ABSENT
    admission_wait_ms: float | None | _Absent = ABSENT
    prefill_leg_ms: float | None | _Absent = ABSENT
    #: what-if: whether the recorded request streamed, and its end in seconds from the run's start
    stream: Any = ABSENT
    t_done: float | None | _Absent = ABSENT
    #: the arm (policy segment, results file) the request belongs to
    arm: str

    def as_record(self) -> dict[str, Any]:
        """The record: a dict of the fields in order, without the ``ABSENT`` ones."""
        return {name: value for name, value in zip(FIELDS, _values(self)) if value is not ABSENT}


#: Every field, in record order.
FIELDS: tuple[str, ...] = tuple(f.name for f in fields(RequestResult))
#: A result's field values in record order, one C-level call (a simulation makes a record per request).
_values = attrgetter(*FIELDS)
#: The fields every record has, in record order (store/arms.py builds exactly these).
RECORD_KEYS: tuple[str, ...] = tuple(f.name for f in fields(RequestResult) if f.default is not ABSENT)
