"""The official openai and anthropic Python SDKs, every call an agent makes, through kvtop to two
simulated vLLM instances (kvtop sim, in this process): Messages create/stream/count_tokens and
tool use, Responses create/stream/retrieve/delete/cancel and function calls, chat (tool calls
too) and completions. Plus the routes around them: HEAD/GET /, unknown paths in their API's
shape, and the answer Claude Code gets when no instance can take its request."""

from __future__ import annotations

import pytest

from kvtop.sim.answers import OutputLengths
from kvtop.sim.engine import Engine
from kvtop.sim.server import SimInstance, create_app
from router.app import STATE, Backend, RouterConfig, create_app as router_app
from test_router_e2e import rows

anthropic = pytest.importorskip("anthropic", reason="the test extra installs the anthropic SDK")
openai = pytest.importorskip("openai", reason="the test extra installs the openai SDK")

TOOLS_ANTHROPIC = [{"name": "Read", "description": "read a file",
                    "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"},
                                                                      "limit": {"type": "integer", "minimum": 1}},
                                     "required": ["file_path"]}}]
TOOLS_CHAT = [{"type": "function", "function": {"name": "shell", "description": "run a command",
                                                "parameters": {"type": "object",
                                                               "properties": {"command": {"type": "array",
                                                                                          "items": {"type": "string"}}},
                                                               "required": ["command"]}}}]
TOOLS_RESPONSES = [{"type": "function", "name": "shell", "description": "run a command",
                    "parameters": TOOLS_CHAT[0]["function"]["parameters"]}]


@pytest.fixture
async def fleet(aiohttp_server, router_client, tmp_path):
    """Two simulated instances (answers drawn from the bundled trace's lengths) behind a router;
    returns (router base URL, [instance URLs], router state)."""
    urls = []
    for _ in range(2):
        inst = SimInstance(Engine("h20"), model="sim-model", speed=500.0,
                           output_lengths=OutputLengths("sample", 0))
        server = await aiohttp_server(create_app(inst), host="127.0.0.1")
        inst.port = server.port
        urls.append(str(server.make_url("")).rstrip("/"))
    cfg = RouterConfig(backends=[Backend(f"i{k}", u) for k, u in enumerate(urls)],
                       db=str(tmp_path / "kvtop.db"), state_dir=str(tmp_path / "state"))
    client = await router_client(router_app(cfg))
    return client.server.url, urls, client.server.app[STATE]


def _anthropic(url: str):
    return anthropic.AsyncAnthropic(base_url=url, api_key="sk-test", max_retries=0)


def _openai(url: str):
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0)


async def test_anthropic_messages_create_stream_count_and_tools(fleet):
    url, _, state = fleet
    client = _anthropic(url)
    msgs = [{"role": "user", "content": "summarise the repository " * 20}]
    meta = {"user_id": "user_1_account_2_session_11111111-2222-3333-4444-555555555555"}
    m = await client.messages.create(model="sim-model", max_tokens=4000, messages=msgs, metadata=meta)
    assert m.type == "message" and m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.output_tokens >= 1 and m.usage.input_tokens > 50
    async with client.messages.stream(model="sim-model", max_tokens=4000, messages=msgs, metadata=meta) as s:
        text = "".join([t async for t in s.text_stream])
        final = await s.get_final_message()
    assert final.content[0].text == text and final.usage.output_tokens == m.usage.output_tokens  # same prompt, same answer
    # count_tokens: Anthropic's shape, the same count the router routes the request on
    count = await client.messages.count_tokens(model="sim-model", messages=msgs)
    decisions = rows(state, "decisions")
    assert count.input_tokens == decisions[0]["input_tokens"] > 50
    longer = await client.messages.count_tokens(model="sim-model", messages=msgs + [
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and the tests " * 30}])
    assert longer.input_tokens > count.input_tokens + 30
    # a tool the model must call comes back as a tool_use block
    t = await client.messages.create(model="sim-model", max_tokens=4000, messages=msgs, tools=TOOLS_ANTHROPIC,
                                     tool_choice={"type": "any"}, metadata=meta)
    assert t.stop_reason == "tool_use"
    use = [b for b in t.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "Read" and use[0].input == {"file_path": "kvtop-sim"}
    async with client.messages.stream(model="sim-model", max_tokens=4000, messages=msgs, tools=TOOLS_ANTHROPIC,
                                      tool_choice={"type": "any"}, metadata=meta) as s:
        final = await s.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].input == {"file_path": "kvtop-sim"}
    # a stop sequence ends the answer before it
    m = await client.messages.create(model="sim-model", max_tokens=400, messages=msgs, stop_sequences=[" fake"],
                                     metadata=meta)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == " fake" and "fake" not in m.content[0].text
    assert {d["session_id"] for d in rows(state, "decisions")} == {"11111111-2222-3333-4444-555555555555"}
    assert {o["status"] for o in rows(state, "outcomes")} == {"ok"}
    await client.close()


async def test_openai_responses_create_stream_retrieve_delete_cancel(fleet):
    url, sims, state = fleet
    client = _openai(url)
    r = await client.responses.create(model="sim-model", input="write the tests " * 20, prompt_cache_key="s1",
                                      max_output_tokens=4000)
    assert r.status == "completed" and r.usage.output_tokens >= 1 and r.output_text
    got = await client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    # a stream, continuing the first response on the instance that holds it
    stream = await client.responses.create(model="sim-model", input="go on", previous_response_id=r.id,
                                           stream=True, tools=TOOLS_RESPONSES, tool_choice="required")
    kinds = [ev.type async for ev in stream]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds
    decisions = rows(state, "decisions")
    assert len({d["instance"] for d in decisions}) == 1
    # function calls, not streamed
    f = await client.responses.create(model="sim-model", input="list the files", tools=TOOLS_RESPONSES,
                                      tool_choice="required", prompt_cache_key="s1")
    call = [o for o in f.output if o.type == "function_call"][0]
    assert call.name == "shell" and call.arguments == '{"command":[]}' and call.call_id.startswith("call_")
    # background: queued at once, cancelled while it runs, then deleted
    bg = await client.responses.create(model="sim-model", input="a long one", background=True,
                                       max_output_tokens=100_000, extra_body={"ignore_eos": True})
    assert bg.status in ("queued", "in_progress")
    cancelled = await client.responses.cancel(bg.id)
    assert cancelled.status == "cancelled"
    await client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve("resp_unknown")
    # a response the router never saw (made on an instance directly) is found on the instance holding it
    direct = await _openai(sims[1]).responses.create(model="sim-model", input="hello", max_output_tokens=5)
    assert (await client.responses.retrieve(direct.id)).id == direct.id
    await client.close()


async def test_openai_chat_and_completions(fleet):
    url, _, state = fleet
    client = _openai(url)
    msgs = [{"role": "user", "content": "hello there " * 10}]
    c = await client.chat.completions.create(model="sim-model", messages=msgs, max_tokens=4000, user="u1")
    assert c.choices[0].finish_reason in ("stop", "length") and c.usage.completion_tokens >= 1
    stream = await client.chat.completions.create(model="sim-model", messages=msgs, max_tokens=4000, user="u1",
                                                  stream=True, stream_options={"include_usage": True})
    chunks = [ch async for ch in stream]
    assert chunks[-1].usage.completion_tokens == c.usage.completion_tokens  # same prompt, same answer
    t = await client.chat.completions.create(model="sim-model", messages=msgs, max_tokens=4000, user="u1",
                                             tools=TOOLS_CHAT, tool_choice="required")
    assert t.choices[0].finish_reason == "tool_calls"
    assert t.choices[0].message.tool_calls[0].function.name == "shell"
    stream = await client.chat.completions.create(model="sim-model", messages=msgs, max_tokens=4000, user="u1",
                                                  tools=TOOLS_CHAT, tool_choice="required", stream=True)
    deltas = [ch.choices[0] async for ch in stream if ch.choices]
    assert deltas[-1].finish_reason == "tool_calls"
    assert "".join(d.delta.tool_calls[0].function.arguments or "" for d in deltas if d.delta.tool_calls) \
        == '{"command":[]}'
    # no max_tokens: the answer ends by itself (vLLM's default lets it run to the context's end)
    free = await client.chat.completions.create(model="sim-model", messages=msgs, user="u1")
    assert free.choices[0].finish_reason == "stop" and free.usage.completion_tokens > 16
    s = await client.chat.completions.create(model="sim-model", messages=msgs, max_tokens=50, user="u1",
                                             stop=[" engine"])
    assert s.choices[0].finish_reason == "stop" and "engine" not in s.choices[0].message.content
    done = await client.completions.create(model="sim-model", prompt="once upon a time " * 5, max_tokens=7,
                                           extra_body={"ignore_eos": True})
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 7
    outcomes = rows(state, "outcomes")
    assert len(outcomes) == 7 and {o["status"] for o in outcomes} == {"ok"}
    await client.close()


async def test_root_probe_and_unknown_paths_in_their_api_shape(fleet):
    import aiohttp

    url, _, _ = fleet
    async with aiohttp.ClientSession() as http:
        for method in ("HEAD", "GET"):
            async with http.request(method, url + "/") as r:
                assert r.status == 200
        async with http.get(url + "/v1/messages/batches") as r:
            assert r.status == 404
            assert (await r.json())["error"]["type"] == "not_found_error"  # Anthropic's shape
        async with http.get(url + "/v1/files") as r:
            body = await r.json()
            assert r.status == 404 and body["error"]["code"] == 404 and "message" in body["error"]  # OpenAI's
        async with http.get(url + "/v1/messages") as r:
            assert r.status == 405 and (await r.json())["type"] == "error" and r.headers["Allow"] == "POST"
        async with http.post(url + "/v1/messages/count_tokens", data=b"{nope") as r:
            assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"
        async with http.get(url + "/kvtop/v1/state") as r:  # the control plane still answers
            assert r.status == 200


async def test_no_instance_is_an_error_claude_code_shows(router_client, tmp_path):
    """Every backend down: an Anthropic-shaped api_error with x-should-retry: false (Claude Code
    2.1 retries overloaded_error, 503 or 529, for minutes whatever the header; it shows this one
    and exits within seconds), and the SDK does not retry it either."""
    from conftest import free_port

    cfg = RouterConfig(backends=[Backend("i0", f"http://127.0.0.1:{free_port()}")],
                       db=str(tmp_path / "kvtop.db"), state_dir=str(tmp_path / "state"))
    client = await router_client(router_app(cfg))
    sdk = anthropic.AsyncAnthropic(base_url=client.server.url, api_key="sk-test", max_retries=2)
    with pytest.raises(anthropic.APIStatusError) as err:
        await sdk.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code in (502, 503)
    assert err.value.body["error"]["type"] == "api_error"
    assert err.value.response.headers["x-should-retry"] == "false"
    assert client.server.state.counts["requests"] == 1  # not retried
    await sdk.close()


async def test_count_tokens_is_exact_with_a_tokenizer(aiohttp_server, router_client, tmp_path):
    """With --tokenizer, count_tokens is the model's own count (its chat template and tokenizer,
    as vLLM renders the request), the same the router routes the request on."""
    from test_tokenize import _bench
    from router.request import parse_request
    from router.tokenizer import Tokenizer

    tok_dir = _bench().build_tokenizer(tmp_path / "tok", vocab=2000, corpus_bytes=400_000)
    inst = SimInstance(Engine("h20"), model="sim-model", speed=500.0)
    server = await aiohttp_server(create_app(inst), host="127.0.0.1")
    cfg = RouterConfig(backends=[Backend("i0", str(server.make_url("")).rstrip("/"))], tokenizer=str(tok_dir),
                       db=str(tmp_path / "kvtop.db"), state_dir=str(tmp_path / "state"))
    client = await router_client(router_app(cfg))
    sdk = _anthropic(client.server.url)
    body = {"system": "you are terse", "messages": [{"role": "user", "content": "count these words, please"}],
            "tools": TOOLS_ANTHROPIC}
    count = await sdk.messages.count_tokens(model="sim-model", **body)
    expected = parse_request({**body, "max_tokens": 1}, "messages", tokenizer=Tokenizer(str(tok_dir))).input_tokens
    assert count.input_tokens == expected
    await sdk.messages.create(model="sim-model", max_tokens=3, **body)
    decision = rows(client.server.app[STATE], "decisions")[0]
    assert decision["token_source"] == "tokenizer" and decision["input_tokens"] == count.input_tokens
    await sdk.close()


async def test_a_response_is_asked_for_where_it_is_stored(aiohttp_server, router_client, tmp_path):
    """Retrieve goes to the instance that stored the response, as previous_response_id does: with
    that instance gone the answer is a 502 naming it, not the other instance's 404."""
    servers, urls = [], []
    for _ in range(2):
        inst = SimInstance(Engine("h20"), model="sim-model", speed=500.0)
        server = await aiohttp_server(create_app(inst), host="127.0.0.1")
        servers.append(server)
        urls.append(str(server.make_url("")).rstrip("/"))
    cfg = RouterConfig(backends=[Backend(f"i{k}", u) for k, u in enumerate(urls)],
                       db=str(tmp_path / "kvtop.db"), state_dir=str(tmp_path / "state"))
    client = await router_client(router_app(cfg))
    sdk = _openai(client.server.url)
    r = await sdk.responses.create(model="sim-model", input="hello there", max_output_tokens=3)
    holder = rows(client.server.app[STATE], "decisions")[0]["instance"]
    assert (await sdk.responses.retrieve(r.id)).id == r.id
    await servers[int(holder[1:])].close()
    with pytest.raises(openai.APIStatusError) as err:
        await sdk.responses.retrieve(r.id)
    assert err.value.status_code == 502 and holder in err.value.message
    await sdk.close()
