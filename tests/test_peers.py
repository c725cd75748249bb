"""sglang-router takes `kvtop sim` instances as workers and routes to them.

The peer lives in its own venv (benchmarks/peers/run.py makes ~/.cache/kvtop-peers/venv);
``KVTOP_PEERS_PYTHON`` points at its interpreter. Skipped when sglang_router is not importable
from it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from kvtop.procs import free_port_run, stop_process

PEERS_PYTHON = os.environ.get(
    "KVTOP_PEERS_PYTHON", str(Path.home() / ".cache" / "kvtop-peers" / "venv" / "bin" / "python"))


def _why_skip() -> str | None:
    if not Path(PEERS_PYTHON).exists():
        return (f"no peers venv at {PEERS_PYTHON} (set KVTOP_PEERS_PYTHON, or run "
                "benchmarks/peers/run.py once to make it)")
    r = subprocess.run([PEERS_PYTHON, "-c", "import sglang_router"], capture_output=True)
    if r.returncode != 0:
        return f"sglang_router is not importable from {PEERS_PYTHON}"
    return None


_WHY = _why_skip()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()




def _wait(url: str, proc: subprocess.Popen, timeout: float, want: bytes | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"process for {url} exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if want is None or want in r.read():
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


def _requests_total(base: str) -> float:
    """Finished requests the engine counted (vllm:request_success_total, all reasons)."""
    with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


@pytest.fixture
def sim():
    base = free_port_run(2)
    proc = subprocess.Popen([sys.executable, "-m", "kvtop", "sim", "--instances", "2",
                             "--port-base", str(base), "--profile", "cpu-tiny", "--speed", "10",
                             "--duration", "120"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    urls = [f"http://127.0.0.1:{base + i}" for i in range(2)]
    try:
        for u in urls:
            _wait(u + "/health", proc, 30)
        yield urls
    finally:
        stop_process(proc)


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_sglang_router_routes_to_kvtop_sim(sim, policy):
    port, prom = _free_ports(2)
    proc = subprocess.Popen(
        [PEERS_PYTHON, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
         "--port", str(port), "--worker-urls", *sim, "--policy", policy,
         "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom), "--log-level", "warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        # It registers the workers (probing /server_info and /model_info) before it serves.
        _wait(url + "/v1/models", proc, 60, want=b"tinymodel")
        before = [_requests_total(u) for u in sim]
        n = 6
        for i in range(n):
            body = {"model": "tinymodel", "prompt": f"request {i}: " + "word " * 200,
                    "max_tokens": 4, "ignore_eos": True, "stream": i % 2 == 1}
            req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                raw = r.read().decode()
            if body["stream"]:
                assert "data: [DONE]" in raw
                events = [json.loads(line[5:]) for line in raw.splitlines()
                          if line.startswith("data:") and "[DONE]" not in line]
                assert "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
            else:
                reply = json.loads(raw)
                assert reply["choices"][0]["text"] and reply["usage"]["completion_tokens"] == 4
        served = [_requests_total(u) - b for u, b in zip(sim, before)]
        assert sum(served) == n, served  # every request reached a kvtop sim engine, once
        if policy == "round_robin":
            assert min(served) > 0, served  # and round robin used both
    finally:
        stop_process(proc)
