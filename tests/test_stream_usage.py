"""Usage from any stream: the final usage is read however large the event around it (a Codex
``response.completed`` echoing 60 tools is over 16 KB), in bounded memory, for Messages,
Responses, chat and completions, in any chunking."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import sqlite_utils

from router.apis import CHAT, COMPLETIONS, MESSAGES, RESPONSES
from router.forward import _TAIL_BYTES, _USAGE_MAX_BYTES, StreamScan, cached_tokens, completion_tokens


def codex_tools(n: int = 60) -> list[dict]:
    """Codex-shaped function tools; some have a parameter named ``usage`` (a JSON key that is
    not the usage)."""
    return [{"type": "function", "name": f"tool_{k}", "strict": False,
             "description": f"Tool {k}: " + "reads and edits files in the workspace; " * 8,
             "parameters": {"type": "object", "properties": {
                 "path": {"type": "string", "description": "a path relative to the workspace root"},
                 "usage": {"type": "object", "properties": {"input_tokens": {"type": "string"}},
                           "description": "how the tool is used"},
                 "mode": {"type": "string", "enum": ["read", "write", "append"]}},
                 "required": ["path"], "additionalProperties": False}}
            for k in range(n)]


def _sse(event: str | None, data: dict) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + json.dumps(data).encode() + b"\n\n"


def responses_stream(tools: list[dict], output: int, cached: int) -> bytes:
    usage = {"input_tokens": 30_000, "input_tokens_details": {"cached_tokens": cached},
             "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 30_000 + output}
    resp = {"id": "resp_abc", "object": "response", "instructions": "You are Codex. " * 200, "tools": tools,
            "output": [], "status": "in_progress", "usage": None}
    out = _sse("response.created", {"type": "response.created", "response": resp})
    for k in range(output):
        out += _sse("response.output_text.delta", {"type": "response.output_text.delta", "delta": f"t{k} "})
    done = {**resp, "status": "completed", "usage": usage, "user": None,
            "output": [{"type": "message", "content": [{"type": "output_text", "text": "x" * 3000}]}]}
    return out + _sse("response.completed", {"type": "response.completed", "response": done})


def messages_stream(output: int, cached: int) -> bytes:
    out = _sse("message_start", {"type": "message_start", "message": {
        "id": "msg_1", "usage": {"input_tokens": 100, "cache_read_input_tokens": 0, "output_tokens": 0}}})
    for k in range(output):
        out += _sse("content_block_delta", {"type": "content_block_delta", "delta": {"type": "text_delta",
                                                                                     "text": f"t{k}"}})
    out += _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                                  "usage": {"input_tokens": 100, "cache_read_input_tokens": cached,
                                            "output_tokens": output}})
    return out + _sse("message_stop", {"type": "message_stop"})


def openai_stream(field: str, output: int, cached: int) -> bytes:
    out = b""
    for k in range(output):
        choice = {"index": 0, "text": f"t{k}"} if field == "text" else {"index": 0, "delta": {"content": f"t{k}"}}
        out += _sse(None, {"choices": [choice], "usage": None})
    out += _sse(None, {"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": output,
                                                "prompt_tokens_details": {"cached_tokens": cached}}})
    return out + b"data: [DONE]\n\n"


STREAMS = [
    pytest.param(RESPONSES, lambda: responses_stream(codex_tools(60), 16, 2048), id="responses-60-tools"),
    pytest.param(RESPONSES, lambda: responses_stream(codex_tools(5), 16, 2048), id="responses-5-tools"),
    pytest.param(MESSAGES, lambda: messages_stream(16, 2048), id="messages"),
    pytest.param(CHAT, lambda: openai_stream("delta", 16, 2048), id="chat"),
    pytest.param(COMPLETIONS, lambda: openai_stream("text", 16, 2048), id="completions"),
]


def _scan(api, data: bytes, sizes) -> StreamScan:
    scan = StreamScan(api.token_re, api.done_re)
    most = 0
    i = 0
    while i < len(data):
        n = sizes()
        scan.feed(data[i:i + n])
        i += n
        most = max(most, scan.held_bytes)
    scan.finish()
    assert most <= 3 * _TAIL_BYTES + _USAGE_MAX_BYTES  # bounded, whatever the last event's size
    return scan


@pytest.mark.parametrize("api, make", STREAMS)
@pytest.mark.parametrize("chunking", ["whole", "1-byte", "random", "4096"])
def test_final_usage_is_found_however_large_the_last_event(api, make, chunking):
    data = make()
    rng = random.Random(7)
    sizes = {"whole": lambda: len(data), "1-byte": lambda: 1, "random": lambda: rng.randrange(1, 300),
             "4096": lambda: 4096}[chunking]
    scan = _scan(api, data, sizes)
    usage = scan.usage()
    assert completion_tokens(usage) == 16 and cached_tokens(usage) == 2048, usage
    assert scan.saw_done and scan.first_token


def test_the_codex_stream_is_larger_than_the_old_tail():
    """The case that lost usage: the last event alone is far over 16 KB."""
    data = responses_stream(codex_tools(60), 16, 2048)
    last = data[data.rindex(b"event: response.completed"):]
    assert len(last) > 3 * _TAIL_BYTES


def test_a_key_named_usage_that_is_not_the_usage_is_not_taken():
    scan = StreamScan(RESPONSES.token_re, RESPONSES.done_re)
    scan.feed(_sse("response.created", {"type": "response.created", "response": {
        "tools": codex_tools(2), "usage": None}}))
    assert scan.usage() is None  # the tools' "usage" parameters are schemas, not token counts
    big = {"usage": {"type": "object", "description": "y" * (_USAGE_MAX_BYTES + 10), "input_tokens": 1}}
    scan.feed(_sse(None, big))
    assert scan.usage() is None  # too large to be a usage object: given up, not held


def test_text_that_quotes_a_usage_object_is_not_taken():
    scan = StreamScan(CHAT.token_re, CHAT.done_re)
    scan.feed(_sse(None, {"choices": [{"index": 0, "delta": {
        "content": 'see "usage":{"completion_tokens":999} and data: [DONE]'}}]}))
    assert scan.usage() is None and not scan.saw_done
    scan.feed(b"data: [DONE]\n\n")
    assert scan.saw_done


# -- end to end: Codex through the router to kvtop sim -----------------------------------------------
async def test_codex_with_60_tools_records_the_engines_usage(router_client, tmp_path):
    from kvtop.sim.engine import Engine
    from kvtop.sim.server import SimInstance, serve
    from router.app import STATE, Backend, RouterConfig, create_app

    inst = SimInstance(Engine("h20", num_gpu_blocks=4000), model="sim-model", port=0, speed=1000.0)
    ready = asyncio.Event()
    task = asyncio.get_running_loop().create_task(serve([inst], on_ready=lambda _: ready.set()))
    await ready.wait()
    try:
        cfg = RouterConfig(backends=[Backend("i0", f"http://127.0.0.1:{inst.port}")], block_size=16,
                           db=str(tmp_path / "k.db"), state_dir=str(tmp_path / "state"))
        client = await router_client(create_app(cfg))
        state = client.server.app[STATE]
        body = {"model": "sim-model", "instructions": "You are Codex. " * 100, "tools": codex_tools(60),
                "input": [{"role": "user", "content": "fix the failing test " * 20}], "stream": True,
                "max_output_tokens": 16, "prompt_cache_key": "codex-1"}
        seen = []
        for turn in range(2):
            r = await client.post("/v1/responses", json=body)
            assert r.status == 200
            raw = await r.read()
            data = [ln[5:] for ln in raw.split(b"\n") if ln.startswith(b"data:")]
            last = data[-1]
            assert len(last) > _TAIL_BYTES and json.loads(last)["type"] == "response.completed"
            seen.append(json.loads(last)["response"]["usage"])
        state.writer.flush()
        rows = list(sqlite_utils.Database(cfg.db)["outcomes"].rows)
        assert [(o["output_tokens"], o["delivered_hit_tokens"]) for o in rows] == [
            (u["output_tokens"], u["input_tokens_details"]["cached_tokens"]) for u in seen]
        assert seen[1]["input_tokens_details"]["cached_tokens"] > 0 and seen[0]["output_tokens"] == 16
    finally:
        task.cancel()
        try:
            await task
        except BaseException:
            pass
