"""POST /v1/messages (Anthropic Messages, as vLLM serves it for Claude Code) through the router:
streams relayed byte for byte, sessions from metadata.user_id, first token and delivered hits
from Anthropic's events, errors in Anthropic's shape."""

from __future__ import annotations

import json

import pytest

from fakevllm import CLOSED_PORT
from router.request import parse_request
from test_router_e2e import rows, start_router

SESSION = "7f1c2a9e-52b4-4c11-9d0e-3f1b8c2d4e5a"
USER_ID = f"user_0a1b2c3d4e5f_account_11111111-2222-3333-4444-555555555555_session_{SESSION}"
TOOLS = [{"name": f"Tool{k}", "description": f"Does thing {k}. " * 20,
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
         for k in range(24)]


def claude_code_body(turn: int, *, stream: bool = True, user_id: str = USER_ID) -> dict:
    """Turn ``turn`` (1-based) of a Claude Code-shaped session: system blocks with
    cache_control (and the per-request billing header vLLM drops), 24 tools, then one
    tool_use / tool_result pair per earlier turn."""
    system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=1.0; cch={turn:05d};"},
              {"type": "text", "text": "You are Claude Code, an agent. " * 200,
               "cache_control": {"type": "ephemeral"}}]
    messages: list[dict] = [{"role": "user", "content": [{"type": "text", "text": "Fix the bug in main.py. " * 30}]}]
    for k in range(1, turn):
        messages.append({"role": "assistant", "content": [
            {"type": "text", "text": f"Reading file {k}."},
            {"type": "tool_use", "id": f"toolu_{k:04d}", "name": "Tool1", "input": {"path": f"f{k}.py"}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{k:04d}",
             "content": [{"type": "text", "text": f"contents of f{k}.py " * 120}]},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]})
    return {"model": "fake-model", "max_tokens": 6, "stream": stream, "system": system,
            "tools": TOOLS, "messages": messages, "metadata": {"user_id": user_id}}


@pytest.mark.parametrize("user_id,session", [
    (USER_ID, SESSION),  # Claude Code's user_<hash>_account_<uuid>_session_<uuid>
    (json.dumps({"device_id": "d", "account_uuid": "a", "session_id": "s-123"}), "s-123"),  # a JSON user_id
    ("plain-user", "plain-user"),  # no session part: the whole value
])
def test_session_from_metadata_user_id(user_id, session):
    r = parse_request(claude_code_body(2, user_id=user_id), "messages")
    assert (r.session_id, r.session_source, r.endpoint) == (session, "metadata_user_id", "messages")


def test_billing_header_and_images_do_not_change_blocks():
    # the billing header changes every request; vLLM drops it, so the prefix must not move
    a = parse_request(claude_code_body(3), "messages", block_size=16)
    b = claude_code_body(3)
    b["system"][0]["text"] = "x-anthropic-billing-header: cc_version=1.0; cch=99999;"
    b["messages"][2]["content"][1]["source"]["data"] = "BBBBBBBB"
    assert parse_request(b, "messages", block_size=16).blocks == a.blocks


def test_tools_are_counted():
    with_tools = parse_request(claude_code_body(1), "messages")
    body = claude_code_body(1)
    del body["tools"]
    assert with_tools.input_tokens > parse_request(body, "messages").input_tokens + 24 * 100


def test_turns_share_their_prefix_blocks():
    t2 = parse_request(claude_code_body(2), "messages", block_size=16)
    t3 = parse_request(claude_code_body(3), "messages", block_size=16)
    shared = sum(1 for x, y in zip(t2.blocks, t3.blocks) if x == y)
    assert shared >= len(t2.blocks) - 2 and t3.input_tokens > t2.input_tokens


@pytest.mark.parametrize("policy", ["leastwork", "unified"])
async def test_claude_code_session_through_the_router(router_client, fake_backends, tmp_path, policy):
    fakes = await fake_backends(2)
    client, state = await start_router(router_client, [u for _, u in fakes], tmp_path, policy=policy,
                                       block_size=16)
    instances = []
    for turn in range(1, 7):
        r = await client.post("/v1/messages", json=claude_code_body(turn))
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        got = await r.read()
        inst = r.headers["X-Kvtop-Instance"]
        instances.append(inst)
        fake = fakes[int(inst[1:])][0]
        assert got == fake.streams[-1]  # byte for byte
        assert b"event: message_stop" in got
    assert len(set(instances[1:])) == 1, instances  # turns 2+ stay on the session's instance
    decisions = rows(state, "decisions")
    assert {d["session_id"] for d in decisions} == {SESSION}
    assert {d["session_source"] for d in decisions} == {"metadata_user_id"}
    outcomes = rows(state, "outcomes")
    assert all(o["status"] == "ok" and o["ttft_ms"] is not None for o in outcomes)
    assert all(o["output_tokens"] == 6 for o in outcomes)  # message_delta's usage.output_tokens
    # cache_read_input_tokens is read as the delivered hit
    assert all(o["delivered_hit_tokens"] > 0 for o in outcomes[2:])
    assert state.cluster.counters_zero()


async def test_non_streaming_messages(router_client, fake_backends, tmp_path):
    fakes = await fake_backends(1)
    client, state = await start_router(router_client, [u for _, u in fakes], tmp_path)
    r = await client.post("/v1/messages", json=claude_code_body(1, stream=False))
    body = await r.json()
    assert r.status == 200 and body["type"] == "message" and body["content"][0]["text"] == "x" * 6
    (o,) = rows(state, "outcomes")
    assert o["status"] == "ok" and o["output_tokens"] == 6
    assert fakes[0][0].seen[-1]["body"] == claude_code_body(1, stream=False)  # passed on unchanged


def _anthropic_error(body: dict, kind: str) -> None:
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]


@pytest.mark.parametrize("body,kind", [
    ({"model": "m", "max_tokens": 4, "messages": []}, "invalid_request_error"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "robot", "content": "hi"}]}, "invalid_request_error"),
    ({"model": "m", "max_tokens": "4", "messages": [{"role": "user", "content": "hi"}]}, "invalid_request_error"),
    ({"model": "m", "max_tokens": 4, "system": 3, "messages": [{"role": "user", "content": "hi"}]},
     "invalid_request_error"),
])
async def test_router_errors_in_anthropic_shape(router_client, fake_backends, tmp_path, body, kind):
    fakes = await fake_backends(1)
    client, _ = await start_router(router_client, [u for _, u in fakes], tmp_path)
    r = await client.post("/v1/messages", json=body)
    assert r.status == 400
    _anthropic_error(await r.json(), kind)
    r = await client.post("/v1/messages", data=b"{not json")
    assert r.status == 400
    _anthropic_error(await r.json(), "invalid_request_error")


async def test_no_instance_and_upstream_errors(router_client, fake_backends, tmp_path):
    dead = f"http://127.0.0.1:{CLOSED_PORT}"
    client, _ = await start_router(router_client, [dead], tmp_path)
    r = await client.post("/v1/messages", json=claude_code_body(1))
    assert r.status in (502, 503)
    # no instance can take it: an error Claude Code shows at once, not an overloaded one it
    # retries silently for minutes
    _anthropic_error(await r.json(), "api_error")
    assert r.headers["x-should-retry"] == "false"
    # the instance's own error is relayed as it is (vLLM answers /v1/messages in Anthropic's shape)
    fakes = await fake_backends(1)
    fakes[0][0].fail_status = 400
    (tmp_path / "b").mkdir()
    client2, _ = await start_router(router_client, [fakes[0][1]], tmp_path / "b")
    r = await client2.post("/v1/messages", json=claude_code_body(1))
    assert r.status == 400
    assert await r.json() == {"type": "error", "error": {"type": "api_error", "message": "boom"}}


async def test_mid_stream_failure_ends_with_an_anthropic_error_event(router_client, fake_backends, tmp_path):
    fakes = await fake_backends(1)
    fakes[0][0].drop_after = 2
    client, state = await start_router(router_client, [fakes[0][1]], tmp_path)
    r = await client.post("/v1/messages", json=claude_code_body(1))
    text = (await r.read()).decode()
    last = text.strip().split("\n\n")[-1]
    assert last.startswith("event: error\ndata: ")
    _anthropic_error(json.loads(last.split("data: ", 1)[1]), "api_error")
    (o,) = rows(state, "outcomes")
    assert o["status"] == "upstream_error" and o["ttft_ms"] is None
    assert state.cluster.counters_zero()
