"""The live path and the offline simulator agree: same trace, same policy, same engine model.

`kvtop sim` + `kvtop route` (real processes on loopback, engine time = wall x speed) and
`kvtop simulate` (virtual time) must give TTFT p50 and p90 within 15% of each other, with
the router-level features off, with the admission queue on, and with P2P offload on: both
drive the same pipeline object (router/pipeline.py), and both count TTFT from the request's
arrival at the router.
Prompts are long enough (8k-30k tokens on the h20 profile: 1.5-6 s of engine time, 0.3-1.2 s
of wall time at speed 5) that the proxy's few milliseconds stay far below the tolerance.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import aiohttp
import pytest

from conftest import free_port
from kvtop.procs import free_port_run
from kvtop.procs import stop_processes
from kvtop.replay import ReplayConfig, replay
from kvtop.seedtable import percentile
from kvtop.simulate import SimConfig, simulate
from kvtop.traces.loader import TraceRequest

SPEED = 5.0


def agentic_trace(gap: float = 3.1) -> list[TraceRequest]:
    """Six sessions of four turns each; every turn extends the previous one's context.
    Sessions start ``gap`` s apart: 0.7 makes requests overlap enough for the admission queue
    and the offload rules to act."""
    reqs = []
    for s in range(6):
        ids = [(s + 1) * 10**7 + k for k in range(32_000 // 64)]
        for t in range(4):
            n = 8_000 + 6_000 * t + 500 * s
            # 3.1 s apart, not 3: no two arrivals coincide, so the live router sees them in
            # the offline order (a tie is a race on loopback, and round_robin follows the order)
            reqs.append(TraceRequest(arrival=gap * s + 9.0 * t, session=f"s{s}", turn=t + 1,
                                     input_tokens=n, output_tokens=20, hash_ids=ids[: n // 64],
                                     block_size=64, think_time=None, parent=None, source="test"))
    return sorted(reqs, key=lambda r: r.arrival)


async def wait_health(url: str, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read().decode()
            try:
                async with http.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise AssertionError(f"{url} did not come up")


async def live_ttfts(policy: str, trace, tmp_path, knobs: list[str]) -> list[float]:
    # two HTTP ports and, right after them, the instances' KV-event and replay ports, all
    # below the range the kernel hands to client sockets (a KV port there collided once)
    base = free_port_run(2 + 2 * 2)
    sim = subprocess.Popen([sys.executable, "-m", "kvtop", "sim", "--instances", "2", "--port-base", str(base),
                            "--profile", "h20", "--speed", str(SPEED), "--duration", "120"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    route_port = free_port()
    route = None
    try:
        for k in range(2):
            await wait_health(f"http://127.0.0.1:{base + k}", sim)
        route = subprocess.Popen([sys.executable, "-m", "kvtop", "route", "--port", str(route_port),
                                  "--db", "none", "--state-dir", str(tmp_path / policy), "--policy", policy,
                                  *(a for k in knobs for a in ("--knob", k)),
                                  "--backend", f"http://127.0.0.1:{base}", "--backend", f"http://127.0.0.1:{base + 1}"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        target = f"http://127.0.0.1:{route_port}"
        await wait_health(target, route)
        result = await replay(trace, ReplayConfig(target=target, speed=SPEED, arm=policy))
        assert all(r["status"] == "ok" for r in result.records), result.records[:2]
        return [r["ttft_ms"] * SPEED for r in result.records]
    finally:
        stop_processes([p for p in (route, sim) if p is not None], grace_s=20)


ADMISSION = ["admission=fifo", "admission_budget_tokens=6000"]
OFFLOAD = ["offload_mode=simple", "offload_threshold=5000"]


@pytest.mark.parametrize("policy,knobs", [("leastwork", []), ("round_robin", []),
                                          ("leastwork", ADMISSION), ("round_robin", OFFLOAD)],
                         ids=["leastwork", "round_robin", "leastwork-admission", "round_robin-offload"])
async def test_live_and_offline_ttft_agree(policy, knobs, tmp_path):
    features = dict(k.split("=") for k in knobs)
    trace = agentic_trace(0.7 if features else 3.1)
    records = simulate(trace, policy, SimConfig(instances=2, profile="h20", features=features))
    if "admission" in features:  # the feature must act on this trace, or the test proves nothing
        assert sum(r["admission_wait_ms"] > 0 for r in records) >= 3
    if "offload_mode" in features:
        assert sum(r["route_class"] == "HEAVY_P2P" for r in records) >= 3
    offline = [r["ttft_ms"] for r in records]
    live = await live_ttfts(policy, trace, tmp_path, knobs)
    for q in (50, 90):
        a, b = percentile(live, q), percentile(offline, q)
        assert abs(a - b) <= 0.15 * b, f"{policy} TTFT p{q}: live {a:.0f} ms vs offline {b:.0f} ms"
