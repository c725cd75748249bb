"""Nothing dies silently: a malformed KV-event batch, a background task that dies, and what
the router shows for them (state, /health, /metrics, decisions' index_source)."""

from __future__ import annotations

import asyncio
import logging
import time

import msgpack
import pytest

from kvfake import FakeEngineCache, FakePublisher, connected, wait_for
from router import kv_events
from router.app import STATE, Backend, RouterConfig, create_app
from router.exact_index import ExactIndex
from router.kv_batches import seq_bytes
from router.kv_events import EXACT, RESYNC, Subscriber
from router.supervise import Supervisor

BS = 16


def _stored(hashes, parent=None, tokens=None):
    """A BlockStored batch as vLLM 0.32 lays it out, with whatever hashes we like."""
    return msgpack.packb([0.0, [{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                                 "token_ids": tokens if tokens is not None else list(range(BS * len(hashes))),
                                 "block_size": BS, "lora_id": None, "medium": "GPU"}]])


#: Batches that decode (the fields have the right outer types) but cannot be applied: before,
#: each raised out of the subscriber's task, which ended silently with the instance still exact.
MALFORMED = [
    pytest.param(_stored([[1, 2]]), id="block_hashes-holds-an-array"),
    pytest.param(_stored([7], parent={"a": 1}), id="parent_block_hash-is-a-map"),
    pytest.param(_stored([{"x": 1}, 9]), id="block_hashes-holds-a-map"),
]


# -- the supervisor itself -------------------------------------------------------------------------
async def test_a_task_that_dies_is_logged_counted_restarted_and_shown(caplog):
    now = [1000.0]
    sup = Supervisor(backoff_s=0.01, clock=lambda: now[0])
    runs = []
    deaths = []

    async def work():
        runs.append(1)
        if len(runs) <= 2:
            raise ValueError(f"boom {len(runs)}")
        await asyncio.sleep(3600)

    with caplog.at_level(logging.ERROR, logger="kvtop.supervise"):
        task = sup.spawn("probe-0", work, kind="health-probe", on_death=deaths.append)
        await wait_for(lambda: len(runs) == 3)
    try:
        h = sup.tasks["probe-0"]
        assert (h.deaths, h.restarts, h.running) == (2, 2, True)
        assert h.last_error == "ValueError: boom 2" and [str(e) for e in deaths] == ["boom 1", "boom 2"]
        assert [r.getMessage() for r in caplog.records if "probe-0" in r.getMessage()].__len__() == 2
        assert [d["task"] for d in sup.degraded()] == ["probe-0"]  # restarted, but died a moment ago
        now[0] += 61
        assert sup.degraded() == []  # a minute later it is history (still counted)
        assert sup.snapshot()[0]["deaths"] == 2
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert not sup.tasks["probe-0"].running


async def test_a_task_that_returns_counts_as_a_death():
    sup = Supervisor(backoff_s=0.01)
    runs = []

    async def work():
        runs.append(1)
        if len(runs) > 1:
            await asyncio.sleep(3600)

    task = sup.spawn("t", work, kind="telemetry")
    await wait_for(lambda: len(runs) == 2)
    task.cancel()
    assert sup.tasks["t"].deaths == 1 and "returned" in sup.tasks["t"].last_error


# -- a malformed batch, message by message ---------------------------------------------------------
@pytest.mark.parametrize("payload", MALFORMED)
async def test_a_batch_that_cannot_be_applied_resyncs_and_does_not_end_the_subscriber(payload, caplog):
    pub = FakePublisher(replay=False)
    idx = ExactIndex(1, BS)
    sub = Subscriber(idx, 0, pub.endpoint, resync_tokens=BS * 4)
    await sub.start()
    await connected(sub, pub)
    try:
        eng = FakeEngineCache(BS)
        pub.publish(eng.run(list(range(64))))
        await wait_for(lambda: sub.state == EXACT and sub.stats.batches == 1)
        with caplog.at_level(logging.INFO, logger="kvtop.kv_events"):
            pub.send_raw([b"", seq_bytes(1), payload])
            pub.seq = 2
            t0 = time.monotonic()
            await wait_for(lambda: sub.state == RESYNC, timeout=2.0)
        assert time.monotonic() - t0 < 2.0 and not idx.is_live(0)
        assert "batch 1 could not be applied (TypeError" in sub.stats.reason
        lines = [r for r in caplog.records if r.name == "kvtop.kv_events"]
        assert len(lines) == 1 and lines[0].levelno == logging.WARNING, [r.getMessage() for r in lines]
        assert sub.stats.unapplied == 1 and sub.stats.task_deaths == 0
        assert not any(t.done() for t in sub._tasks)  # the subscriber goes on
        pub.publish(eng.run(list(range(1000, 1064))))  # a cache's worth of new blocks: resynced
        await wait_for(lambda: sub.state == EXACT)
        assert idx.is_live(0)
    finally:
        await sub.stop()
        await pub.close()


async def test_a_malformed_batch_in_a_replay_resyncs_too():
    pub = FakePublisher()
    idx = ExactIndex(1, BS)
    sub = Subscriber(idx, 0, pub.endpoint, replay_endpoint=pub.replay_endpoint, resync_tokens=BS * 4)
    await sub.start()
    await connected(sub, pub)
    try:
        eng = FakeEngineCache(BS)
        pub.publish(eng.run(list(range(64))))
        await wait_for(lambda: sub.stats.batches == 1)
        pub.buffer.append((1, _stored([[1, 2]])))  # lost on the live socket, poisoned in the replay
        pub.seq = 2
        pub.publish(eng.run(list(range(500, 532))), drop=False)  # reveals the gap
        await wait_for(lambda: sub.expected == 3)
        assert sub.state == RESYNC and sub.stats.unapplied == 1 and not idx.is_live(0)
        assert not any(t.done() for t in sub._tasks)
        pub.publish(eng.clear())  # the engine's cache emptied: everything is known again
        await wait_for(lambda: sub.state == EXACT)
    finally:
        await sub.stop()
        await pub.close()


async def test_a_subscriber_task_that_dies_is_restarted_and_never_called_exact(caplog):
    pub = FakePublisher(replay=False)
    idx = ExactIndex(1, BS)
    sup = Supervisor(backoff_s=0.01)
    sub = Subscriber(idx, 0, pub.endpoint, resync_tokens=BS * 4, supervisor=sup)
    await sub.start()
    await connected(sub, pub)
    try:
        eng = FakeEngineCache(BS)
        pub.publish(eng.run(list(range(64))))
        await wait_for(lambda: sub.state == EXACT and sub.stats.batches == 1)
        real = sub._handle_safely

        def broken(frames):  # a bug anywhere in the receive loop, not only in one batch
            sub._handle_safely = real
            raise RuntimeError("a bug in the loop")

        sub._handle_safely = broken
        with caplog.at_level(logging.ERROR, logger="kvtop.supervise"):
            pub.publish(eng.run(list(range(200, 232))))
            await wait_for(lambda: sub.stats.task_deaths == 1, timeout=2.0)
        assert sub.state == RESYNC and not idx.is_live(0) and "task died" in sub.stats.reason
        assert any("kv-events-0 died" in r.getMessage() for r in caplog.records)
        assert [d["task"] for d in sup.degraded()] == ["kv-events-0"]
        await wait_for(lambda: sup.tasks["kv-events-0"].running)
        pub.publish(eng.run(list(range(1000, 1064))))  # the restarted loop reads on: a gap, then a resync
        await wait_for(lambda: sub.state == EXACT)
    finally:
        await sub.stop()
        await pub.close()


# -- what the router shows -------------------------------------------------------------------------
def _metric(text: str, name: str, **labels) -> float | None:
    """One sample's value from Prometheus text, by name and (a subset of) its labels."""
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return None


async def test_router_shows_a_malformed_batch_within_two_seconds(router_client, fake_backends, tmp_path):
    fakes = await fake_backends(1)
    pub = FakePublisher(replay=False)
    cfg = RouterConfig(backends=[Backend("i0", fakes[0][1], kv_events=pub.endpoint)], policy="leastwork",
                       block_size=BS, db=None, state_dir=str(tmp_path / "state"), kv_speculative_ttl_s=0,
                       capacity_tokens=BS * 4)
    client = await router_client(create_app(cfg))
    state = client.server.app[STATE]
    try:
        sub = state.kv_subscribers[0]
        await connected(sub, pub)
        eng = FakeEngineCache(BS)
        prompt = list(range(50, 50 + BS * 4))
        pub.publish(eng.run(prompt))
        await wait_for(lambda: sub.state == EXACT and sub.stats.batches == 1)

        async def routed_source() -> str:
            r = await client.post("/v1/completions", json={"prompt": prompt + [1], "max_tokens": 1})
            assert r.status == 200
            return state.ring[-1]["index_source"]

        assert await routed_source() == "exact"
        pub.send_raw([b"", seq_bytes(1), _stored([[1, 2]])])
        pub.seq = 2
        await wait_for(lambda: sub.state == RESYNC, timeout=2.0)
        snap = await (await client.get("/kvtop/v1/state")).json()
        inst = snap["instances"][0]
        assert inst["index_source"] == "estimate" and inst["kv_events"]["state"] == "resync"
        assert "could not be applied" in inst["kv_events"]["reason"] and inst["kv_events"]["unapplied"] == 1
        metrics = await (await client.get("/metrics")).text()
        assert _metric(metrics, "kvtop_instance_kv_index_exact", instance="i0") == 0
        assert _metric(metrics, "kvtop_instance_kv_events_state", instance="i0", state="resync") == 1
        assert await routed_source() == "estimate"
        pub.publish(eng.clear())  # the next good resync
        await wait_for(lambda: sub.state == EXACT)
        pub.publish(eng.run(prompt))
        await wait_for(lambda: sub.stats.batches == 3)
        assert await routed_source() == "exact"
        metrics = await (await client.get("/metrics")).text()
        assert _metric(metrics, "kvtop_instance_kv_index_exact", instance="i0") == 1
    finally:
        await pub.close()


async def test_router_shows_a_dead_task_in_health_state_and_metrics(router_client, fake_backends, tmp_path):
    fakes = await fake_backends(1)
    pub = FakePublisher(replay=False)
    cfg = RouterConfig(backends=[Backend("i0", fakes[0][1], kv_events=pub.endpoint)], policy="leastwork",
                       block_size=BS, db=str(tmp_path / "kvtop.db"), state_dir=str(tmp_path / "state"))
    client = await router_client(create_app(cfg))
    state = client.server.app[STATE]
    try:
        assert (await (await client.get("/health")).json())["degraded"] == []
        snap = await (await client.get("/kvtop/v1/state")).json()
        assert snap["degraded"] == [] and {t["task"] for t in snap["tasks"]} >= {"kv-events-0", "health-probe-0",
                                                                                  "telemetry"}
        sub = state.kv_subscribers[0]
        await connected(sub, pub)
        real = sub._handle_safely

        def broken(frames):
            sub._handle_safely = real
            raise RuntimeError("a bug in the loop")

        sub._handle_safely = broken
        pub.publish(FakeEngineCache(BS).run(list(range(64))))
        await wait_for(lambda: sub.stats.task_deaths == 1, timeout=2.0)
        health = await client.get("/health")
        body = await health.json()
        assert health.status == 200 and body["status"] == "degraded"
        assert [d["task"] for d in body["degraded"]] == ["kv-events-0"]
        assert body["degraded"][0]["last_error"] == "RuntimeError: a bug in the loop"
        snap = await (await client.get("/kvtop/v1/state")).json()
        assert [d["task"] for d in snap["degraded"]] == ["kv-events-0"]
        metrics = await (await client.get("/metrics")).text()
        assert _metric(metrics, "kvtop_background_task_deaths_total", task="kv-events-0", kind="kv-subscriber") == 1
        assert _metric(metrics, "kvtop_background_task_degraded", task="kv-events-0", kind="kv-subscriber") == 1
        assert _metric(metrics, "kvtop_background_task_degraded", task="decision-log", kind="writer") == 0
    finally:
        await pub.close()


def test_a_writer_window_that_fails_outside_sqlite_is_counted_and_the_writer_goes_on(tmp_path, caplog):
    from store.writer import Writer

    w = Writer(str(tmp_path / "w.db"), flush_interval=0.01).start()
    try:
        class Unencodable(dict):
            def get(self, key, default=None):  # a row whose values blow up while encoding
                raise KeyError("not a row")

        with caplog.at_level(logging.ERROR, logger="kvtop.store"):
            w.put("outcomes", Unencodable())
            assert w.flush(5)
        h = w.health()
        assert h["thread_deaths"] == 1 and h["rows_failed"] == 1 and h["degraded"]
        assert any("write window failed" in r.getMessage() for r in caplog.records)
        w.put("outcomes", {"run_id": "r", "request_id": "x", "status": "ok"})
        assert w.flush(5) and w.health()["rows_written"] == 1  # the thread went on
    finally:
        w.close()


# -- exact for real traffic: where tokens cannot match, say so ----------------------------------------
async def test_kv_events_without_a_tokenizer_warn_and_show_that_text_routes_on_the_estimate(
        router_client, fake_backends, tmp_path, caplog):
    fakes = await fake_backends(1)
    pub = FakePublisher()
    cfg = RouterConfig(backends=[Backend("i0", fakes[0][1], kv_events=pub.endpoint, kv_replay=pub.replay_endpoint)],
                       policy="leastwork", block_size=BS, db=None, state_dir=str(tmp_path / "state"))
    with caplog.at_level(logging.WARNING, logger="kvtop.route"):
        client = await router_client(create_app(cfg))
    state = client.server.app[STATE]
    try:
        assert any("no --tokenizer" in r.getMessage() for r in caplog.records)  # the startup warning
        sub = state.kv_subscribers[0]
        await connected(sub, pub)
        await wait_for(lambda: sub.state == EXACT)
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi " * 50}],
                                                              "max_tokens": 1})
        assert r.status == 200
        assert state.ring[-1]["index_source"] == "estimate" and state.ring[-1]["token_source"] == "text_approx"
        r = await client.post("/v1/completions", json={"prompt": list(range(40)), "max_tokens": 1})
        assert r.status == 200 and state.ring[-1]["index_source"] == "exact"
        snap = await (await client.get("/kvtop/v1/state")).json()
        assert snap["instances"][0]["index_source"] == "exact"  # its events flow...
        assert "no --tokenizer" in snap["router"]["token_warning"]  # ...but text cannot use them
        assert snap["decisions_by_index_source"] == {"estimate": 1, "exact": 1}
        assert snap["decisions_by_token_source"] == {"text_approx": 1, "tokens": 1}
        metrics = await (await client.get("/metrics")).text()
        assert _metric(metrics, "kvtop_decisions_by_source_total", index_source="estimate",
                       token_source="text_approx") == 1
    finally:
        await pub.close()
