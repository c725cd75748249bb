"""Hostile inputs, round 3 (issue 36): each case a 4xx in the client's API shape naming the
field, a one-line CLI error with exit 2, or a bound that holds; never a 500 or a traceback."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from fakevllm import CLOSED_PORT
from router.app import STATE, Backend, RouterConfig, create_app
from router.request import MAX_NESTING, BadRequest, parse_request, read_body

TOKEN = "hostile-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def deep(n: int) -> dict:
    o: dict = {}
    for _ in range(n):
        o = {"a": o}
    return o


def deep_dumps(obj) -> bytes:
    """JSON text of an object nested past the json module's default recursion bound."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)
    try:
        return json.dumps(obj).encode()
    finally:
        sys.setrecursionlimit(old)


USER = {"role": "user", "content": "hi"}

# (endpoint, body, the words the error must name) -- each was a 500 (TypeError or
# RecursionError from serializing the prompt) before issue 36
BAD_BODIES = [
    ("messages", {"messages": [{"role": ["user"], "content": "hi"}]}, "messages[0]"),  # unhashable role
    ("messages", {"messages": [{"role": {"a": 1}, "content": "hi"}]}, "messages[0]"),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x",
                                                                "content": [{"type": "text", "text": 5}]}]}]},
     "messages[0].content[0].content[0].text"),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x",
                                                                "content": 7}]}]},
     "messages[0].content[0].content"),
    ("messages", {"messages": [USER], "tools": [{"name": "t", "input_schema": deep(1000)}]},
     "tools[0].input_schema"),
    ("messages", {"messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "a", "name": "n", "input": deep(1000)}]}, USER]},
     "messages[0].content[0].input"),
    ("responses", {"input": [{"type": "function_call_output", "call_id": "c", "output": deep(1000)}]},
     "input[0].output"),
    ("responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f",
                              "arguments": deep(1000)}]}, "input[0].arguments"),
    ("responses", {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": deep(1000)}]},
     "tools[0].parameters"),
    ("chat", {"messages": [USER], "tools": [{"type": "function", "function": {"name": "f",
                                                                           "parameters": deep(1000)}}]},
     "tools[0]"),
    ("chat", {"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": deep(1000)}}]}, USER]},
     "messages[0].tool_calls"),
]


@pytest.mark.parametrize("endpoint,body,field", BAD_BODIES)
def test_bad_bodies_are_bad_requests_naming_the_field(endpoint, body, field):
    with pytest.raises(BadRequest) as e:
        parse_request(body, endpoint, block_size=16)
    assert field in e.value.message and e.value.status == 400


def test_nesting_at_the_limit_is_served():
    # a schema as deep as the bound still routes (the bound is on nesting, not on schemas)
    body = {"messages": [USER], "tools": [{"name": "t", "input_schema": deep(MAX_NESTING - 1)}]}
    assert parse_request(body, "messages", block_size=16).input_tokens > 0


@pytest.mark.parametrize("endpoint,body", [
    ("messages", {"messages": [USER], "metadata": {"user_id": "u" * 1_000_000}}),
    ("messages", {"messages": [USER], "metadata": {"user_id": "user_x_account_y_session_" + "a" * 500_000}}),
    ("responses", {"input": "hi", "prompt_cache_key": "k" * 1_000_000}),
    ("chat", {"messages": [USER], "session_id": "s" * 100_000}),
    ("chat", {"messages": [USER], "user": "u" * 100_000}),
])
def test_session_ids_are_bounded(endpoint, body):
    parsed = read_body(body, endpoint)
    assert parsed.session_id is not None and len(parsed.session_id) <= 256


def test_bounded_session_ids_stay_distinct():
    a = read_body({"input": "hi", "prompt_cache_key": "k" * 300 + "a"}, "responses").session_id
    b = read_body({"input": "hi", "prompt_cache_key": "k" * 300 + "b"}, "responses").session_id
    short = read_body({"input": "hi", "prompt_cache_key": "k" * 256}, "responses").session_id
    assert a != b and short == "k" * 256


# -- the same through HTTP: the client's own error shape, no 500 ---------------------------------

@pytest.fixture
async def router(router_client, tmp_path):
    cfg = RouterConfig(backends=[Backend("i0", f"http://127.0.0.1:{CLOSED_PORT}")], control_token=TOKEN,
                       state_dir=str(tmp_path / "st"), health_interval_s=0, policy="unified")
    return await router_client(create_app(cfg))


PATHS = {"messages": "/v1/messages", "responses": "/v1/responses", "chat": "/v1/chat/completions"}


async def test_bad_bodies_over_http_get_400_in_the_apis_shape(router):
    for endpoint, body, field in BAD_BODIES:
        r = await router.post(PATHS[endpoint], data=deep_dumps(body), headers={"Content-Type": "application/json"})
        out = await r.json()
        assert r.status == 400, (endpoint, field, out)
        if endpoint == "messages":
            assert out["type"] == "error" and out["error"]["type"] == "invalid_request_error"
        else:
            assert out["error"]["code"] == 400
        assert field in out["error"]["message"]
    state = router.server.app[STATE]
    assert state.counts["requests"] == 0 and state.cluster.counters_zero()


# -- the control API --------------------------------------------------------------------------

async def _raw(client, request: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection(client.host, client.port)
    try:
        writer.write(request)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        status = int(head.split(b" ", 2)[1])
        n = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                     if line.lower().startswith(b"content-length:")))
        return status, await asyncio.wait_for(reader.readexactly(n), 5)
    finally:
        writer.close()


@pytest.mark.parametrize("method,path,body", [
    ("PUT", "/kvtop/v1/policy", b'{"name": "lmetric"}'),
    ("GET", "/kvtop/v1/auth", b""),
    ("PATCH", "/kvtop/v1/knobs", b'{"overload_factor": 2.5}'),
])
@pytest.mark.parametrize("token", [b"\xff\xfe", TOKEN.encode() + b"\xe9", b"\xc3\xa9t\xc3\xa9"])
async def test_non_ascii_bearer_is_401(router, method, path, body, token):
    req = (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           f"Content-Length: {len(body)}\r\nConnection: close\r\n").encode()
    status, out = await _raw(router, req + b"Authorization: Bearer " + token + b"\r\n\r\n" + body)
    assert status == 401, out
    assert json.loads(out)["error"]["code"] == 401
    assert router.server.app[STATE].slot.version == 1


@pytest.mark.parametrize("method,path,body,param", [
    ("PATCH", "/kvtop/v1/knobs", {"overload_factor": "1.5"}, "overload_factor"),
    ("PATCH", "/kvtop/v1/knobs", {"heavy_threshold": "30000"}, "heavy_threshold"),  # a feature knob
    ("PUT", "/kvtop/v1/policy", {"name": "unified", "knobs": {"cache_ratio_gate": "0.5"}}, "cache_ratio_gate"),
    ("PUT", "/kvtop/v1/shadows", {"policies": "leastwork"}, "policies"),
    ("PUT", "/kvtop/v1/shadows", {"policies": None}, "policies"),
    ("PUT", "/kvtop/v1/shadows", {"policies": [{"policy": "unified", "knobs": {"overload_factor": "2"}}]},
     "policies"),
])
async def test_control_refuses_strings_for_numbers_and_non_list_shadows(router, method, path, body, param):
    r = await router.request(method, path, json=body, headers=AUTH)
    out = await r.json()
    assert r.status == 400, out
    assert out["error"]["param"] == param and param in out["error"]["message"]
    state = router.server.app[STATE]
    assert state.slot.version == 1 and not state.shadows.active


async def test_control_still_takes_json_numbers_and_lists(router):
    r = await router.patch("/kvtop/v1/knobs", json={"overload_factor": 1.5}, headers=AUTH)
    assert r.status == 200 and (await r.json())["knobs"]["overload_factor"] == 1.5
    r = await router.put("/kvtop/v1/shadows", json={"policies": ["leastwork"]}, headers=AUTH)
    assert r.status == 200
    r = await router.put("/kvtop/v1/shadows", json={"policies": []}, headers=AUTH)
    assert r.status == 200
