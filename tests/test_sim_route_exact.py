"""`kvtop sim --instances 2`, then the `route with:` line it prints, run as it is: text traffic
(Claude Code-shaped Messages sessions with a resume, an agent's chat with tools) is counted
with the simulator's own tokenizer (`--tokenizer kvtop-sim`), so every decision is exact and
the router's estimated hits are the cached tokens the engines served."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import sqlite_utils

from kvtop.procs import free_port_run

ROOT = Path(__file__).resolve().parents[1]


def _audit_module():
    spec = importlib.util.spec_from_file_location("_truth_audit_shapes", ROOT / "benchmarks" / "truth_audit.py")
    ta = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = ta  # its dataclasses look their module up
    spec.loader.exec_module(ta)
    return ta


def _wait_health(url: str, proc: subprocess.Popen, log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"{url} did not come up")


async def agent_chat(c, turns: int, sid: str) -> None:
    """An agent over chat completions: tools, assistant tool calls and tool results."""
    ta = sys.modules["_truth_audit_shapes"]
    tools = [{"type": "function", "function": {"name": f"fn{k}", "description": ta.words(30, k),
                                               "parameters": {"type": "object", "properties": {}}}}
             for k in range(5)]
    msgs = [{"role": "system", "content": "You are an agent. " + ta.words(150, 9)},
            {"role": "user", "content": ta.words(40, 10)}]
    for t in range(turns):
        await c.post("agent_chat", "/v1/chat/completions",
                     {"model": "sim-model", "messages": msgs, "tools": tools, "max_tokens": 8,
                      "stream": True, "stream_options": {"include_usage": True}}, headers={"X-Session-ID": sid})
        msgs = msgs + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call{t}", "type": "function",
                 "function": {"name": "fn1", "arguments": json.dumps({"t": t})}}]},
            {"role": "tool", "tool_call_id": f"call{t}", "content": ta.words(120, 20 + t)},
            {"role": "user", "content": ta.words(25, 40 + t)}]


async def _sessions(url: str, turns: int):
    ta = sys.modules["_truth_audit_shapes"]
    async with aiohttp.ClientSession() as http:
        c = ta.Client(url, http)
        history, _, _ = await asyncio.gather(ta.claude_code(c, turns, "s1", 1), ta.chat(c, turns, "chat-1", 3),
                                             agent_chat(c, turns, "agent-1"))
        await ta.claude_code_resume(c, history, 1)
        return c.sent


def test_the_printed_route_line_makes_every_text_decision_exact(tmp_path):
    ta = _audit_module()
    base = free_port_run(6)  # 2 HTTP ports, then 2 x (events, replay)
    sim = subprocess.Popen([sys.executable, "-m", "kvtop", "sim", "--instances", "2", "--port-base", str(base),
                            "--speed", "20", "--duration", "120"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    router = None
    db = tmp_path / "route.db"
    try:
        line = ""
        for _ in range(5):
            line = sim.stdout.readline()
            if line.startswith("route with: ") or not line:
                break
        assert line.startswith("route with: kvtop route "), (line, sim.stderr.read()[-2000:] if not line else "")
        argv = shlex.split(line.split(":", 1)[1])
        assert argv[:2] == ["kvtop", "route"] and "--tokenizer" in argv
        port = free_port_run(1)
        log = open(tmp_path / "route.log", "w+")  # a file: a pipe nobody reads could fill and stall it
        router = subprocess.Popen([sys.executable, "-m", *argv, "--port", str(port), "--db", str(db),
                                   "--state-dir", str(tmp_path / "state")], stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        _wait_health(url, router, tmp_path / "route.log")
        deadline = time.monotonic() + 10  # the startup replay makes both instances exact
        while time.monotonic() < deadline:
            with urllib.request.urlopen(url + "/kvtop/v1/state", timeout=5) as r:
                state = json.load(r)
            if all(i["index_source"] == "exact" for i in state["instances"]):
                break
            time.sleep(0.1)
        sent = asyncio.run(_sessions(url, 4))
        assert sent and all(s.status == 200 for s in sent), [(s.shape, s.status) for s in sent]
    finally:
        if router is not None:
            router.send_signal(signal.SIGINT)  # it flushes its decision log on the way out
            router.wait(timeout=60)
            log.close()
        sim.terminate()
        sim.communicate(timeout=30)

    summary = subprocess.run([sys.executable, "-m", "kvtop", "log", "summary", "--db", str(db)],
                             capture_output=True, text=True, timeout=60)
    assert summary.returncode == 0, summary.stderr
    n = len(sent)
    assert f"exact {n} of {n} decisions" in summary.stdout, summary.stdout

    d = sqlite_utils.Database(db)
    rows = {r["request_id"]: r for r in d.query(
        "SELECT d.request_id, d.index_source, d.token_source, d.input_tokens, d.est_hit_tokens, "
        "o.delivered_hit_tokens FROM decisions d JOIN outcomes o USING (request_id)")}
    mine = [rows[s.request_id] for s in sent]
    assert {s.shape for s in sent} == {"claude_code", "claude_code_resume", "chat", "agent_chat"}
    assert all(r["index_source"] == "exact" and r["token_source"] == "tokenizer" for r in mine), mine
    # the router counted what the engine counted, and estimated what it served
    for s, r in zip(sent, mine):
        u = s.usage
        prompt = u.get("prompt_tokens", (u.get("input_tokens", 0) + u.get("cache_read_input_tokens", 0))
                       if "cache_read_input_tokens" in u else u.get("input_tokens"))
        assert r["input_tokens"] == prompt, (s.shape, r, u)
        assert r["delivered_hit_tokens"] == ta.client_cached(u), (s.shape, r, u)
    prompt_tokens = sum(r["input_tokens"] for r in mine)
    off = sum(abs(r["est_hit_tokens"] - r["delivered_hit_tokens"]) for r in mine)
    assert sum(r["delivered_hit_tokens"] for r in mine) > prompt_tokens // 3  # the sessions did hit
    assert off <= 0.01 * prompt_tokens, (off, prompt_tokens, [(s.shape, r["input_tokens"], r["est_hit_tokens"],
                                                               r["delivered_hit_tokens"]) for s, r in zip(sent, mine)])
