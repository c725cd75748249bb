"""The router's ``--tokenizer kvtop-sim`` (router/sim_tokenizer.py) counts a prompt into the
token ids kvtop sim's engine hashes: the same count and ids for chat (tools and tool calls
included), Anthropic Messages and Responses bodies, and a returning turn's prefix reuse gives
the ids of tokenizing the whole text."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtop.sim.engine import Engine
from kvtop.sim.server import SimInstance, create_app
from router.request import Counted, count_prompt, read_body
from router.tokenizer import load_tokenizer
from router.sim_tokenizer import SimTokenizer, tokenize
from test_messages import claude_code_body
from test_responses import codex_body

SIM = SimTokenizer()

# text a regex tokenizer can trip on: ChatML specials (also right after a space), whitespace
# runs of every kind, long words cut at 6 letters, digits cut at 3, underscores, non-ASCII
_PARTS = st.sampled_from(["<|im_start|>", "<|im_end|>", " <|im_end|>", "\n", "\n\n", "  ", "\t", " ", "a",
                          "word", " longerword", "12345", "_x", "é", "中文", "{}", "\"k\":", "<|im_", "|>"])
_TEXT = st.lists(_PARTS, max_size=80).map("".join)


@settings(max_examples=300, deadline=None)
@given(head=_TEXT, tail_a=_TEXT, tail_b=_TEXT)
def test_a_returning_turns_reused_prefix_gives_the_whole_texts_ids(head, tail_a, tail_b):
    # the head repeated so that a reuse (a mark 64 tokens or more in) actually happens
    first = head * 8 + tail_a
    ids, marks, _ = SIM.ids_after(first)
    assert list(ids) == tokenize(first)
    second = head * 8 + tail_b
    got, marks2, common = SIM.ids_after(second, ids, marks)
    assert list(got) == tokenize(second)
    third = second + tail_a
    assert list(SIM.ids_after(third, got, marks2)[0]) == tokenize(third)


def test_a_long_returning_turn_reuses_its_prefix():
    first = "You are an agent. " * 3000 + "<|im_end|>\n"
    ids, marks, _ = SIM.ids_after(first)
    got, _, common = SIM.ids_after(first + "<|im_start|>user\nmore", ids, marks)
    assert common is not None and common > len(ids) - 80  # all but the last mark's tokens reused
    assert list(got) == tokenize(first + "<|im_start|>user\nmore")


def test_load_tokenizer_names_the_simulators():
    assert isinstance(load_tokenizer("kvtop-sim"), SimTokenizer)
    with pytest.raises(ValueError):
        load_tokenizer("/nonexistent/tokenizer.json")


def _chat_body() -> dict:
    tools = [{"type": "function", "function": {"name": f"fn{k}", "description": "reads files " * 20,
                                               "parameters": {"type": "object", "properties": {}}}}
             for k in range(4)]
    return {"model": "sim-model", "max_tokens": 4, "tools": tools, "messages": [
        {"role": "system", "content": "be an agent " * 50},
        {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "text", "text": "at this"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "fn1", "arguments": json.dumps({"p": 1})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "file contents " * 40},
        {"role": "user", "content": "and now?"}]}


def _with_inline_system(body: dict) -> dict:
    """Claude Code's mid-conversation ``system`` message, before the last user turn."""
    msgs = list(body["messages"])
    msgs.insert(len(msgs) - 1, {"role": "system", "content": "<system-reminder>todo</system-reminder>"})
    return {**body, "messages": msgs}


@pytest.mark.parametrize("endpoint, path, body", [
    ("chat", "/v1/chat/completions", _chat_body()),  # tools and tool calls are rendered on both sides
    ("messages", "/v1/messages", {**claude_code_body(3), "stream": False}),
    ("messages", "/v1/messages", _with_inline_system({**claude_code_body(4), "stream": False})),
    ("responses", "/v1/responses", {**codex_body(3), "stream": False}),
])
async def test_the_router_counts_what_kvtop_sim_counts(aiohttp_client, endpoint, path, body):
    inst = SimInstance(Engine("h20"), model="sim-model", speed=1000.0)
    client = await aiohttp_client(create_app(inst))
    r = await client.post(path, json=body)
    assert r.status == 200, await r.text()
    usage = (await r.json())["usage"]
    engine = usage.get("prompt_tokens", usage.get("input_tokens", 0) + usage.get("cache_read_input_tokens", 0))
    counted: Counted = count_prompt(read_body(body, endpoint).prompt, 16, SIM)
    assert counted.token_source == "tokenizer"
    assert counted.input_tokens == engine
    if endpoint == "chat":  # and the ids themselves: the sim's /tokenize renders chat the same way
        ids = await (await client.post("/tokenize", json={"messages": body["messages"], "tools": body["tools"]})).json()
        assert list(counted.tokens) == ids["tokens"]


async def test_tokenizer_auto_finds_the_simulators_own_on_kvtop_sim(aiohttp_server, tmp_path, monkeypatch):
    """kvtop sim names ``kvtop-sim`` as its model's root: ``--tokenizer auto`` takes the
    simulator's tokenizer, not a real model's of the same name from the Hugging Face cache."""
    from router.app import Backend, RouterConfig
    from router.cli import resolve_tokenizer

    hub = tmp_path / "hub" / "models--Qwen--Qwen3-30B-A3B" / "snapshots" / "abc"
    hub.mkdir(parents=True)
    (hub / "tokenizer.json").write_text("{}")  # a cached real tokenizer of the served model's name
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    inst = SimInstance(Engine("h20"), model="Qwen/Qwen3-30B-A3B", speed=1000.0)
    server = await aiohttp_server(create_app(inst), host="127.0.0.1")
    cfg = RouterConfig(backends=[Backend("s", str(server.make_url("")).rstrip("/"))], tokenizer="auto",
                       db=None, state_dir=str(tmp_path / "state"))
    await resolve_tokenizer(cfg)
    assert cfg.tokenizer == "kvtop-sim"
