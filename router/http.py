"""The HTTP edge's shared pieces: OpenAI-shaped JSON errors, the error middleware, and
request bodies read within the client timeout and parsed as JSON."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Callable

import orjson
from aiohttp import web

from router.body import Chunks, as_bytes
from router.deadlines import body_deadlines
from router.request import BadRequest

log = logging.getLogger("kvtop.route")

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                404: "NotFoundError", 405: "MethodNotAllowed", 408: "RequestTimeout",
                413: "RequestTooLarge", 429: "RateLimitError", 502: "BadGateway",
                503: "ServiceUnavailableError", 504: "GatewayTimeout"}


def error_body(status: int, message: str, *, param: str | None = None,
               err_type: str | None = None) -> dict[str, Any]:
    """An OpenAI-shaped error object."""
    return {"error": {"message": message, "type": err_type or _ERROR_TYPES.get(status, "APIError"),
                      "param": param, "code": status}}


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
    except Exception:  # a bug: say so plainly, keep serving
        log.exception("internal error on %s %s", request.method, request.path)
        return error_response(500, "internal router error", err_type="InternalServerError")


def dumps(obj: Any) -> str:
    """Compact JSON text for the control API and the event stream: orjson, 3-5x json's speed
    on decision lists and snapshots (unknown types as str, integer keys allowed)."""
    return orjson.dumps(obj, default=str, option=orjson.OPT_NON_STR_KEYS).decode()


def parse_json(raw: bytes) -> Any:
    """A request body parsed as JSON; BadRequest (400) otherwise.

    orjson first (0.29 ms for an 800 KB agentic body, json's 0.50 ms); what it refuses goes
    through json, which accepts a little more (integers past 64 bits, NaN) and words the error."""
    if not raw:
        raise BadRequest("the request body is empty; expected a JSON object")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise BadRequest("the request body is not valid UTF-8") from None
    except (ValueError, RecursionError) as exc:  # RecursionError: arrays nested thousands deep
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None


def refusal(exc: BadRequest) -> web.Response:
    """The JSON answer to a request we will not route. After a 408, 413 or 503 the rest of the
    body may be unread, so the connection closes behind the answer; a 503 says when to retry."""
    resp = error_response(exc.status, exc.message, param=exc.param,
                          headers={"Retry-After": "1"} if exc.status == 503 else None)
    if exc.status in (408, 413, 503):
        resp.force_close()
    return resp


#: Bodies with a Content-Length from this size on are kept as the chunks they arrived in.
_BIG_READ = 1 << 20


async def _read_big(request: web.Request, n: int) -> Chunks:
    """A large body with a known length, kept as its chunks (aiohttp would grow a bytearray
    chunk by chunk and then copy it whole into bytes: two passes over 60 MB on the event loop).
    A body that is not ``n`` bytes is a 400."""
    chunks: list[bytes] = []
    got = 0
    content = request.content
    while True:
        chunk = await content.readany()
        if not chunk:
            break
        got += len(chunk)
        if got > n:
            raise BadRequest("the request body is longer than its Content-Length")
        chunks.append(chunk)
    if got != n:
        raise BadRequest(f"the request body ended after {got:,} of {n:,} bytes")
    return Chunks(chunks, got)


async def _read_unsized(request: web.Request, limit: int, reserve: Callable[[int], None]) -> bytes | Chunks:
    """A body without a Content-Length (chunked): each chunk is passed to ``reserve`` as it
    arrives (which raises BadRequest to refuse it), so that the router's bound on the bodies it
    holds at once counts it while it arrives, not only after; past ``limit`` bytes it is a 413."""
    chunks: list[bytes] = []
    got = 0
    content = request.content
    while chunk := await content.readany():
        got += len(chunk)
        if got > limit:
            raise BadRequest(f"the request body is larger than the router's limit of {limit:,} bytes "
                             "(--max-body-mb)", status=413)
        reserve(len(chunk))
        chunks.append(chunk)
    return Chunks(chunks, got) if got >= _BIG_READ else b"".join(chunks)


async def read_body(request: web.Request, timeout_s: float | None,
                    reserve: Callable[[int], None] | None = None) -> bytes | Chunks:
    """The request body within ``timeout_s`` (a slow or stalled client gets a 408); a body over
    the app's ``client_max_size`` is a 413, refused before reading when its length says so.
    A body of ``_BIG_READ`` bytes or more comes back as ``Chunks``. ``reserve``, when given, is
    called with the size of each piece of a body without a Content-Length as it arrives."""
    limit = request.client_max_size
    n = request.content_length
    if n is not None and n > limit:
        raise BadRequest(f"the request body ({n:,} bytes) is larger than the "
                         f"router's limit of {limit:,} bytes (--max-body-mb)", status=413)
    content = request.content
    deadlines = None
    try:
        if content.is_eof():  # the whole body is already here: taken at once, not by read()'s loop
            raw = content.read_nowait()
            if len(raw) > limit:
                raise BadRequest(f"the request body is larger than the router's limit of {limit:,} bytes "
                                 "(--max-body-mb)", status=413)
            return raw
        if timeout_s:  # one timer for every body on its way (router/deadlines.py), not one each
            deadlines = body_deadlines()
            deadlines.add(content, timeout_s, lambda: BadRequest(
                f"the request body did not arrive within {timeout_s:g} s", status=408))
        if n is None and reserve is not None:
            return await _read_unsized(request, limit, reserve)
        if n is not None and n >= _BIG_READ:
            return await _read_big(request, n)
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BadRequest(f"the request body is larger than the router's limit of {limit:,} bytes "
                         "(--max-body-mb)", status=413) from None
    finally:
        if deadlines is not None:
            deadlines.discard(content)


async def read_json(request: web.Request, timeout_s: float | None) -> tuple[bytes, Any]:
    """The body, raw and parsed; BadRequest (400, 408 or 413) otherwise."""
    raw = as_bytes(await read_body(request, timeout_s))
    return raw, parse_json(raw)
