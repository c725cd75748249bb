"""kvtop sim serves /v1/messages and /v1/responses with vLLM's shapes, and a Claude Code trace
replays as Messages requests (``kvtop replay --api messages``) through the router to kvtop sim."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kvtop.replay import ReplayConfig, replay
from kvtop.sim.engine import Engine
from kvtop.sim.server import SimInstance, create_app
from router.app import STATE, Backend, RouterConfig, create_app as router_app
from test_messages import claude_code_body
from test_responses import codex_body
from test_router_e2e import rows

SAMPLE = Path(__file__).resolve().parents[1] / "kvtop" / "data" / "sample_trace.jsonl.gz"


@pytest.fixture
async def sims(aiohttp_server):
    async def make(n: int = 1):
        out = []
        for _ in range(n):
            inst = SimInstance(Engine("h20"), model="sim-model", speed=1000.0)
            server = await aiohttp_server(create_app(inst), host="127.0.0.1")
            inst.port = server.port
            out.append(str(server.make_url("")).rstrip("/"))
        return out
    return make


def events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block.strip():
            name, data = block.split("\n", 1)
            assert name.startswith("event: ") and data.startswith("data: "), block
            out.append((name[7:], json.loads(data[6:])))
    return out


async def test_sim_messages_stream_and_usage(sims, aiohttp_client):
    import aiohttp

    (url,) = await sims(1)
    async with aiohttp.ClientSession() as http:
        r = await http.post(url + "/v1/messages", json=claude_code_body(2))
        evs = events(await r.read())
        names = [n for n, _ in evs]
        assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == [
            "content_block_stop", "message_delta", "message_stop"]
        assert all(n == "content_block_delta" for n in names[2:-3]) and len(names) > 5
        assert all(d["type"] == n for n, d in evs)
        usage = evs[-2][1]["usage"]
        assert usage["output_tokens"] == 6 and usage["input_tokens"] > 1000
        # the same turn again: vLLM reports the cached part apart (input_tokens net of it)
        r = await http.post(url + "/v1/messages", json=claude_code_body(2, stream=False))
        body = await r.json()
        assert body["type"] == "message" and body["usage"]["cache_read_input_tokens"] > 1000
        assert body["usage"]["input_tokens"] + body["usage"]["cache_read_input_tokens"] == usage["input_tokens"]
        r = await http.post(url + "/v1/messages", json={"max_tokens": 3, "messages": []})
        assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"


async def test_sim_responses_store_and_previous_response_id(sims):
    import aiohttp

    a, b = await sims(2)
    async with aiohttp.ClientSession() as http:
        r = await http.post(a + "/v1/responses", json=codex_body(1))
        evs = events(await r.read())
        assert evs[0][0] == "response.created" and evs[-1][0] == "response.completed"
        assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
        first = evs[-1][1]["response"]
        assert first["usage"]["output_tokens"] == 5 and first["id"].startswith("resp_")
        follow = {"input": "and now the tests", "previous_response_id": first["id"], "max_output_tokens": 3}
        r = await http.post(a + "/v1/responses", json=follow)
        second = await r.json()
        # the stored conversation (not its instructions, as vLLM) comes before the new input
        assert r.status == 200 and second["usage"]["input_tokens"] > 150
        alone = await (await http.post(a + "/v1/responses", json={**follow, "previous_response_id": None})).json()
        assert alone["usage"]["input_tokens"] < 20
        r = await http.post(b + "/v1/responses", json=follow)  # another instance does not hold it
        assert r.status == 404 and "not found" in (await r.json())["error"]["message"]


def claude_code_trace(path: Path, sessions: int = 2, turns: int = 4) -> str:
    """The bundled sample's first Claude Code sessions (source weka), a few turns each."""
    picked: dict[str, list[dict]] = {}
    with gzip.open(SAMPLE, "rt") as f:
        header = f.readline()
        for line in f:
            r = json.loads(line)
            if r.get("source") != "weka":
                continue
            if r["session"] not in picked and len(picked) >= sessions:
                continue
            if len(picked.setdefault(r["session"], [])) < turns:
                picked[r["session"]].append(r)
    with open(path, "w") as f:
        f.write(header)
        for rs in picked.values():
            for r in rs:
                f.write(json.dumps({**r, "output_tokens": 4, "think_time": 0.0}) + "\n")
    return str(path)


@pytest.mark.parametrize("api,policy", [("messages", "leastwork"), ("messages", "unified"),
                                        ("responses", "unified")])
async def test_claude_code_trace_replays_through_router_to_sim(sims, router_server, tmp_path, api, policy):
    from kvtop.traces.loader import load_trace

    urls = await sims(2)
    cfg = RouterConfig(backends=[Backend(f"i{k}", u) for k, u in enumerate(urls)], policy=policy,
                       db=str(tmp_path / "kvtop.db"), state_dir=str(tmp_path / "state"), block_size=16)
    router = await router_server(router_app(cfg))
    state = router.app[STATE]
    trace = load_trace(claude_code_trace(tmp_path / "cc.jsonl"))
    result = await replay(sorted(trace, key=lambda r: r.arrival),
                          ReplayConfig(target=router.url, mode="closed", speed=1000.0, api=api, arm=api))
    records = result.records
    assert len(records) == 8 and all(r["status"] == "ok" for r in records), records
    assert all(r["ttft_ms"] is not None and r["output_tokens"] == 4 for r in records)
    decisions = rows(state, "decisions")
    by_session: dict[str, list] = {}
    for d in decisions:
        by_session.setdefault(d["session_id"], []).append(d)
    assert len(by_session) == 2  # one session id per trace session, from the body
    assert {d["session_source"] for d in decisions} == {"metadata_user_id" if api == "messages" else "prompt_cache_key"}
    for ds in by_session.values():
        assert len({d["instance"] for d in ds[1:]}) == 1, [d["instance"] for d in ds]
    # later turns reuse what earlier ones cached on the instance
    assert sum(r["cached_tokens"] or 0 for r in records) > 0
    assert state.cluster.counters_zero()
