"""The simulated vLLM HTTP server: vLLM's OpenAI API, /metrics and peer probes over one Engine.

Each instance is one aiohttp application driving one ``Engine`` from an asyncio task: step
while there is work, sleep ``duration / speed`` wall seconds per step, then hand out what the
step produced. Engine time is ``wall * speed`` while the host keeps up; when it cannot (very
high ``--speed``), engine time simply runs slower and every latency stays engine-consistent.
A stream gets one SSE event per engine step that gave it tokens, as vLLM sends one per token;
``stream_interval_ms`` > 0 coalesces them into at most one event per interval (speed runs).
Handlers only translate between HTTP and the engine; all serving behaviour is the engine's.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from aiohttp import web

from kvtop.sim.engine import Engine, EngineRejected, EngineRequest, FinishedRequest, check_priority
from kvtop.sim.metrics import CONTENT_TYPE, SimMetrics
from kvtop.sim import apis, truth
from kvtop.sim.answers import RUN_TO_MAX, Answer, OutputLengths, plan
from kvtop.sim.tokenizer import render_messages, token_strs, tokenize
from router.blocks import hash_token_blocks

SIM_VERSION = "0.11.0+kvtop.sim"
DEFAULT_MAX_TOKENS = 16


class BadRequest(Exception):
    """Answered as OpenAI's 400 ``{"error": {...}}``."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


def error_response(message: str, *, status: int = 400, err_type: str = "BadRequestError",
                   param: str | None = None) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": err_type, "param": param, "code": status}},
        status=status)


class _Stream:
    """One engine request as its HTTP handler waits on it."""

    __slots__ = ("request_id", "index", "prompt_tokens", "max_tokens", "arrival", "output",
                 "last_token_time", "finished", "event", "answer")

    def __init__(self, request_id: str, index: int, prompt_tokens: int, max_tokens: int,
                 arrival: float, event: asyncio.Event):
        self.request_id = request_id
        self.index = index
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.arrival = arrival
        self.output = 0
        self.last_token_time: float | None = None
        self.finished: FinishedRequest | None = None
        self.event = event
        self.answer: Answer = RUN_TO_MAX


class SimInstance:
    """One simulated vLLM: an engine, its driver task, its metrics and its HTTP identity."""

    def __init__(self, engine: Engine, *, model: str, host: str = "127.0.0.1", port: int = 8100,
                 speed: float = 1.0, stream_interval_ms: float = 0.0, engine_label: str = "0",
                 output_lengths: OutputLengths | None = None):
        if speed <= 0:
            raise ValueError("speed must be positive")
        self.engine = engine
        self.model = model
        self.host = host
        self.port = port
        self.speed = speed
        self.stream_interval_s = max(0.0, stream_interval_ms) / 1000.0
        self.metrics = SimMetrics(engine, model, engine_label)
        self.metrics.busy_ratio_fn = lambda: self.engine.busy_ratio(self.engine_clock())
        self.server_load = 0
        self._streams: dict[str, _Stream] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._step_end: float | None = None
        self._w0 = 0.0
        self._v0 = 0.0
        self.kv_publisher = None  # kvtop/sim/kv_publisher.KvEventPublisher when KV events are on
        # where answers end (kvtop/sim/answers.py); None: every answer runs to max_tokens
        self.output_lengths = output_lengths

    # ---------------------------------------------------------------- clock and driver

    def virtual_now(self) -> float:
        return self._v0 + (time.monotonic() - self._w0) * self.speed

    def engine_clock(self) -> float:
        """Engine time now: wall x speed, but never past the end of the step in flight."""
        v = self.virtual_now()
        return v if self._step_end is None or v < self._step_end else self._step_end

    async def start(self) -> None:
        self._w0 = time.monotonic()
        self._v0 = 0.0
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._drive(), name=f"kvtop-sim-engine-{self.port}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _drive(self) -> None:
        engine = self.engine
        speed = self.speed
        wake = self._wake
        assert wake is not None
        t: float | None = None        # start of the next step while busy back-to-back
        while True:
            if not engine.has_work():
                t = None
                wake.clear()
                await wake.wait()
                continue
            res = engine.step(self.virtual_now() if t is None else t)
            if res.idle:
                t = None
                nxt = engine.next_event_time()
                wake.clear()
                if nxt is None:
                    await wake.wait()
                else:
                    delay = (nxt - self.virtual_now()) / speed
                    try:
                        await asyncio.wait_for(wake.wait(), max(delay, 0.0))
                    except TimeoutError:
                        pass
                continue
            self._step_end = res.end_time
            delay = (res.end_time - self.virtual_now()) / speed
            await asyncio.sleep(delay if delay > 0 else 0)
            self._step_end = None
            t = res.end_time
            self._publish(res)

    def _publish(self, res) -> None:
        kv = self.kv_publisher
        if kv is not None:
            kv.flush()
            for f in res.finished:
                kv.forget(f.request_id)
        streams = self._streams
        metrics = self.metrics
        end = res.end_time
        metrics.h_iteration.observe(res.num_scheduled_tokens)
        for rid in res.first_token:
            s = streams.get(rid)
            if s is not None:
                metrics.h_ttft.observe(end - s.arrival)
        itl = metrics.h_itl
        for rid, n in res.emitted.items():
            s = streams.get(rid)
            if s is None:
                continue
            if s.last_token_time is not None:
                itl.observe(end - s.last_token_time)
            s.last_token_time = end
            s.output = n
            s.event.set()
        for f in res.finished:
            s = streams.pop(f.request_id, None)
            metrics.observe_finished(f, s.max_tokens if s else f.num_output_tokens)
            if s is not None:
                s.output = f.num_output_tokens
                s.finished = f
                s.event.set()

    # ---------------------------------------------------------------- requests

    def submit(self, request_id: str, index: int, tokens: list[int], max_tokens: int,
               kv_transfer_params: dict | None, event: asyncio.Event,
               answer: Answer = RUN_TO_MAX, priority: int = 0) -> _Stream:
        """Queue one prompt on the engine, to end where ``answer`` says (kvtop/sim/answers.py);
        raises EngineRejected (answered as 400). ``priority``: the body's, checked by
        ``priority_of``."""
        arrival = self.engine_clock()
        hashes = hash_token_blocks(tokens, self.engine.block_size)
        if self.kv_publisher is not None:
            self.kv_publisher.remember(request_id, tokens, hashes)
        self.engine.add_request(EngineRequest(request_id, len(tokens), hashes, max_tokens, arrival,
                                              kv_transfer_params=kv_transfer_params,
                                              stop_at=answer.stop_at, priority=priority))
        s = _Stream(request_id, index, len(tokens), max_tokens, arrival, event)
        s.answer = answer
        self._streams[request_id] = s
        assert self._wake is not None
        self._wake.set()
        return s

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if self.kv_publisher is not None:
            self.kv_publisher.forget(request_id)
        self.engine.abort(request_id, self.engine_clock())

    def transfer_params(self, f: FinishedRequest) -> dict | None:
        if f.kv_transfer_params is None:
            return None
        params = dict(f.kv_transfer_params)
        params["remote_host"] = self.host
        params["remote_port"] = self.port
        return params


INSTANCE = web.AppKey("kvtop_sim_instance", SimInstance)


# -------------------------------------------------------------------- request parsing

async def _read_json(request: web.Request) -> dict:
    try:
        body = await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        # RecursionError: arrays nested thousands deep (was a plain-text 500)
        raise BadRequest(f"Invalid JSON body: {exc!s:.200}") from None
    if not isinstance(body, dict):
        raise BadRequest("Request body must be a JSON object")
    return body


def _is_int_list(v: Any) -> bool:
    return isinstance(v, list) and all(type(t) is int and t >= 0 for t in v)


def _too_long_to_tokenize(text: str, max_model_len: int) -> bool:
    """True when ``text`` certainly has more than ``max_model_len`` tokens, known without
    tokenizing it: every piece but a whitespace run covers at most 12 non-space characters
    (a ChatML special token; words are cut at 6 letters; kvtop/sim/tokenizer.py), so tokens >=
    non-space characters / 12. A 20 MB prompt is refused in milliseconds instead of being
    tokenized on the event loop first."""
    if len(text) <= 12 * max_model_len:
        return False
    spaces = text.count(" ") + text.count("\n") + text.count("\t") + text.count("\r")
    return (len(text) - spaces) / 12 > max_model_len


def _prompts_of(body: dict, chat: bool, max_model_len: int | None = None) -> list[list[int]]:
    """Token ids of every prompt in a completion or chat request."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list of messages", "messages")
        add_gen = body.get("add_generation_prompt", True)
        try:
            # tools and tool calls rendered as for /v1/messages and the router's --tokenizer kvtop-sim
            text = render_messages(messages, body.get("tools"), add_generation_prompt=bool(add_gen))
        except ValueError as exc:
            raise BadRequest(str(exc), "messages") from None
        _check_text_length(text, max_model_len)
        return [tokenize(text)]
    if "prompt" not in body or body["prompt"] is None:
        raise BadRequest("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    prompt = body["prompt"]
    for text in ([prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else []):
        if isinstance(text, str):
            _check_text_length(text, max_model_len)
    if isinstance(prompt, str):
        prompts = [tokenize(prompt)]
    elif isinstance(prompt, list) and prompt:
        if _is_int_list(prompt):
            prompts = [prompt]
        elif all(isinstance(p, str) for p in prompt):
            prompts = [tokenize(p) for p in prompt]
        elif all(_is_int_list(p) for p in prompt):
            prompts = [list(p) for p in prompt]
        else:
            raise BadRequest("'prompt' must be a string, a list of token ids, or a list of either",
                             "prompt")
    else:
        raise BadRequest("'prompt' must be a string, a list of token ids, or a list of either",
                         "prompt")
    if any(len(p) == 0 for p in prompts):
        raise BadRequest("The prompt cannot be empty.", "prompt")
    return prompts


def _check_text_length(text: str, max_model_len: int | None) -> None:
    if max_model_len is not None and _too_long_to_tokenize(text, max_model_len):
        raise BadRequest(f"This model's maximum context length is {max_model_len} tokens. However, "
                         f"the prompt ({len(text):,} characters) has more than that.", "input_tokens")


def _max_tokens_of(body: dict, chat: bool) -> int:
    value = body.get("max_tokens")
    if value is None and chat:
        value = body.get("max_completion_tokens")
    if value is None:
        return DEFAULT_MAX_TOKENS
    if type(value) is not int or value < 1:
        raise BadRequest("max_tokens must be at least 1, got " + json.dumps(value), "max_tokens")
    return value


def priority_of(body: dict, engine: Engine) -> int:
    """The body's ``priority``, as vLLM takes it (``kvtop.sim.engine.check_priority``)."""
    try:
        return check_priority(body.get("priority"), engine.scheduling_policy)
    except EngineRejected as exc:
        raise BadRequest(str(exc), "priority") from None


def _check_sampling(body: dict) -> tuple[bool, bool, dict | None]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    include_usage = bool(opts and opts.get("include_usage"))
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise BadRequest("the simulator supports only n=1", "n")
    params = body.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise BadRequest("'kv_transfer_params' must be an object", "kv_transfer_params")
    for key in ("ignore_eos",):
        if key in body and body[key] is not None and not isinstance(body[key], bool):
            raise BadRequest(f"'{key}' must be a boolean", key)
    return stream, include_usage, params


def stop_strings(body: dict, key: str = "stop") -> list[str]:
    """The request's stop strings (a string or a list of them); BadRequest otherwise."""
    stop = body.get(key)
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        return stop
    raise BadRequest(f"'{key}' must be a string or a list of strings", key)


# -------------------------------------------------------------------- generation

def _usage(streams: list[_Stream]) -> dict:
    prompt = sum(s.prompt_tokens for s in streams)
    completion = sum(s.output for s in streams)
    cached = sum(s.finished.num_cached_tokens if s.finished else 0 for s in streams)
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion, "prompt_tokens_details": {"cached_tokens": cached}}


def _connection_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    inst = request.app[INSTANCE]
    body = await _read_json(request)
    prompts = _prompts_of(body, chat, inst.engine.max_model_len)
    max_tokens = _max_tokens_of(body, chat)
    stream, include_usage, kv_params = _check_sampling(body)
    stop = stop_strings(body)
    tools = body.get("tools") if chat and isinstance(body.get("tools"), list) else None
    priority = priority_of(body, inst.engine)
    if chat and len(prompts) != 1:
        raise BadRequest("chat requests carry one conversation")
    if chat and inst.output_lengths is not None and body.get("max_tokens") is None \
            and body.get("max_completion_tokens") is None:
        max_tokens = max(1, inst.engine.max_model_len - len(prompts[0]))  # vLLM's: the rest of the context
    if kv_params and kv_params.get("do_remote_decode"):
        max_tokens = 1
    for p in prompts:
        if len(p) + max_tokens > inst.engine.max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {inst.engine.max_model_len} tokens. "
                f"However, you requested {len(p) + max_tokens} tokens ({len(p)} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages or "
                f"completion.", "input_tokens")

    base_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    event = asyncio.Event()
    streams: list[_Stream] = []
    inst.server_load += 1
    try:
        try:
            for i, tokens in enumerate(prompts):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                answer = plan(inst.output_lengths, tokens, max_tokens, ignore_eos=bool(body.get("ignore_eos")),
                              stop=stop, tools=tools, tool_choice=body.get("tool_choice"),
                              messages=body.get("messages") if chat else None)
                streams.append(inst.submit(rid, i, tokens, max_tokens, kv_params, event, answer, priority))
        except EngineRejected as exc:
            raise BadRequest(str(exc), "input_tokens") from None
        if stream:
            return await _stream_response(request, inst, chat, base_id, created, streams, event,
                                          include_usage)
        while not all(s.finished for s in streams):
            try:
                await asyncio.wait_for(event.wait(), 0.5)
            except TimeoutError:
                pass
            event.clear()
            if _connection_gone(request):
                raise ConnectionResetError("client went away")
        return web.json_response(_full_response(inst, chat, base_id, created, streams))
    finally:
        inst.server_load -= 1
        for s in streams:
            if s.finished is None:
                inst.abort(s.request_id)


def _full_response(inst: SimInstance, chat: bool, base_id: str, created: int,
                   streams: list[_Stream]) -> dict:
    choices = []
    for s in streams:
        answer = s.answer
        text = answer.text(0, s.output)
        reason = answer.finish(s.finished.finish_reason if s.finished else None)
        if chat:
            calls = [_chat_call(answer)] if reason == "tool_calls" else []
            choices.append({"index": s.index,
                            "message": {"role": "assistant", "content": text if text or not calls else None,
                                        "refusal": None, "annotations": None, "audio": None,
                                        "function_call": None, "tool_calls": calls,
                                        "reasoning_content": None},
                            "logprobs": None, "finish_reason": reason, "stop_reason": answer.stop_string})
        else:
            choices.append({"index": s.index, "text": text, "logprobs": None, "finish_reason": reason,
                            "stop_reason": answer.stop_string, "prompt_logprobs": None})
    params = None
    if len(streams) == 1 and streams[0].finished is not None:
        params = inst.transfer_params(streams[0].finished)
    return {"id": base_id, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": inst.model, "choices": choices,
            "service_tier": None, "system_fingerprint": None, "usage": _usage(streams),
            "prompt_logprobs": None, "kv_transfer_params": params}


async def _stream_response(request: web.Request, inst: SimInstance, chat: bool, base_id: str,
                           created: int, streams: list[_Stream], event: asyncio.Event,
                           include_usage: bool) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    obj = "chat.completion.chunk" if chat else "text_completion"
    model = inst.model

    def chunk(choices: list[dict], usage: dict | None = None) -> bytes:
        payload: dict[str, Any] = {"id": base_id, "object": obj, "created": created,
                                   "model": model, "choices": choices}
        if usage is not None or include_usage:
            payload["usage"] = usage
        return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

    if chat:
        first = [{"index": s.index, "delta": {"role": "assistant", "content": ""},
                  "logprobs": None, "finish_reason": None} for s in streams]
        await resp.write(chunk(first))
    sent = [0] * len(streams)
    closed = [False] * len(streams)
    interval = inst.stream_interval_s
    while not all(closed):
        try:
            await asyncio.wait_for(event.wait(), 0.5)
        except TimeoutError:
            if _connection_gone(request):
                raise ConnectionResetError("client went away") from None
            continue
        event.clear()
        out = []
        for k, s in enumerate(streams):
            if closed[k] or (s.output <= sent[k] and s.finished is None):
                continue
            answer = s.answer
            text = answer.text(sent[k], s.output - sent[k])
            sent[k] = s.output
            reason = answer.finish(s.finished.finish_reason) if s.finished is not None else None
            closed[k] = reason is not None
            stop_reason = answer.stop_string if reason is not None else None
            if chat and reason == "tool_calls":
                call = _chat_call(answer)
                if text:
                    out.append(chunk([{"index": s.index, "delta": {"content": text}, "logprobs": None,
                                       "finish_reason": None}]))
                head = {**call, "function": {"name": call["function"]["name"], "arguments": ""}}
                out.append(chunk([{"index": s.index, "delta": {"tool_calls": [{"index": 0, **head}]},
                                   "logprobs": None, "finish_reason": None}]))
                args = {"index": 0, "function": {"arguments": call["function"]["arguments"]}}
                c = {"index": s.index, "delta": {"tool_calls": [args]}, "logprobs": None,
                     "finish_reason": reason, "stop_reason": None}
            elif chat:
                delta = {"content": text} if text else {}
                c = {"index": s.index, "delta": delta, "logprobs": None, "finish_reason": reason,
                     "stop_reason": stop_reason}
            else:
                c = {"index": s.index, "text": text, "logprobs": None, "finish_reason": reason,
                     "stop_reason": stop_reason}
            out.append(chunk([c]))
        if out:
            await resp.write(b"".join(out))   # ConnectionResetError aborts via the finally
        if interval and not all(closed):
            await asyncio.sleep(interval)
    tail = b""
    if include_usage:
        tail += chunk([], _usage(streams))
    await resp.write(tail + b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _chat_call(answer: Answer) -> dict:
    call = answer.tool_call
    assert call is not None
    return {"id": call.call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


# -------------------------------------------------------------------- handlers

async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def models(request: web.Request) -> web.Response:
    inst = request.app[INSTANCE]
    return web.json_response({"object": "list", "data": [{
        "id": inst.model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
        # the "weights" it loaded are this simulator: --tokenizer auto finds its tokenizer by it
        "root": "kvtop-sim", "parent": None, "max_model_len": inst.engine.max_model_len,
        "permission": []}]})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def tokenize_handler(request: web.Request) -> web.Response:
    inst = request.app[INSTANCE]
    body = await _read_json(request)
    if "messages" in body:
        tokens = _prompts_of(body, chat=True)[0]
        text = None
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise BadRequest("'prompt' must be a string", "prompt")
        tokens, text = tokenize(prompt), prompt
    strs = token_strs(text) if text is not None and body.get("return_token_strs") else None
    return web.json_response({"count": len(tokens), "max_model_len": inst.engine.max_model_len,
                              "tokens": tokens, "token_strs": strs})


async def completions_render(request: web.Request) -> web.Response:
    inst = request.app[INSTANCE]
    body = await _read_json(request)
    prompts = _prompts_of(body, chat=False)
    max_tokens = _max_tokens_of(body, chat=False)
    base = "cmpl-" + uuid.uuid4().hex
    return web.json_response([
        {"request_id": base if len(prompts) == 1 else f"{base}-{i}", "token_ids": p,
         "sampling_params": {"max_tokens": max_tokens}, "model": inst.model}
        for i, p in enumerate(prompts)])


async def chat_render(request: web.Request) -> web.Response:
    inst = request.app[INSTANCE]
    body = await _read_json(request)
    tokens = _prompts_of(body, chat=True)[0]
    return web.json_response({"request_id": "chatcmpl-" + uuid.uuid4().hex, "token_ids": tokens,
                              "sampling_params": {"max_tokens": _max_tokens_of(body, True)},
                              "model": inst.model})


async def server_info(request: web.Request) -> web.Response:
    inst = request.app[INSTANCE]
    e = inst.engine
    p = e.profile
    return web.json_response({
        "model_path": inst.model, "served_model_name": inst.model, "tokenizer_path": inst.model,
        "version": SIM_VERSION, "max_model_len": e.max_model_len, "context_length": e.max_model_len,
        "block_size": e.block_size, "page_size": e.block_size, "num_gpu_blocks": e.num_gpu_blocks,
        "max_num_seqs": e.max_num_seqs, "max_running_requests": e.max_num_seqs,
        "max_num_batched_tokens": e.max_num_batched_tokens, "tp_size": 1, "dp_size": 1,
        "disaggregation_mode": "null",
        "kvtop_sim": {"profile": p.name, "estimated": p.estimated, "speed": inst.speed,
                      "engine_id": e.engine_id}})


async def model_info(request: web.Request) -> web.Response:
    inst = request.app[INSTANCE]
    return web.json_response({"model_path": inst.model, "tokenizer_path": inst.model,
                              "is_generation": True, "preferred_sampling_params": None,
                              "weight_version": "default", "has_image_understanding": False,
                              "has_audio_understanding": False, "model_type": "kvtop-sim",
                              "architectures": ["KvtopSimulatedEngine"]})


async def kv_event_sources(request: web.Request) -> web.Response:
    """vLLM's ``GET /kv_event_sources``: the KV-event publisher, as the engine bound it (a bare
    array, one entry per data-parallel rank; [] without KV events)."""
    pub = request.app[INSTANCE].kv_publisher
    if pub is None:
        return web.json_response([])
    return web.json_response([{"data_parallel_rank": 0, "endpoint": pub.endpoint,
                               "replay_endpoint": pub.replay_endpoint, "topic": ""}])


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": SIM_VERSION})


async def load(request: web.Request) -> web.Response:
    return web.json_response({"server_load": request.app[INSTANCE].server_load})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[INSTANCE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


@web.middleware
async def openai_errors(request: web.Request, handler):
    try:
        return await handler(request)
    except BadRequest as exc:
        return error_response(exc.message, param=exc.param)


def create_app(instance: SimInstance) -> web.Application:
    """The aiohttp app of one instance; its engine driver runs for the app's lifetime."""
    app = web.Application(middlewares=[openai_errors], client_max_size=64 * 1024 * 1024)
    app[INSTANCE] = instance

    async def engine_task(app: web.Application):
        if instance.kv_publisher is not None:
            await instance.kv_publisher.start()
        await instance.start()
        yield
        await instance.stop()
        if instance.kv_publisher is not None:
            await instance.kv_publisher.stop()

    app.cleanup_ctx.append(engine_task)
    r = app.router
    r.add_post("/v1/completions", completions)
    r.add_post("/v1/chat/completions", chat_completions)
    r.add_post("/v1/completions/render", completions_render)
    r.add_post("/v1/chat/completions/render", chat_render)
    r.add_post("/tokenize", tokenize_handler)
    r.add_get("/v1/models", models)
    r.add_get("/health", health)
    r.add_get("/metrics", metrics)
    r.add_get("/version", version)
    r.add_get("/kv_event_sources", kv_event_sources)
    r.add_get("/load", load)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, server_info)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, model_info)
    apis.setup(app, instance)  # /v1/messages and /v1/responses
    truth.install(app, instance)  # GET /kvtop/sim/truth: the engine's account of each request
    return app


async def serve(instances: list[SimInstance], *, duration: float | None = None,
                on_ready=None) -> None:
    """Run every instance on its host:port in this event loop until ``duration`` or cancel."""
    runners: list[web.AppRunner] = []
    try:
        for inst in instances:
            runner = web.AppRunner(create_app(inst), access_log=None, handle_signals=False)
            await runner.setup()
            runners.append(runner)
            site = web.TCPSite(runner, inst.host, inst.port)
            await site.start()
            if inst.port == 0:
                server = getattr(site, "_server", None)
                if server is not None and server.sockets:
                    inst.port = server.sockets[0].getsockname()[1]
        if on_ready is not None:
            on_ready(instances)
        if duration is not None:
            await asyncio.sleep(duration)
        else:
            await asyncio.Event().wait()
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
