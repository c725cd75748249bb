"""One lifecycle, two drivers, the same answers: a scripted sequence of arrivals, engine answers,
an engine failure and a client's departure, driven through the live router (real HTTP on
127.0.0.1 to scripted fake engines) and through the offline simulator (scripted engines in
virtual time), gives the same decisions, retries, admission waits and outcomes, with offload
and admission on (router/lifecycle.py is the one place that orders a request's steps).

Every scripted event lies on a 0.15 s grid, so the live run's wall-clock jitter cannot change
the order of events; the live admission wait is held to the offline one within 80 ms."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import sqlite_utils
from aiohttp import web

from kvtop.sim.engine import EngineFailed, FinishedRequest, StepResult
from kvtop.simulate import SimConfig, simulate
from kvtop.traces.loader import TraceRequest
from router.app import STATE, Backend, RouterConfig, create_app

KNOBS = {"offload_mode": "simple", "offload_threshold": 1000, "admission": "fifo",
         "admission_budget_tokens": 1000}


@dataclass
class Req:
    t: float  # arrival, seconds from the start
    session: str
    tokens: int  # prompt length; a session's later prompt extends its earlier one
    first_s: float  # from the serve leg's send to its first token (and the prefill leg's answer)
    done_s: float  # from the first token to the end
    out: int = 5
    cached: int = 0
    fail_first: bool = False  # the first engine it reaches answers 500
    leave_s: float | None = None  # the client leaves this long after sending


SCRIPT = [
    Req(0.00, "a", 600, 0.60, 2.40),  # i0 (fewest in flight, first): decodes until 3.0
    Req(0.30, "b", 610, 0.30, 0.15),  # i1, over at 0.75
    Req(0.90, "a", 3000, 0.30, 0.30),  # sticky i0 (decoding A): 2,488 new tokens, prefilled on idle i1
    Req(1.05, "d", 2000, 0.45, 0.60),  # i2, prefilling until 1.5
    Req(1.35, "d", 2100, 0.30, 0.30),  # sticky i2: waits at i2's gate (budget 1,000) until 1.5
    Req(2.25, "f", 800, 0.15, 0.15, fail_first=True),  # i1 answers 500: retried on i2
    Req(2.70, "g", 620, 0.90, 0.30, leave_s=0.45),  # i1; its client leaves before the first token
]


def _session_prefix(k: int) -> int:
    """The request a prompt extends (same session, earlier), or k itself."""
    return next(j for j, r in enumerate(SCRIPT) if r.session == SCRIPT[k].session)


def _tokens(k: int) -> list[int]:
    base = _session_prefix(k)
    return [base * 100_000 + j for j in range(SCRIPT[k].tokens)]


def _by_length(n: int) -> int:
    return next(k for k, r in enumerate(SCRIPT) if r.tokens == n)


# -- the live side -----------------------------------------------------------------------
class ScriptedBackend:
    """A fake vLLM answering each request as the script says (found by its prompt length)."""

    def __init__(self, failed: set[int]):
        self.failed = failed  # shared by every backend: the first to see a failing request fails it

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        k = _by_length(len(body["prompt"]))
        r = SCRIPT[k]
        if r.fail_first and k not in self.failed:
            self.failed.add(k)
            return web.json_response({"error": {"message": "scripted failure"}}, status=500)
        kv = body.get("kv_transfer_params") or {}
        if kv.get("do_remote_decode"):  # the prefill leg: one token, the KV kept for D
            await asyncio.sleep(r.first_s)
            return web.json_response({"choices": [{"index": 0, "text": "x"}],
                                      "usage": {"prompt_tokens": r.tokens, "completion_tokens": 1},
                                      "kv_transfer_params": {"remote_request": k}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(r.first_s)
        await resp.write(b'data: {"choices":[{"index":0,"text":"x"}]}\n\n')
        await asyncio.sleep(r.done_s)
        usage = {"prompt_tokens": r.tokens, "completion_tokens": r.out,
                 "prompt_tokens_details": {"cached_tokens": r.cached}}
        await resp.write(f'data: {json.dumps({"choices": [], "usage": usage})}\n\n'.encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def _live(aiohttp_server, router_client, tmp_path):
    failed: set[int] = set()
    urls = []
    for _ in range(3):
        server = await aiohttp_server(ScriptedBackend(failed).app(), host="127.0.0.1")
        urls.append(str(server.make_url("")).rstrip("/"))
    cfg = RouterConfig(backends=[Backend(f"i{k}", u) for k, u in enumerate(urls)], policy="sticky",
                       knobs={k: str(v) for k, v in KNOBS.items()}, db=str(tmp_path / "kvtop.db"),
                       state_dir=str(tmp_path / "st"), health_interval_s=60.0)
    client = await router_client(create_app(cfg))
    state = client.server.app[STATE]
    t0 = time.monotonic()

    async def one(k: int) -> None:
        r = SCRIPT[k]
        await asyncio.sleep(max(0.0, t0 + r.t - time.monotonic()))
        resp = await client.post("/v1/completions", headers={"X-Session-ID": r.session}, json={
            "prompt": _tokens(k), "max_tokens": r.out, "stream": True,
            "stream_options": {"include_usage": True}})
        await resp.read()

    async def leaving(k: int) -> None:
        try:
            await asyncio.wait_for(one(k), SCRIPT[k].t + SCRIPT[k].leave_s)
        except TimeoutError:
            pass

    await asyncio.gather(*(leaving(k) if r.leave_s is not None else one(k) for k, r in enumerate(SCRIPT)))
    for _ in range(100):  # the router sees the departure a moment after the client left
        if state.cluster.counters_zero():
            break
        await asyncio.sleep(0.02)
    state.deferred.run()
    state.writer.flush()
    db = sqlite_utils.Database(cfg.db)
    return list(db["decisions"].rows), list(db["outcomes"].rows), state


# -- the offline side --------------------------------------------------------------------
class ScriptedEngine:
    """The Engine interface kvtop/simulate.py drives, answering as the script says."""

    max_model_len = 1_000_000
    frontend_overhead_s = 0.0

    class profile:  # noqa: N801 - the attribute the driver reads
        frontend_s_per_token = 0.0

    def __init__(self, failed: set[int]):
        self.failed = failed
        self.events: list[tuple[float, str, str, int]] = []  # (time, kind, engine id, trace index)
        self.current: tuple[StepResult, list] | None = None

    def add_request(self, ereq) -> None:
        k = int(ereq.request_id.split("#")[0])
        r = SCRIPT[k]
        if r.fail_first and k not in self.failed:
            self.failed.add(k)
            raise EngineFailed("scripted failure")
        t = ereq.arrival_time
        if self.current is not None and self.current[0].end_time > t:  # cut the step in flight
            res, batch = self.current
            self.events += batch
            res.end_time, res.first_token, res.finished = t, [], []
            self.current = None
        if (ereq.kv_transfer_params or {}).get("do_remote_decode"):
            self.events.append((t + r.first_s, "done", ereq.request_id, k))
        else:
            self.events += [(t + r.first_s, "first", ereq.request_id, k),
                            (t + r.first_s + r.done_s, "done", ereq.request_id, k)]

    def abort(self, request_id: str, now: float | None = None):
        self.events = [e for e in self.events if e[2] != request_id]
        if self.current is not None:
            res, batch = self.current
            res.first_token = [x for x in res.first_token if x != request_id]
            res.finished = [f for f in res.finished if f.request_id != request_id]

    def has_work(self) -> bool:
        return bool(self.events)

    def next_event_time(self):
        return None

    def step(self, now: float, *, coalesce: bool = False) -> StepResult:
        if not self.events:
            return StepResult(now)
        e = min(ev[0] for ev in self.events)
        batch = [ev for ev in self.events if ev[0] == e]
        self.events = [ev for ev in self.events if ev[0] != e]
        res = StepResult(now, duration=e - now, end_time=e, num_scheduled_tokens=1)
        for _, kind, rid, k in batch:
            r = SCRIPT[k]
            if kind == "first":
                res.first_token.append(rid)
            else:
                prefill = rid.endswith("#p")
                res.finished.append(FinishedRequest(
                    rid, "length", r.tokens, 1 if prefill else r.out, r.cached, 0, now, None, None, None, e,
                    kv_transfer_params={"remote_request": k} if prefill else None))
        self.current = (res, batch)
        return res


def _offline():
    trace = [TraceRequest(arrival=r.t, session=r.session, turn=1, input_tokens=r.tokens, output_tokens=r.out,
                          hash_ids=[_session_prefix(k) * 100_000 + b for b in range(r.tokens // 16)],
                          block_size=16) for k, r in enumerate(SCRIPT)]
    failed: set[int] = set()
    decisions: list[dict] = []
    cfg = SimConfig(instances=3, router_block_size=16, features={k: v for k, v in KNOBS.items()})
    records = simulate(trace, "sticky", cfg, engines=[ScriptedEngine(failed) for _ in range(3)],
                       departures={k: r.leave_s for k, r in enumerate(SCRIPT) if r.leave_s is not None},
                       decisions=decisions)
    return decisions, records


def _decision_key(d: dict, live: bool) -> tuple:
    k = _by_length(d["input_tokens"])
    return (k, d["attempt"], d["instance"], d["reason"], d.get("offload", 0), d.get("prefill_instance"),
            d.get("offload_reason"))


async def test_live_and_offline_drivers_agree(aiohttp_server, router_client, tmp_path):
    live_decisions, live_outcomes, state = await _live(aiohttp_server, router_client, tmp_path)
    off_decisions, records = _offline()
    live = sorted(_decision_key(d, True) for d in live_decisions)
    offline = sorted(_decision_key(d, False) for d in off_decisions)
    assert live == offline
    # the script did what it says: an offload, a retry, a wait, a departure
    assert any(d[4] == 1 and d[5] == "i1" for d in live), live
    assert [d[:3] for d in live if d[0] == 5] == [(5, 1, "i1"), (5, 2, "i2")]
    waits_live = {_by_length(d["input_tokens"]): d["admission_wait_ms"] for d in live_decisions if d["attempt"] == 1}
    waits_off = {_by_length(d["input_tokens"]): d["admission_wait_ms"] for d in off_decisions if d["attempt"] == 1}
    assert waits_off[4] == 150.0 or abs(waits_off[4] - 150.0) < 1e-6
    for k in range(len(SCRIPT)):
        assert abs(waits_live[k] - waits_off[k]) < 80, (k, waits_live[k], waits_off[k])
    # outcomes: the last attempt of every request, status and usage alike
    final_live = {}
    by_rid = {d["request_id"]: _by_length(d["input_tokens"]) for d in live_decisions}
    for o in sorted(live_outcomes, key=lambda o: o["attempt"]):
        final_live[by_rid[o["request_id"]]] = (o["status"], o["output_tokens"] if o["status"] == "ok" else None,
                                               o["delivered_hit_tokens"] if o["status"] == "ok" else None)
    final_off = {int(r["request_id"]): (r["status"], r["output_tokens"] if r["status"] == "ok" else None,
                                        r["cached_tokens"] if r["status"] == "ok" else None) for r in records}
    assert final_live == final_off
    assert final_off[6][0] == "client_gone" and final_off[5][0] == "ok"
    attempts_live = sorted((by_rid[o["request_id"]], o["attempt"], o["status"]) for o in live_outcomes)
    assert (5, 1, "upstream_error") in attempts_live  # the failed first attempt has its own row
    assert state.cluster.counters_zero()
