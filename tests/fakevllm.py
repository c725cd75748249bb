"""A small fake vLLM for router tests: vLLM's response shapes, scripted behaviour.

Serves completions, chat, Anthropic Messages (``/v1/messages``: vLLM's event sequence
message_start, content_block_start, content_block_delta..., content_block_stop, message_delta,
message_stop) and the Responses API (``/v1/responses``: response.created ...
response.output_text.delta ... response.completed, stored responses for
``previous_response_id``, 404 for one it does not hold). Streams one SSE event per token like
vLLM, reports usage with cached tokens (a prompt's cached share is the part seen before on this
instance, rounded down to 16-token blocks; text prompts count 4 characters a token), and can be
told to fail: refuse (500), drop mid-stream, or delay.
"""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

CLOSED_PORT = 9  # discard: nothing listens there on a test machine


class FakeVLLM:
    def __init__(self, name: str = "fake", *, token_delay: float = 0.0, first_delay: float = 0.0):
        self.name = name
        self.token_delay = token_delay
        self.first_delay = first_delay
        self.fail_status: int | None = None
        self.drop_after: int | None = None  # tokens sent before the connection is cut
        self.linger_after_done = 0.0  # seconds between [DONE] and the end of the stream
        self.seen: list[dict] = []
        self.raw: list[bytes] = []
        self.prefixes: set[tuple] = set()
        self.text_prefixes: set[int] = set()
        self.stored: dict[str, dict] = {}  # response id -> its request (previous_response_id)
        self.streams: list[bytes] = []  # every Messages/Responses stream's bytes, as sent
        self._ids = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)  # vLLM takes large prompts
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    def _cached(self, prompt) -> int:
        if not isinstance(prompt, list) or (prompt and not isinstance(prompt[0], int)):
            return 0  # text, or chat messages: no token ids to match
        hit = 0
        for end in range(16, len(prompt), 16):
            if tuple(prompt[:end]) in self.prefixes:
                hit = end
        for end in range(16, len(prompt) + 1, 16):
            self.prefixes.add(tuple(prompt[:end]))
        return hit

    async def completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.raw.append(raw)
        body = json.loads(raw)
        self.seen.append({"body": body, "headers": dict(request.headers)})
        if self.fail_status:
            return web.json_response({"error": {"message": "boom", "type": "InternalServerError",
                                                "code": self.fail_status}}, status=self.fail_status)
        prompt = body.get("prompt", body.get("messages"))
        n_prompt = len(prompt) if isinstance(prompt, list) else len(str(prompt)) // 4
        cached = self._cached(prompt)
        n_out = body.get("max_tokens") or 4
        chat = "messages" in body
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        await asyncio.sleep(self.first_delay)
        if not body.get("stream"):
            await asyncio.sleep(self.token_delay * n_out)
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": "x" * n_out},
                          "finish_reason": "length"}
            else:
                choice = {"index": 0, "text": "x" * n_out, "finish_reason": "length"}
            return web.json_response({"id": "cmpl-1", "object": "text_completion", "created": int(time.time()),
                                      "model": "fake-model", "choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if chat:  # vLLM opens a chat stream with an empty role delta
            await resp.write(b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n')
        for k in range(n_out):
            if self.drop_after is not None and k >= self.drop_after:
                request.transport.close()
                return resp
            piece = {"delta": {"content": "x"}} if chat else {"text": "x"}
            ev = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, **piece}], "usage": None}
            await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
            await asyncio.sleep(self.token_delay)
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(b"data: " + json.dumps({"id": "cmpl-1", "choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.sleep(self.linger_after_done)
        await resp.write_eof()
        return resp

    # --- Anthropic Messages and the Responses API ---------------------------------------------

    def _text_cached(self, text: str) -> int:
        """Tokens of ``text`` (4 characters each) served from this instance's cache."""
        hit = 0
        for end in range(64, len(text), 64):
            if hash(text[:end]) in self.text_prefixes:
                hit = end // 4
        for end in range(64, len(text) + 1, 64):
            self.text_prefixes.add(hash(text[:end]))
        return hit

    def _next_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}{self.name}-{self._ids}"

    async def _take(self, request: web.Request) -> dict | web.Response:
        raw = await request.read()
        self.raw.append(raw)
        body = json.loads(raw)
        self.seen.append({"body": body, "headers": dict(request.headers)})
        return body

    async def messages(self, request: web.Request) -> web.StreamResponse:
        body = await self._take(request)
        if self.fail_status:
            return web.json_response({"type": "error", "error": {"type": "api_error", "message": "boom"}},
                                     status=self.fail_status)
        text = json.dumps([body.get("system"), body.get("tools"), body.get("messages")])
        n_prompt = len(text) // 4
        cached = self._text_cached(text)
        n_out = body.get("max_tokens") or 4
        mid = self._next_id("msg_")
        usage = {"input_tokens": n_prompt, "output_tokens": n_out, "cache_read_input_tokens": cached}
        await asyncio.sleep(self.first_delay)
        if not body.get("stream"):
            await asyncio.sleep(self.token_delay * n_out)
            return web.json_response({"id": mid, "type": "message", "role": "assistant",
                                      "content": [{"type": "text", "text": "x" * n_out}],
                                      "model": "fake-model", "stop_reason": "max_tokens",
                                      "stop_sequence": None, "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        sent = bytearray()

        async def event(name: str, data: dict) -> None:
            b = f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
            sent.extend(b)
            await resp.write(b)

        await event("message_start", {"type": "message_start", "message": {
            "id": mid, "type": "message", "role": "assistant", "content": [], "model": "fake-model",
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": n_prompt, "output_tokens": 0}}})
        await event("content_block_start", {"type": "content_block_start", "index": 0,
                                            "content_block": {"type": "text", "text": ""}})
        for k in range(n_out):
            if self.drop_after is not None and k >= self.drop_after:
                request.transport.close()
                return resp
            await event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                "delta": {"type": "text_delta", "text": "x"}})
            await asyncio.sleep(self.token_delay)
        await event("content_block_stop", {"type": "content_block_stop", "index": 0})
        await event("message_delta", {"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                                      "usage": usage})
        await event("message_stop", {"type": "message_stop"})
        self.streams.append(bytes(sent))
        await resp.write_eof()
        return resp

    async def responses(self, request: web.Request) -> web.StreamResponse:
        body = await self._take(request)
        if self.fail_status:
            return web.json_response({"error": {"message": "boom", "type": "InternalServerError",
                                                "param": None, "code": self.fail_status}}, status=self.fail_status)
        prev = body.get("previous_response_id")
        history = ""
        if prev is not None:
            if prev not in self.stored:  # vLLM keeps stored responses in this process only
                return web.json_response({"error": {"message": f"Response with id '{prev}' not found.",
                                                    "type": "invalid_request_error", "param": None,
                                                    "code": 404}}, status=404)
            history = self.stored[prev]["text"]
        text = history + json.dumps([body.get("instructions"), body.get("tools"), body.get("input")])
        n_prompt = len(text) // 4
        cached = self._text_cached(text)
        n_out = body.get("max_output_tokens") or 4
        rid = self._next_id("resp_")
        if body.get("store", True):
            self.stored[rid] = {"text": text + "x" * n_out}
        usage = {"input_tokens": n_prompt, "input_tokens_details": {"cached_tokens": cached},
                 "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": n_prompt + n_out}
        message = {"id": "msg_" + rid, "type": "message", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": "x" * n_out, "annotations": []}]}
        full = {"id": rid, "object": "response", "created_at": int(time.time()), "model": "fake-model",
                "status": "completed", "instructions": body.get("instructions"), "output": [message],
                "previous_response_id": prev, "usage": usage}
        await asyncio.sleep(self.first_delay)
        if not body.get("stream"):
            await asyncio.sleep(self.token_delay * n_out)
            return web.json_response(full)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        seq = 0
        sent = bytearray()

        async def event(data: dict) -> None:
            nonlocal seq
            data = {"type": data.pop("type"), "sequence_number": seq, **data}
            seq += 1
            b = f"event: {data['type']}\ndata: {json.dumps(data)}\n\n".encode()
            sent.extend(b)
            await resp.write(b)

        head = {**full, "status": "in_progress", "output": [], "usage": None}
        await event({"type": "response.created", "response": head})
        await event({"type": "response.in_progress", "response": head})
        await event({"type": "response.output_item.added", "output_index": 0,
                     "item": {**message, "status": "in_progress", "content": []}})
        await event({"type": "response.content_part.added", "output_index": 0, "item_id": message["id"],
                     "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}})
        for k in range(n_out):
            if self.drop_after is not None and k >= self.drop_after:
                request.transport.close()
                return resp
            await event({"type": "response.output_text.delta", "output_index": 0, "item_id": message["id"],
                         "content_index": 0, "delta": "x", "logprobs": []})
            await asyncio.sleep(self.token_delay)
        await event({"type": "response.output_text.done", "output_index": 0, "item_id": message["id"],
                     "content_index": 0, "text": "x" * n_out, "logprobs": []})
        await event({"type": "response.completed", "response": full})
        self.streams.append(bytes(sent))
        await resp.write_eof()
        return resp
