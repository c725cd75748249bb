"""Fairness between planes: control reads cannot starve completions, viewers are capped."""

from __future__ import annotations

import asyncio

import aiohttp

from router.app import STATE, Backend, RouterConfig, create_app
from router.control import CONTROL
from router.control_reads import READ_BURST


async def start(router_client, fake_backends, tmp_path, **kw):
    fakes = await fake_backends(1, **kw.pop("fake_kw", {}))
    cfg = RouterConfig(backends=[Backend("i0", fakes[0][1])], db=None, state_dir=str(tmp_path / "state"),
                       health_interval_s=0, **kw)
    client = await router_client(create_app(cfg))
    return client, client.server.app[STATE]


async def test_event_stream_viewers_are_capped_with_a_clear_503(router_client, fake_backends, tmp_path):
    client, state = await start(router_client, fake_backends, tmp_path, max_viewers=2)
    held = [await client.get("/kvtop/v1/events?types=state") for _ in range(2)]
    assert all(r.status == 200 for r in held)
    async with client.get("/kvtop/v1/events") as r:
        body = await r.json()
    assert r.status == 503 and "--max-viewers" in body["error"]["message"] and r.headers["Retry-After"]
    for r in held:
        r.close()


async def test_control_reads_are_paced_per_client_then_refused(router_client, fake_backends, tmp_path):
    """Past the burst a client's reads wait their turn at READ_RATE; a line longer than
    READ_MAX_WAIT_S is refused with 429. The data plane is not affected."""
    import time

    from router.control_reads import READ_MAX_WAIT_S, READ_RATE

    client, state = await start(router_client, fake_backends, tmp_path)
    t0 = time.monotonic()
    for _ in range(int(READ_BURST) + 25):  # the burst at once, then 25 paced reads
        async with client.get("/kvtop/v1/decisions?limit=10") as r:
            assert r.status == 200
    took = time.monotonic() - t0
    assert took >= 0.8 * 25 / READ_RATE, took
    n = int(READ_RATE * READ_MAX_WAIT_S) + 40  # more at once than the line may hold
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:  # all at once
        rs = await asyncio.gather(*(http.get(client.server.url + "/kvtop/v1/decisions?limit=10")
                                    for _ in range(n)))
        statuses = [r.status for r in rs]
        for r in rs:
            r.close()
    assert 429 in statuses and statuses.count(200) >= READ_RATE * READ_MAX_WAIT_S * 0.8
    async with client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1}) as r:
        assert r.status == 200  # the data plane is not paced by the control plane's bucket


async def test_busy_router_serves_one_shared_snapshot_to_repeated_reads(router_client, fake_backends, tmp_path):
    client, state = await start(router_client, fake_backends, tmp_path, fake_kw={"first_delay": 1.0})
    slow = asyncio.create_task(client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}))
    while state.cluster.in_flight == 0:
        await asyncio.sleep(0.01)
    bodies = []
    for _ in range(5):
        async with client.get("/kvtop/v1/state") as r:
            bodies.append(await r.read())
    guard = client.server.app[CONTROL].guard
    assert guard.served_from_snapshot >= 3 and len(set(bodies)) <= 2
    # a policy change is visible at once, snapshot or not
    async with client.put("/kvtop/v1/policy", json={"name": "round_robin"},
                          headers={"Authorization": "Bearer " + client.server.app[CONTROL].token}) as r:
        assert r.status == 200
    async with client.get("/kvtop/v1/state") as r:
        assert (await r.json())["router"]["policy_name"] == "round_robin"
    (await slow).close()


async def test_request_bodies_held_at_once_are_bounded(router_client, fake_backends, tmp_path):
    client, state = await start(router_client, fake_backends, tmp_path, max_buffered_bytes=1_000_000,
                                fake_kw={"first_delay": 0.5})
    big = {"prompt": "word " * 140_000, "max_tokens": 1}  # about 700 KB
    first = asyncio.create_task(client.post("/v1/completions", json=big))
    while state.body_bytes == 0:
        await asyncio.sleep(0.01)
    async with client.post("/v1/completions", json=big) as r:
        body = await r.json()
    assert r.status == 503 and "--max-buffered-mb" in body["error"]["message"]
    async with client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}) as r:
        assert r.status == 200  # small bodies still fit beside the big one
    resp = await first
    assert resp.status == 200
    resp.close()
    assert state.body_bytes == 0


async def test_chunked_bodies_count_against_the_bound_as_they_arrive(router_client, fake_backends, tmp_path):
    """A body without a Content-Length is counted while it arrives: a second one that would pass
    --max-buffered-mb is refused mid-body with a 503 (and its connection closed), as one whose
    length said so would be; the first is answered and the books return to zero."""
    import json

    client, state = await start(router_client, fake_backends, tmp_path, max_buffered_bytes=1_000_000,
                                fake_kw={"first_delay": 0.5})
    raw = json.dumps({"prompt": "word " * 140_000, "max_tokens": 1}).encode()  # about 700 KB

    async def chunked():
        for k in range(0, len(raw), 65536):
            yield raw[k:k + 65536]

    first = asyncio.create_task(client.post("/v1/completions", data=chunked(),
                                            headers={"Content-Type": "application/json"}))
    while state.body_bytes < len(raw):
        await asyncio.sleep(0.01)
    assert state.body_bytes == len(raw)  # counted piece by piece, though no length was declared
    try:
        async with client.post("/v1/completions", data=chunked(),
                               headers={"Content-Type": "application/json"}) as r:
            assert r.status == 503 and r.headers["Retry-After"]
            assert "--max-buffered-mb" in (await r.json())["error"]["message"]
    except aiohttp.ClientError:  # the router may close before the client has sent it all
        pass
    assert state.counts["rejected"] == 1
    resp = await first
    assert resp.status == 200, await resp.text()
    resp.close()
    assert state.body_bytes == 0


async def test_a_huge_body_is_parsed_off_the_event_loop(router_client, fake_backends, tmp_path):
    """A 40 MB prompt parses in the worker process while /health keeps answering: probes
    complete while the parse is in flight, which a parse on the event loop would not allow.
    (How fast they answer is a benchmark's question: benchmarks/bench_bodies.py, with its
    prober in a process of its own; here the test's client shares the loop.)"""
    import time

    client, state = await start(router_client, fake_backends, tmp_path, max_input_tokens=100_000_000)
    parsing: list[float] = []
    handoff = state.parser._handoff
    real_run = handoff.run

    async def timed_run(*args, **kw):
        parsing.append(time.monotonic())
        try:
            return await real_run(*args, **kw)
        finally:
            parsing.append(time.monotonic())

    handoff.run = timed_run
    huge = {"messages": [{"role": "user", "content": "word " * 200} for _ in range(40_000)], "max_tokens": 1}
    task = asyncio.create_task(client.post("/v1/chat/completions", json=huge))
    while state.body_bytes == 0:
        await asyncio.sleep(0.005)
    answered: list[float] = []
    while not task.done():
        async with client.get("/health") as r:
            assert r.status == 200
        answered.append(time.monotonic())
        await asyncio.sleep(0.01)
    resp = task.result()
    assert resp.status == 200, await resp.text()
    resp.close()
    assert state.parser.offloaded == 1 and len(parsing) == 2
    during = [t for t in answered if parsing[0] < t < parsing[1]]
    assert len(during) >= 2, (len(during), parsing[1] - parsing[0])


async def test_big_bodies_reach_the_backend_byte_for_byte(router_client, fake_backends, tmp_path):
    """Bodies over 1 MB take the chunked read and the two-buffer upstream write: the backend
    gets exactly the client's bytes (2 MB parsed on the loop, 6 MB in the worker)."""
    import json

    fakes = await fake_backends(1)
    cfg = RouterConfig(backends=[Backend("i0", fakes[0][1])], db=None, state_dir=str(tmp_path / "state"),
                       health_interval_s=0, max_input_tokens=100_000_000)
    client = await router_client(create_app(cfg))
    fake = fakes[0][0]
    for words in (400_000, 1_200_000):
        raw = json.dumps({"model": "m", "prompt": "word " * words, "max_tokens": 1}).encode()
        assert len(raw) > 1 << 20
        async with client.post("/v1/completions", data=raw, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 200, await r.text()
        assert fake.raw[-1] == raw
