"""The data plane's lane through aiohttp's connection handler (router/fastlane.py).

A POST to a data-plane path on an idle keep-alive connection is served in a task of its own
instead of aiohttp's request loop; these tests pin what must not change with it: answers in
request order on one connection (pipelined, and mixed with control requests), the keep-alive
timer (an idle connection still closes; a long request is not cut), a client that leaves,
and a graceful shutdown. Each test also checks that the lane was taken, so none passes by
going through aiohttp's path alone.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from test_server import (closed_by_server, completion, connect, get, post, read_response, start,
                         wait_for)

from router import fastlane


@pytest.fixture
def lane_uses(monkeypatch):
    """How many requests the lane served."""
    seen = []
    serve_one = fastlane.FastLane._serve_one

    async def counted(self, msg, payload, handler):
        seen.append(msg.path)
        return await serve_one(self, msg, payload, handler)

    monkeypatch.setattr(fastlane.FastLane, "_serve_one", counted)
    return seen


def kind(resp) -> str:
    """Which request an answer belongs to: a completion or the health page."""
    body = json.loads(resp.body)
    return "completion" if "choices" in body else "health" if "status" in body else repr(body)[:80]


async def test_requests_on_one_connection_are_answered_in_order(router_server, fake_backends, tmp_path,
                                                                lane_uses):
    router, (fake,) = await start(router_server, fake_backends, tmp_path)
    reader, writer = await connect(router)
    writer.write(post("/v1/completions", completion()))
    assert (await read_response(reader)).status == 200
    # one after another, then all at once (pipelined), control requests between data-plane ones
    order = ["completion", "health", "completion", "completion", "health", "completion"]
    for want in order:
        writer.write(post("/v1/completions", completion()) if want == "completion" else get("/health"))
        resp = await read_response(reader)
        assert resp.status == 200 and kind(resp) == want
    writer.write(b"".join(post("/v1/completions", completion()) if k == "completion" else get("/health")
                          for k in order))
    got = [await read_response(reader) for _ in order]
    assert [r.status for r in got] == [200] * len(order)
    assert [kind(r) for r in got] == order
    assert lane_uses  # the lane served some of them
    assert len(fake.seen) == 1 + 2 * order.count("completion")
    await wait_for(lambda: router.state.cluster.counters_zero())
    writer.close()


async def test_idle_connection_after_lane_requests_is_closed(router_server, fake_backends, tmp_path,
                                                             monkeypatch, lane_uses):
    import router.app

    monkeypatch.setattr(router.app, "KEEPALIVE_TIMEOUT_S", 0.3)
    router, _ = await start(router_server, fake_backends, tmp_path)
    reader, writer = await connect(router)
    await asyncio.sleep(0.05)  # aiohttp's request loop is waiting: the first request takes the lane too
    for _ in range(3):
        writer.write(post("/v1/completions", completion()))
        assert (await read_response(reader)).status == 200
    assert len(lane_uses) == 3
    assert await closed_by_server(reader)  # the keep-alive timer still sweeps it
    writer.close()


async def test_lane_request_longer_than_keep_alive_is_not_cut(router_server, fake_backends, tmp_path,
                                                              monkeypatch, lane_uses):
    import router.app

    monkeypatch.setattr(router.app, "KEEPALIVE_TIMEOUT_S", 0.2)
    router, (fake,) = await start(router_server, fake_backends, tmp_path)
    reader, writer = await connect(router)
    writer.write(post("/v1/completions", completion()))
    assert (await read_response(reader)).status == 200
    fake.first_delay = 0.6  # the next answer takes three keep-alive timeouts
    writer.write(post("/v1/completions", completion()))
    resp = await read_response(reader)
    assert resp.status == 200 and kind(resp) == "completion"
    assert lane_uses
    writer.close()


async def test_client_leaving_mid_lane_request_is_client_gone(router_server, fake_backends, tmp_path,
                                                              lane_uses):
    router, (fake,) = await start(router_server, fake_backends, tmp_path)
    reader, writer = await connect(router)
    writer.write(post("/v1/completions", completion()))
    assert (await read_response(reader)).status == 200
    fake.first_delay = 5.0
    used = len(lane_uses)
    writer.write(post("/v1/completions", completion()))
    await wait_for(lambda: len(lane_uses) == used + 1 and len(fake.seen) == 2)
    writer.close()
    await wait_for(lambda: router.state.cluster.counters_zero())
    await wait_for(lambda: router.state.outcome_counts.get("client_gone") == 1)


async def test_shutdown_lets_a_lane_request_finish(router_server, fake_backends, tmp_path, lane_uses):
    router, (fake,) = await start(router_server, fake_backends, tmp_path)
    reader, writer = await connect(router)
    writer.write(post("/v1/completions", completion()))
    assert (await read_response(reader)).status == 200
    fake.first_delay = 0.3
    used = len(lane_uses)
    writer.write(post("/v1/completions", completion()))
    await wait_for(lambda: len(lane_uses) == used + 1)
    stopping = asyncio.create_task(router.runner.cleanup())
    resp = await read_response(reader)
    assert resp.status == 200 and kind(resp) == "completion"
    await stopping
    assert await closed_by_server(reader)
    writer.close()
