"""A small fake vLLM for router tests: vLLM's response shapes, scripted behaviour.

Streams one SSE event per token like vLLM, reports usage with cached tokens (a prompt's
cached share is the part seen before on this instance, rounded down to 16-token blocks),
and can be told to fail: refuse (500), drop mid-stream, or delay.
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

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)  # vLLM takes large prompts
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
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
