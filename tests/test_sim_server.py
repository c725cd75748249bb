"""The simulated vLLM over real loopback HTTP: API shapes, usage, metrics, errors, P/D two-step."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvtop.sim.engine import Engine
from kvtop.sim.server import SimInstance, create_app
from kvtop.sim.tokenizer import count_tokens, render_chat, tokenize
from kvtop.procs import free_port_run

FAST = 1000.0   # engine seconds per wall second: a 1k-token H20 prefill takes ~0.2 ms of wall


def instance(speed: float = FAST, stream_interval_ms: float = 0.0, **engine_kw) -> SimInstance:
    engine = Engine("h20", **engine_kw)
    return SimInstance(engine, model="sim-model", speed=speed, stream_interval_ms=stream_interval_ms)


@pytest.fixture
async def sim(aiohttp_client):
    inst = instance()
    client = await aiohttp_client(create_app(inst))
    inst.port = client.server.port
    client.inst = inst
    return client


async def sse_events(resp) -> list:
    """Parsed ``data:`` payloads of an SSE response; "[DONE]" kept as a string."""
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    body = (await resp.read()).decode()
    out = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a Prometheus page, read by prometheus_client's own parser (which
    rejects a malformed line); histograms and counters come with their suffixes."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def metric(samples, name: str, **labels) -> float:
    total = 0.0
    found = False
    for (n, ls), v in samples.items():
        if n == name and set(labels.items()) <= set(ls):
            total += v
            found = True
    assert found, name
    return total


# ---------------------------------------------------------------- shapes

async def test_completion_non_streaming_shape(sim):
    resp = await sim.post("/v1/completions", json={"model": "sim-model", "prompt": "Hello there, world",
                                                   "max_tokens": 7})
    assert resp.status == 200
    body = await resp.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == "sim-model" and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert count_tokens(choice["text"]) == 7
    n = len(tokenize("Hello there, world"))
    assert body["usage"] == {"prompt_tokens": n, "completion_tokens": 7, "total_tokens": n + 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}


async def test_default_max_tokens_is_16(sim):
    body = await (await sim.post("/v1/completions", json={"prompt": [1, 2, 3]})).json()
    assert body["usage"]["completion_tokens"] == 16


async def test_completion_streaming_shape_and_usage(sim):
    resp = await sim.post("/v1/completions", json={
        "prompt": list(range(100)), "max_tokens": 12, "stream": True,
        "stream_options": {"include_usage": True}})
    events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 12
    chunks = events[:-2]
    assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert count_tokens(text) == 12
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


async def test_chat_non_streaming_and_streaming(sim):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    body = await (await sim.post("/v1/chat/completions",
                                 json={"messages": messages, "max_tokens": 5})).json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and count_tokens(msg["content"]) == 5
    assert body["usage"]["prompt_tokens"] == len(tokenize(render_chat(messages)))

    resp = await sim.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5,
                                                        "stream": True})
    events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:])
    assert count_tokens(text) == 5
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_batch_prompts_give_one_choice_each(sim):
    body = await (await sim.post("/v1/completions", json={"prompt": ["one", "two two"],
                                                          "max_tokens": 3})).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 6


async def test_stream_coalesces_tokens(aiohttp_client):
    # 200 tokens finish in well under 200 wall ms at this speed: one interval, few events.
    inst = instance(stream_interval_ms=200.0)
    client = await aiohttp_client(create_app(inst))
    events = await sse_events(await client.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 200, "stream": True}))
    content = [e for e in events[:-1] if e["choices"][0]["text"]]
    assert len(content) < 20
    assert count_tokens("".join(e["choices"][0]["text"] for e in content)) == 200


# ---------------------------------------------------------------- prefix cache through HTTP

@pytest.mark.parametrize("n, cached", [
    (100, 96),      # 16 * floor(99 / 16)
    (1024, 1008),   # block-aligned: the last block is recomputed
])
async def test_repeated_prompt_reports_cached_tokens(sim, n, cached):
    prompt = list(range(5000, 5000 + n))
    first = await (await sim.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})).json()
    again = await (await sim.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == cached


async def test_text_and_chat_prompts_hit_the_cache_too(sim):
    text = "An agentic session repeats its whole context every turn. " * 40
    for key, payload in (("prompt", text), ("messages", [{"role": "user", "content": text}])):
        path = "/v1/completions" if key == "prompt" else "/v1/chat/completions"
        await sim.post(path, json={key: payload, "max_tokens": 1})
        body = await (await sim.post(path, json={key: payload, "max_tokens": 1})).json()
        n = body["usage"]["prompt_tokens"]
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 16 * ((n - 1) // 16)


# ---------------------------------------------------------------- metrics

async def test_metrics_parse_and_counters_move(sim):
    before = parse_metrics(await (await sim.get("/metrics")).text())
    prompt = list(range(300))
    for _ in range(2):
        assert (await sim.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})).status == 200
    resp = await sim.get("/metrics")
    assert resp.headers["Content-Type"].startswith("text/plain")
    after = parse_metrics(await resp.text())

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == 600
    assert delta("vllm:generation_tokens_total") == 8
    assert delta("vllm:prefix_cache_queries_total") == 600
    assert delta("vllm:prefix_cache_hits_total") == 288     # 16 * floor(299 / 16)
    assert delta("vllm:request_success_total", finished_reason="length") == 2
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:e2e_request_latency_seconds_count") == 2
    assert delta("vllm:inter_token_latency_seconds_count") == 6
    assert delta("vllm:request_queue_time_seconds_count") == 2
    # vLLM's queue time: QUEUED (between steps) to first SCHEDULED, 0 on an idle engine
    assert delta("vllm:request_queue_time_seconds_sum") == 0.0
    assert delta("vllm:prompt_tokens_cached_total") == 288
    assert delta("vllm:request_prefill_time_seconds_count") == 2
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total", "kvtop_sim:busy_ratio"):
        metric(after, name)
    assert metric(after, "vllm:kv_cache_usage_perc") == 0.0     # idle, warm cache reads ~0
    assert metric(after, "vllm:cache_config_info", block_size="16", num_gpu_blocks="16560") == 1.0
    # every sample carries model_name and engine
    assert all({"model_name", "engine"} <= {k for k, _ in ls} for (_, ls) in after)
    assert resp.headers["Content-Type"].startswith("text/plain; version=")
    # histogram buckets are cumulative and end at _count
    ttft = sorted(((float(dict(ls)["le"]), v) for (n, ls), v in after.items()
                   if n == "vllm:time_to_first_token_seconds_bucket"))
    assert [v for _, v in ttft] == sorted(v for _, v in ttft)
    assert ttft[-1] == (float("inf"), metric(after, "vllm:time_to_first_token_seconds_count"))
    assert ttft[0][0] == 0.001 and ttft[-2][0] == 2560.0


# ---------------------------------------------------------------- other endpoints

async def test_tokenize_models_health_and_probes(sim):
    body = await (await sim.post("/tokenize", json={"prompt": "Hello, world!"})).json()
    assert body["tokens"] == tokenize("Hello, world!") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == sim.inst.engine.max_model_len
    messages = [{"role": "user", "content": "hi"}]
    body = await (await sim.post("/tokenize", json={"messages": messages})).json()
    assert body["tokens"] == tokenize(render_chat(messages))

    render = await (await sim.post("/v1/completions/render", json={"prompt": "Hello, world!"})).json()
    assert render[0]["token_ids"] == tokenize("Hello, world!")
    assert render[0]["request_id"].startswith("cmpl-")
    chat = await (await sim.post("/v1/chat/completions/render", json={"messages": messages})).json()
    assert chat["token_ids"] == tokenize(render_chat(messages))

    models = await (await sim.get("/v1/models")).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "sim-model"
    assert (await sim.get("/health")).status == 200
    for path in ("/server_info", "/get_server_info"):
        info = await (await sim.get(path)).json()
        assert info["block_size"] == 16 and info["kvtop_sim"]["profile"] == "h20"
    for path in ("/model_info", "/get_model_info"):
        info = await (await sim.get(path)).json()
        assert info["model_path"] == "sim-model" and info["is_generation"] is True
    assert "version" in await (await sim.get("/version")).json()
    assert (await (await sim.get("/load")).json()) == {"server_load": 0}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b"{not json", None),                                  # malformed JSON
    ("/v1/completions", b"[1, 2]", None),                                     # not an object
    ("/v1/completions", {"max_tokens": 3}, "prompt"),                         # missing prompt
    ("/v1/completions", {"prompt": 5}, "prompt"),                             # wrong type
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),                      # mixed list
    ("/v1/completions", {"prompt": ""}, "prompt"),                            # empty
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),    # string number
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "n": 2}, "n"),
    ("/v1/chat/completions", {"prompt": "x"}, "messages"),                    # chat needs messages
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages"),   # no role
    ("/tokenize", {"prompt": 3}, "prompt"),
])
async def test_bad_input_is_an_openai_400(sim, path, body, param):
    if isinstance(body, bytes):
        resp = await sim.post(path, data=body, headers={"Content-Type": "application/json"})
    else:
        resp = await sim.post(path, json=body)
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["message"]
    assert err["param"] == param


async def test_prompt_beyond_max_model_len_rejected_like_vllm(aiohttp_client):
    client = await aiohttp_client(create_app(instance(max_model_len=64)))
    resp = await client.post("/v1/completions", json={"prompt": list(range(60)), "max_tokens": 10})
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["message"].startswith("This model's maximum context length is 64 tokens. "
                                     "However, you requested 70 tokens")
    ok = await client.post("/v1/completions", json={"prompt": list(range(60)), "max_tokens": 4})
    assert ok.status == 200


async def test_client_disconnect_aborts_the_engine_request(aiohttp_client):
    inst = instance(speed=1.0)      # real time: 10k tokens would take over a minute
    client = await aiohttp_client(create_app(inst))
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10_000,
                                                      "stream": True})
    assert resp.status == 200
    await resp.content.readuntil(b"\n\n")      # the first tokens arrived
    assert inst.engine.num_running == 1
    resp.close()
    for _ in range(200):                        # the server notices within its 0.5 s poll
        if not inst.engine.has_work():
            break
        await asyncio.sleep(0.02)
    assert not inst.engine.has_work()
    assert inst.engine.request_success["abort"] == 1
    assert inst.engine.num_allocated_blocks() == 0


# ---------------------------------------------------------------- P/D two-step

async def test_prefill_decode_two_step(aiohttp_client):
    p_inst, d_inst = instance(), instance()
    p = await aiohttp_client(create_app(p_inst))
    d = await aiohttp_client(create_app(d_inst))
    p_inst.port = p.server.port
    prompt = list(range(1000))
    first = await (await p.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})).json()
    params = first["kv_transfer_params"]
    assert first["usage"]["completion_tokens"] == 1
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_port"] == p.server.port and params["remote_host"] == "127.0.0.1"
    assert len(params["remote_block_ids"]) == 62     # floor(999 / 16) full blocks

    second = await (await d.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": 5, "kv_transfer_params": params})).json()
    assert second["usage"]["completion_tokens"] == 5
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 992
    assert second["kv_transfer_params"] is None
    d_metrics = parse_metrics(await (await d.get("/metrics")).text())
    assert metric(d_metrics, "vllm:prefix_cache_hits_total") == 0   # pulled, not a local hit


# ---------------------------------------------------------------- the verb



async def test_kvtop_sim_verb_serves_n_instances_and_exits_by_itself(aiohttp_client):
    import sys

    import aiohttp

    base = free_port_run(2)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvtop.cli", "sim", "--instances", "2", "--port-base", str(base),
        "--profile", "cpu-tiny", "--speed", "100", "--duration", "3",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        lines = [await proc.stdout.readline() for _ in range(2)]
        assert [ln.decode().split()[2] for ln in lines] == [f"http://127.0.0.1:{base}",
                                                           f"http://127.0.0.1:{base + 1}"]
        async with aiohttp.ClientSession() as session:
            for port in (base, base + 1):
                async with session.post(f"http://127.0.0.1:{port}/v1/completions",
                                        json={"prompt": "hi", "max_tokens": 2}) as resp:
                    assert resp.status == 200
                async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                    assert 'block_size="128"' in await resp.text()
        assert await asyncio.wait_for(proc.wait(), 20) == 0     # --duration ends it
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_kvtop_sim_verb_port_in_use_is_a_one_line_error():
    import socket
    import sys

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvtop.cli", "sim", "--port-base", str(port), "--duration", "1",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtop sim: cannot listen on 127.0.0.1")


def test_kvtop_sim_stops_on_sigint_even_when_started_with_it_ignored():
    """A shell starts background jobs with SIGINT ignored; kvtop demo stops its sim with SIGINT."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "kvtop", "sim", "--instances", "1", "--port-base", str(port),
                             "--duration", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert proc.stdout.readline().startswith(b"instance 0:")  # serving
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - t0 < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_huge_prompt_is_refused_before_tokenizing_and_nested_json_is_a_json_400(aiohttp_client):
    """A 20 MB prompt is refused in milliseconds (it used to be tokenized on the event loop
    first, stalling every instance's /health), and arrays nested thousands deep are a JSON 400
    (they were a plain-text 500)."""
    import time

    client = await aiohttp_client(create_app(instance()))
    t0 = time.perf_counter()
    async with client.post("/v1/completions", json={"prompt": "word " * 4_000_000, "max_tokens": 1}) as r:
        body = await r.json()
    assert r.status == 400 and "maximum context length" in body["error"]["message"]
    assert time.perf_counter() - t0 < 1.0
    async with client.post("/v1/completions", data=b"[" * 50_000 + b"]" * 50_000,
                           headers={"Content-Type": "application/json"}) as r:
        body = await r.json()
    assert r.status == 400 and body["error"]["message"].startswith("Invalid JSON body")
