"""Backend health: probes, passive marking, backoff, re-admission, events and config rows."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import sqlite_utils
from aiohttp import web
from aiohttp.test_utils import TestServer

from conftest import free_port
from fakevllm import CLOSED_PORT, FakeVLLM
from router.app import STATE, Backend, RouterConfig, create_app
from router.health import FAIL_THRESHOLD, backoff_s


@pytest.mark.parametrize("failures, expected", [
    (0, 0.5),   # healthy: the plain interval
    (1, 0.5),   # first failure: one interval
    (2, 1.0),   # then doubling
    (3, 2.0),
    (4, 4.0),
    (5, 5.0),   # capped
    (500, 5.0),  # no overflow however long it stays down
])
def test_backoff(failures, expected):
    assert backoff_s(failures, 0.5, 5.0) == expected


async def start(router_client, urls, tmp_path, **kw):
    cfg = RouterConfig(backends=[Backend(f"i{k}", u) for k, u in enumerate(urls)],
                       db=str(tmp_path / "h.db"), state_dir=str(tmp_path / "st"), **kw)
    client = await router_client(create_app(cfg))
    state = client.server.app[STATE]
    events: list[dict] = []
    state.listeners.append(lambda kind, p: events.append(p) if kind == "health" else None)
    return client, state, events


async def wait_for(cond, timeout: float) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not met in time"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


def health_rows(state):
    state.writer.flush()
    return [r for r in sqlite_utils.Database(state.config.db)["config_events"].rows if r["kind"] == "health"]


async def test_down_backend_is_excluded_then_readmitted(router_client, tmp_path):
    """A backend that stops is out within 2 s; after it restarts on its port it is back."""
    port = free_port()
    fake = FakeVLLM("f0")
    server = TestServer(fake.app(), host="127.0.0.1", port=port)
    await server.start_server()
    other = TestServer(FakeVLLM("f1").app(), host="127.0.0.1")
    await other.start_server()
    client, state, events = await start(
        router_client, [f"http://127.0.0.1:{port}", str(other.make_url("")).rstrip("/")], tmp_path,
        health_interval_s=0.2, health_backoff_max_s=0.8, policy="round_robin")
    await server.close()
    t = await wait_for(lambda: not state.cluster.instances[0].healthy, 2.0)
    assert t < 2.0
    for _ in range(4):  # nothing is sent to the down instance meanwhile
        r = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
        assert r.status == 200 and r.headers["X-Kvtop-Instance"] == "i1"
    await asyncio.sleep(1.0)  # several backed-off probes fail
    assert app_checker(client).probes[0].failures >= 2
    server = TestServer(fake.app(), host="127.0.0.1", port=port)
    await server.start_server()
    # re-admitted within one capped backoff plus one probe
    await wait_for(lambda: state.cluster.instances[0].healthy, 0.8 + 0.2 + 1.0)
    assert [(e["instance"], e["healthy"], e["source"]) for e in events] == [("i0", False, "probe"),
                                                                          ("i0", True, "probe")]
    assert "connect failed" in events[0]["reason"]
    rows = health_rows(state)
    after = [json.loads(r["after"]) for r in rows]
    assert [(r["who"], a["instance"], a["healthy"]) for r, a in zip(rows, after)] == [
        ("probe", "i0", False), ("probe", "i0", True)]
    await server.close()
    await other.close()


def app_checker(client):
    return client.server.app[STATE].health


async def test_connect_failure_marks_down_at_once(router_client, fake_backends, tmp_path):
    """Passive marking: the proxy's failed connect excludes the instance before any probe."""
    fakes = await fake_backends(1)
    client, state, events = await start(
        router_client, [f"http://127.0.0.1:{CLOSED_PORT}", fakes[0][1]], tmp_path,
        health_interval_s=0, policy="round_robin")  # no active probes: only the proxy marks
    r = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
    assert r.status == 200 and r.headers["X-Kvtop-Instance"] == "i1"  # retried elsewhere
    assert not state.cluster.instances[0].healthy
    assert [(e["instance"], e["healthy"], e["source"]) for e in events] == [("i0", False, "proxy")]
    assert "ConnectFailed" in events[0]["reason"]
    for _ in range(3):  # round robin no longer offers i0, so no more retries
        r = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
        assert r.headers["X-Kvtop-Instance"] == "i1"
    assert state.counts["retries"] == 1
    assert state.cluster.counters_zero()
    assert [r["who"] for r in health_rows(state)] == ["proxy"]


class FlakyHealth:
    """A /health that answers with a scripted status, or hangs."""

    def __init__(self):
        self.status = 200
        self.hang = False

    def app(self) -> web.Application:
        app = web.Application()

        async def health(request):
            if self.hang:
                await asyncio.sleep(30)
            return web.Response(status=self.status)
        app.router.add_get("/health", health)
        return app


async def test_soft_failures_need_a_streak(router_client, tmp_path):
    """One 5xx or one timeout does not take a busy instance out; FAIL_THRESHOLD in a row do."""
    flaky = FlakyHealth()
    server = TestServer(flaky.app(), host="127.0.0.1")
    await server.start_server()
    client, state, events = await start(router_client, [str(server.make_url("")).rstrip("/")], tmp_path,
                                        health_interval_s=0.1, health_timeout_s=0.2)
    checker = app_checker(client)
    await wait_for(lambda: checker.probes[0].probes >= 1, 2)
    # one failed probe, then good again: stays healthy
    ok, hard, why = False, False, "/health answered HTTP 503"
    checker.after_probe(0, ok, hard, why)
    assert state.cluster.instances[0].healthy
    flaky.status = 503
    await wait_for(lambda: not state.cluster.instances[0].healthy, 0.1 * (FAIL_THRESHOLD + 3) + 1)
    assert "HTTP 503" in events[-1]["reason"]
    flaky.status = 200
    await wait_for(lambda: state.cluster.instances[0].healthy, 3)
    flaky.hang = True
    await wait_for(lambda: not state.cluster.instances[0].healthy, (0.1 + 0.2) * (FAIL_THRESHOLD + 2) + 1)
    assert "timed out" in events[-1]["reason"]
    await server.close()


async def test_timeouts_across_the_fleet_at_once_do_not_take_it_all_out(router_client, fake_backends, tmp_path):
    """Every probe timing out together (an overloaded host, a stalled loop) is held, not counted:
    the old rule marked the whole fleet down and answered 503 to every request. One instance
    timing out alone still goes down after FAIL_THRESHOLD, and a fleet-wide streak past
    CORRELATED_MAX_FAILURES counts."""
    from router.health import CORRELATED_MAX_FAILURES

    fakes = await fake_backends(3)
    client, state, events = await start(router_client, [u for _, u in fakes], tmp_path, health_interval_s=0)
    checker = app_checker(client)
    insts = state.cluster.instances
    timeout = "/health timed out after 1 s"
    for _ in range(FAIL_THRESHOLD + 1):  # every instance, round after round
        for i in range(3):
            checker.after_probe(i, False, False, timeout)
    assert all(s.healthy for s in insts) and all(checker.probes[i].held >= 1 for i in range(3))
    r = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
    assert r.status == 200
    for i in range(3):
        checker.after_probe(i, True, False, None)
    assert checker.probes[0].held == 0
    for _ in range(FAIL_THRESHOLD):  # i0 alone: it goes down as before
        checker.after_probe(0, False, False, timeout)
    assert not insts[0].healthy and insts[1].healthy and insts[2].healthy
    for _ in range(CORRELATED_MAX_FAILURES):  # i1 and i2 together, for long: counted in the end
        for i in (1, 2):
            checker.after_probe(i, False, False, timeout)
    assert not insts[1].healthy and not insts[2].healthy
    assert state.cluster.counters_zero()


async def test_a_timeout_is_confirmed_before_it_counts(router_client, tmp_path):
    """One /health that times out (a stalled loop fires its timer late) and then answers at once
    is not a failure; one that keeps hanging is."""
    flaky = FlakyHealth()
    server = TestServer(flaky.app(), host="127.0.0.1")
    await server.start_server()
    client, state, events = await start(router_client, [str(server.make_url("")).rstrip("/")], tmp_path,
                                        health_interval_s=0, health_timeout_s=0.2)
    checker = app_checker(client)
    hung = {"n": 0}

    async def once_slow(request):
        hung["n"] += 1
        if hung["n"] == 1:
            await asyncio.sleep(1)
        return web.Response(status=200)

    app = web.Application()
    app.router.add_get("/health", once_slow)
    slow = TestServer(app, host="127.0.0.1")
    await slow.start_server()
    state.cluster.instances[0].url = str(slow.make_url("")).rstrip("/")
    assert await checker.probe(0) == (True, False, None) and hung["n"] == 2
    state.cluster.instances[0].url = str(server.make_url("")).rstrip("/")
    flaky.hang = True
    ok, hard, why = await checker.probe(0)
    assert (ok, hard) == (False, False) and "timed out" in why
    await slow.close()
    await server.close()


async def test_unhealthy_at_start_is_admitted_when_it_answers(router_client, fake_backends, tmp_path):
    """`kvtop route` marks a silent backend down at start; the checker brings it in later."""
    fakes = await fake_backends(1)
    client, state, events = await start(router_client, [fakes[0][1]], tmp_path, health_interval_s=0.1)
    state.cluster.set_healthy(0, False)  # as cli.serve does for a backend that did not answer
    r = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
    assert r.status == 503 and r.headers["Retry-After"] == "1"
    await wait_for(lambda: state.cluster.instances[0].healthy, 2)
    r = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
    assert r.status == 200


async def test_busy_instance_is_not_taken_out_by_slow_probes(router_client, fake_backends, tmp_path):
    """Timeouts while the instance keeps completing requests are forgiven; a refusal is not."""
    fakes = await fake_backends(1)
    client, state, events = await start(router_client, [fakes[0][1]], tmp_path, health_interval_s=0)
    checker = app_checker(client)
    inst = state.cluster.instances[0]
    for _ in range(FAIL_THRESHOLD + 2):
        inst.routed_total += 1  # one more request finished since the last probe
        checker.after_probe(0, False, False, "/health timed out after 1 s")
    assert inst.healthy and checker.probes[0].forgiven == FAIL_THRESHOLD + 2
    for _ in range(FAIL_THRESHOLD):  # no progress: the streak counts
        checker.after_probe(0, False, False, "/health timed out after 1 s")
    assert not inst.healthy
    checker.after_probe(0, True, False, None)
    inst.routed_total += 1
    checker.after_probe(0, False, True, "connect failed: refused")  # hard: out at once
    assert not inst.healthy
