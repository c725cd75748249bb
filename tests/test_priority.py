"""Program-level priority (router/priority.py): what the router sets on each request, that it
reaches a priority-scheduling kvtop sim, and that a client's own priority is kept."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import sqlite_utils

from router.body import Chunks
from router.priority import (COST_BUCKET_TOKENS, SessionOrder, apply, client_priority, priority_for,
                             with_priority)


def _decision(session: str, new_prefill: int = 0, extra: dict | None = None):
    return SimpleNamespace(request=SimpleNamespace(session_id=session), new_prefill_tokens=new_prefill,
                           extra=dict(extra or {}))


def test_session_fcfs_ranks_sessions_by_their_first_request():
    order = SessionOrder()
    seen = [priority_for("session_fcfs", _decision(s), order) for s in ("a", "b", "a", "c", "b")]
    assert seen == [0, 1, 0, 2, 1]   # a's later turns keep rank 0: ahead of b's and c's


def test_session_order_forgets_the_longest_unseen_session_past_its_bound():
    order = SessionOrder(max_sessions=2)
    assert [order.rank(s) for s in ("a", "b", "a", "c")] == [0, 1, 0, 2]   # c evicts b (a was seen again)
    assert order.rank("a") == 0 and order.rank("b") == 3                   # b comes back last in line


@pytest.mark.parametrize("mode, new_prefill, expected", [
    ("off", 50_000, None),
    ("cost", 0, 0),                                   # a full cache hit: first
    ("cost", COST_BUCKET_TOKENS - 1, 0),              # same bucket: arrival order decides
    ("cost", 20 * COST_BUCKET_TOKENS + 5, 20),
])
def test_cost_mode_buckets_new_prefill_tokens(mode, new_prefill, expected):
    assert priority_for(mode, _decision("s", new_prefill), SessionOrder()) == expected


@pytest.mark.parametrize("raw", [
    b'{"prompt": [1, 2], "max_tokens": 3}',
    b'  \n{"prompt": "say \\"priority\\": 9"}',           # the word in the text is not a key
    b'{}',
])
def test_with_priority_splices_a_first_key_and_keeps_the_rest(raw):
    out, _ = with_priority(raw, None, 7)
    assert json.loads(out) == {"priority": 7, **json.loads(raw)}
    assert out.endswith(raw.lstrip()[1:])           # the rest byte for byte


def test_with_priority_takes_chunks_and_copies_a_parsed_body():
    body = {"prompt": "x" * 10}
    raw = json.dumps(body).encode()
    out, parsed = with_priority(Chunks([raw[:5], raw[5:]], len(raw)), body, 3)
    assert json.loads(out)["priority"] == 3 and parsed == {**body, "priority": 3} and "priority" not in body


@pytest.mark.parametrize("raw, body, expected", [
    (b'{"prompt": "a", "priority": 0}', None, True),
    (b'{"prompt": "the \\"priority\\" field"}', None, False),
    (b'{"prompt": "a"}', {"prompt": "a"}, False),
    (b'{"priority": -5, "prompt": "a"}', {"priority": -5, "prompt": "a"}, True),
])
def test_client_priority(raw, body, expected):
    assert client_priority(raw, body) is expected


def test_apply_keeps_a_clients_priority_and_records_none():
    d = _decision("s", extra={"priority": 4})
    raw = b'{"prompt": "a", "priority": 1}'
    assert apply(d, raw, None) == (raw, None) and d.extra["priority"] is None
    d = _decision("s", extra={"priority": 4})
    out, _ = apply(d, b'{"prompt": "a"}', None)
    assert json.loads(out)["priority"] == 4 and d.extra["priority"] == 4
    off = _decision("s")
    assert apply(off, b'{"prompt": "a"}', None) == (b'{"prompt": "a"}', None)


def test_the_feature_knob_is_validated():
    from router.config import KnobError
    from router.features import Features

    assert Features.build().knobs["priority"] == "off"       # off by default
    assert Features.build({"priority": "session_fcfs"}).knobs["priority"] == "session_fcfs"
    with pytest.raises(KnobError, match="priority"):
        Features.build({"priority": "sjf"})


async def test_priorities_reach_a_priority_scheduling_sim_and_the_decision_rows(router_client, aiohttp_client,
                                                                               tmp_path):
    from kvtop.sim.engine import Engine
    from kvtop.sim.server import SimInstance, create_app as sim_app
    from router.app import STATE, Backend, RouterConfig, create_app

    engine = Engine("h20", scheduling_policy="priority")
    seen: list[tuple[str, int]] = []
    add = engine.add_request
    engine.add_request = lambda r: (seen.append((r.request_id, r.priority)), add(r))[1]
    inst = SimInstance(engine, model="sim-model", speed=1000.0)
    sim = await aiohttp_client(sim_app(inst))
    inst.port = sim.server.port
    cfg = RouterConfig(backends=[Backend("i0", str(sim.make_url("")).rstrip("/"))], policy="leastwork",
                       knobs={"priority": "session_fcfs"}, db=str(tmp_path / "kvtop.db"),
                       state_dir=str(tmp_path / "state"))
    client = await router_client(create_app(cfg))
    state = client.server.app[STATE]
    for session, body in (("s0", {"prompt": "hello " * 40, "max_tokens": 2}),
                          ("s1", {"prompt": "other " * 40, "max_tokens": 2}),
                          ("s0", {"prompt": "hello " * 50, "max_tokens": 2}),
                          ("s2", {"prompt": "third " * 40, "max_tokens": 2, "priority": -3})):   # its own
        r = await client.post("/v1/completions", json=body, headers={"X-Session-ID": session})
        assert r.status == 200, await r.text()
    assert [p for _, p in seen] == [0, 1, 0, -3]
    state.writer.flush()
    rows = list(sqlite_utils.Database(cfg.db).query("SELECT session_id, priority FROM decisions ORDER BY id"))
    assert [(x["session_id"], x["priority"]) for x in rows] == [("s0", 0), ("s1", 1), ("s0", 0), ("s2", None)]


async def test_a_fcfs_sim_refuses_a_nonzero_priority_as_vllm_does(aiohttp_client):
    from kvtop.sim.engine import Engine
    from kvtop.sim.server import SimInstance, create_app as sim_app

    inst = SimInstance(Engine("h20"), model="sim-model", speed=1000.0)
    sim = await aiohttp_client(sim_app(inst))
    r = await sim.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "priority": 2})
    assert r.status == 400
    err = (await r.json())["error"]
    assert err["message"] == "Got priority 2 but Priority scheduling is not enabled." and err["param"] == "priority"
    ok = await sim.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "priority": 0})
    assert ok.status == 200
    r = await sim.post("/v1/messages", json={"model": "m", "max_tokens": 1, "priority": 2,
                                             "messages": [{"role": "user", "content": "hi"}]})
    assert r.status == 400 and "Priority scheduling is not enabled" in await r.text()
