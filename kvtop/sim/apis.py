"""The simulated vLLM's Anthropic Messages (``POST /v1/messages``) and OpenAI Responses
(``POST /v1/responses``) endpoints, with vLLM's shapes, over the same engine as chat.

Bodies are converted to chat messages and tools as vLLM converts them (the router's own
converter, router/request.py, which follows vllm/entrypoints/anthropic/serving.py and the
Responses API's input items), rendered as ChatML with the tools' JSON in the system turn, and
tokenized with the simulator's tokenizer. Answers follow vLLM 0.32: Messages streams are
``message_start``, ``content_block_start``, ``content_block_delta``..., ``content_block_stop``,
``message_delta`` (usage: ``input_tokens`` net of ``cache_read_input_tokens``, as vLLM reports
them), ``message_stop``; errors are ``{"type": "error", "error": {...}}``. Responses streams are
``response.created`` ... ``response.output_text.delta``... ``response.completed`` (usage with
``input_tokens_details.cached_tokens``), each as ``event: TYPE`` + ``data: JSON``; a stored
response (``store``, default true) is kept in this instance's memory (bounded) and a request
naming another as ``previous_response_id`` gets its conversation prepended, or a 404 when this
instance does not hold it, as vLLM does.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from typing import Any

from aiohttp import web

from kvtop.sim.engine import EngineRejected, check_priority
from kvtop.sim.tokenizer import filler_text, render_chat, tokenize

#: Stored responses kept per instance (least recently stored out first).
STORED_RESPONSES = 10_000
STORE = web.AppKey("kvtop_sim_responses", OrderedDict)

_ANTHROPIC_TYPES = {400: "invalid_request_error", 404: "not_found_error", 500: "api_error"}


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


#: The instance an app serves, handed over by ``setup`` (this module does not import the
#: server module, which imports it).
SIM = web.AppKey("kvtop_sim_apis_instance", object)


def setup(app: web.Application, instance: Any) -> None:
    """Register both endpoints on one instance's app (kvtop/sim/server.py create_app)."""
    app[SIM] = instance
    app[STORE] = OrderedDict()
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/responses", responses)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {_dumps(data)}\n\n".encode()


def _chatml(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Chat messages with plain-string content for the simulator's ChatML renderer: tools as
    JSON lines in the system turn, tool calls as <tool_call> JSON (as Qwen's template does)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        content = content or ""
        for call in m.get("tool_calls") or ():
            fn = call.get("function") or {}
            content += f"\n<tool_call>\n{_dumps({'name': fn.get('name'), 'arguments': fn.get('arguments')})}\n</tool_call>"
        out.append({"role": m["role"], "content": content})
    if tools:
        listing = "\n".join(_dumps(t) for t in tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + f"\n\n# Tools\n<tools>\n{listing}\n</tools>"}
        else:
            out.insert(0, {"role": "system", "content": f"# Tools\n<tools>\n{listing}\n</tools>"})
    return out


async def _read(request: web.Request, endpoint: str):
    from router.request import BadRequest, read_body

    try:
        body = json.loads(await request.read())
        parsed = read_body(body, endpoint)
    except ValueError as exc:  # BadRequest is a ValueError; so is bad JSON
        if isinstance(exc, BadRequest):
            raise ApiError(exc.message, param=exc.param) from None
        raise ApiError(f"Invalid JSON body: {exc}") from None
    return body, parsed


async def _run(request: web.Request, tokens: list[int], max_tokens: int, kv_params: dict | None,
               on_tokens, priority: Any = None) -> tuple[Any, int]:
    """Generate on the engine; ``on_tokens(start, count)`` is awaited as tokens arrive (None for
    a non-streaming answer). Returns (the engine's FinishedRequest, output tokens)."""

    inst = request.app[SIM]
    if len(tokens) + max_tokens > inst.engine.max_model_len:
        raise ApiError(f"This model's maximum context length is {inst.engine.max_model_len} tokens. "
                       f"However, you requested {len(tokens) + max_tokens} tokens.")
    event = asyncio.Event()
    rid = uuid.uuid4().hex
    inst.server_load += 1
    s = None
    try:
        try:
            s = inst.submit(rid, 0, tokens, max_tokens, kv_params, event,
                            check_priority(priority, inst.engine.scheduling_policy))
        except EngineRejected as exc:
            raise ApiError(str(exc)) from None
        sent = 0
        while s.finished is None or sent < s.output:
            if s.output > sent and on_tokens is not None:
                n = s.output
                await on_tokens(sent, n - sent)
                sent = n
                if inst.stream_interval_s and s.finished is None:
                    await asyncio.sleep(inst.stream_interval_s)
                continue
            if on_tokens is None and s.finished is not None:
                break
            try:
                await asyncio.wait_for(event.wait(), 0.5)
            except TimeoutError:
                if request.transport is None or request.transport.is_closing():
                    raise ConnectionResetError("client went away") from None
            event.clear()
        return s.finished, s.output
    finally:
        inst.server_load -= 1
        if s is not None and s.finished is None:
            inst.abort(rid)


def _max_tokens(body: dict, name: str) -> int:
    v = body.get(name)
    if v is None:
        return 16
    if type(v) is not int or v < 1:
        raise ApiError(f"{name} must be at least 1, got {_dumps(v)}", param=name)
    return v


# --- Anthropic Messages --------------------------------------------------------------------------

def _anthropic_error(exc: ApiError) -> web.Response:
    return web.json_response({"type": "error", "error": {
        "type": _ANTHROPIC_TYPES.get(exc.status, "api_error"), "message": exc.message}}, status=exc.status)


def _anthropic_usage(prompt: int, cached: int, output: int) -> dict:
    return {"input_tokens": max(0, prompt - cached), "cache_read_input_tokens": cached, "output_tokens": output}


async def messages(request: web.Request) -> web.StreamResponse:

    inst = request.app[SIM]
    try:
        body, parsed = await _read(request, "messages")
        max_tokens = _max_tokens(body, "max_tokens")
        tokens = tokenize(render_chat(_chatml(parsed.prompt.messages, parsed.prompt.tools)))
        msg_id = "msg_" + uuid.uuid4().hex[:24]
        if not parsed.stream:
            finished, n = await _run(request, tokens, max_tokens, body.get("kv_transfer_params"), None,
                                     body.get("priority"))
            cached = finished.num_cached_tokens if finished else 0
            reason = "max_tokens" if finished is None or finished.finish_reason == "length" else "end_turn"
            return web.json_response({
                "id": msg_id, "type": "message", "role": "assistant",
                "content": [{"type": "text", "text": filler_text(0, n)}], "model": inst.model,
                "stop_reason": reason, "stop_sequence": None,
                "usage": _anthropic_usage(len(tokens), cached, n)})
    except ApiError as exc:
        return _anthropic_error(exc)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    await resp.write(_event("message_start", {"type": "message_start", "message": {
        "id": msg_id, "type": "message", "role": "assistant", "content": [], "model": inst.model,
        "stop_reason": None, "stop_sequence": None, "usage": _anthropic_usage(len(tokens), 0, 0)}}))
    opened = False

    async def on_tokens(start: int, count: int) -> None:
        nonlocal opened
        out = b""
        if not opened:
            out += _event("content_block_start", {"type": "content_block_start", "index": 0,
                                                  "content_block": {"type": "text", "text": ""}})
            opened = True
        out += _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                              "delta": {"type": "text_delta", "text": filler_text(start, count)}})
        await resp.write(out)

    try:
        finished, n = await _run(request, tokens, max_tokens, body.get("kv_transfer_params"), on_tokens,
                                     body.get("priority"))
    except ApiError as exc:
        await resp.write(_event("error", {"type": "error", "error": {"type": "api_error", "message": exc.message}}))
        await resp.write_eof()
        return resp
    cached = finished.num_cached_tokens if finished else 0
    reason = "max_tokens" if finished is None or finished.finish_reason == "length" else "end_turn"
    tail = b""
    if opened:
        tail += _event("content_block_stop", {"type": "content_block_stop", "index": 0})
    tail += _event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": None},
                                     "usage": _anthropic_usage(len(tokens), cached, n)})
    tail += _event("message_stop", {"type": "message_stop"})
    await resp.write(tail)
    await resp.write_eof()
    return resp


# --- OpenAI Responses ------------------------------------------------------------------------------

def _openai_error(exc: ApiError) -> web.Response:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(exc.status, "InternalServerError")
    return web.json_response({"error": {"message": exc.message, "type": kind, "param": exc.param,
                                        "code": exc.status}}, status=exc.status)


async def responses(request: web.Request) -> web.StreamResponse:

    inst = request.app[SIM]
    store: OrderedDict = request.app[STORE]
    try:
        body, parsed = await _read(request, "responses")
        max_tokens = _max_tokens(body, "max_output_tokens")
        history: list[dict] = []
        prev = parsed.previous_response_id
        if prev is not None:
            if prev not in store:
                raise ApiError(f"Response with id '{prev}' not found.", status=404, param="previous_response_id")
            history = store[prev]
        msgs = parsed.prompt.messages
        if history:  # the stored conversation, then this request's (its instructions first)
            system = [m for m in msgs[:1] if m["role"] == "system" and body.get("instructions") is not None]
            msgs = system + [m for m in history if m["role"] != "system"] + msgs[len(system):]
        tokens = tokenize(render_chat(_chatml(msgs, parsed.prompt.tools)))
    except ApiError as exc:
        return _openai_error(exc)
    rid = "resp_" + uuid.uuid4().hex
    item_id = "msg_" + uuid.uuid4().hex[:24]
    created = int(time.time())

    def response_obj(status: str, output: list, usage: dict | None) -> dict:
        return {"id": rid, "created_at": created, "incomplete_details": None,
                "instructions": body.get("instructions"), "metadata": body.get("metadata"),
                "model": inst.model, "object": "response", "output": output, "parallel_tool_calls": True,
                "temperature": body.get("temperature"), "tool_choice": body.get("tool_choice", "auto"),
                "tools": body.get("tools") or [], "top_p": body.get("top_p"), "background": False,
                "max_output_tokens": max_tokens, "previous_response_id": prev, "status": status,
                "text": body.get("text"), "truncation": "disabled", "usage": usage, "user": None}

    def finish(finished, n: int) -> tuple[dict, dict]:
        cached = finished.num_cached_tokens if finished else 0
        usage = {"input_tokens": len(tokens), "input_tokens_details": {"cached_tokens": cached},
                 "output_tokens": n, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": len(tokens) + n}
        message = {"id": item_id, "content": [{"annotations": [], "text": filler_text(0, n), "type": "output_text",
                                                "logprobs": None}],
                   "role": "assistant", "status": "completed", "type": "message"}
        if body.get("store", True):
            store[rid] = msgs + [{"role": "assistant", "content": filler_text(0, n)}]
            while len(store) > STORED_RESPONSES:
                store.popitem(last=False)
        return message, usage

    if not parsed.stream:
        try:
            finished, n = await _run(request, tokens, max_tokens, body.get("kv_transfer_params"), None,
                                     body.get("priority"))
        except ApiError as exc:
            return _openai_error(exc)
        message, usage = finish(finished, n)
        return web.json_response(response_obj("completed", [message], usage))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    seq = 0

    def ev(data: dict) -> bytes:
        nonlocal seq
        data = {**data, "sequence_number": seq}
        seq += 1
        return _event(data["type"], data)

    await resp.write(ev({"type": "response.created", "response": response_obj("in_progress", [], None)})
                     + ev({"type": "response.in_progress", "response": response_obj("in_progress", [], None)}))
    opened = False

    async def on_tokens(start: int, count: int) -> None:
        nonlocal opened
        out = b""
        if not opened:
            out += ev({"type": "response.output_item.added", "output_index": 0, "item": {
                "id": item_id, "content": [], "role": "assistant", "status": "in_progress", "type": "message"}})
            out += ev({"type": "response.content_part.added", "output_index": 0, "item_id": item_id,
                       "content_index": 0, "part": {"annotations": [], "text": "", "type": "output_text"}})
            opened = True
        out += ev({"type": "response.output_text.delta", "output_index": 0, "item_id": item_id,
                   "content_index": 0, "delta": filler_text(start, count), "logprobs": []})
        await resp.write(out)

    try:
        finished, n = await _run(request, tokens, max_tokens, body.get("kv_transfer_params"), on_tokens,
                                     body.get("priority"))
    except ApiError as exc:
        await resp.write(ev({"type": "error", "code": str(exc.status), "message": exc.message, "param": None}))
        await resp.write_eof()
        return resp
    message, usage = finish(finished, n)
    text = message["content"][0]["text"]
    tail = b""
    if opened:
        tail += ev({"type": "response.output_text.done", "output_index": 0, "item_id": item_id,
                    "content_index": 0, "text": text, "logprobs": []})
        tail += ev({"type": "response.content_part.done", "output_index": 0, "item_id": item_id,
                    "content_index": 0, "part": message["content"][0]})
        tail += ev({"type": "response.output_item.done", "output_index": 0, "item": message})
    tail += ev({"type": "response.completed", "response": response_obj("completed", [message], usage)})
    await resp.write(tail)
    await resp.write_eof()
    return resp
