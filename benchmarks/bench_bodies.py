"""Many large bodies at once: the router's peak memory and /health's latency meanwhile.

A trivial backend (bench_overhead's) answers at once; ``kvtop route`` sits in front with
``--max-input-tokens`` raised so that huge prompts are routed, not refused. ``--bodies``
clients each send one ``--mb`` MB chat body at the same moment, ``--rounds`` times, while a
prober in a process of its own (so the senders' event loop, busy writing 480 MB, does not
delay its timer or its reads) GETs ``/health`` every 20 ms. Printed: answers by status, the
router's peak RSS (VmHWM from /proc), and /health's p50 / p99 / max latency during the bodies.

    python benchmarks/bench_bodies.py                  # 8 x 60 MB, 3 rounds (the issue's case)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_overhead as bo  # noqa: E402

from kvtop.procs import stop_process  # noqa: E402


def vm_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


async def run(url: str, args: argparse.Namespace) -> tuple[list[int], list[float]]:
    import aiohttp

    msg = {"role": "user", "content": "word " * 200}
    n_msgs = args.mb * 1024 * 1024 // len(json.dumps(msg))
    body = json.dumps({"model": "tiny", "messages": [msg] * n_msgs, "max_tokens": 1}).encode()
    statuses: list[int] = []

    async def one(http) -> None:
        async with http.post(url + "/v1/chat/completions", data=body,
                             headers={"Content-Type": "application/json"}) as r:
            await r.read()
            statuses.append(r.status)

    timeout = aiohttp.ClientTimeout(total=300)
    prober = subprocess.Popen([sys.executable, __file__, "--probe", url], stdout=subprocess.PIPE, text=True)
    try:
        await asyncio.sleep(0.5)  # the prober's first probes are before the bodies: a baseline
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
            for _ in range(args.rounds):
                await asyncio.gather(*(one(http) for _ in range(args.bodies)))
    finally:
        prober.terminate()
        out, _ = prober.communicate(timeout=30)
    health = [float(x) for x in out.split()]
    return statuses, health


def probe(url: str) -> None:
    """GET /health every 20 ms until terminated; print each latency in ms (one per line)."""
    import http.client
    import signal
    from urllib.parse import urlsplit

    u = urlsplit(url)
    stop = False

    def on_term(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    out = []
    while not stop:
        t0 = time.perf_counter()
        try:
            conn.request("GET", "/health")
            conn.getresponse().read()
        except (OSError, http.client.HTTPException):
            conn.close()
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
            continue
        out.append((time.perf_counter() - t0) * 1000)
        time.sleep(0.02)
    print("\n".join(f"{x:.3f}" for x in out))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bodies", type=int, default=8)
    p.add_argument("--mb", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe:
        probe(args.probe)
        return 0
    tmp = tempfile.mkdtemp(prefix="kvtop-bodies-")
    bport, rport = bo.free_port(), bo.free_port()
    backend = subprocess.Popen([sys.executable, bo.__file__, "--serve-backend", str(bport)])
    router = None
    try:
        bo.wait_ready(f"http://127.0.0.1:{bport}/v1/models", backend)
        router = subprocess.Popen([sys.executable, "-m", "kvtop", "route", "--port", str(rport), "--backend",
                                   f"http://127.0.0.1:{bport}", "--db", "none", "--state-dir", tmp,
                                   "--max-input-tokens", "1000000000", "--max-body-mb", str(args.mb + 8)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        bo.wait_ready(f"http://127.0.0.1:{rport}/v1/models", router)
        idle = vm_kb(router.pid, "VmRSS")
        statuses, health = asyncio.run(run(f"http://127.0.0.1:{rport}", args))
        peak = vm_kb(router.pid, "VmHWM")
        time.sleep(3)  # what the router keeps once the bodies are answered
        after = vm_kb(router.pid, "VmRSS")
    finally:
        stop_process(router)
        stop_process(backend)
    by = {s: statuses.count(s) for s in sorted(set(statuses))}
    print(f"{args.bodies} x {args.mb} MB bodies at once, {args.rounds} rounds: answers {by}")
    print(f"router RSS idle {idle / 1024:.0f} MB, peak {peak / 1024:.0f} MB, 3 s after the last answer "
          f"{after / 1024:.0f} MB")
    print(f"/health during the bodies ({len(health)} probes): p50 {statistics.median(health):.1f} ms, "
          f"p99 {sorted(health)[int(0.99 * (len(health) - 1))]:.1f} ms, max {max(health):.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
