"""The routes around the data plane that real clients call but that route no generation:

* ``POST /v1/messages/count_tokens``: Anthropic's token count of a Messages body,
  ``{"input_tokens": N}``, counted by the router itself as it counts a request it routes (exact
  with ``--tokenizer``: the model's chat template and tokenizer, as vLLM would; the text
  approximation otherwise). No instance is asked.
* ``GET`` / ``DELETE /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``: sent to the
  instance that stored that response (vLLM keeps it in that instance's memory), as a request
  naming it as ``previous_response_id`` is; an id the router does not know is looked for on each
  healthy instance in turn. The instance's answer is relayed as it is.
* ``HEAD`` / ``GET /`` (Claude Code probes its base URL before the first request): 200.
* Any other path: 404 in the shape of the API family the path belongs to (Anthropic's under
  ``/v1/messages``, OpenAI's elsewhere), 405 where the path exists but not the method.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from router.apis import MESSAGES, ResponseStore
from router.forward import upstream_headers
from router.http import error_response, parse_json, read_body, refusal
from router.request import BadRequest

if TYPE_CHECKING:  # pragma: no cover
    from router.state import RouterState
from router.upstream import UpstreamError

log = logging.getLogger("kvtop.route")

#: Where each stored response lives: shared with the data plane (router/proxy.py handlers).
RESPONSE_STORE = web.AppKey("kvtop_response_store", ResponseStore)
#: A relayed answer to retrieve / delete / cancel is at most this big.
_MAX_ANSWER_BYTES = 16 * 1024 * 1024
_TIMEOUT_S = 30.0
#: The catch-all route, registered last (unknown() skips it when it looks for other methods).
_CATCH_ALL = "/{tail:.*}"


def setup(app: web.Application, state_key, store: ResponseStore) -> None:
    """Register the routes (router/app.py), after the data plane's own."""
    app[RESPONSE_STORE] = store

    async def count_tokens(request: web.Request) -> web.Response:
        return await _count_tokens(request, request.app[state_key])

    async def response_op(request: web.Request) -> web.StreamResponse:
        return await _response_op(request, request.app[state_key], request.app[RESPONSE_STORE])

    r = app.router
    r.add_post("/v1/messages/count_tokens", count_tokens)
    r.add_get("/v1/responses/{response_id}", response_op)
    r.add_delete("/v1/responses/{response_id}", response_op)
    r.add_post("/v1/responses/{response_id}/cancel", response_op)
    r.add_get("/", root)  # aiohttp answers HEAD on a GET route
    r.add_route("*", _CATCH_ALL, unknown)


async def root(request: web.Request) -> web.Response:
    """The base URL itself: 200, so a client's connectivity probe (``HEAD /``) passes."""
    return web.json_response({"service": "kvtop", "apis": ["/v1/messages", "/v1/responses",
                                                           "/v1/chat/completions", "/v1/completions"]})


async def unknown(request: web.Request) -> web.Response:
    """404 in the shape of the path's API family; 405 (with ``Allow``) where another route
    serves the path with other methods."""
    path = request.path
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource.canonical == "/{tail}":  # _CATCH_ALL itself
            continue
        match, methods = await resource.resolve(request)
        if match is None and methods:
            allowed |= methods
    if allowed:
        status, message = 405, f"method {request.method} not allowed on {path}"
        headers = {"Allow": ",".join(sorted(allowed))}
    else:
        status, message, headers = 404, f"no route for {request.method} {path}", None
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return MESSAGES.error_response(status, message, headers=headers)
    return error_response(status, message, headers=headers)


async def _count_tokens(request: web.Request, state: RouterState) -> web.Response:
    """Anthropic's ``{"input_tokens": N}`` for a Messages body (``max_tokens`` not needed)."""
    try:
        raw = await read_body(request, state.config.client_timeout_s)
        if not isinstance(raw, (bytes, bytearray)):
            raw = b"".join(raw.parts)
        body = parse_json(raw)
        if isinstance(body, dict) and "max_tokens" not in body:
            body = {**body, "max_tokens": 1}  # count_tokens bodies carry none; the parser wants one
        _, req = await state.parser.parse(orjson.dumps(body), "messages", {}, early=False)
    except BadRequest as exc:
        return MESSAGES.reshape(refusal(exc))
    return web.json_response({"input_tokens": req.input_tokens},
                             headers={"X-Kvtop-Token-Source": req.token_source})


async def _response_op(request: web.Request, state: RouterState, store: ResponseStore) -> web.StreamResponse:
    """Relay a retrieve / delete / cancel to the instance holding the response."""
    rid = request.match_info["response_id"]
    insts = state.cluster.instances
    held = store.get(rid)
    if held is not None:
        order = [held[0]]
    else:  # not routed by this router (or forgotten): ask each healthy instance
        order = [i for i, inst in enumerate(insts) if inst.healthy]
    try:
        body = await read_body(request, state.config.client_timeout_s) if request.can_read_body else b""
    except BadRequest as exc:
        return refusal(exc)
    headers = upstream_headers(request.headers, "kvtop-" + uuid.uuid4().hex)
    path = request.rel_url.raw_path_qs
    last: web.Response | None = None
    for i in order:
        inst = insts[i]
        try:
            async with asyncio.timeout(_TIMEOUT_S):
                up = await state.upstream.request(inst.url, request.method, path, headers, body)
                async with up:
                    data = await up.read(limit=_MAX_ANSWER_BYTES)
        except (UpstreamError, TimeoutError, OSError) as exc:
            log.info("response %s: %s %s on %s failed: %s", rid, request.method, path, inst.name, exc)
            last = error_response(502, f"instance {inst.name} did not answer for response {rid}: {exc}")
            continue
        out = web.Response(body=data, status=up.status,
                           content_type=(up.headers.get("Content-Type") or "application/json").split(";")[0])
        if up.status == 404 and held is None:
            last = out
            continue  # maybe on another instance
        return out
    if last is not None:
        return last
    return error_response(503, "no healthy instance to ask for the response", headers={"Retry-After": "1"})


