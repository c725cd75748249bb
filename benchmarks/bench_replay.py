"""How many requests per second can ``kvtop replay`` drive from one core?

A trivial streaming server (no engine, answers at once) runs in a child process; the replay
client runs in this process, pinned to one core where the OS allows. The run is bounded
(``--requests``), open loop with every arrival at 0, so the client is the limit.

Prints throughput and the client's CPU time per request; 1000 / (CPU ms per request) is the
client's ceiling on one core even when the server, sharing the machine, is slower.

  python benchmarks/bench_replay.py                      # 2000 requests, 512-token prompts
  python benchmarks/bench_replay.py --input-tokens 50000 --requests 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import resource
import socket
import sys
import time


def _serve(port: int, core: int | None) -> None:
    from aiohttp import web

    if core is not None:
        _pin(core)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "bench"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        n_out = json.loads(body).get("max_tokens", 1)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "X-Kvtop-Instance": "bench0"})
        await resp.prepare(request)
        chunk = b'data: {"choices":[{"index":0,"text":"x","finish_reason":null}]}\n\n'
        await resp.write(chunk * n_out)
        await resp.write(b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":'
                         + str(n_out).encode()
                         + b',"prompt_tokens_details":{"cached_tokens":0}}}\n\ndata: [DONE]\n\n')
        await resp.write_eof()
        return resp

    app = web.Application(client_max_size=256 * 1024 * 1024)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def _pin(core: int) -> None:
    try:
        os.sched_setaffinity(0, {core})
    except (AttributeError, OSError):
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit("benchmark server did not start")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--input-tokens", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--sessions", type=int, default=50, help="requests spread over this many sessions")
    args = p.parse_args()

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from kvtop.replay import ReplayConfig, replay
    from kvtop.traces.loader import TraceRequest

    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    client_core = cores[0] if len(cores) >= 2 else None
    server_core = cores[1] if len(cores) >= 2 else None
    port = _free_port()
    server = mp.get_context("spawn").Process(target=_serve, args=(port, server_core), daemon=True)
    server.start()
    try:
        _wait_port(port)
        if client_core is not None:
            _pin(client_core)
        bs = 64
        trace = []
        for i in range(args.requests):
            s, turn = i % args.sessions, i // args.sessions + 1
            # each session's turns share a growing prefix, as agentic traffic does
            ids = [s * 10**6 + k for k in range(args.input_tokens // bs)]
            trace.append(TraceRequest(0.0, f"s{s}", turn, args.input_tokens, args.output_tokens,
                                      ids, bs, None, None, "bench"))
        cfg = ReplayConfig(target=f"http://127.0.0.1:{port}", arm="bench",
                           max_concurrency=args.concurrency)
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        result = asyncio.run(replay(trace, cfg))
        wall = time.perf_counter() - t0
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        server.terminate()
        server.join(5)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    ok = sum(r["status"] == "ok" for r in result.records)
    n = len(result.records)
    print(f"replay client: {n} requests ({ok} ok), {args.input_tokens} input / "
          f"{args.output_tokens} output tokens, concurrency {args.concurrency}, "
          f"client pinned to core {client_core}")
    print(f"  wall {wall:.2f} s  -> {n / wall:.0f} requests/s, "
          f"{n * args.output_tokens / wall:.0f} streamed tokens/s")
    print(f"  client CPU {cpu:.2f} s ({cpu / wall * 100:.0f}% of one core), "
          f"{cpu / n * 1000:.2f} ms per request -> ceiling {n / cpu:.0f} requests/s on one core")
    return 0 if ok == n else 1


if __name__ == "__main__":
    sys.exit(main())
