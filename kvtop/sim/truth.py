"""The simulated engine's own account of each request, for holding kvtop's figures against it.

``install(app, instance)`` (kvtop/sim/server.py) records, for every request the engine
finishes, what the engine itself did: prompt tokens, cached tokens served from its prefix
cache, the tokens it prefilled, output tokens, the time it waited in the queue and its time
to first token (engine seconds, and wall seconds at the instance's ``--speed``). A request
is named by the ``X-Request-Id`` the client (kvtop's router) sent, else by the engine's id.
``GET /kvtop/sim/truth`` answers the records (``?request_id=ID`` for one, ``?since=N`` for
those after the N-th), the newest ``MAX_RECORDS`` kept. benchmarks/truth_audit.py and
tests/test_truth_audit.py compare kvtop's views with it.
"""

from __future__ import annotations

import contextvars
from collections import OrderedDict
from typing import Any

from aiohttp import web

#: Records kept per instance (oldest out first).
MAX_RECORDS = 100_000

#: The router's id of the request the current handler serves (set per HTTP request).
_CLIENT_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvtop_sim_client_id", default=None)

TRUTH = web.AppKey("kvtop_sim_truth", object)


class TruthLog:
    """Finished requests, as the engine saw them, by the client's request id."""

    def __init__(self, speed: float, max_records: int = MAX_RECORDS):
        self.speed = speed
        self.max_records = max_records
        self.records: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.finished = 0
        self._names: dict[str, str] = {}  # engine request id -> client's id

    def submitted(self, engine_id: str) -> None:
        self._names[engine_id] = _CLIENT_ID.get() or engine_id

    def observe(self, f: Any) -> None:
        name = self._names.pop(f.request_id, f.request_id)
        sched = f.scheduled_time
        first = f.first_token_time
        queue_s = (sched - f.arrival_time) if sched is not None else None
        ttft_s = (first - f.arrival_time) if first is not None else None
        rec = {"request_id": name, "engine_request_id": f.request_id, "finish_reason": f.finish_reason,
               "prompt_tokens": f.num_prompt_tokens, "cached_tokens": f.num_cached_tokens,
               "prefill_tokens": max(0, f.num_prompt_tokens - f.num_cached_tokens),
               "output_tokens": f.num_output_tokens, "preemptions": f.num_preemptions,
               "queue_s": queue_s, "ttft_s": ttft_s,
               "queue_wall_s": queue_s / self.speed if queue_s is not None else None,
               "ttft_wall_s": ttft_s / self.speed if ttft_s is not None else None,
               "arrival": f.arrival_time, "finish": f.finish_time, "seq": self.finished}
        self.finished += 1
        # a client id used twice (a retry): both attempts kept, the later under "id#n"
        key = name if name not in self.records else f"{name}#{self.finished}"
        self.records[key] = rec
        while len(self.records) > self.max_records:
            self.records.popitem(last=False)


def install(app: web.Application, instance: Any) -> TruthLog:
    """Record ``instance``'s finished requests and serve them on ``app``."""
    log = TruthLog(getattr(instance, "speed", 1.0))
    app[TRUTH] = log
    submit, publish = instance.submit, instance._publish

    def submit_noting(request_id, *args, **kw):
        stream = submit(request_id, *args, **kw)
        log.submitted(request_id)
        return stream

    def publish_noting(res) -> None:
        publish(res)
        for f in res.finished:
            log.observe(f)

    instance.submit = submit_noting
    instance._publish = publish_noting

    @web.middleware
    async def name_requests(request: web.Request, handler):
        token = _CLIENT_ID.set(request.headers.get("X-Request-Id"))
        try:
            return await handler(request)
        finally:
            _CLIENT_ID.reset(token)

    app.middlewares.append(name_requests)
    app.router.add_get("/kvtop/sim/truth", truth_handler)
    return log


async def truth_handler(request: web.Request) -> web.Response:
    log: TruthLog = request.app[TRUTH]
    rid = request.query.get("request_id")
    if rid is not None:
        rec = log.records.get(rid)
        if rec is None:
            return web.json_response({"error": {"message": f"no finished request {rid!r}", "type": "NotFound"}},
                                     status=404)
        return web.json_response(rec)
    try:
        since = int(request.query.get("since", "0"))
    except ValueError:
        return web.json_response({"error": {"message": "since must be an integer", "type": "BadRequestError"}},
                                 status=400)
    return web.json_response({"speed": log.speed, "finished": log.finished,
                              "records": [r for r in log.records.values() if r["seq"] >= since]})
