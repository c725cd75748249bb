"""What do attached viewers cost the router? Throughput and added latency with 0, 1 and 10
``/kvtop/v1/events`` viewers at 20 Hz.

A trivial backend (answers at once, non-streaming), the router (``kvtop route``) and the
viewers each run in their own process; the closed-loop load generator runs here. Every
configuration runs ``--repeat`` times, interleaved, for ``--seconds`` each; the table
shows the median round. On a shared machine throughput is noisy; the router's CPU time per
request (from /proc) is the steadier measure of what viewers cost. Added latency = routed latency - direct-to-backend latency at the
same percentile and concurrency.

  python benchmarks/bench_viewers.py                   # 5 s x 2 rounds per configuration
  python benchmarks/bench_viewers.py --seconds 10 --repeat 3 --concurrency 32
  python benchmarks/bench_viewers.py --hostile --seconds 10 --repeat 3   # 250 viewers that never
      # read + 4 clients looping on GET /kvtop/v1/decisions?limit=2000, against none
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(port: int) -> None:
    from aiohttp import web

    body = (b'{"choices":[{"text":"ok"}],"usage":{"prompt_tokens":200,"completion_tokens":1,'
            b'"prompt_tokens_details":{"cached_tokens":0}}}')

    async def completions(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, content_type="application/json")

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", lambda r: ok(r))
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def _viewers(url: str, n: int, hz: float, stop: mp.Event, counts: mp.Array) -> None:
    import aiohttp

    async def one(k: int, http: aiohttp.ClientSession) -> None:
        async with http.get(f"{url}/kvtop/v1/events?hz={hz}") as r:
            while not stop.is_set():
                chunk = await r.content.readany()
                if not chunk:
                    return
                counts[k] += chunk.count(b"event: state")

    async def main() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
            tasks = [asyncio.create_task(one(k, http)) for k in range(n)]
            while not stop.is_set():
                await asyncio.sleep(0.1)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


def _hostile(url: str, viewers: int, readers: int, stop: mp.Event, counts: mp.Array) -> None:
    """``viewers`` event streams opened and never read (small receive windows), and ``readers``
    clients asking for the largest decision list in a loop, as fast as they are answered."""
    import aiohttp
    from urllib.parse import urlsplit

    host, port = urlsplit(url).hostname, urlsplit(url).port

    async def dead_viewer() -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.setblocking(False)
        await asyncio.get_running_loop().sock_connect(s, (host, port))
        s.send(b"GET /kvtop/v1/events?hz=20&types=state,decision,outcome HTTP/1.1\r\nHost: x\r\n\r\n")
        while not stop.is_set():
            await asyncio.sleep(0.2)
        s.close()

    async def reader(k: int, http: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            async with http.get(f"{url}/kvtop/v1/decisions?limit=2000") as r:
                await r.read()
                counts[k] += 1

    async def main() -> None:
        async with aiohttp.ClientSession() as http:
            tasks = [asyncio.create_task(dead_viewer()) for _ in range(viewers)]
            tasks += [asyncio.create_task(reader(k, http)) for k in range(readers)]
            while not stop.is_set():
                await asyncio.sleep(0.1)
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


async def _load(url: str, seconds: float, concurrency: int) -> tuple[float, list[float]]:
    import aiohttp

    prompt = "word " * 800  # about 200 tokens by the router's text estimate
    lat: list[float] = []
    n = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        end = time.perf_counter() + seconds

        async def worker(k: int) -> None:
            nonlocal n
            j = 0
            while time.perf_counter() < end:
                body = {"model": "m", "prompt": f"s{k} {j} " + prompt, "max_tokens": 1}
                t0 = time.perf_counter()
                async with http.post(url + "/v1/completions", json=body,
                                     headers={"X-Session-ID": f"s{k}-{j % 50}"}) as r:
                    await r.read()
                    assert r.status == 200, r.status
                lat.append((time.perf_counter() - t0) * 1000)
                n += 1
                j += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(concurrency)))
        return n / (time.perf_counter() - t0), lat


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc), or nan elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def _wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), 0.2):
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"nothing listening on {port}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--repeat", type=int, default=2,
                    help="rounds per configuration; the table shows the median round")
    # The old spelling, kept working (hidden) for commands already written down in notes.
    ap.add_argument("--repeats", dest="repeat", type=int, default=argparse.SUPPRESS,
                    help=argparse.SUPPRESS)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--hz", type=float, default=20.0)
    ap.add_argument("--viewers", default="0,1,10")
    ap.add_argument("--policy", default="unified")
    ap.add_argument("--hostile", action="store_true",
                    help="compare 0 viewers with 250 never-reading viewers + 4 control-read loops")
    return ap.parse_args(argv)


def main() -> int:
    args = parse_args()
    configs = [0, -1] if args.hostile else [int(v) for v in args.viewers.split(",")]  # -1: hostile

    bport, rport = _free_port(), _free_port()
    backend = mp.Process(target=_backend, args=(bport,), daemon=True)
    backend.start()
    _wait_port(bport)
    tmp = tempfile.mkdtemp(prefix="kvtop-bench-")
    kvtop = Path(sys.executable).with_name("kvtop")
    router = subprocess.Popen([str(kvtop), "route", "--backend", f"http://127.0.0.1:{bport}",
                               "--port", str(rport), "--db", "none", "--policy", args.policy,
                               "--state-dir", tmp], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rows: dict[int, list[tuple[float, ...]]] = {v: [] for v in configs}
    try:
        _wait_port(rport)
        url = f"http://127.0.0.1:{rport}"
        # Direct baseline for "added" latency.
        _, direct = asyncio.run(_load(f"http://127.0.0.1:{bport}", min(3.0, args.seconds), args.concurrency))
        d50, d99 = _pct(direct, 50), _pct(direct, 99)
        asyncio.run(_load(url, 1.0, args.concurrency))  # warm-up
        for _ in range(args.repeat):
            for v in configs:
                stop = mp.Event()
                counts = mp.Array("q", max(1, v))
                proc = None
                if v == -1:
                    counts = mp.Array("q", 4)
                    proc = mp.Process(target=_hostile, args=(url, 250, 4, stop, counts), daemon=True)
                    proc.start()
                    time.sleep(2.0)  # let every viewer attach (or be refused)
                elif v:
                    proc = mp.Process(target=_viewers, args=(url, v, args.hz, stop, counts), daemon=True)
                    proc.start()
                    time.sleep(1.0)  # let every viewer attach
                before = sum(counts[:v]) if v else 0
                cpu0 = _cpu_s(router.pid)
                rps, lat = asyncio.run(_load(url, args.seconds, args.concurrency))
                cpu_ms = (_cpu_s(router.pid) - cpu0) * 1000 / max(1, len(lat))
                got_hz = (sum(counts[:v]) - before) / args.seconds / v if v > 0 else 0.0
                if v == -1:  # control reads answered per second, all four clients
                    got_hz = sum(counts[:4]) / (args.seconds + 2.0)
                stop.set()
                if proc:
                    proc.join(5)
                rows[v].append((rps, _pct(lat, 50) - d50, _pct(lat, 99) - d99, got_hz, cpu_ms))
                time.sleep(0.5)
    finally:
        router.terminate()
        router.wait(10)
        backend.terminate()

    print(f"\nbench_viewers: {args.seconds:g} s x {args.repeat} rounds, concurrency {args.concurrency}, "
          f"policy {args.policy}, {os.cpu_count()} CPUs; direct p50 {d50:.2f} ms, p99 {d99:.2f} ms")
    print(f"{'viewers':>7}  {'req/s':>8}  {'vs 0':>6}  {'added p50 ms':>12}  {'added p99 ms':>12}  {'state Hz/viewer':>15}  {'router CPU ms/req':>17}")
    base = statistics.median(r[0] for r in rows[configs[0]]) if rows[configs[0]] else 0
    for v in configs:
        rps = statistics.median(r[0] for r in rows[v])
        a50 = statistics.median(r[1] for r in rows[v])
        a99 = statistics.median(r[2] for r in rows[v])
        hz = statistics.median(r[3] for r in rows[v])
        cpu = statistics.median(r[4] for r in rows[v])
        rel = f"{(rps / base - 1) * 100:+.1f}%" if base else "-"
        label = "250+4r" if v == -1 else str(v)
        print(f"{label:>7}  {rps:>8.0f}  {rel:>6}  {a50:>12.2f}  {a99:>12.2f}  {hz:>15.1f}  {cpu:>17.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
