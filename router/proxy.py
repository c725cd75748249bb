"""The data plane over HTTP: drive the routing pipeline (router/pipeline.py) for each request.

``POST /v1/completions``, ``/v1/chat/completions``, ``/v1/messages`` (Anthropic) and
``/v1/responses``, streaming or not (what differs between them: router/apis.py). The client's bytes go
upstream unchanged (the offload prefill leg is the one rewritten body) through the pooled
backend client (router/upstream.py); the answer comes back byte for byte. A request whose
backend fails before any byte reached the client is retried once on another instance (a
second decision, reason ``retry``). A client that leaves cancels its request at once
(aiohttp's handler cancellation); its tickets are released and its outcome is ``client_gone``.
The router's own errors are answered in the client API's shape. A Responses request naming a
``previous_response_id`` goes only to the instance that produced that response.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

from aiohttp import web

from router import limits, priority
from router.answer import send_whole
from router.apis import APIS, RESPONSES, Api, ResponseStore, response_id
from router.features import decode_leg_body, prefill_leg_body
from router.forward import StreamScan, cached_tokens, completion_tokens, upstream_head, upstream_headers, usage_of
from router.http import error_response, read_body, refusal
from router.lifecycle import (ALL_FULL, Action, Admitted, Arrived, ClientGone, Counted, Ended, FirstToken,
                              LegFailed, LegSent, Lifecycle, PrefillAnswered, Refuse, Wait)
from router.pipeline import CLIENT_GONE, ERROR, OK, PREFILL, TIMEOUT, UPSTREAM_ERROR, Flow
from router.request import BadRequest
from router.upstream import ConnectFailed, UpstreamError

if TYPE_CHECKING:  # typing only: router/state.py imports this module's app
    from router.state import RouterState

log = logging.getLogger("kvtop.route")

#: A client write that finds this much already queued waits at most --client-timeout.
_WRITE_HIGH_WATER = 64 * 1024


def handlers(state_key, store: ResponseStore | None = None) -> dict[str, Any]:
    """The data-plane handlers by path, bound to the app key holding the RouterState. They
    share one ResponseStore (response id -> instance) for ``previous_response_id``."""
    store = store if store is not None else ResponseStore()

    def bind(api: Api):
        async def handler(request: web.Request) -> web.StreamResponse:
            return await serve(request, request.app[state_key], api, store)
        handler.__name__ = api.name
        return handler

    return {api.path: bind(api) for api in APIS.values()}


def direct_handlers(state: RouterState, store: ResponseStore) -> dict[str, Any]:
    """The same handlers bound to ``state`` itself, for router/app.py's data-plane dispatch
    (which skips the application's URL dispatcher, so a request there has no ``request.app``)."""

    def bind(api: Api):
        async def handler(request: web.Request) -> web.StreamResponse:
            return await serve(request, state, api, store)
        handler.__name__ = api.name
        return handler

    return {api.path: bind(api) for api in APIS.values()}


async def serve(request: web.Request, state: RouterState, api: Api,
                store: ResponseStore | None) -> web.StreamResponse:
    """``handle``, with a bug answered plainly in the client's own error shape."""
    try:
        resp = await handle(request, state, api, store)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:  # a bug: said plainly, in the client's own error shape
        log.exception("internal error on %s %s", request.method, request.path)
        resp = error_response(500, "internal router error", err_type="InternalServerError")
    return api.reshape(resp)


async def handle(request: web.Request, state: RouterState, api: Api, store: ResponseStore | None = None) -> web.StreamResponse:
    """Refuse early (before reading the body), parse, then route and forward."""
    pipe = state.pipeline
    t_recv = pipe.clock()  # ONE receive time: every latency of this request counts from here
    cfg = state.config
    if state.draining:
        return error_response(503, "the router is shutting down", headers={"Retry-After": "1"})
    if (busy := limits.admit(state)) is not None:
        return busy
    held = request.content_length or 0  # (a property that parses the header on every read)
    if (busy := limits.body_room(state, held)) is not None:
        return busy
    state.body_bytes += held  # the body's bytes are the router's from here to the answer's end

    def reserve(n: int) -> None:
        """A body without a Content-Length is counted as it arrives, and refused like one
        whose length said too much (else chunked bodies would pass the bound)."""
        nonlocal held
        if limits.over_body_room(state, n, own=held):
            state.counts["rejected"] = state.counts.get("rejected", 0) + 1
            raise BadRequest(limits.body_room_message(state), status=503)
        held += n
        state.body_bytes += n

    try:
        raw = await read_body(request, cfg.client_timeout_s, reserve)
        state.body_bytes += len(raw) - held
        held = len(raw)
        return await _route(request, state, api, t_recv, raw, store)
    except BadRequest as exc:
        state.counts["bad_requests"] += 1
        return refusal(exc)
    finally:
        state.body_bytes -= held
        state.memory.body_done(held, state.body_bytes)


async def _route(request: web.Request, state: RouterState, api: Api, t_recv: float, raw: bytes,
                 store: ResponseStore | None) -> web.StreamResponse:
    """Perform the lifecycle's actions (router/lifecycle.py) for one request over HTTP."""
    life = state.lifecycle
    feats = state.features
    # A returning turn may be routed on its prefix's count and its new text's estimate while
    # the worker tokenizes that text (router/parsing.py); offload and admission plan with the
    # prefill's size before the request goes, so with either on the router waits for the count.
    early = feats.admission == "off" and feats.offload_mode == "off"
    body, req = await state.parser.parse(raw, api.name, request.headers, early=early)
    pinned = _pinned(state, req, store)
    if state.draining:
        return error_response(503, "the router is shutting down", headers={"Retry-After": "1"})
    if (busy := limits.admit(state)) is not None:  # again: others were admitted while this body arrived
        return busy
    state.counts["requests"] += 1
    flow = life.receive(req, t_recv)
    if req.counting is not None:
        req.counting.add_done_callback(lambda fut: _counted(life, flow, fut))
    act = life.step(flow, Arrived(pinned))
    sent, sent_body = raw, body  # what this attempt sends: the client's bytes, or the decode leg's
    while True:
        if isinstance(act, Refuse):
            return _refusal(state, act, req, pinned)
        if act.new_attempt:
            if flow.decision.attempt > 1:
                state.counts["retries"] += 1
            # the router's priority for vLLM, spliced into what goes upstream (the client's own
            # kept); raw and body stay the client's, for a retry
            sent, sent_body = priority.apply(flow.decision, raw, body)
        try:
            if isinstance(act, Wait):
                flow.waiter = asyncio.get_running_loop().create_future()
                try:
                    await flow.waiter
                finally:
                    flow.waiter = None
                act = life.step(flow, Admitted())
                continue
            if act.leg.kind == PREFILL:
                life.step(flow, LegSent())
                sent_body = state.parser.body(sent, sent_body)
                params, why = await _prefill_leg(state, act.leg.instance, request, sent_body, api.path,
                                                 req.request_id)
                if params is not None:
                    sent = json.dumps(decode_leg_body(sent_body, params)).encode()
                else:
                    log.warning("prefill leg on %s failed (%s); prefilling on %s",
                                state.cluster.instances[act.leg.instance].name, why, flow.decision.instance_name)
                act = life.step(flow, PrefillAnswered(params))
                continue
        except BaseException:
            life.step(flow, ClientGone("before the answer began"))
            raise
        resp, act = await _forward(request, state, flow, sent, api, store)
        if resp is not None:
            return resp


def _refusal(state: RouterState, act: Refuse, req, pinned: tuple[int, ...]) -> web.Response:
    if act.reason == ALL_FULL:
        return limits.all_full(state)
    state.counts["no_instance"] += 1
    msg = act.message
    if pinned:
        msg = (f"previous_response_id {req.previous_response_id} is stored on instance "
               f"{_pin_name(state, pinned)}, which cannot take requests now ({msg})")
    # x-should-retry: false, so that a client shows this at once (Claude Code retries an
    # overloaded answer for minutes; router/apis.py answers this one as api_error)
    return error_response(act.status, msg, headers={"Retry-After": "1", "x-should-retry": "false"})


def _counted(life: Lifecycle, flow: Flow, fut: asyncio.Future) -> None:
    """The worker counted a request that was routed on its estimate."""
    exc = None if fut.cancelled() else fut.exception()
    if fut.cancelled() or exc is not None:
        log.warning("request %s: counting its new text failed (%r); its records keep the estimate",
                    flow.request.request_id, exc)
        life.step(flow, Counted(None))
    else:
        life.step(flow, Counted(fut.result()))


def _pinned(state: RouterState, req, store: ResponseStore | None) -> tuple[int, ...]:
    """Every instance but the one holding ``previous_response_id`` (none when unknown); the
    request also takes that response's session, so the chain counts as one session."""
    if not req.previous_response_id or store is None:
        return ()
    held = store.get(req.previous_response_id)
    if held is None:
        return ()
    instance, session_id = held
    if req.session_source in ("first_block", ""):
        req.session_id, req.session_source = session_id, "previous_response"
    return tuple(i for i in range(len(state.cluster.instances)) if i != instance)


def _pin_name(state: RouterState, pinned: tuple[int, ...]) -> str:
    free = [inst.name for i, inst in enumerate(state.cluster.instances) if i not in pinned]
    return free[0] if free else "?"


async def _prefill_leg(state: RouterState, p_index: int, request, body: dict, path: str,
                       request_id: str) -> tuple[dict | None, str | None]:
    """POST the prefill-only request to P; return (its kv_transfer_params, None) or (None, why)."""
    inst = state.cluster.instances[p_index]
    # the same id on both legs, as vLLM's P/D proxy does; the body is ours, so is its type
    headers = [(k, v) for k, v in upstream_headers(request.headers, request_id) if k.lower() != "content-type"]
    headers.append(("Content-Type", "application/json"))
    cfg = state.config
    try:
        async with asyncio.timeout(cfg.first_byte_timeout_s):  # one token: its answer is quick
            up = await state.upstream.request(inst.url, "POST", path, headers,
                                              json.dumps(prefill_leg_body(body)).encode(),
                                              total_timeout=cfg.total_timeout_s)
        async with up:
            data = await up.read()
            if up.status != 200:
                return None, f"HTTP {up.status}"
        params = json.loads(data).get("kv_transfer_params")
    except (UpstreamError, TimeoutError, ValueError, AttributeError) as exc:
        return None, f"{type(exc).__name__}: {exc}"[:200]
    if not isinstance(params, dict) or not params:
        return None, "the prefill response has no kv_transfer_params"
    return params, None


async def _write(resp: web.StreamResponse, chunk: bytes, transport, timeout_s: float | None) -> None:
    """Write to the client; a client that stops reading may hold us at most ``timeout_s``."""
    # a write can only block (the transport pauses) once its buffer passes the high-water mark
    if timeout_s and transport is not None and transport.get_write_buffer_size() + len(chunk) >= _WRITE_HIGH_WATER:
        try:
            async with asyncio.timeout(timeout_s):
                await resp.write(chunk)
        except TimeoutError:
            raise ConnectionResetError(f"the client read nothing for {timeout_s:g} s") from None
    else:
        await resp.write(chunk)


def _failure_status(exc: BaseException) -> str:
    """An upstream that stopped answering in time is a ``timeout``; anything else failed."""
    return TIMEOUT if isinstance(exc, TimeoutError) else UPSTREAM_ERROR


async def _forward(request: web.Request, state: RouterState, flow: Flow, raw: bytes, api: Api,
                   store: ResponseStore | None) -> tuple[web.StreamResponse | None, Action]:
    """The serve leg, reported to the lifecycle as it ends: (the client's response, None), or
    (None, the lifecycle's next action) after a failure it retries."""
    life = state.lifecycle
    end: dict[str, Any] = {"status": ERROR, "retry": False}  # filled in as we learn how it ends
    try:
        resp = await _serve_leg(request, state, flow, raw, api, store, end, can_retry=life.may_retry(flow))
    finally:
        status, retry = end.pop("status"), end.pop("retry")
        if retry:
            act = life.step(flow, LegFailed(status, end.get("error"), end.get("http_status")))
        else:
            life.step(flow, Ended(status, **end))
    return (None, act) if retry else (resp, None)


async def _serve_leg(request: web.Request, state: RouterState, flow: Flow, raw: bytes, api: Api,
                     store: ResponseStore | None, end: dict[str, Any], *,
                     can_retry: bool) -> web.StreamResponse | None:
    """Send ``raw`` to the decision's instance and relay the answer; ``end`` says how it ended
    (None returned: it failed before any byte reached the client, and may be retried)."""
    life = state.lifecycle
    d = flow.decision
    cluster = state.cluster
    inst = cluster.instances[d.instance]
    req = d.request
    cfg = state.config
    path = api.path
    headers = upstream_head(request.raw_headers, req.request_id)
    reply_headers = {"X-Kvtop-Instance": d.instance_name, "X-Kvtop-Request-Id": req.request_id,
                     "X-Kvtop-Policy": d.slot.label}
    scan: StreamScan | None = None
    resp: web.StreamResponse | None = None
    transport = request.transport
    try:
        # a stream's head comes at once from vLLM: a backend that accepts and never answers is
        # caught after --first-byte-timeout, not --read-timeout
        on_sent = lambda: life.step(flow, LegSent())  # noqa: E731
        up = await state.upstream.request(inst.url, "POST", path, headers, raw, total_timeout=cfg.total_timeout_s,
                                          head_timeout=cfg.first_byte_timeout_s if req.stream else None,
                                          on_sent=on_sent)
        async with up:
            end["http_status"] = up.status
            if up.status != 200:
                data = await up.read(limit=cfg.max_answer_bytes)
                end["error"] = data[:500].decode("utf-8", "replace")
                if up.status >= 500:  # the instance failed (outlier detection counts it)
                    end["status"] = UPSTREAM_ERROR
                    if can_retry:
                        end["retry"] = True
                        return None
                # the client gets the backend's own status and error body
                ctype = up.headers.get("Content-Type", "application/json")
                resp = web.Response(body=data, status=up.status, headers={**reply_headers, "Content-Type": ctype})
                await resp.prepare(request)
                await resp.write_eof()
                return resp
            if not req.stream:
                # the connection goes back to the pool after the client's write (``async with``),
                # off the answer's path; at once when the write may wait for the client to read
                data = await up.read(limit=cfg.max_answer_bytes, release=False)
                if len(data) >= _WRITE_HIGH_WATER:
                    up.release()
                resp = await send_whole(request, 200, {**reply_headers, "Content-Type": up.headers.get(
                    "Content-Type", "application/json")}, data)
                # the client has its answer: the bookkeeping below is off its path
                life.step(flow, FirstToken(observed=False))
                _remember(store, api, data, d)
                usage = usage_of(data)
                end.update(status=OK, output_tokens=completion_tokens(usage),
                           cached_tokens=cached_tokens(usage))
                return resp
            resp = web.StreamResponse(headers={**reply_headers, "Content-Type": up.headers.get(
                "Content-Type", "text/event-stream"), "Cache-Control": "no-cache"})
            await resp.prepare(request)
            scan = StreamScan(api.token_re, api.done_re)
            try:
                async for chunk in up.iter_chunks():
                    if scan.feed(chunk):
                        life.step(flow, FirstToken())
                        _remember(store, api, scan.head, d)
                    await _write(resp, chunk, transport, cfg.client_timeout_s)
            except (UpstreamError, TimeoutError) as exc:
                end["status"] = _failure_status(exc)
                end["error"] = f"upstream failed mid-stream: {exc!r}"[:500]
                await resp.write(api.stream_error(502, f"upstream instance {d.instance_name} failed mid-stream"))
                await resp.write_eof()
                return resp
            if scan.finish():
                life.step(flow, FirstToken())
            if not scan.first_token:
                _remember(store, api, scan.head, d)
            _stream_done(end, scan)
            try:
                await resp.write_eof()
            except ConnectionResetError:
                pass  # every event, [DONE] included, was written; a client may leave without the terminator
            return resp
    except (UpstreamError, TimeoutError) as exc:
        end["status"] = _failure_status(exc)
        end["error"] = f"{type(exc).__name__}: {exc}"[:500]
        if isinstance(exc, ConnectFailed) and state.health is not None:
            state.health.passive_down(d.instance, exc)
        if can_retry and (resp is None or not resp.prepared):
            end["retry"] = True
            return None
        if resp is not None and resp.prepared:
            return resp
        return error_response(502, f"upstream instance {d.instance_name} failed: {type(exc).__name__}",
                              headers=reply_headers)
    except (ConnectionResetError, asyncio.CancelledError):
        if scan is not None and scan.saw_done and end["status"] != OK:
            _stream_done(end, scan)  # [DONE] reached the client: the answer is complete
        elif end["status"] != OK:
            end.update(status=CLIENT_GONE, error="client disconnected")
        raise


def _remember(store: ResponseStore | None, api: Api, head: bytes, d) -> None:
    """A Responses answer: note which instance holds it (for a later previous_response_id)."""
    if store is not None and api is RESPONSES:
        rid = response_id(head)
        if rid is not None:
            store.put(rid, (d.instance, d.request.session_id))


def _stream_done(end: dict[str, Any], scan: StreamScan) -> None:
    usage = scan.usage()
    out = completion_tokens(usage)
    end.update(status=OK, output_tokens=scan.data_events if out is None else out,
               cached_tokens=cached_tokens(usage))
