"""The routing proxy: ``create_app(config)`` builds the aiohttp application.

Data plane: ``POST /v1/completions`` and ``/v1/chat/completions`` (streaming or not),
``GET /v1/models``, ``GET /health``. Every request gets a decision (policy pick, reason,
every candidate's terms) and an outcome (status and latencies), both written to SQLite
through the background writer and kept in an in-memory ring for the control API.

A request whose backend fails before any byte reached the client is retried once on
another instance (a second decision, reason ``retry``). Counters are released on every
path, including a client that goes away mid-stream.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from router import features as router_features
from router import health as backend_health
from router import limits
from router.cluster import Cluster
from router.config import KnobError
from router.core import Decision, NoInstance, PolicySlot, RoutingCore
from router.forward import StreamScan, cached_tokens, completion_tokens, upstream_headers, usage_of
from router.policies import build_policy, policy_class
from router.policies.base import RETRY
from router.request import BadRequest, Tokenizer, parse_request
from router.upstream import ConnectFailed, Pool, UpstreamError
from store.writer import Writer

#: Default estimated-cache capacity per instance, in router blocks: one H20 running
#: Qwen3-30B-A3B holds about 265k tokens of KV (vllm-engine-model.md), 518 blocks of 512.
DEFAULT_CAPACITY_TOKENS = 265_000


@dataclass
class Backend:
    name: str
    url: str
    gpu: int | None = None


@dataclass
class RouterConfig:
    backends: list[Backend]
    policy: str = "unified"
    knobs: dict[str, Any] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 8000
    db: str | None = "kvtop.db"
    block_size: int = 512
    capacity_tokens: int = DEFAULT_CAPACITY_TOKENS
    session_header: str = "X-Session-ID"
    tokenizer: str | None = None
    max_input_tokens: int | None = 1_000_000
    max_body_bytes: int = 64 * 1024 * 1024
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    decision_ring: int = 2000
    run_id: str = field(default_factory=lambda: time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6])
    argv: str = ""
    # control plane (router/control.py)
    control_token: str | None = None
    control_token_file: str | None = None
    control_readonly: bool = False
    state_dir: str | None = None
    # telemetry (router/telemetry.py): backlog seconds = pending_prefill_tokens / this rate
    assumed_prefill_tps: float = 5000.0
    scrape_interval_s: float = 1.0
    # reliability (router/health.py, router/limits.py, docs/reliability.md); 0 = no bound
    max_inflight: int = 10_000
    max_inflight_per_instance: int = 4_096
    client_timeout_s: float = 60.0
    total_timeout_s: float | None = None
    health_interval_s: float = 0.5
    health_timeout_s: float = 1.0
    health_backoff_max_s: float = 5.0

    @property
    def capacity_blocks(self) -> int:
        return max(1, self.capacity_tokens // self.block_size)


class RouterState:
    """Everything mutable about a running router, stored once under ``STATE``."""

    def __init__(self, config: RouterConfig):
        self.config = config
        # --knob takes policy and router-level feature knobs together (router/features.py)
        schema = policy_class(config.policy).schema
        policy_knobs, feature_knobs = router_features.split_knobs(config.knobs, schema)
        self.features = router_features.Features.build(feature_knobs)
        policy = build_policy(config.policy, {**self.features.shared_for(schema), **policy_knobs})
        cluster = router_features.ObservedCluster(
            [b.name for b in config.backends], urls=[b.url for b in config.backends],
            block_size=config.block_size, capacity_blocks=config.capacity_blocks)
        self.core = RoutingCore(cluster, policy)
        self.admission = router_features.attach(self)
        self.tokenizer = Tokenizer(config.tokenizer) if config.tokenizer else None
        #: one ClientTimeout for every upstream call (the config does not change while running)
        self.upstream_timeout = aiohttp.ClientTimeout(total=config.total_timeout_s,
                                                      connect=config.connect_timeout_s,
                                                      sock_read=config.read_timeout_s)
        self.run_id = config.run_id
        self.started_at = time.time()
        self.writer: Writer | None = None
        self.http: aiohttp.ClientSession | None = None  # side calls: /v1/models, prefill legs
        self.upstream: Pool | None = None  # the data plane's upstream connections
        self.app: web.Application | None = None
        self.ring: deque[dict[str, Any]] = deque(maxlen=config.decision_ring)
        #: Called with ("decision" | "outcome" | "config" | "health", payload) on the loop thread.
        self.listeners: list[Callable[[str, dict[str, Any]], None]] = []
        self.counts: dict[str, int] = {"requests": 0, "bad_requests": 0, "no_instance": 0,
                                       "retries": 0, "rejected": 0}
        self.outcome_counts: dict[str, int] = {}
        self.draining = False

    @property
    def cluster(self) -> Cluster:
        return self.core.cluster

    @property
    def slot(self) -> PolicySlot:
        return self.core.slot

    # -- recording ------------------------------------------------------------------
    def emit(self, kind: str, payload: dict[str, Any]) -> None:
        for fn in list(self.listeners):
            try:
                fn(kind, payload)
            except Exception as exc:  # a viewer must never break routing
                print(f"kvtop route: listener failed: {exc!r}", file=sys.stderr)

    def record_decision(self, d: Decision) -> None:
        d.recorded = True
        if self.writer:
            self.writer.put("decisions", d.row(self.run_id))
        ev = d.event()
        self.ring.append(ev)
        self.emit("decision", ev)

    def record_outcome(self, d: Decision, outcome: dict[str, Any]) -> None:
        outcome.update(d.outcome_columns())  # copied, so the log segments an outcome without a join
        outcome.update(run_id=self.run_id, request_id=d.request.request_id, attempt=d.attempt,
                       instance=d.instance_name, ts=time.time())
        self.outcome_counts[outcome["status"]] = self.outcome_counts.get(outcome["status"], 0) + 1
        if self.writer:
            self.writer.put("outcomes", outcome)
        self.emit("outcome", outcome)

    def record_config(self, kind: str, who: str, before: Any, after: Any) -> dict[str, Any]:
        row = {"run_id": self.run_id, "ts": time.time(), "kind": kind, "who": who,
               "policy_version": self.slot.version, "before": before, "after": after}
        if self.writer:
            self.writer.put("config_events", row)
        self.emit("config", row)
        return row

    # -- control --------------------------------------------------------------------
    def set_policy(self, name: str | None, knobs: dict[str, Any] | None, who: str,
                   *, merge: bool = False) -> PolicySlot:
        """Validate completely, then swap in one assignment. Raises KnobError, changing nothing.

        ``merge`` keeps the current knobs and changes only those given (PATCH semantics).
        ``knobs`` may mix policy knobs and router-level feature knobs (router/features.py);
        feature knobs always merge, and shared names (heavy_threshold, prefill_tps) set both.
        """
        current = self.slot.policy
        name = name or current.name
        if knobs is not None and not isinstance(knobs, dict):
            raise KnobError("knobs", "expected an object of knob names to values")
        schema = policy_class(name).schema
        policy_knobs, feature_knobs = router_features.split_knobs(knobs or {}, schema)
        features = router_features.Features.build(feature_knobs, base=self.features.knobs)
        base = current.knobs if merge and policy_class(name).name == current.name else {}
        new = build_policy(name, {**base, **features.shared_for(schema), **policy_knobs})
        before = {"policy": current.name, "version": self.slot.version, "knobs": current.knobs,
                  "features": self.features.knobs}
        self.features = features
        slot = self.core.swap(new)
        after = {"policy": new.name, "version": slot.version, "knobs": new.knobs,
                 "features": features.knobs}
        self.record_config("policy" if new.name != current.name else "knobs", who, before, after)
        self.admission.pump()  # a larger budget or admission=off lets waiters through now
        return slot

    def run_row(self, ended: bool = False) -> dict[str, Any]:
        cfg = self.config
        safe = {k: v for k, v in asdict(cfg).items() if k not in ("control_token",)}
        return {"run_id": self.run_id, "started_at": self.started_at,
                "ended_at": time.time() if ended else None, "host": cfg.host, "port": cfg.port,
                "policy": cfg.policy, "backends": [asdict(b) for b in cfg.backends], "config": safe,
                "argv": cfg.argv, "kvtop_version": _version(), "schema_version": 1}


STATE = web.AppKey("state", RouterState)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kvtop")
    except Exception:
        return "unknown"


def error_body(status: int, message: str, *, param: str | None = None,
               err_type: str | None = None) -> dict[str, Any]:
    """An OpenAI-shaped error object."""
    err_type = err_type or {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                            404: "NotFoundError", 405: "MethodNotAllowed", 408: "RequestTimeout",
                            413: "RequestTooLarge",
                            429: "RateLimitError", 503: "ServiceUnavailableError"}.get(status, "APIError")
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(status: int, message: str, *, param: str | None = None,
                   err_type: str | None = None, headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI-shaped JSON error."""
    return web.json_response(error_body(status, message, param=param, err_type=err_type),
                             status=status, headers=headers)


@web.middleware
async def json_errors(request: web.Request, handler):
    """Every error the router itself produces is JSON, never an HTML page or a traceback."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        msg = {404: f"no route for {request.method} {request.path}",
               405: f"method {request.method} not allowed on {request.path}",
               413: "request body too large"}.get(exc.status, exc.reason)
        return error_response(exc.status, msg, headers={k: v for k, v in exc.headers.items()
                                                        if k.lower() == "allow"})
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:  # a bug: say so plainly, keep serving
        print(f"kvtop route: internal error on {request.path}: {exc!r}", file=sys.stderr)
        return error_response(500, "internal router error", err_type="InternalServerError")


# -- data plane ----------------------------------------------------------------------

def parse_json(raw: bytes) -> Any:
    """A request body parsed as JSON; BadRequest (400) otherwise."""
    if not raw:
        raise BadRequest("the request body is empty; expected a JSON object")
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise BadRequest("the request body is not valid UTF-8") from None
    except (ValueError, RecursionError) as exc:  # RecursionError: arrays nested thousands deep
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None


async def read_json(request: web.Request) -> tuple[bytes, Any]:
    """The body, raw and parsed, within --client-timeout; BadRequest (400, or 408) otherwise.

    The aiohttp handlers (the control API's mutations) read their bodies through this."""
    raw = await limits.read_body(request, request.app[STATE].config.client_timeout_s)
    return raw, parse_json(raw)


class AioExchange:
    """One request's answer through aiohttp (the proxy's client side; see front.Exchange).

    The proxy writes the answer itself, so bookkeeping after it (counters, the outcome row)
    runs after the client has its bytes."""

    __slots__ = ("request", "headers", "response")

    def __init__(self, request: web.Request):
        self.request = request
        self.headers = request.headers
        self.response: web.StreamResponse | None = None

    @property
    def started(self) -> bool:
        return self.response is not None and self.response.prepared

    @property
    def gone(self) -> bool:
        return self.request.transport is None

    async def send(self, resp: web.StreamResponse) -> None:
        self.response = resp
        await resp.prepare(self.request)
        await resp.write_eof()

    async def respond(self, status: int, headers, body: bytes) -> None:
        await self.send(web.Response(body=body, status=status, headers=headers))

    async def start(self, status: int, headers) -> None:
        self.response = web.StreamResponse(status=status, headers=headers)
        await self.response.prepare(self.request)

    async def write(self, chunk: bytes) -> None:
        await self.response.write(chunk)

    async def finish(self) -> None:
        await self.response.write_eof()


async def completions(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, "completions", "/v1/completions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, "chat", "/v1/chat/completions")


async def _proxy(request: web.Request, endpoint: str, path: str) -> web.StreamResponse:
    """The aiohttp handler: refuse early (before reading the body), then ``proxy``."""
    state = request.app[STATE]
    t_recv = time.time()
    if state.draining:
        return error_response(503, "the router is shutting down", headers={"Retry-After": "1"})
    if (busy := limits.admit(state)) is not None:
        return busy
    try:
        raw = await limits.read_body(request, state.config.client_timeout_s)
    except BadRequest as exc:
        state.counts["bad_requests"] += 1
        return error_response(exc.status, exc.message, param=exc.param)
    x = AioExchange(request)
    await proxy(state, x, raw, endpoint, path, t_recv)
    return x.response


async def proxy(state: RouterState, x, raw: bytes, endpoint: str, path: str, t_recv: float) -> None:
    """Route and forward one data-plane request whose body is ``raw``; the answer goes to ``x``.

    Shared by the listening front (router/front.py) and the aiohttp handlers."""
    cfg = state.config
    if state.draining:
        await x.send(error_response(503, "the router is shutting down", headers={"Retry-After": "1"}))
        return
    try:
        body = parse_json(raw)
        req = parse_request(body, endpoint, headers=x.headers, session_header=cfg.session_header,
                            block_size=cfg.block_size, tokenizer=state.tokenizer,
                            max_input_tokens=cfg.max_input_tokens)
    except BadRequest as exc:
        state.counts["bad_requests"] += 1
        await x.send(error_response(exc.status, exc.message, param=exc.param))
        return
    if (busy := limits.admit(state)) is not None:  # again: others were admitted while this body arrived
        await x.send(busy)
        return
    state.counts["requests"] += 1
    first: Decision | None = None
    exclude: tuple[int, ...] = ()
    for attempt in (1, 2):
        full = limits.full_instances(state)
        try:
            d = state.core.decide(req, exclude=exclude + full, attempt=attempt,
                                  reason_override=RETRY if attempt > 1 else None)
        except NoInstance as exc:
            if full and first is None:
                await x.send(limits.all_full(state))
                return
            state.counts["no_instance"] += 1
            msg = str(exc) if first is None else f"{first.instance_name} failed and {exc}"
            await x.send(error_response(503 if first is None else 502, msg, headers={"Retry-After": "1"}))
            return
        if first is not None:
            d.turn = first.turn
            state.counts["retries"] += 1
        d.extra["t_proxy_recv"] = t_recv
        if state.features.active:  # offload and/or admission (router/features.py)
            done = await router_features.serve(x, state, d, body, raw, path, _forward,
                                               attempt=attempt, new_turn=first is None,
                                               exclude=exclude + full)
        else:
            state.core.dispatch(d, new_turn=first is None)
            done = await _forward(x, state, d, raw, path, can_retry=attempt == 1, record=True)
        if done:
            return
        first = d
        exclude = (d.instance,)
    raise AssertionError("unreachable")  # pragma: no cover


async def _forward(x, state: RouterState, d: Decision, raw: bytes, path: str,
                   *, can_retry: bool, record: bool = False) -> bool | None:
    """Run one attempt, answering through ``x``. Returns True once the client has an answer,
    or None to retry elsewhere (nothing was sent).

    ``record``: write the decision row here, once the request is on its way upstream, so
    that serializing it overlaps the backend's work instead of delaying the request."""
    cluster = state.cluster
    ticket = d.ticket
    inst = cluster.instances[d.instance]
    req = d.request
    cfg = state.config
    t0 = time.monotonic()
    outcome: dict[str, Any] = {"stream": int(req.stream), "status": "error", "http_status": None,
                               "error": None, "ttft_ms": None, "e2e_ms": None, "tpot_ms": None,
                               "output_tokens": None, "delivered_hit_tokens": None,
                               "t_first_token": None, "t_done": None}
    headers = upstream_headers(x.headers, req.request_id)
    reply_headers = {"X-Kvtop-Instance": d.instance_name, "X-Kvtop-Request-Id": req.request_id,
                     "X-Kvtop-Policy": d.slot.label}
    scan: StreamScan | None = None
    t_first: float | None = None
    try:
        up = await state.upstream.request(inst.url, "POST", path, headers, raw,
                                          total_timeout=cfg.total_timeout_s,
                                          on_sent=(lambda: state.record_decision(d)) if record else None)
        record = False
        async with up:
            outcome["http_status"] = up.status
            if up.status != 200:
                data = await up.read()
                outcome["error"] = data[:500].decode("utf-8", "replace")
                if up.status >= 500 and can_retry:
                    outcome["status"] = "upstream_error"
                    return None
                outcome["status"] = "error"
                ctype = up.headers.get("Content-Type", "application/json")
                await x.respond(up.status, {**reply_headers, "Content-Type": ctype}, data)
                return True
            if not req.stream:
                data = await up.read()
                outcome["status"] = "ok"
                await x.respond(200, {**reply_headers, "Content-Type": up.headers.get(
                    "Content-Type", "application/json")}, data)
                # the client has its answer: the bookkeeping below is off its path
                cluster.first_token(ticket)
                _done(outcome, t0, None, usage_of(data), None)
                return True
            await x.start(200, {**reply_headers, "Content-Type": up.headers.get(
                "Content-Type", "text/event-stream"), "Cache-Control": "no-cache"})
            scan = StreamScan()
            try:
                async for chunk in up.iter_chunks():
                    if scan.feed(chunk) and t_first is None:
                        t_first = time.monotonic()
                        cluster.first_token(ticket)
                        outcome["t_first_token"] = time.time()
                    await x.write(chunk)
            except (UpstreamError, TimeoutError) as exc:
                outcome["status"] = _failure_status(exc)
                outcome["error"] = f"upstream failed mid-stream: {exc!r}"[:500]
                err = error_body(502, f"upstream instance {d.instance_name} failed mid-stream")
                # the blank line first ends whatever partial event the upstream left behind
                await x.write(b"\n\ndata: " + json.dumps(err).encode() + b"\n\n")
                await x.finish()
                return True
            if scan.finish() and t_first is None:
                t_first = time.monotonic()
                cluster.first_token(ticket)
            _done(outcome, t0, t_first, scan.usage(), scan.data_events)
            outcome["status"] = "ok"
            try:
                await x.finish()
            except ConnectionResetError:
                pass  # every event, [DONE] included, was written; a client may leave without the terminator
            return True
    except (UpstreamError, TimeoutError) as exc:
        outcome["status"] = _failure_status(exc)
        outcome["error"] = f"{type(exc).__name__}: {exc}"[:500]
        if isinstance(exc, ConnectFailed):
            backend_health.passive_down(state.app, d.instance, exc)
        if can_retry:
            return None
        await x.send(error_response(502, f"upstream instance {d.instance_name} failed: {type(exc).__name__}",
                                    headers=reply_headers))
        return True
    except (ConnectionResetError, asyncio.CancelledError):
        if scan is not None and scan.saw_done and outcome["status"] != "ok":
            # [DONE] reached the client: the answer is complete, whatever happens after it
            _done(outcome, t0, t_first, scan.usage(), scan.data_events)
            outcome["status"] = "ok"
        elif outcome["status"] != "ok":
            outcome["status"] = "client_gone"
            outcome["error"] = "client disconnected"
        raise
    finally:
        if record and not d.recorded:  # the upstream call failed before its request went out
            state.record_decision(d)
        if outcome["e2e_ms"] is None:
            outcome["e2e_ms"] = (time.monotonic() - t0) * 1000
            outcome["t_done"] = time.time()
        # a client that leaves says nothing about the instance: only upstream failures count
        cluster.finish(ticket, error=outcome["status"] not in ("ok", "client_gone"))
        state.record_outcome(d, outcome)  # on a retry the caller then routes attempt 2


def _failure_status(exc: BaseException) -> str:
    """An upstream that stopped answering in time is a ``timeout``; anything else failed."""
    return "timeout" if isinstance(exc, asyncio.TimeoutError) else "upstream_error"


def _done(outcome: dict[str, Any], t0: float, t_first: float | None, usage: dict | None,
          events: int | None) -> None:
    now = time.monotonic()
    e2e = (now - t0) * 1000
    outcome["e2e_ms"] = e2e
    outcome["t_done"] = time.time()
    out = completion_tokens(usage)
    if out is None:
        out = events
    outcome["output_tokens"] = out
    outcome["delivered_hit_tokens"] = cached_tokens(usage)
    if t_first is not None:
        ttft = (t_first - t0) * 1000
        outcome["ttft_ms"] = ttft
        if out and out > 1:
            outcome["tpot_ms"] = (e2e - ttft) / (out - 1)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    for inst in state.cluster.instances:
        if not inst.healthy:
            continue
        try:
            async with state.http.get(inst.url + "/v1/models",
                                      timeout=aiohttp.ClientTimeout(total=5)) as up:
                if up.status == 200:
                    return web.Response(body=await up.read(), content_type="application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError):
            continue
    return error_response(503, "no instance answered /v1/models")


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    insts = state.cluster.instances
    healthy = sum(1 for s in insts if s.healthy)
    status = "ok" if healthy == len(insts) else ("degraded" if healthy else "unavailable")
    body = {"status": status, "healthy_instances": healthy, "instances": len(insts),
            "policy": state.slot.label, "draining": state.draining}
    return web.json_response(body, status=200 if healthy and not state.draining else 503)


# -- assembly ------------------------------------------------------------------------

def create_app(config: RouterConfig) -> web.Application:
    """Build the router. Raises KnobError / ValueError for a bad config, before any I/O."""
    if not config.backends:
        raise ValueError("at least one --backend is required")
    state = RouterState(config)
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[json_errors])
    app[STATE] = state
    state.app = app
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.cleanup_ctx.append(_resources)
    backend_health.setup(app, state)
    from router import control

    control.setup(app)
    return app


async def _resources(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    cfg = state.config
    if cfg.db:
        state.writer = Writer(cfg.db).start()
        state.writer.put("runs", state.run_row())
        state.record_config("run", "router", None, {"policy": state.slot.policy.name,
                                                    "version": state.slot.version,
                                                    "knobs": state.slot.policy.knobs,
                                                    "features": state.features.knobs})
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60)
    state.http = aiohttp.ClientSession(connector=connector, auto_decompress=False)
    state.upstream = Pool(connect_timeout=cfg.connect_timeout_s, read_timeout=cfg.read_timeout_s)
    try:
        yield
    finally:
        state.upstream.close()
        await state.http.close()
        if state.writer:
            state.writer.put("runs", state.run_row(ended=True))
            await asyncio.get_running_loop().run_in_executor(None, state.writer.close)
            state.writer = None

