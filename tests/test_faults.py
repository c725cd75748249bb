"""Faults: an instance killed mid-replay, timeouts, overload, oversized or stalled bodies,
and the control plane's security promises. Everything runs on 127.0.0.1 and is bounded in time.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
import stat
import subprocess
import sys
import time

import aiohttp
import pytest
import sqlite_utils

from conftest import free_port
from router.app import STATE, Backend, RouterConfig, create_app
from router.control import CONTROL, Control

# -- an instance killed in the middle of a replay ---------------------------------------------


def start_sim(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "kvtop", "sim", "--instances", "1", "--port-base", str(port),
                             "--speed", "4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = proc.stdout.readline()
    if b"instance 0" not in line:
        proc.kill()
        proc.wait(5)
        raise AssertionError(f"kvtop sim did not start: {proc.stderr.read().decode()}")
    return proc


async def get_state(http, base) -> dict:
    async with http.get(base + "/kvtop/v1/state") as r:
        return await r.json()


async def wait_instance(http, base, name, healthy: bool, timeout: float) -> float:
    t0 = time.monotonic()
    while True:
        st = await get_state(http, base)
        if next(i for i in st["instances"] if i["name"] == name)["healthy"] == healthy:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < timeout, f"{name} not healthy={healthy} within {timeout} s"
        await asyncio.sleep(0.05)


def trace(sessions: int = 12, turns: int = 8, span_s: float = 5.0):
    from kvtop.traces.loader import TraceRequest

    out = []
    for s in range(sessions):
        hashes: list[int] = []
        for t in range(turns):
            hashes = hashes + [s * 1000 + len(hashes) + k for k in range(8)]  # 512 tokens more a turn
            out.append(TraceRequest(arrival=span_s * (t * sessions + s) / (sessions * turns), session=f"s{s}",
                                    turn=t + 1, input_tokens=len(hashes) * 64, output_tokens=60,
                                    hash_ids=list(hashes), block_size=64))
    return sorted(out, key=lambda r: r.arrival)


async def test_instance_killed_mid_replay(tmp_path):
    from kvtop.replay import ReplayConfig, replay

    ports = [free_port() for _ in range(3)]
    sims: list[subprocess.Popen] = []
    try:
        for p in ports:
            sims.append(start_sim(p))
    except BaseException:  # one failed to start: end the ones already serving
        for s in sims:
            s.kill()
            s.wait(5)
        raise
    port = free_port()
    db = tmp_path / "faults.db"
    route = subprocess.Popen(
        [sys.executable, "-m", "kvtop", "route", "--port", str(port), "--db", str(db), "--state-dir",
         str(tmp_path / "st"), "--policy", "leastwork", "--health-interval", "0.25", "--health-backoff-max", "1",
         *[a for p in ports for a in ("--backend", f"http://127.0.0.1:{p}")]],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    requests = trace()
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(150):
                try:
                    if (await get_state(http, base))["totals"]["healthy_instances"] == 3:
                        break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
            run = asyncio.create_task(replay(requests, ReplayConfig(target=base, arm="faults", timeout=30)))
            t0 = time.monotonic()
            await asyncio.sleep(1.5)
            sims[1].kill()  # SIGKILL, by pid: the engine and its open streams vanish
            killed_at = time.time()
            sims[1].wait(5)
            excluded_in = await wait_instance(http, base, "i1", False, 2.0)
            await asyncio.sleep(max(0.0, 3.0 - (time.monotonic() - t0)))
            sims[1] = start_sim(ports[1])
            restarted = time.monotonic()
            await wait_instance(http, base, "i1", True, 1.0 + 0.25 + 2.0)  # capped backoff + a probe + slack
            readmitted_in = time.monotonic() - restarted
            result = await run
            await asyncio.sleep(0.3)
            st = await get_state(http, base)
    finally:
        route.send_signal(signal.SIGTERM)
        try:
            route.wait(20)
        finally:
            for p in sims:
                p.kill()
                p.wait(5)
    assert route.returncode == 0, route.stderr.read().decode()
    print(f"excluded in {excluded_in:.2f} s, re-admitted {readmitted_in:.2f} s after restart")
    records = result.records
    assert len(records) == len(requests)
    failed = [r for r in records if r["status"] != "ok"]
    # Only requests whose stream had begun on the killed instance fail, with a clear error;
    # every other request succeeds, including those that hit the dead port before it was
    # excluded (retried elsewhere before any byte was sent).
    assert all(r["instance"] == "i1" and "i1 failed mid-stream" in r["error"] for r in failed), failed
    assert len(failed) <= 6
    kill_offset = killed_at - result.started_at
    assert all(r["status"] == "ok" for r in records if r["sent_at"] > kill_offset + 0.05)
    # counters back to zero, through the control API
    tot = st["totals"]
    assert tot["in_flight"] == 0 and tot["num_requests"] == 0 and tot["pending_prefill_tokens"] == 0
    assert all(i["num_requests"] == 0 and i["decode_tokens"] == 0 for i in st["instances"])
    d = sqlite_utils.Database(db)
    rows = list(d["decisions"].rows)
    retries = [r for r in rows if r["attempt"] == 2]
    # one attempt-1 decision per request sent; each retry is one extra row, reason 'retry',
    # on another instance than the request's first attempt (which was i1)
    assert len([r for r in rows if r["attempt"] == 1]) == len(requests)
    assert len(rows) == len(requests) + len(retries)
    assert all(r["reason"] == "retry" and r["instance"] != "i1" for r in retries)
    first = {r["request_id"]: r for r in rows if r["attempt"] == 1}
    assert all(first[r["request_id"]]["instance"] == "i1" for r in retries)
    assert d["outcomes"].count == len(rows)  # one outcome per attempt
    failed_ids = {r["request_id"] for r in failed}
    # a mid-stream failure is reported within a second of the kill: it fails fast
    cut = [o for o in d["outcomes"].rows if o["request_id"] in failed_ids]
    assert all(o["t_done"] - killed_at < 1.0 for o in cut)
    health = [json.loads(r["after"]) for r in d["config_events"].rows if r["kind"] == "health"]
    assert [(h["instance"], h["healthy"]) for h in health] == [("i1", False), ("i1", True)]


# -- timeouts, overload and limits, in-process ----------------------------------------------

async def start(router_client, urls, tmp_path, **kw):
    cfg = RouterConfig(backends=[Backend(f"i{k}", u) for k, u in enumerate(urls)], db=str(tmp_path / "f.db"),
                       state_dir=str(tmp_path / "st"), health_interval_s=0, **kw)
    client = await router_client(create_app(cfg))
    return client, client.server.app[STATE]


def outcome_statuses(state) -> list[str]:
    state.writer.flush()
    return [r["status"] for r in sqlite_utils.Database(state.config.db)["outcomes"].rows]


async def test_read_timeout_before_first_byte_is_retried_then_502(router_client, fake_backends, tmp_path):
    fakes = await fake_backends(2, first_delay=2.0)
    client, state = await start(router_client, [u for _, u in fakes], tmp_path, read_timeout_s=0.2)
    t0 = time.monotonic()
    r = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "stream": True})
    assert r.status == 502 and "failed" in (await r.json())["error"]["message"]
    assert time.monotonic() - t0 < 1.5  # two attempts of 0.2 s, not the backend's 2 s
    assert outcome_statuses(state) == ["timeout", "timeout"]  # both attempts timed out reading
    assert state.cluster.counters_zero()


async def test_total_timeout_mid_stream_ends_with_error_event(router_client, fake_backends, tmp_path):
    fakes = await fake_backends(1, token_delay=0.05)
    client, state = await start(router_client, [fakes[0][1]], tmp_path, total_timeout_s=0.3)
    r = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 100, "stream": True})
    assert r.status == 200
    body = await r.read()
    assert b"failed mid-stream" in body.splitlines()[-2]
    assert outcome_statuses(state) == ["timeout"]  # stalled past --total-timeout mid-stream
    assert state.cluster.counters_zero()


async def test_overload_429_total_and_per_instance(router_client, fake_backends, tmp_path):
    fakes = await fake_backends(2, first_delay=0.5)
    body = {"prompt": [1, 2], "max_tokens": 1}
    for kw, n_ok in (({"max_inflight": 3}, 3), ({"max_inflight_per_instance": 1}, 2)):
        client, state = await start(router_client, [u for _, u in fakes], tmp_path, **kw)
        rs = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(6)))
        codes = sorted(r.status for r in rs)
        assert codes == [200] * n_ok + [429] * (6 - n_ok), (kw, codes)
        for r in rs:
            if r.status == 429:
                err = (await r.json())["error"]
                assert r.headers["Retry-After"] == "1" and err["type"] == "RateLimitError" and err["code"] == 429
        assert state.counts["rejected"] == 6 - n_ok and state.cluster.counters_zero()
        await client.close()


async def test_requests_waiting_for_admission_count_toward_max_inflight(router_client, fake_backends,
                                                                        tmp_path):
    # fifo with a 1000-token budget lets one 900-token prompt at a time reach the backend, which
    # holds each for 0.4 s: the others wait in the router's admission queue. A request is
    # dispatched (and counted) before it waits, so the queue cannot grow past --max-inflight.
    (fake, url), = await fake_backends(1, first_delay=0.4)
    client, state = await start(router_client, [url], tmp_path, max_inflight=3, policy="round_robin",
                                knobs={"admission": "fifo", "admission_budget_tokens": "1000"})

    def waiting():  # the queue replaces its list on every change: read it fresh
        return len(state.pipeline.queue.waiting[0])

    def post(k):
        return asyncio.create_task(client.post("/v1/completions", json={
            "prompt": list(range(k * 1000, k * 1000 + 900)), "max_tokens": 1}))

    async def until(cond):
        for _ in range(300):
            if cond():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("timed out")

    at_backend = post(0)
    await until(lambda: len(fake.seen) == 1)
    queued = [post(1), post(2)]
    await until(lambda: waiting() == 2)
    assert state.cluster.in_flight == 3 and len(fake.seen) == 1

    r = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
    assert r.status == 429  # one at the backend + two queued = the bound
    assert r.headers["Retry-After"] == "1" and (await r.json())["error"]["type"] == "RateLimitError"

    queued[1].cancel()  # a client that leaves the queue gives its place back, once
    with pytest.raises(asyncio.CancelledError):
        await queued[1]
    await until(lambda: waiting() == 1)
    assert state.cluster.in_flight == 2
    queued[1] = post(3)  # the freed place is usable
    await until(lambda: waiting() == 2)
    r = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
    assert r.status == 429 and state.counts["rejected"] == 2

    assert [r.status for r in await asyncio.gather(at_backend, *queued)] == [200, 200, 200]
    await until(lambda: state.cluster.in_flight == 0)
    assert state.cluster.counters_zero() and not waiting() and state.pipeline.queue.pending(0) == 0
    assert len(fake.seen) == 3  # neither the rejected requests nor the one that left reached it
    assert sorted(outcome_statuses(state)) == ["client_gone", "ok", "ok", "ok"]


async def test_oversized_body_is_json_413(router_client, fake_backends, tmp_path):
    fakes = await fake_backends(1)
    client, state = await start(router_client, [fakes[0][1]], tmp_path, max_body_bytes=1024 * 1024)
    r = await client.post("/v1/completions", data=b'{"prompt": "' + b"a" * (2 * 1024 * 1024) + b'"}',
                          headers={"Content-Type": "application/json"})
    assert r.status == 413 and (await r.json())["error"]["type"] == "RequestTooLarge"
    assert state.counts["requests"] == 0 and not fakes[0][0].seen


async def test_stalled_client_body_gets_408(router_client, fake_backends, tmp_path):
    fakes = await fake_backends(1)
    client, state = await start(router_client, [fakes[0][1]], tmp_path, client_timeout_s=0.3)
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompt\": ")  # and then nothing
    await writer.drain()
    head = await asyncio.wait_for(reader.read(4096), 3)
    writer.close()
    assert head.startswith(b"HTTP/1.1 408") and b'"RequestTimeout"' in head
    assert state.cluster.counters_zero() and state.counts["requests"] == 0


async def test_stalled_control_body_gets_408(router_client, fake_backends, tmp_path):
    # PATCH knobs reads its body like the proxy does: bounded by --client-timeout, not forever
    fakes = await fake_backends(1)
    client, state = await start(router_client, [fakes[0][1]], tmp_path, client_timeout_s=0.3,
                                control_token="t0k")
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    writer.write(b"PATCH /kvtop/v1/knobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t0k\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"overload")
    await writer.drain()
    head = await asyncio.wait_for(reader.read(4096), 3)
    writer.close()
    assert head.startswith(b"HTTP/1.1 408") and b'"param": "body"' in head
    assert state.slot.version == 1


def test_route_flags_reach_the_config():
    import argparse

    from router.cli import add_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args([
        "--backend", "http://127.0.0.1:1", "--max-inflight", "7", "--max-inflight-per-instance", "3",
        "--max-body-mb", "2", "--client-timeout", "9", "--total-timeout", "30", "--health-interval", "0.7",
        "--health-timeout", "0.4", "--health-backoff-max", "8"]))
    assert (cfg.max_inflight, cfg.max_inflight_per_instance, cfg.max_body_bytes) == (7, 3, 2 * 1024 * 1024)
    assert (cfg.client_timeout_s, cfg.total_timeout_s) == (9, 30)
    assert (cfg.health_interval_s, cfg.health_timeout_s, cfg.health_backoff_max_s) == (0.7, 0.4, 8)


# -- control-plane security (router/control.py) ----------------------------------------------

TOKEN = "t0k3n-" + "s" * 40


async def test_control_token_never_leaks(tmp_path):
    """Not in stderr, the discovery file, the state snapshot, URLs, or the decision log."""
    port = free_port()
    db = tmp_path / "sec.db"
    tok = tmp_path / "token"
    tok.write_text(TOKEN + "\n")
    os.chmod(tok, 0o600)
    from fakevllm import CLOSED_PORT

    proc = subprocess.Popen([sys.executable, "-m", "kvtop", "route", "--port", str(port), "--db", str(db),
                             "--state-dir", str(tmp_path / "st"), "--control-token-file", str(tok),
                             "--allow-unreachable", "--backend", f"http://127.0.0.1:{CLOSED_PORT}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    seen: list[str] = []
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(100):
                try:
                    async with http.get(base + "/kvtop/v1/state") as r:
                        seen.append(await r.text())
                        break
                except aiohttp.ClientError:
                    await asyncio.sleep(0.1)
            for path in ("/kvtop/v1/policies", "/kvtop/v1/decisions", "/metrics"):
                async with http.get(base + path) as r:
                    seen.append(await r.text())
            async with http.put(base + "/kvtop/v1/policy?token=" + TOKEN, json={"name": "lmetric"}) as r:
                assert r.status == 401, "a token in the URL is not accepted"
                seen.append(await r.text())
            async with http.put(base + "/kvtop/v1/policy", json={"name": "lmetric"},
                                headers={"Authorization": "Bearer " + TOKEN}) as r:
                assert r.status == 200
                seen.append(await r.text())
            seen.append((tmp_path / "st" / f"router-{port}.json").read_text())
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0
    seen += [out.decode(), err.decode()]
    d = sqlite_utils.Database(db)
    seen += [json.dumps(list(d[t].rows)) for t in ("runs", "config_events", "decisions")]
    assert all(TOKEN not in s for s in seen)


def test_token_compare_is_constant_time():
    src = inspect.getsource(Control.check_mutation)
    assert "hmac.compare_digest" in src and "==" not in src.replace("!=", "")


async def test_readonly_refuses_even_the_right_token(router_client, tmp_path):
    cfg = RouterConfig(backends=[Backend("i0", "http://127.0.0.1:9")], db=None, state_dir=str(tmp_path / "st"),
                       control_token=TOKEN, control_readonly=True, health_interval_s=0)
    client = await router_client(create_app(cfg))
    for method, path, body in (("PUT", "/kvtop/v1/policy", {"name": "lmetric"}),
                               ("PATCH", "/kvtop/v1/knobs", {"overload_factor": 3.0})):
        r = await client.request(method, path, json=body, headers={"Authorization": "Bearer " + TOKEN})
        assert r.status == 403 and (await r.json())["error"]["type"] == "PermissionDeniedError"
    assert client.server.app[STATE].slot.version == 1


async def test_generated_token_file_is_private(tmp_path):
    from aiohttp import web

    cfg = RouterConfig(backends=[Backend("i0", "http://127.0.0.1:9")], db=None, state_dir=str(tmp_path / "st"),
                       port=free_port(), health_interval_s=0)
    app = create_app(cfg)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        tok = app[CONTROL].token_path
        assert stat.S_IMODE(os.stat(tok).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(tok.parent).st_mode) & 0o077 == 0
    finally:
        await runner.cleanup()


def test_group_readable_token_file_is_refused(tmp_path):
    f = tmp_path / "tok"
    f.write_text(TOKEN)
    os.chmod(f, 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        create_app(RouterConfig(backends=[Backend("i0", "http://127.0.0.1:9")], db=None,
                                control_token_file=str(f), state_dir=str(tmp_path / "st")))


@pytest.mark.parametrize("case", ["port_taken", "bad_db"])
def test_route_start_failure_is_one_line_and_leaves_state_dir_alone(tmp_path, case):
    # A second router on a taken port used to overwrite, then delete, the running one's
    # router-<port>.json and token file; an unopenable --db ended in a traceback.
    import socket

    state_dir = tmp_path / "st"
    state_dir.mkdir()
    holder = socket.create_server(("127.0.0.1", 0))
    port = holder.getsockname()[1] if case == "port_taken" else free_port()
    if case == "bad_db":
        holder.close()
    info = state_dir / f"router-{port}.json"
    info.write_text("the running router's\n")
    db = str(tmp_path / "kvtop.db") if case == "port_taken" else str(tmp_path / "no" / "such" / "x.db")
    try:
        r = subprocess.run([sys.executable, "-m", "kvtop", "route", "--port", str(port), "--db", db,
                            "--state-dir", str(state_dir), "--allow-unreachable",
                            "--backend", f"http://127.0.0.1:{free_port()}"],
                           capture_output=True, text=True, timeout=30)
    finally:
        holder.close()
    lines = [ln for ln in r.stderr.splitlines() if "warning" not in ln]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("kvtop route: cannot " + ("listen" if case == "port_taken" else "open"))
    assert sorted(p.name for p in state_dir.iterdir()) == [info.name]
    assert info.read_text() == "the running router's\n"
