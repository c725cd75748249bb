"""POST /v1/responses (the OpenAI Responses API, as vLLM serves it) through the router: input
items, prompt_cache_key sessions, previous_response_id as a hard affinity to the instance that
stored the response, first token and usage from its events, errors in OpenAI's shape."""

from __future__ import annotations

import json

import pytest

from router.apis import ResponseStore, response_id
from router.request import BadRequest, parse_request
from test_router_e2e import rows, start_router

TOOLS = [{"type": "function", "name": f"tool_{k}", "description": f"does {k} " * 30,
          "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}} for k in range(20)]


def codex_body(turn: int, *, stream: bool = True, key: str | None = "sess-r1", previous: str | None = None) -> dict:
    """Turn ``turn`` of a Codex-shaped session: instructions, tools, and the whole history as
    input items (message, function_call, function_call_output)."""
    items: list[dict] = [{"type": "message", "role": "user",
                          "content": [{"type": "input_text", "text": "Refactor the parser. " * 40}]}]
    for k in range(1, turn):
        items.append({"type": "function_call", "call_id": f"call_{k}", "name": "tool_1",
                      "arguments": json.dumps({"cmd": f"cat f{k}.py"})})
        items.append({"type": "function_call_output", "call_id": f"call_{k}", "output": f"line {k}\n" * 150})
    body = {"model": "fake-model", "instructions": "You are a coding agent. " * 150, "tools": TOOLS,
            "input": items, "stream": stream, "max_output_tokens": 5}
    if key:
        body["prompt_cache_key"] = key
    if previous:
        body["previous_response_id"] = previous
    return body


@pytest.mark.parametrize("body,session,source", [
    (codex_body(1), "sess-r1", "prompt_cache_key"),
    ({**codex_body(1, key=None), "user": "u1"}, "u1", "user"),
    (codex_body(1, key=None), None, "first_block"),
])
def test_responses_sessions(body, session, source):
    r = parse_request(body, "responses")
    assert r.session_source == source and r.endpoint == "responses"
    if session:
        assert r.session_id == session


def test_input_string_and_previous_response_id_only():
    assert parse_request({"input": "hello there " * 20}, "responses").input_tokens > 50
    r = parse_request({"input": "more", "previous_response_id": "resp_1"}, "responses")
    assert r.previous_response_id == "resp_1"
    for bad in ({"input": 5}, {}, {"input": "x", "previous_response_id": 7}, {"input": [1]}):
        with pytest.raises(BadRequest):
            parse_request(bad, "responses")


def test_tools_and_instructions_are_counted():
    full = parse_request(codex_body(1), "responses")
    bare = codex_body(1)
    del bare["tools"], bare["instructions"]
    assert full.input_tokens > parse_request(bare, "responses").input_tokens + 20 * 60 + 800


def test_response_store_is_bounded_lru():
    s = ResponseStore(capacity=2)
    s.put("a", (0, "s")), s.put("b", (1, "s"))
    s.get("a")
    s.put("c", (1, "s"))
    assert s.get("b") is None and s.get("a") == (0, "s") and len(s) == 2
    assert response_id(b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_x1"') == "resp_x1"


@pytest.mark.parametrize("policy", ["leastwork", "unified"])
async def test_streamed_session_through_the_router(router_client, fake_backends, tmp_path, policy):
    fakes = await fake_backends(2)
    client, state = await start_router(router_client, [u for _, u in fakes], tmp_path, policy=policy,
                                       block_size=16)
    insts = []
    for turn in range(1, 6):
        r = await client.post("/v1/responses", json=codex_body(turn))
        assert r.status == 200
        got = await r.read()
        insts.append(r.headers["X-Kvtop-Instance"])
        assert got == fakes[int(insts[-1][1:])][0].streams[-1]
    assert len(set(insts[1:])) == 1, insts
    assert {d["session_id"] for d in rows(state, "decisions")} == {"sess-r1"}
    outcomes = rows(state, "outcomes")
    assert all(o["status"] == "ok" and o["ttft_ms"] is not None and o["output_tokens"] == 5 for o in outcomes)
    assert all(o["delivered_hit_tokens"] > 0 for o in outcomes[2:])  # input_tokens_details.cached_tokens


@pytest.mark.parametrize("stream", [True, False])
async def test_previous_response_id_is_a_hard_affinity(router_client, fake_backends, tmp_path, stream):
    fakes = await fake_backends(3)
    # round_robin would send each request to the next instance: only the affinity keeps a chain together
    client, state = await start_router(router_client, [u for _, u in fakes], tmp_path, policy="round_robin")
    prev, where = None, None
    for turn in range(1, 5):
        body = {"model": "fake-model", "input": f"step {turn} " * 50, "stream": stream, "max_output_tokens": 3}
        if prev:
            body["previous_response_id"] = prev
        r = await client.post("/v1/responses", json=body)
        assert r.status == 200, await r.text()
        data = await r.read()
        if stream:
            prev = response_id(data)
        else:
            prev = json.loads(data)["id"]
        inst = r.headers["X-Kvtop-Instance"]
        assert where in (None, inst), (turn, where, inst)
        where = inst
    decisions = rows(state, "decisions")
    assert len({d["session_id"] for d in decisions}) == 1  # the chain is one session
    assert [d["session_source"] for d in decisions][1:] == ["previous_response"] * 3


async def test_previous_response_on_a_lost_instance_fails_clearly(router_client, fake_backends, tmp_path):
    fakes = await fake_backends(2)
    client, state = await start_router(router_client, [u for _, u in fakes], tmp_path, policy="round_robin")
    r = await client.post("/v1/responses", json={"input": "hello " * 40, "max_output_tokens": 2})
    rid, inst = (await r.json())["id"], r.headers["X-Kvtop-Instance"]
    state.cluster.instances[int(inst[1:])].healthy = False
    r = await client.post("/v1/responses", json={"input": "next", "previous_response_id": rid})
    body = await r.json()
    assert r.status == 503 and rid in body["error"]["message"] and inst in body["error"]["message"]
    assert body["error"]["code"] == 503  # OpenAI's shape on this API
    # an id the router never saw routes as usual; the instance says it does not hold it
    r = await client.post("/v1/responses", json={"input": "next", "previous_response_id": "resp_unknown"})
    assert r.status == 404 and "not found" in (await r.json())["error"]["message"]


async def test_mid_stream_failure_ends_with_a_responses_error_event(router_client, fake_backends, tmp_path):
    fakes = await fake_backends(1)
    fakes[0][0].drop_after = 1
    client, state = await start_router(router_client, [fakes[0][1]], tmp_path)
    r = await client.post("/v1/responses", json=codex_body(1))
    last = (await r.read()).decode().strip().split("\n\n")[-1]
    assert last.startswith("event: error\ndata: ")
    ev = json.loads(last.split("data: ", 1)[1])
    assert ev["type"] == "error" and "failed mid-stream" in ev["message"]
    assert state.cluster.counters_zero()
