"""The simulated vLLM's Anthropic Messages (``POST /v1/messages``) and OpenAI Responses
(``POST /v1/responses``) endpoints, with vLLM's shapes, over the same engine as chat.

Bodies are converted to chat messages and tools as vLLM converts them (the router's own
converter, router/prompts.py, which follows vllm/entrypoints/anthropic/serving.py and the
Responses API's input items), rendered as ChatML with the tools' JSON in the system turn and
tokenized with the simulator's tokenizer (router/sim_tokenizer.py render_messages: the router's
``--tokenizer kvtop-sim`` renders and counts them with the same function). Answers follow vLLM
0.32: Messages streams are ``message_start``, ``content_block_start``,
``content_block_delta``..., ``content_block_stop``,
``message_delta`` (usage: ``input_tokens`` net of ``cache_read_input_tokens``, as vLLM reports
them), ``message_stop``; errors are ``{"type": "error", "error": {...}}``. Responses streams are
``response.created`` ... ``response.output_text.delta``... ``response.completed`` (usage with
``input_tokens_details.cached_tokens``), each as ``event: TYPE`` + ``data: JSON``; a stored
response (``store``, default true) is kept in this instance's memory (bounded) and a request
naming another as ``previous_response_id`` gets its conversation prepended, or a 404 when this
instance does not hold it, as vLLM does. ``GET /v1/responses/{id}`` returns a stored response,
``DELETE`` forgets it, and ``POST /v1/responses/{id}/cancel`` stops a ``background`` one (which
is answered at once with status ``queued`` and generated while the client polls).

Where an answer ends, and whether it is a tool call, is kvtop/sim/answers.py's plan: a Messages
tool call is a ``tool_use`` block (``stop_reason: tool_use``), a Responses one a
``function_call`` output item; ``stop_sequences`` end a Messages answer with ``stop_sequence``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from typing import Any

from aiohttp import web

from kvtop.sim.answers import Answer, plan
from kvtop.sim.engine import EngineRejected, check_priority
from kvtop.sim.tokenizer import render_messages, tokenize

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
    app.router.add_get("/v1/responses/{response_id}", retrieve_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel_response)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {_dumps(data)}\n\n".encode()


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
               on_tokens, answer: Answer, *, background: bool = False,
               priority: Any = None) -> tuple[Any, int]:
    """Generate on the engine, to end where ``answer`` says; ``on_tokens(start, count)`` is
    awaited as tokens arrive (None for a non-streaming answer). Returns (the engine's
    FinishedRequest, output tokens). A ``background`` run has no client to lose. ``priority``:
    the body's, for vLLM's priority scheduling (checked as vLLM does)."""

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
            s = inst.submit(rid, 0, tokens, max_tokens, kv_params, event, answer,
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
            try:  # not wait_for: on 3.11 it swallows a cancel that meets the event (a background cancel)
                async with asyncio.timeout(0.5):
                    await event.wait()
            except TimeoutError:
                if not background and (request.transport is None or request.transport.is_closing()):
                    raise ConnectionResetError("client went away") from None
            event.clear()
        return s.finished, s.output
    finally:
        inst.server_load -= 1
        if s is not None and s.finished is None:
            inst.abort(rid)


def _max_tokens(body: dict, name: str, inst: Any = None, prompt_tokens: int = 0) -> int:
    v = body.get(name)
    if v is None and inst is not None and inst.output_lengths is not None:
        return max(1, inst.engine.max_model_len - prompt_tokens)  # vLLM's default: the rest of the context
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


def _stop_sequences(body: dict, name: str) -> list[str]:
    stop = body.get(name)
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        return stop
    raise ApiError(f"{name} must be a list of strings", param=name)


def _ignore_eos(body: dict) -> bool:
    v = body.get("ignore_eos")
    if v is not None and not isinstance(v, bool):
        raise ApiError("ignore_eos must be a boolean", param="ignore_eos")
    return bool(v)


def _anthropic_stop(answer: Answer, finished) -> str:
    reason = answer.finish(finished.finish_reason if finished else None)
    if reason == "tool_calls":
        return "tool_use"
    if reason == "stop":
        return "stop_sequence" if answer.stop_string is not None else "end_turn"
    return "max_tokens"


async def messages(request: web.Request) -> web.StreamResponse:

    inst = request.app[SIM]
    try:
        body, parsed = await _read(request, "messages")
        tokens = tokenize(render_messages(parsed.prompt.messages, parsed.prompt.tools))
        max_tokens = _max_tokens(body, "max_tokens")
        answer = plan(inst.output_lengths, tokens, max_tokens, ignore_eos=_ignore_eos(body),
                      stop=_stop_sequences(body, "stop_sequences"), tools=parsed.prompt.tools,
                      tool_choice=body.get("tool_choice"), messages=parsed.prompt.messages,
                      call_prefix="toolu_")
        msg_id = "msg_" + uuid.uuid4().hex[:24]
        if not parsed.stream:
            finished, n = await _run(request, tokens, max_tokens, body.get("kv_transfer_params"), None, answer,
                                     priority=body.get("priority"))
            cached = finished.num_cached_tokens if finished else 0
            reason = _anthropic_stop(answer, finished)
            text = answer.text(0, n)
            content = [{"type": "text", "text": text}] if text or reason != "tool_use" else []
            if reason == "tool_use":
                call = answer.tool_call
                content.append({"type": "tool_use", "id": call.call_id, "name": call.name,
                                "input": json.loads(call.arguments)})
            return web.json_response({
                "id": msg_id, "type": "message", "role": "assistant", "content": content,
                "model": inst.model, "stop_reason": reason,
                "stop_sequence": answer.stop_string if reason == "stop_sequence" else None,
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
        text = answer.text(start, count)
        if not text:
            return
        out = b""
        if not opened:
            out += _event("content_block_start", {"type": "content_block_start", "index": 0,
                                                  "content_block": {"type": "text", "text": ""}})
            opened = True
        out += _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                              "delta": {"type": "text_delta", "text": text}})
        await resp.write(out)

    try:
        finished, n = await _run(request, tokens, max_tokens, body.get("kv_transfer_params"), on_tokens, answer,
                                     priority=body.get("priority"))
    except ApiError as exc:
        await resp.write(_event("error", {"type": "error", "error": {"type": "api_error", "message": exc.message}}))
        await resp.write_eof()
        return resp
    cached = finished.num_cached_tokens if finished else 0
    reason = _anthropic_stop(answer, finished)
    tail = b""
    if opened:
        tail += _event("content_block_stop", {"type": "content_block_stop", "index": 0})
    if reason == "tool_use":
        call, index = answer.tool_call, 1 if opened else 0
        tail += _event("content_block_start", {"type": "content_block_start", "index": index, "content_block": {
            "type": "tool_use", "id": call.call_id, "name": call.name, "input": {}}})
        tail += _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                               "delta": {"type": "input_json_delta", "partial_json": call.arguments}})
        tail += _event("content_block_stop", {"type": "content_block_stop", "index": index})
    tail += _event("message_delta", {"type": "message_delta", "delta": {
        "stop_reason": reason, "stop_sequence": answer.stop_string if reason == "stop_sequence" else None},
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


class _Stored:
    """A stored response: its conversation (for ``previous_response_id``), its object as
    retrieve returns it, and for a ``background`` one the task generating it."""

    __slots__ = ("messages", "response", "task")

    def __init__(self, messages: list[dict], response: dict, task: asyncio.Task | None = None):
        self.messages, self.response, self.task = messages, response, task


def _keep(store: OrderedDict, rid: str, stored: _Stored) -> None:
    store[rid] = stored
    store.move_to_end(rid)
    while len(store) > STORED_RESPONSES:
        _, old = store.popitem(last=False)
        if old.task is not None:
            old.task.cancel()


async def responses(request: web.Request) -> web.StreamResponse:

    inst = request.app[SIM]
    store: OrderedDict = request.app[STORE]
    try:
        body, parsed = await _read(request, "responses")
        history: list[dict] = []
        prev = parsed.previous_response_id
        if prev is not None:
            if prev not in store or store[prev].response["status"] != "completed":
                raise ApiError(f"Response with id '{prev}' not found.", status=404, param="previous_response_id")
            history = store[prev].messages
        msgs = parsed.prompt.messages
        if history:  # the stored conversation, then this request's (its instructions first)
            system = [m for m in msgs[:1] if m["role"] == "system" and body.get("instructions") is not None]
            msgs = system + [m for m in history if m["role"] != "system"] + msgs[len(system):]
        tokens = tokenize(render_messages(msgs, parsed.prompt.tools))
        max_tokens = _max_tokens(body, "max_output_tokens", inst, len(tokens))
        answer = plan(inst.output_lengths, tokens, max_tokens, ignore_eos=_ignore_eos(body),
                      tools=parsed.prompt.tools, tool_choice=body.get("tool_choice"), messages=msgs)
        background = body.get("background") is True
        if background and (parsed.stream or body.get("store") is False):
            raise ApiError("background responses need store=true and no stream", param="background")
    except ApiError as exc:
        return _openai_error(exc)
    rid = "resp_" + uuid.uuid4().hex
    item_id = "msg_" + uuid.uuid4().hex[:24]
    fc_id = "fc_" + uuid.uuid4().hex[:24]
    created = int(time.time())

    def response_obj(status: str, output: list, usage: dict | None) -> dict:
        return {"id": rid, "created_at": created, "incomplete_details": None,
                "instructions": body.get("instructions"), "metadata": body.get("metadata"),
                "model": inst.model, "object": "response", "output": output, "parallel_tool_calls": True,
                "temperature": body.get("temperature"), "tool_choice": body.get("tool_choice", "auto"),
                "tools": body.get("tools") or [], "top_p": body.get("top_p"), "background": background,
                "max_output_tokens": max_tokens, "previous_response_id": prev, "status": status,
                "text": body.get("text"), "truncation": "disabled", "usage": usage, "user": None}

    def finish(finished, n: int) -> tuple[list[dict], dict]:
        cached = finished.num_cached_tokens if finished else 0
        usage = {"input_tokens": len(tokens), "input_tokens_details": {"cached_tokens": cached},
                 "output_tokens": n, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": len(tokens) + n}
        text = answer.text(0, n)
        called = answer.finish(finished.finish_reason if finished else None) == "tool_calls"
        output = []
        if text or not called:
            output.append({"id": item_id, "content": [{"annotations": [], "text": text, "type": "output_text",
                                                        "logprobs": None}],
                           "role": "assistant", "status": "completed", "type": "message"})
        said = {"role": "assistant", "content": text}
        if called:
            call = answer.tool_call
            output.append({"id": fc_id, "type": "function_call", "call_id": call.call_id, "name": call.name,
                           "arguments": call.arguments, "status": "completed"})
            said["tool_calls"] = [{"id": call.call_id, "type": "function",
                                   "function": {"name": call.name, "arguments": call.arguments}}]
        if body.get("store", True):
            _keep(store, rid, _Stored(msgs + [said], response_obj("completed", output, usage)))
        return output, usage

    if background:  # answered at once; generated while the client polls GET /v1/responses/{id}
        async def generate() -> None:
            stored.response["status"] = "in_progress"
            try:
                finished, n = await _run(request, tokens, max_tokens, body.get("kv_transfer_params"), None,
                                         answer, background=True, priority=body.get("priority"))
            except ApiError as exc:
                stored.response.update(status="failed", error={"code": "server_error", "message": exc.message})
                return
            except asyncio.CancelledError:
                stored.response["status"] = "cancelled"
                raise
            finally:
                stored.task = None
            if rid in store:  # not deleted meanwhile
                finish(finished, n)

        stored = _Stored(msgs, response_obj("queued", [], None))
        _keep(store, rid, stored)
        stored.task = asyncio.get_running_loop().create_task(generate())
        return web.json_response(stored.response)
    if not parsed.stream:
        try:
            finished, n = await _run(request, tokens, max_tokens, body.get("kv_transfer_params"), None, answer,
                                     priority=body.get("priority"))
        except ApiError as exc:
            return _openai_error(exc)
        output, usage = finish(finished, n)
        return web.json_response(response_obj("completed", output, usage))
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
        text = answer.text(start, count)
        if not text:
            return
        out = b""
        if not opened:
            out += ev({"type": "response.output_item.added", "output_index": 0, "item": {
                "id": item_id, "content": [], "role": "assistant", "status": "in_progress", "type": "message"}})
            out += ev({"type": "response.content_part.added", "output_index": 0, "item_id": item_id,
                       "content_index": 0, "part": {"annotations": [], "text": "", "type": "output_text"}})
            opened = True
        out += ev({"type": "response.output_text.delta", "output_index": 0, "item_id": item_id,
                   "content_index": 0, "delta": text, "logprobs": []})
        await resp.write(out)

    try:
        finished, n = await _run(request, tokens, max_tokens, body.get("kv_transfer_params"), on_tokens, answer,
                                     priority=body.get("priority"))
    except ApiError as exc:
        await resp.write(ev({"type": "error", "code": str(exc.status), "message": exc.message, "param": None}))
        await resp.write_eof()
        return resp
    output, usage = finish(finished, n)
    tail = b""
    for index, item in enumerate(output):
        if item["type"] == "message":
            if not opened:  # an empty answer still opens and closes its message
                tail += ev({"type": "response.output_item.added", "output_index": 0, "item": {
                    "id": item_id, "content": [], "role": "assistant", "status": "in_progress", "type": "message"}})
                tail += ev({"type": "response.content_part.added", "output_index": 0, "item_id": item_id,
                            "content_index": 0, "part": {"annotations": [], "text": "", "type": "output_text"}})
            tail += ev({"type": "response.output_text.done", "output_index": index, "item_id": item_id,
                        "content_index": 0, "text": item["content"][0]["text"], "logprobs": []})
            tail += ev({"type": "response.content_part.done", "output_index": index, "item_id": item_id,
                        "content_index": 0, "part": item["content"][0]})
        else:  # the function call, its arguments in one delta
            tail += ev({"type": "response.output_item.added", "output_index": index,
                        "item": {**item, "arguments": "", "status": "in_progress"}})
            tail += ev({"type": "response.function_call_arguments.delta", "output_index": index,
                        "item_id": fc_id, "delta": item["arguments"]})
            tail += ev({"type": "response.function_call_arguments.done", "output_index": index,
                        "item_id": fc_id, "arguments": item["arguments"]})
        tail += ev({"type": "response.output_item.done", "output_index": index, "item": item})
    tail += ev({"type": "response.completed", "response": response_obj("completed", output, usage)})
    await resp.write(tail)
    await resp.write_eof()
    return resp


def _held(request: web.Request) -> tuple[str, _Stored]:
    rid = request.match_info["response_id"]
    stored = request.app[STORE].get(rid)
    if stored is None:
        raise ApiError(f"Response with id '{rid}' not found.", status=404)
    return rid, stored


async def retrieve_response(request: web.Request) -> web.Response:
    """GET /v1/responses/{id}: the stored response as it stands (a background one's status
    moves queued -> in_progress -> completed | cancelled | failed)."""
    try:
        _, stored = _held(request)
    except ApiError as exc:
        return _openai_error(exc)
    return web.json_response(stored.response)


async def delete_response(request: web.Request) -> web.Response:
    """DELETE /v1/responses/{id}: forget it (stopping it first if it runs in the background)."""
    try:
        rid, stored = _held(request)
    except ApiError as exc:
        return _openai_error(exc)
    if stored.task is not None:
        stored.task.cancel()
    request.app[STORE].pop(rid, None)
    return web.json_response({"id": rid, "object": "response", "deleted": True})


async def cancel_response(request: web.Request) -> web.Response:
    """POST /v1/responses/{id}/cancel: stop a background response; one that already ended is
    returned as it is; a response that was not created in the background cannot be cancelled."""
    try:
        _, stored = _held(request)
        if not stored.response.get("background"):
            raise ApiError("Cannot cancel a synchronous response.")
    except ApiError as exc:
        return _openai_error(exc)
    task = stored.task
    if task is not None:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
    return web.json_response(stored.response)
