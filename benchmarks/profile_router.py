"""Where the router's CPU goes on the sequential non-streaming path, by stage, in µs a request.

The router runs in this process (``create_app`` + ``start_server``, ``--policy`` (lmetric), no
decision log, as bench_overhead.py runs it) in front of bench_overhead.py's trivial backend;
a client process sends ``--requests`` sequential non-streaming completions. A CPU-time timer
(``ITIMER_PROF``: user + system time of this process, so time waiting on the client or the
backend is not sampled) records the Python stack at each tick; each sample is charged to the
innermost stage of ``STAGES`` on its stack, and the counts are scaled to the process's measured
CPU per request. C code (a socket call, a C parser) is charged to the Python frame that called
it, since the handler runs at the next bytecode. The tick is the kernel's (4 ms here), so use
10,000 requests or more; the profiler adds about 5% of CPU.

    python benchmarks/profile_router.py --requests 20000
    python benchmarks/profile_router.py --requests 20000 --stacks out.txt   # folded stacks too
    /path/to/main/.venv/bin/python benchmarks/profile_router.py         # another checkout's router
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_overhead; the router is the venv's

import bench_overhead as bo  # noqa: E402

#: (stage, the frame that marks it, as "dir/file.py:function"), innermost match wins
STAGES = (
    ("policy view and pick (core.decide)", "router/core.py:decide"),
    ("metrics listener (telemetry)", "router/telemetry.py:__call__"),
    ("decision record and event (state.decision)", "router/state.py:decision"),
    ("outcome record (state.outcome)", "router/state.py:outcome"),
    ("the rest of the lifecycle and pipeline steps", "router/lifecycle.py:step"),
    ("request JSON parse, API read, block hashes (parsing.py)", "router/parsing.py:parse"),
    ("the answer's write to the client (answer.send_whole)", "router/answer.py:send_whole"),
    ("upstream request: head, connection, timer, send", "router/upstream.py:request"),
    ("upstream answer: read, httptools parse, wake", "router/upstream.py:data_received"),
    ("the answer's usage (forward.usage_of)", "router/forward.py:usage_of"),
    ("aiohttp request in: read, C parse, message, body stream", "router/app.py:data_received"),
    ("request body read (http.read_body)", "router/http.py:read_body"),
    ("the proxy's own code (proxy.handle)", "router/proxy.py:handle"),
    ("aiohttp's per-request objects and finish", "aiohttp/web_protocol.py:start"),
)

CLIENT = """
import asyncio, sys
sys.path.insert(0, {bench!r})
import aiohttp, bench_overhead as bo
async def main():
    async with aiohttp.ClientSession() as http:
        for _ in range({n}):
            await bo.one(http, {url!r}, False)
asyncio.run(main())
"""


def frame_name(code) -> str:
    return "/".join(code.co_filename.split("/")[-2:]) + ":" + code.co_name


async def profile(args: argparse.Namespace, backend_url: str) -> tuple[float, collections.Counter]:
    from router.app import create_app, start_server
    from router.state import Backend, RouterConfig

    cfg = RouterConfig(backends=[Backend("b0", backend_url)], policy=args.policy, db=None,
                       state_dir=args.state_dir)
    app = create_app(cfg)
    sock = socket.create_server(("127.0.0.1", 0))
    runner = await start_server(app, sock)
    url = "http://127.0.0.1:%d/v1/completions" % sock.getsockname()[1]
    bench = str(Path(bo.__file__).parent)
    stacks: collections.Counter = collections.Counter()

    def sample(_sig, frame) -> None:
        names = []
        while frame is not None:
            names.append(frame_name(frame.f_code))
            frame = frame.f_back
        stacks[tuple(reversed(names))] += 1

    try:
        warm = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT.format(bench=bench, n=300, url=url))
        await warm.wait()
        client = await asyncio.create_subprocess_exec(sys.executable, "-c",
                                                      CLIENT.format(bench=bench, n=args.requests, url=url))
        t0 = os.times()
        signal.signal(signal.SIGPROF, sample)
        signal.setitimer(signal.ITIMER_PROF, 0.0001, 0.0001)
        await client.wait()
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        t1 = os.times()
    finally:
        await runner.cleanup()
    cpu_us = (t1.user + t1.system - t0.user - t0.system) / args.requests * 1e6
    return cpu_us, stacks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--policy", default="lmetric", help="the router's policy (default lmetric, as bench_overhead.py runs it)")
    p.add_argument("--stacks", help="also write the folded stacks (frame;frame;... count) here")
    p.add_argument("--state-dir", default=None, help="the router's state directory (default: a temporary one)")
    args = p.parse_args(argv)
    if args.requests < 1:
        p.error("--requests must be at least 1")
    import tempfile

    import uvloop

    with tempfile.TemporaryDirectory(prefix="kvtop-profile-") as tmp:
        args.state_dir = args.state_dir or tmp
        port = bo.free_port()
        backend = subprocess.Popen([sys.executable, bo.__file__, "--serve-backend", str(port)])
        try:
            bo.wait_ready(f"http://127.0.0.1:{port}/v1/models", backend)
            cpu_us, stacks = uvloop.run(profile(args, f"http://127.0.0.1:{port}"))
        finally:
            bo.stop_process(backend)
    total = sum(stacks.values()) or 1
    by_stage: collections.Counter = collections.Counter()
    for stack, n in stacks.items():
        stage = "the event loop, callbacks, GC (no stage on the stack)"
        for frame in reversed(stack):
            hit = next((name for name, mark in STAGES if mark == frame), None)
            if hit is not None:
                stage = hit
                break
        by_stage[stage] += n
    print(f"router CPU {cpu_us:.0f} µs a request ({args.requests} requests, {total} samples, "
          f"load {os.getloadavg()[0]:.2f})\n")
    print("| stage | µs a request |\n|---|---:|")
    for stage, n in by_stage.most_common():
        print(f"| {stage} | {n / total * cpu_us:.0f} |")
    if args.stacks:
        with open(args.stacks, "w") as f:
            for stack, n in stacks.most_common():
                f.write(";".join(stack) + f" {n}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
