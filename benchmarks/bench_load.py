"""Hold N concurrent streaming requests through `kvtop route` against simulated instances.

Starts `kvtop sim` (several instances, high --speed) and `kvtop route` as subprocesses on
loopback, then keeps --concurrency clients each sending streaming completions back to back
for --duration seconds. Prints errors (target 0), requests/s, the TTFT the router adds (the
client's TTFT minus the router's own upstream TTFT from the decision log, per request) and
the router's RSS sampled every --rss-every seconds (memory should stay flat).

  python benchmarks/bench_load.py --concurrency 1000 --duration 60 --instances 4 --speed 100
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


async def wait_http(url: str, timeout: float = 30) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while True:
            try:
                async with http.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} did not come up")
            await asyncio.sleep(0.2)


async def client(base: str, k: int, args, stop_at: float, out: dict) -> None:
    import aiohttp

    rng = random.Random(k)
    prompt = [rng.randrange(32000) for _ in range(args.prompt_tokens)]
    turn = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.request_timeout)) as http:
        while time.monotonic() < stop_at:
            turn += 1
            body = {"prompt": prompt + [turn], "max_tokens": args.max_tokens, "ignore_eos": True, "stream": True}
            t0 = time.perf_counter()
            first = None
            try:
                async with http.post(base + "/v1/completions", json=body, headers={"X-Session-ID": f"c{k}"}) as r:
                    if r.status != 200:
                        out["errors"].append(f"HTTP {r.status}: {(await r.text())[:120]}")
                        await asyncio.sleep(0.5)
                        continue
                    rid = r.headers.get("X-Kvtop-Request-Id")
                    ok = False
                    async for line in r.content:
                        if first is None and line.startswith(b"data: {"):
                            first = time.perf_counter()
                        if b'"error"' in line:
                            out["errors"].append(line[:160].decode(errors="replace"))
                            break
                        if line.startswith(b"data: [DONE]"):
                            ok = True
                    if ok:
                        out["done"] += 1
                        if first is not None:
                            out["ttft"][rid] = (first - t0) * 1000
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                out["errors"].append(f"{type(exc).__name__}: {exc}"[:160])
                await asyncio.sleep(0.5)


async def main(args) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, 4 * args.concurrency + 1024))
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    tmp = tempfile.mkdtemp(prefix="kvtop-bench-load-")
    ports = free_ports(args.instances + 1)
    sim_base, route_port = ports[0], ports[-1]
    # consecutive ports for the sim: find a free run
    while True:
        sim_base = free_ports(1)[0]
        if sim_base + args.instances < 65000 and all(_free(sim_base + i) for i in range(args.instances)):
            break
    py = sys.executable
    sim = subprocess.Popen([py, "-m", "kvtop", "sim", "--instances", str(args.instances), "--port-base",
                            str(sim_base), "--speed", str(args.speed), "--no-kv-events"],  # the router does not follow them
                           stdout=subprocess.DEVNULL)
    db = os.path.join(tmp, "load.db")
    route_cmd = [py, "-m", "kvtop", "route", "--port", str(route_port), "--db", db, "--state-dir", tmp,
                 "--policy", args.policy, *[a for i in range(args.instances)
                                            for a in ("--backend", f"http://127.0.0.1:{sim_base + i}")]]
    route = None
    try:
        for i in range(args.instances):
            await wait_http(f"http://127.0.0.1:{sim_base + i}/health")
        route = subprocess.Popen(route_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        base = f"http://127.0.0.1:{route_port}"
        await wait_http(base + "/health")
        out: dict = {"done": 0, "errors": [], "ttft": {}}
        t_start = time.monotonic()
        stop_at = t_start + args.duration
        tasks = [asyncio.create_task(client(base, k, args, stop_at, out)) for k in range(args.concurrency)]
        rss: list[tuple[float, float]] = []
        while time.monotonic() < stop_at:
            rss.append((time.monotonic() - t_start, rss_mb(route.pid)))
            print(f"  t={rss[-1][0]:5.1f}s  router RSS {rss[-1][1]:7.1f} MB  done {out['done']:7d}  "
                  f"errors {len(out['errors'])}", file=sys.stderr, flush=True)
            await asyncio.sleep(min(args.rss_every, max(0.0, stop_at - time.monotonic())))
        await asyncio.gather(*tasks)
        wall = time.monotonic() - t_start
        rss.append((wall, rss_mb(route.pid)))
        route.send_signal(signal.SIGTERM)
        rc = route.wait(60)
    finally:
        for p in (route, sim):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
    conn = sqlite3.connect(db)
    upstream = dict(conn.execute("select request_id, ttft_ms from outcomes where status = 'ok' and ttft_ms is not null"))
    conn.close()
    added = [c - upstream[rid] for rid, c in out["ttft"].items() if rid in upstream]
    client_ttft = list(out["ttft"].values())
    mbs = [m for _, m in rss]
    print(f"bench_load: {args.concurrency} concurrent streams, {args.instances} sim instances at speed "
          f"{args.speed:g}, {args.duration:g} s, policy {args.policy}, prompt {args.prompt_tokens} tokens, "
          f"{args.max_tokens} out")
    print(f"  requests ok       {out['done']}  ({out['done'] / wall:.1f} req/s)")
    print(f"  errors            {len(out['errors'])}")
    kinds: dict[str, int] = {}
    for e in out["errors"]:
        kinds[e[:90]] = kinds.get(e[:90], 0) + 1
    for e, n in sorted(kinds.items(), key=lambda kv: -kv[1])[:4]:
        print(f"    {n:6d} x {e}")
    print(f"  client TTFT ms    p50 {pct(client_ttft, .5):.1f}  p99 {pct(client_ttft, .99):.1f}")
    print(f"  TTFT added ms     p50 {pct(added, .5):.2f}  p99 {pct(added, .99):.2f}  (n={len(added)})")
    print(f"  router RSS MB     start {mbs[0]:.1f}  min {min(mbs):.1f}  max {max(mbs):.1f}  end {mbs[-1]:.1f}  "
          f"(samples every {args.rss_every:g} s: {' '.join(f'{m:.0f}' for m in mbs)})")
    print(f"  router exit code  {rc}")
    return 0 if not out["errors"] and rc == 0 else 1


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=1000, help="streams held open at once (default 1000)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    p.add_argument("--instances", type=int, default=4, help="simulated instances (default 4)")
    p.add_argument("--speed", type=float, default=100.0, help="kvtop sim --speed (default 100)")
    p.add_argument("--policy", default="unified", help="routing policy (default unified)")
    p.add_argument("--prompt-tokens", type=int, default=1000, help="prompt length (default 1000)")
    p.add_argument("--max-tokens", type=int, default=100, help="tokens per answer (default 100)")
    p.add_argument("--rss-every", type=float, default=5.0, help="RSS sampling period, s (default 5)")
    p.add_argument("--request-timeout", type=float, default=120.0, help="client timeout per request, s")
    sys.exit(asyncio.run(main(p.parse_args())))
