"""Added latency and max throughput of kvtop's proxy against a direct call and the peer routers.

A trivial OpenAI-compatible backend (an aiohttp app in this file, its own process) answers
instantly; each target sits in front of it on loopback: direct, ``kvtop route`` (``--db none``;
``kvtop-db`` with the SQLite decision log on, ``kvtop-db-shadow2`` with it and two shadow policies),
and, when their venv exists, sglang-router and vllm-router. Per target and mode (non-streaming,
streaming with 8 SSE chunks):
  - latency: ``--requests`` sequential requests, p50/p99 client-side, and the p50 added over direct;
  - throughput: ``--concurrency`` clients in a closed loop for ``--seconds`` (bounded by
    ``--max-requests``), completed requests per second;
  - router CPU: the target process's CPU time (user + system, every thread, from
    /proc/PID/task/*/schedstat, nanoseconds) over the sequential non-streaming requests, per
    request: what the router itself spends, apart from the client and the backend.

    python benchmarks/bench_overhead.py                      # about 2 minutes
    python benchmarks/bench_overhead.py --targets direct,kvtop --requests 200
    python benchmarks/bench_overhead.py --repeat 3           # the figures in docs/performance.md
    python benchmarks/bench_overhead.py --targets direct,kvtop@/path/to/main,kvtop,vllm-round_robin
                                                             # another checkout's router, interleaved

A third mode, ``big``, is the realistic agentic turn: ``--big-requests`` sequential chat
requests of about 800 KB (200k tokens at 4 characters a token) in one growing session, each
turn the previous one plus about 2 KB, as a coding agent sends them. It measures what a router
spends reading, parsing, hashing and forwarding a large body.

Every process binds 127.0.0.1. On a 2-core machine the client, router and backend share the
cores, so throughput is a ceiling of the whole loop, not the router alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from kvtop.procs import stop_process

PEERS_BIN = Path(os.environ.get("KVTOP_PEERS_VENV",
                                Path.home() / ".cache" / "kvtop-peers" / "venv")) / "bin"
PROMPT = "You are a helpful assistant. " * 10
STREAM_CHUNKS = 8


# --- the trivial backend -----------------------------------------------------------------------

def serve_backend(port: int) -> None:
    import logging

    from aiohttp import web

    # sglang-router opens with an HTTP/2 preface; aiohttp logs a harmless 400 for each.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)

    usage = {"prompt_tokens": 64, "completion_tokens": STREAM_CHUNKS, "total_tokens": 72,
             "prompt_tokens_details": {"cached_tokens": 0}}

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = request.path.endswith("/chat/completions")
        if not body.get("stream"):
            choice = ({"index": 0, "message": {"role": "assistant", "content": "ok " * STREAM_CHUNKS},
                       "finish_reason": "length"} if chat else
                      {"index": 0, "text": "ok " * STREAM_CHUNKS, "finish_reason": "length"})
            return web.json_response({"id": "cmpl-1", "object": "chat.completion" if chat else
                                      "text_completion", "model": "tiny", "choices": [choice],
                                      "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(STREAM_CHUNKS):
            choice = ({"index": 0, "delta": {"content": "ok "}, "finish_reason": None} if chat
                      else {"index": 0, "text": "ok ", "finish_reason": None})
            await resp.write(b"data: " + json.dumps({"id": "cmpl-1", "model": "tiny",
                                                      "choices": [choice]}).encode() + b"\n\n")
        await resp.write(b"data: " + json.dumps({"id": "cmpl-1", "model": "tiny", "choices": [],
                                                  "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        text = body.get("prompt") or ""
        ids = list(range(max(1, len(str(text)) // 4)))
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": 32768})

    async def render(request: web.Request) -> web.Response:
        body = await request.json()
        text = body.get("prompt") or ""
        return web.json_response([{"prompt_token_ids": list(range(max(1, len(str(text)) // 4)))}])

    async def models(_):
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model",
                                                              "max_model_len": 32768}]})

    async def ok(_):
        return web.Response(text="")

    async def info(_):
        return web.json_response({"model_path": "tiny", "served_model_name": "tiny",
                                  "tokenizer_path": "tiny", "is_generation": True})

    app = web.Application(client_max_size=64 * 1024 * 1024)  # the big mode's 800 KB bodies
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/completions/render", render)
    app.router.add_get("/v1/models", models)
    for path in ("/health", "/metrics"):
        app.router.add_get(path, ok)
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        app.router.add_get(path, info)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# --- process helpers ---------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 60, expect: bytes = b"tiny") -> None:
    """Wait until ``url`` answers 200 with ``expect`` in its body (b"" for any body)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200 and expect in r.read():
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout} s")


def target_cmd(name: str, port: int, backend: str, tmp: str) -> list[str] | None:
    prom = str(free_port())
    if name.startswith("kvtop@"):  # another checkout's router (its .venv when it has one), same flags as kvtop
        src = Path(name[6:]).resolve()
        if not (src / "router").is_dir():
            raise SystemExit(f"{name}: no kvtop checkout at {src}")
        py = src / ".venv" / "bin" / "python"
        # -P: without it "-m" puts the working directory (this checkout) ahead of PYTHONPATH
        return ["env", f"PYTHONPATH={src}", str(py if py.exists() else sys.executable), "-P", "-m", "kvtop", "route",
                "--host", "127.0.0.1", "--port", str(port), "--backend", backend, "--policy", "lmetric",
                "--db", "none", "--state-dir", tmp]
    if name in ("kvtop", "kvtop-db", "kvtop-shadow2", "kvtop-db-shadow2"):
        # kvtop-db: with the decision log on, as deployed; *-shadow2: and two shadow policies
        db = str(Path(tmp) / f"overhead-{port}.db") if name.startswith("kvtop-db") else "none"
        shadow = ["--shadow", "leastwork,unified"] if name.endswith("-shadow2") else []
        return [sys.executable, "-m", "kvtop", "route", "--host", "127.0.0.1", "--port", str(port),
                "--backend", backend, "--policy", "lmetric", "--db", db, "--state-dir", tmp, *shadow]
    peer = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", backend,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", prom]
    if name.startswith("sglang-"):
        py = PEERS_BIN / "python"
        if not py.exists():
            return None
        return [str(py), "-m", "sglang_router.launch_router", *peer, "--policy",
                name.split("-", 1)[1], "--log-level", "warn"]
    if name.startswith("vllm-"):
        exe = PEERS_BIN / "vllm-router"
        if not exe.exists():
            return None
        return [str(exe), *peer, "--policy", name.split("-", 1)[1], "--log-level", "warning"]
    raise SystemExit(f"unknown target {name}")


# --- the client --------------------------------------------------------------------------------

def cpu_seconds(pid: int | None) -> float | None:
    """CPU time of every live thread of ``pid`` so far (Linux schedstat: ns, not the 10 ms ticks
    of /proc/PID/stat; a thread that ends takes its time with it); None where it cannot be read."""
    if pid is None:
        return None
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return total / 1e9


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def one(http, url: str, stream: bool) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": STREAM_CHUNKS, "stream": stream}
    async with http.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
        if stream:
            async for _ in r.content:
                pass
        else:
            await r.read()


def big_bodies(n: int, start_bytes: int = 800_000, step_bytes: int = 2_000) -> list[bytes]:
    """A growing agentic session: turn k is turn k-1 plus one more exchange of ~2 KB."""
    rng = __import__("random").Random(7)
    words = [f"w{rng.randrange(100_000)}" for _ in range(4096)]

    def text(nbytes: int, salt: int) -> str:
        out, size, k = [], 0, salt
        while size < nbytes:
            w = words[k % len(words)]
            out.append(w)
            size += len(w) + 1
            k = k * 31 + 7
        return " ".join(out)

    system = text(start_bytes, 1)
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "start"}]
    bodies = []
    for k in range(n):
        msgs = msgs + [{"role": "assistant", "content": text(step_bytes // 2, 10 + k)},
                       {"role": "user", "content": text(step_bytes // 2, 1000 + k)}]
        bodies.append(json.dumps({"model": "tiny", "messages": msgs, "max_tokens": STREAM_CHUNKS,
                                  "stream": False}).encode())
    return bodies


async def measure_big(base: str, args: argparse.Namespace) -> dict[str, float]:
    """Sequential 800 KB chat turns of one growing session: p50/p99 ms."""
    import aiohttp

    url = base + "/v1/chat/completions"
    bodies = big_bodies(args.big_requests + 3)
    headers = {"Content-Type": "application/json", "X-Session-ID": "big-session"}
    lat = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        for k, body in enumerate(bodies):
            t0 = time.perf_counter()
            async with http.post(url, data=body, headers=headers) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
                await r.read()
            if k >= 3:  # the first turns warm the connection and the router's index
                lat.append((time.perf_counter() - t0) * 1e3)
    return {"big_p50_ms": pct(lat, 0.5), "big_p99_ms": pct(lat, 0.99)}


async def measure(base: str, args: argparse.Namespace, pid: int | None = None) -> dict[str, float]:
    """The latency and throughput figures; with ``pid``, also the router's CPU per sequential
    non-streaming request (``plain_cpu_us``)."""
    import aiohttp

    url = base + "/v1/completions"
    out: dict[str, float] = {}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as http:
        for stream in (False, True):
            mode = "stream" if stream else "plain"
            for _ in range(args.warmup):
                await one(http, url, stream)
            lat = []
            cpu0 = cpu_seconds(pid)
            for _ in range(args.requests):
                t0 = time.perf_counter()
                await one(http, url, stream)
                lat.append((time.perf_counter() - t0) * 1e3)
            cpu1 = cpu_seconds(pid)
            if not stream and cpu0 is not None and cpu1 is not None:
                out["plain_cpu_us"] = (cpu1 - cpu0) / args.requests * 1e6
            out[f"{mode}_p50_ms"], out[f"{mode}_p99_ms"] = pct(lat, 0.5), pct(lat, 0.99)
            done = 0
            deadline = time.perf_counter() + args.seconds

            async def worker() -> None:
                nonlocal done
                while time.perf_counter() < deadline and done < args.max_requests:
                    await one(http, url, stream)
                    done += 1
            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            out[f"{mode}_rps"] = done / (time.perf_counter() - t0)
    if args.big_requests:
        out.update(await measure_big(base, args))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", default="direct,kvtop,kvtop-db,sglang-round_robin,sglang-cache_aware,"
                   "vllm-round_robin,vllm-cache_aware")
    p.add_argument("--requests", type=int, default=300, help="sequential requests per mode")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seconds", type=float, default=3.0, help="throughput window per mode")
    p.add_argument("--max-requests", type=int, default=20_000, help="cap per throughput window")
    p.add_argument("--big-requests", type=int, default=30,
                   help="sequential 800 KB chat turns of one growing session (0 = skip the big mode)")
    p.add_argument("--repeat", type=int, default=1,
                   help="measure every target this many times, interleaved, and report the median "
                        "of each figure (the machine's noise moves one run's p50 by 20-50%%)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--serve-backend", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_backend:
        serve_backend(args.serve_backend)
        return 0

    import tempfile
    tmp = tempfile.mkdtemp(prefix="kvtop-overhead-")
    bport = free_port()
    backend = subprocess.Popen([sys.executable, __file__, "--serve-backend", str(bport)])
    backend_url = f"http://127.0.0.1:{bport}"
    runs: dict[str, list[dict[str, float]]] = {}
    if args.repeat < 1:
        raise SystemExit("--repeat must be 1 or more")
    try:
        wait_ready(backend_url + "/v1/models", backend)
        for _ in range(args.repeat):  # interleaved, so a noisy minute hits every target alike
            for name in args.targets.split(","):
                if name == "direct":
                    runs.setdefault(name, []).append(asyncio.run(measure(backend_url, args)))
                    continue
                port = free_port()
                cmd = target_cmd(name, port, backend_url, tmp)
                if cmd is None:
                    print(f"skip {name}: not installed (python benchmarks/peers/run.py makes the venv)",
                          file=sys.stderr)
                    continue
                proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                try:
                    wait_ready(f"http://127.0.0.1:{port}/v1/models", proc)
                    runs.setdefault(name, []).append(asyncio.run(measure(f"http://127.0.0.1:{port}", args, proc.pid)))
                except Exception as exc:  # one broken peer must not lose the others' figures
                    print(f"{name}: {exc}", file=sys.stderr)
                finally:
                    stop_process(proc)
    finally:
        stop_process(backend)
    rows = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}

    base = rows.get("direct")
    print(f"\n{args.requests} sequential requests per mode for latency; {args.concurrency} "
          f"concurrent clients for {args.seconds:g} s for throughput; {os.cpu_count()} cores; "
          f"median of {args.repeat} run(s) per target\n")
    big = args.big_requests > 0
    print("| target | plain p50 ms | p99 ms | added p50 ms | req/s | stream p50 ms | p99 ms "
          "| added p50 ms | req/s |" + (" 800 KB chat p50 ms | p99 ms | added p50 ms |" if big else "")
          + " router CPU µs/req |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if big else "") + "---:|")
    for name, r in rows.items():
        add = (lambda m: f"{r[m] - base[m]:.2f}" if base and name != "direct" else "-")
        line = (f"| {name} | {r['plain_p50_ms']:.2f} | {r['plain_p99_ms']:.2f} | {add('plain_p50_ms')} "
                f"| {r['plain_rps']:.0f} | {r['stream_p50_ms']:.2f} | {r['stream_p99_ms']:.2f} "
                f"| {add('stream_p50_ms')} | {r['stream_rps']:.0f} |")
        if big:
            line += f" {r['big_p50_ms']:.2f} | {r['big_p99_ms']:.2f} | {add('big_p50_ms')} |"
        line += f" {r['plain_cpu_us']:.0f} |" if "plain_cpu_us" in r else " - |"
        print(line)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
