"""The router's one aiohttp application, and the server that listens with it.

``create_app(config)`` assembles everything served on the router's port: the data plane
(router/proxy.py), ``GET /v1/models``, ``GET /health``, the control API and event stream
(router/control.py) and ``GET /metrics`` (router/telemetry.py). ``start_server`` serves it
the way ``kvtop route`` does (aiohttp's own HTTP/1.1 server on uvloop, with its header
limits, handler cancellation when a client leaves, and TLS when given); tests use it too.
A POST to a data-plane path reaches its handler before the application's URL dispatcher
(``data_plane_first``): the same handler and error middleware, without the resolve.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import AsyncIterator

from aiohttp import hdrs, web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_protocol import _ErrInfo  # private; see _JsonErrorHandler.data_received

from router import health as backend_health
from router import kv_wiring
from router import passthrough, proxy
from router.apis import ResponseStore
from router.http import error_response, json_errors
from router import control, replicas
from router.telemetry import TELEMETRY
from router.state import STATE, DEFAULT_CAPACITY_TOKENS, Backend, RouterConfig, RouterState  # noqa: F401 (re-exported)
from router.upstream import Pool, UpstreamError
from router.request import BadRequest
from store.writer import Writer

log = logging.getLogger("kvtop.route")

#: aiohttp's request-head limits, set explicitly: a request line or one header up to 8 KiB,
#: at most 128 headers (the server answers 400 past them; trailers count against the same).
MAX_LINE_SIZE = 8190
MAX_FIELD_SIZE = 8190
MAX_HEADERS = 128
#: An idle keep-alive connection is closed after this long (a client that vanished without
#: closing must not hold a descriptor for ever).
KEEPALIVE_TIMEOUT_S = 75.0
#: After refusing a request whose body is still arriving (413, 408, a malformed head), read
#: and drop what the client sends for at most this long before closing, so that the client
#: sees the answer instead of a reset.
LINGERING_S = 2.0
#: The data-plane handlers by path, bound to the app's RouterState (``data_plane_first``).
DATA_PLANE = web.AppKey("kvtop_data_plane", dict)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    for inst in state.cluster.instances:
        if not inst.healthy:
            continue
        try:
            async with asyncio.timeout(5):
                up = await state.upstream.request(inst.url, "GET", "/v1/models", (), b"")
                async with up:
                    data = await up.read(limit=4 * 1024 * 1024)
            if up.status == 200:
                return web.Response(body=data, content_type="application/json")
        except (UpstreamError, TimeoutError, OSError):
            continue
    return error_response(503, "no instance answered /v1/models")


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    insts = state.cluster.instances
    healthy = sum(1 for s in insts if s.healthy)
    status = "ok" if healthy == len(insts) else ("degraded" if healthy else "unavailable")
    log_health = state.writer.health() if state.writer is not None else None
    degraded = state.degraded()
    if degraded and status == "ok":
        # routing goes on; a background task died lately or the decision log is losing rows
        status = "degraded"
    body = {"status": status, "healthy_instances": healthy, "instances": len(insts),
            "policy": state.slot.label, "draining": state.draining, "decision_log": log_health,
            "degraded": degraded}
    return web.json_response(body, status=200 if healthy and not state.draining else 503)


def create_app(config: RouterConfig) -> web.Application:
    """Build the router. Raises KnobError / ValueError for a bad config, before any I/O."""
    if not config.backends:
        raise ValueError("at least one --backend is required")
    state = RouterState(config)
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[json_errors],
                          handler_args={"max_line_size": MAX_LINE_SIZE, "max_field_size": MAX_FIELD_SIZE,
                                        "max_headers": MAX_HEADERS, "lingering_time": LINGERING_S})
    app[STATE] = state
    state.app = app
    responses = ResponseStore()  # response id -> instance, for the data plane and passthrough
    for path, handler in proxy.handlers(STATE, responses).items():  # completions, chat, messages, responses
        app.router.add_post(path, handler)
    app[DATA_PLANE] = proxy.direct_handlers(state, responses)  # the same, reached before the URL dispatcher
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.cleanup_ctx.append(_resources)
    backend_health.setup(app, state)
    control.setup(app)
    replicas.setup(app, state.replicas, state.supervisor, app[TELEMETRY].registry)  # after control, which made the telemetry
    passthrough.setup(app, STATE, responses)  # count_tokens, /v1/responses/{id}, /, unknown paths: last
    return app


async def _resources(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    cfg = state.config
    if cfg.db:
        state.writer = Writer(cfg.db).start()
        state.writer.run_id = state.run_id  # for the writer's own log_drop rows
        state.writer.put("runs", state.run_row())
        state.record_config("run", "router", None, {"policy": state.slot.policy.name,
                                                    "version": state.slot.version,
                                                    "knobs": state.slot.policy.knobs,
                                                    "features": state.features.knobs})
    state.upstream = Pool(connect_timeout=cfg.connect_timeout_s, read_timeout=cfg.read_timeout_s,
                          ssl_ca_file=cfg.backend_ca_file)
    state.kv_subscribers = await kv_wiring.start_subscribers(
        state.cluster, cfg.backends, capacity_tokens=cfg.capacity_tokens, supervisor=state.supervisor)
    warning = control.token_warning(state)
    if warning:
        log.warning("%s", warning)
    try:
        yield
    finally:
        await kv_wiring.stop_subscribers(state.kv_subscribers)
        state.deferred.run()  # decisions whose shadow picks were still queued
        state.upstream.close()
        state.parser.close()
        if state.writer:
            state.writer.put("runs", state.run_row(ended=True))
            await asyncio.get_running_loop().run_in_executor(None, state.writer.close)
            state.writer = None


def tls_context(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The listener's TLS context from --tls-cert/--tls-key; ValueError when unusable."""
    if not cert and not key:
        return None
    if not (cert and key):
        raise ValueError("--tls-cert and --tls-key go together")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load --tls-cert {cert} / --tls-key {key}: {exc}") from None
    return ctx


class _JsonErrorHandler(RequestHandler):
    """aiohttp's connection handler, with its protocol-level errors (a malformed request, a
    head over the limits, a bad chunk or trailer) answered as our JSON errors instead of a
    text page, and logged as the client's mistake rather than with a traceback."""

    __slots__ = ()

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # part of an answer went out: only closing is left
            raise ConnectionError("cannot answer with an error after the answer began")
        if status >= 500:
            log.error("error handling %s %s", request.method, request.path, exc_info=exc)
            text = "internal router error"
        else:
            log.debug("bad request from %s: %s", request.remote, exc)
            state = getattr(self._manager, "kvtop_state", None)
            if state is not None:
                state.counts["bad_requests"] += 1
            text = f"malformed HTTP request: {getattr(exc, 'message', None) or exc or message}"
        resp = error_response(status, text[:300])
        resp.force_close()
        return resp

    def data_received(self, data: bytes) -> None:
        """As aiohttp's, except when the body of the request being handled turns out malformed
        (a trailer section over the limits, a bad chunk) in a later read than its head: aiohttp
        then queues the error as the connection's next request, and this one waits for a body
        end that never comes (a 128-line trailer section of 2 KB lines waited for
        --client-timeout, ~60 s). Its body fails at once instead: the handler answers 400 in
        the client's API shape, and the connection closes behind it."""
        queued = len(self._messages)
        super().data_received(data)
        req = self._current_request
        if req is None or len(self._messages) <= queued:
            return
        err = self._messages[-1][0]
        if isinstance(err, _ErrInfo) and not req.content.is_eof():
            self._messages.pop()
            state = getattr(self._manager, "kvtop_state", None)
            if state is not None:
                state.counts["bad_requests"] += 1
            req.content.set_exception(BadRequest(f"malformed HTTP request: {err.message or err.exc}"[:300]))
            req.content.feed_eof()  # at its end: after the answer, aiohttp does not read it on
            self.close()  # nothing after it on this connection can be parsed


def data_plane_first(app: web.Application, handle):
    """The server's request handler: a POST to one of the four data-plane paths goes straight
    to its handler (with the app's error middleware around it); everything else, and a
    request with an ``Expect`` header (100-continue is the app's to answer), through
    ``handle``, the application's URL dispatcher and middlewares. The dispatcher's resolve,
    match info and middleware chain cost about 6 µs a request in a tight loop, 2-3x that on
    the router's cold caches, and the data plane needs none of it."""
    direct = app.get(DATA_PLANE) or {}

    async def dispatch(request: web.BaseRequest) -> web.StreamResponse:
        handler = direct.get(request.path) if request.method == "POST" else None
        if handler is None or hdrs.EXPECT in request.headers:
            return await handle(request)
        return await json_errors(request, handler)

    return dispatch


class _Server(web.Server):
    """The low-level server making one ``_JsonErrorHandler`` per connection."""

    __slots__ = ()

    def __call__(self) -> RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


async def start_server(app: web.Application, sock: socket.socket,
                       ssl_context: ssl.SSLContext | None = None) -> web.AppRunner:
    """Serve ``app`` on the bound ``sock``; returns the runner (``await runner.cleanup()``)."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0,
                           handler_cancellation=True,
                           keepalive_timeout=KEEPALIVE_TIMEOUT_S)
    await runner.setup()
    runner.server.__class__ = _Server  # JSON for protocol errors too (see _JsonErrorHandler)
    runner.server.request_handler = data_plane_first(app, runner.server.request_handler)
    runner.server.kvtop_state = app[STATE]
    try:
        await web.SockSite(runner, sock, ssl_context=ssl_context).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
