"""The four client APIs the data plane serves, and what differs between them on the wire.

=============  =========================  ======================================  ==================
api            path                       first token (a stream event carrying)    stream ends with
=============  =========================  ======================================  ==================
completions    POST /v1/completions       non-empty ``text``                       ``data: [DONE]``
chat           POST /v1/chat/completions  non-empty ``content`` / reasoning        ``data: [DONE]``
messages       POST /v1/messages          ``content_block_delta``: non-empty        ``message_stop``
                                          ``text`` / ``partial_json`` / thinking
responses      POST /v1/responses         ``response.*.delta``: non-empty delta    ``response.completed``
=============  =========================  ======================================  ==================

Errors are answered in the client's own shape: OpenAI's ``{"error": {"message", "type",
"param", "code"}}`` for completions, chat and responses, Anthropic's ``{"type": "error",
"error": {"type", "message"}}`` for messages (vLLM's anthropic/api_router.py answers the same
shape; the type names are Anthropic's). Usage is read the same way for all four: output tokens
from ``completion_tokens`` | ``output_tokens``; delivered cached tokens from
``prompt_tokens_details.cached_tokens`` (chat, completions), ``input_tokens_details.cached_tokens``
(responses) or ``cache_read_input_tokens`` (messages).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from router.http import error_body

# The closing event of each stream, at the start of a line (inside generated text a newline is
# escaped, so text can never match these).
_OPENAI_DONE = re.compile(rb"(?:^|\n)data:\s*\[DONE\]")
_MESSAGES_DONE = re.compile(rb'(?:^|\n)(?:event:\s*message_stop|data:\s*\{"type":\s*"message_stop")')
_RESPONSES_DONE = re.compile(
    rb'(?:^|\n)(?:event:\s*response\.(?:completed|incomplete|failed)'
    rb'|data:\s*\{"type":\s*"response\.(?:completed|incomplete|failed)")')

# A data event with a non-empty piece of output. Chat opens with an empty-content role delta,
# messages with ``"text":""`` in content_block_start, responses with ``"text":""`` parts:
# none of those count.
_OPENAI_TOKEN = re.compile(rb'"(?:text|content|reasoning_content|reasoning)":\s*"(?!")')
_MESSAGES_TOKEN = re.compile(rb'"(?:text|partial_json|thinking)":\s*"(?!")')
_RESPONSES_TOKEN = re.compile(rb'"delta":\s*"(?!")')

#: The response id in a Responses answer (the first ``"id"`` of response.created, or the body's).
_RESPONSE_ID = re.compile(rb'"id":\s*"(resp_[^"\\]{1,200})"')

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors); a router that
# is full or has no instance answers overloaded_error, which Claude Code retries.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                    429: "rate_limit_error", 500: "api_error", 502: "api_error",
                    503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


@dataclass(frozen=True, slots=True)
class Api:
    name: str  # completions | chat | messages | responses (RouteRequest.endpoint)
    path: str
    token_re: re.Pattern
    done_re: re.Pattern
    anthropic: bool = False

    def error_body(self, status: int, message: str, *, param: str | None = None,
                   err_type: str | None = None) -> dict[str, Any]:
        if self.anthropic:
            return {"type": "error", "error": {"type": err_type or _ANTHROPIC_TYPES.get(status, "api_error"),
                                               "message": message}}
        return error_body(status, message, param=param, err_type=err_type)

    def error_response(self, status: int, message: str, *, param: str | None = None,
                       headers: dict[str, str] | None = None, err_type: str | None = None) -> web.Response:
        return web.json_response(self.error_body(status, message, param=param, err_type=err_type),
                                 status=status, headers=headers)

    def stream_error(self, status: int, message: str) -> bytes:
        """An error event that ends a stream the upstream broke off. The blank line first ends
        whatever partial event the upstream left behind."""
        if self.anthropic:
            return (b"\n\nevent: error\ndata: " + json.dumps(self.error_body(status, message)).encode()
                    + b"\n\n")
        if self.name == "responses":
            ev = {"type": "error", "code": str(status), "message": message, "param": None}
            return b"\n\nevent: error\ndata: " + json.dumps(ev).encode() + b"\n\n"
        return b"\n\ndata: " + json.dumps(error_body(status, message)).encode() + b"\n\n"

    def reshape(self, resp: web.StreamResponse) -> web.StreamResponse:
        """The router's own (OpenAI-shaped, not yet sent) error answer, in this API's shape.
        Answers relayed from an instance are already in its shape and are never touched."""
        if not self.anthropic or resp.status < 400 or resp.prepared or not isinstance(resp, web.Response):
            return resp
        try:
            err = json.loads(resp.body)["error"]
            message = err["message"]
        except (TypeError, ValueError, KeyError):
            return resp
        if not isinstance(err, dict) or err.get("code") != resp.status:
            return resp  # not one of ours (our errors carry the status as their code)
        headers = {k: v for k, v in resp.headers.items()
                   if k.lower() not in ("content-type", "content-length")}
        # no instance can take it (x-should-retry: false): not "overloaded", which Claude Code
        # retries silently for minutes (measured: 9 attempts in 150 s), but an error it shows
        final = resp.headers.get("x-should-retry") == "false"
        out = self.error_response(resp.status, str(message), headers=headers,
                                  err_type="api_error" if final else None)
        if not resp.keep_alive and resp.keep_alive is not None:
            out.force_close()
        return out


COMPLETIONS = Api("completions", "/v1/completions", _OPENAI_TOKEN, _OPENAI_DONE)
CHAT = Api("chat", "/v1/chat/completions", _OPENAI_TOKEN, _OPENAI_DONE)
MESSAGES = Api("messages", "/v1/messages", _MESSAGES_TOKEN, _MESSAGES_DONE, anthropic=True)
RESPONSES = Api("responses", "/v1/responses", _RESPONSES_TOKEN, _RESPONSES_DONE)
APIS = {a.name: a for a in (COMPLETIONS, CHAT, MESSAGES, RESPONSES)}


def response_id(data: bytes) -> str | None:
    """The ``resp_...`` id in a Responses answer's first bytes (JSON body or stream head)."""
    m = _RESPONSE_ID.search(data, 0, 65536)
    return m.group(1).decode() if m else None


class ResponseStore:
    """Where each recent Responses answer was produced: response id -> (instance index, session).

    vLLM keeps a stored response in the instance's memory, so a request naming it as
    ``previous_response_id`` can only be served there: the router sends it nowhere else.
    Bounded (least recently used out first); an id it no longer knows routes as usual.
    """

    def __init__(self, capacity: int = 100_000):
        self.capacity = capacity
        self._where: OrderedDict[str, tuple[int, str]] = OrderedDict()

    def put(self, response_id: str, where: tuple[int, str]) -> None:
        self._where[response_id] = where
        self._where.move_to_end(response_id)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def get(self, response_id: str) -> tuple[int, str] | None:
        i = self._where.get(response_id)
        if i is not None:
            self._where.move_to_end(response_id)
        return i

    def __len__(self) -> int:
        return len(self._where)
