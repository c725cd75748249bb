"""`kvtop route` shutdown: SIGTERM drains and loses no row; SIGKILL leaves a sound database.

The router runs as a real process in front of fake vLLM instances served by this test's
event loop on loopback.
"""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import subprocess
import sys
import time

import aiohttp
import sqlite_utils

from conftest import free_port


async def start_route(fakes, tmp_path, *extra):
    port = free_port()
    db = tmp_path / "route.db"
    cmd = [sys.executable, "-m", "kvtop", "route", "--port", str(port), "--db", str(db),
           "--state-dir", str(tmp_path / "st"), "--policy", "leastwork", *extra]
    for _, u in fakes:
        cmd += ["--backend", u]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as http:
        deadline = time.monotonic() + 15
        while True:
            try:
                async with http.get(base + "/health") as r:
                    if r.status == 200:
                        return proc, base, db
            except aiohttp.ClientError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "kvtop route did not start"
            await asyncio.sleep(0.1)


async def exit_code(proc, timeout: float) -> int:
    t0 = time.monotonic()
    while proc.poll() is None:
        assert time.monotonic() - t0 < timeout, "kvtop route did not exit"
        await asyncio.sleep(0.05)
    return proc.returncode


async def load(base: str, stop: asyncio.Event, got: list[dict], *, max_tokens: int = 20) -> None:
    """One client sending streaming requests back to back until told to stop or refused."""
    body = {"prompt": list(range(600)), "max_tokens": max_tokens, "stream": True}
    async with aiohttp.ClientSession() as http:
        while not stop.is_set():
            rec = {"status": None, "request_id": None, "complete": False, "retry_after": None}
            try:
                async with http.post(base + "/v1/completions", json=body) as r:
                    rec["status"] = r.status
                    rec["request_id"] = r.headers.get("X-Kvtop-Request-Id")
                    rec["retry_after"] = r.headers.get("Retry-After")
                    data = await r.read()
                    rec["complete"] = r.status != 200 or data.rstrip().endswith(b"[DONE]")
                    if r.status != 200:
                        rec["error"] = (await r.json())["error"]
            except (aiohttp.ClientError, ConnectionError):
                rec["status"] = "refused"
            got.append(rec)
            if rec["status"] == "refused":
                return
            if rec["status"] == 503:
                await asyncio.sleep(0.05)


async def sigterm_under_load(proc, base: str, *, clients: int, warm_s: float, exit_within: float,
                             holder_tokens: int | None = None,
                             **load_kw) -> tuple[int | None, float, str, list[dict], list[dict]]:
    """``clients`` loops of ``load`` for ``warm_s``, then SIGTERM; waits for the exit.
    ``holder_tokens``: one more client whose requests stream that many tokens, so that the
    drain lasts while the others' next requests arrive (else, on a loaded host, every short
    stream can end before any client sends again).

    Returns (exit code, seconds from SIGTERM to exit, stderr, every record, the records
    finished before SIGTERM)."""
    stop = asyncio.Event()
    got: list[dict] = []
    try:
        tasks = [asyncio.create_task(load(base, stop, got, **load_kw)) for _ in range(clients)]
        if holder_tokens is not None:
            tasks.append(asyncio.create_task(load(base, stop, got, max_tokens=holder_tokens)))
        await asyncio.sleep(warm_s)
        before = list(got)
        t_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = await exit_code(proc, exit_within)
        t_exit = time.monotonic() - t_term
        stop.set()
        await asyncio.gather(*tasks)
    finally:
        if proc.poll() is None:
            proc.kill()
        err = proc.stderr.read().decode()
    return rc, t_exit, err, got, before


async def test_sigterm_under_load_loses_nothing(fake_backends, tmp_path):
    fakes = await fake_backends(2, token_delay=0.02)  # a request streams for about 0.4 s
    proc, base, db = await start_route(fakes, tmp_path, "--drain-timeout", "10")
    # the holder streams 150 tokens (3 s): SIGTERM at 1.5 s finds it mid-stream
    rc, t_exit, err, got, before = await sigterm_under_load(proc, base, clients=24, warm_s=1.5,
                                                            exit_within=15, holder_tokens=150)
    assert all(r["status"] == 200 for r in before) and len(before) >= 24
    assert rc == 0, err
    assert t_exit < 5, "the drain waits for in-flight requests only, not the whole deadline"
    ok = [r for r in got if r["status"] == 200]
    assert ok and all(r["complete"] for r in ok), "every request admitted before SIGTERM finished its stream"
    draining = [r for r in got if r["status"] == 503]
    assert draining, "requests during the drain are refused"
    assert all(r["retry_after"] == "1" and "shutting down" in r["error"]["message"] for r in draining)
    assert {r["status"] for r in got} <= {200, 503, "refused"}
    d = sqlite_utils.Database(db)
    decisions = {r["request_id"] for r in d["decisions"].rows}
    outcomes = {r["request_id"]: r["status"] for r in d["outcomes"].rows}
    answered = {r["request_id"] for r in ok}
    # every answered request has its decision and its outcome; nothing else was routed
    assert decisions == answered and set(outcomes) == answered
    assert set(outcomes.values()) == {"ok"}
    assert next(d["runs"].rows)["ended_at"] is not None


async def test_drain_deadline_bounds_the_exit(fake_backends, tmp_path):
    """Requests still streaming at the deadline are cut; their outcomes are still written."""
    fakes = await fake_backends(1, token_delay=0.1)  # 200 tokens: 20 s, far past the deadline
    proc, base, db = await start_route(fakes, tmp_path, "--drain-timeout", "0.5")
    rc, t_exit, err, _, _ = await sigterm_under_load(proc, base, clients=3, warm_s=0.8, exit_within=10,
                                                     max_tokens=200)
    assert rc == 0, err
    assert t_exit < 0.5 + 1.0 + 2.0, "drain deadline plus the 1 s shutdown grace, with slack"
    d = sqlite_utils.Database(db)
    ids = [r["request_id"] for r in d["decisions"].rows]
    outcomes = {r["request_id"]: r["status"] for r in d["outcomes"].rows}
    assert len(ids) == 3 and set(outcomes) == set(ids), "a cut request still has its outcome row"
    assert set(outcomes.values()) == {"client_gone"}


async def test_sigkill_leaves_a_sound_database(fake_backends, tmp_path):
    """After SIGKILL: integrity_check ok, and everything older than a flush interval is there."""
    fakes = await fake_backends(2, token_delay=0.01)
    proc, base, db = await start_route(fakes, tmp_path)
    done: list[str] = []
    try:
        async with aiohttp.ClientSession() as http:
            for k in range(30):
                body = {"prompt": list(range(k, 700)), "max_tokens": 3, "stream": k % 2 == 0}
                async with http.post(base + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    await r.read()
                    done.append(r.headers["X-Kvtop-Request-Id"])
        await asyncio.sleep(0.6)  # three writer flush intervals (0.2 s)
        stop = asyncio.Event()
        got: list[dict] = []
        clients = [asyncio.create_task(load(base, stop, got)) for _ in range(16)]
        await asyncio.sleep(0.7)  # rows are being written when the kill lands
        proc.kill()
        proc.wait(5)
        stop.set()
        await asyncio.gather(*clients)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.read()
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    decisions = {r[0] for r in conn.execute("select request_id from decisions")}
    outcomes = {r[0] for r in conn.execute("select request_id from outcomes")}
    assert set(done) <= decisions and set(done) <= outcomes
    assert len(decisions) > len(done), "rows written during the load survive too"
    assert conn.execute("select ended_at from runs").fetchone()[0] is None  # it never ended cleanly
    conn.close()
