"""Cost of the simulator: the engine in virtual time, and the HTTP server streaming tokens.

    python benchmarks/bench_sim_server.py engine [--requests 10000] [--engines 8]
    python benchmarks/bench_sim_server.py trace FILE [--requests 10000] [--session-gap 20]
    python benchmarks/bench_sim_server.py server [--speed 10] [--streams 16] [--tokens 400]
    python benchmarks/bench_sim_server.py fingerprint FILE [--limit N] [--policies P,...]
    python benchmarks/bench_sim_server.py ab FILE NAME=ENGINE.py NAME=ENGINE.py ... [--rounds 2]

``engine``: an agentic-shaped synthetic trace (sessions whose every turn repeats the previous
context and adds 1-8k tokens; prompts 5k-200k tokens; block size 64; outputs 50-400 tokens)
through N engines in a tiny discrete-event loop, sessions pinned to engines. Prints steps/s
and simulated requests per CPU second; the offline simulator's budget is 10,000 requests
over 8 engines in <= 20 s.

``trace FILE``: the same synthetic trace written as a normalized trace (kvtop/traces/loader.py),
so ``kvtop simulate FILE`` runs the benchmark's load through the router's policies.

``fingerprint FILE``: ``kvtop simulate``'s records of each policy on a trace, as a SHA-256 of
their JSON, with the CPU seconds each simulation took. A change meant to make the simulator
faster without changing what it simulates must print the same fingerprints before and after
(run it on both commits, e.g. the old one from ``git worktree add``).

``ab FILE NAME=PATH ...``: two or more versions of kvtop/sim/engine.py (e.g. the old one from
``git show COMMIT:kvtop/sim/engine.py > /tmp/old_engine.py``) run alternately in ONE process
on the same trace, each policy once per round, swapped in as ``kvtop.sim.engine``'s classes:
CPU seconds per run, the records' SHA-256, and the median per version. One process, the
trace loaded once and the versions interleaved, is the fairest comparison a shared host gives.

``server``: one instance (``--speed``) on a free 127.0.0.1 port in a subprocess, driven by
concurrent streaming clients in this process; prints the server's CPU seconds (user + sys,
from /proc) per 1,000 streamed tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import os
import random
import socket
import subprocess
import sys
import time


def synthetic_agentic_trace(num_requests: int, seed: int = 1, block_size: int = 64,
                            session_gap_s: float = 20.0):
    """(arrival, session, num_tokens, block_hashes, max_tokens), sorted by arrival."""
    rng = random.Random(seed)
    out = []
    t = 0.0
    session = 0
    while len(out) < num_requests:
        session += 1
        context = rng.randint(5_000, 30_000)
        hashes: list[int] = []
        turns = rng.randint(3, 40)
        st = t
        for _ in range(turns):
            if context > 200_000 or len(out) >= num_requests:
                break
            n_blocks = context // block_size
            while len(hashes) < n_blocks:
                hashes.append(hash((session, len(hashes))))
            out.append((st, session, context, hashes[:n_blocks], rng.randint(50, 400)))
            st += rng.expovariate(1 / 20.0)          # think + tool time between turns
            context += rng.randint(1_000, 8_000)
        t += rng.expovariate(1 / session_gap_s)      # a new session every ~gap seconds
    out.sort(key=lambda r: r[0])
    return out


def bench_engine(num_requests: int, num_engines: int, session_gap_s: float = 20.0,
                 coalesce: bool = True) -> None:
    from kvtop.sim.engine import Engine, EngineRequest

    trace = synthetic_agentic_trace(num_requests, session_gap_s=session_gap_s)
    engines = [Engine("h20", block_size=64, num_gpu_blocks=16_560 * 16 // 64,
                      engine_id=str(i)) for i in range(num_engines)]
    c0 = time.process_time()
    w0 = time.perf_counter()
    # events: (time, kind, index, generation); kind 0 = arrival, 1 = engine step. Engines
    # coalesce uneventful decode steps as kvtop simulate has them do; an arrival inside such a
    # result cuts it short, and the step event is re-pushed with a new generation.
    events = [(r[0], 0, k, 0) for k, r in enumerate(trace)]
    heapq.heapify(events)
    scheduled = [False] * num_engines
    in_flight: list = [None] * num_engines
    generation = [0] * num_engines
    calls = finished = hits = prompts = 0
    while events:
        t, kind, k, gen = heapq.heappop(events)
        if kind == 0:
            arrival, session, n, hashes, max_tokens = trace[k]
            i = session % num_engines
            res = in_flight[i]
            end = res.end_time if res is not None else None
            engines[i].add_request(EngineRequest(f"r{k}", n, hashes, max_tokens, arrival))
            prompts += n
            if res is not None and res.end_time != end:
                generation[i] += 1
                heapq.heappush(events, (res.end_time, 1, i, generation[i]))
            if not scheduled[i]:
                scheduled[i] = True
                generation[i] += 1
                heapq.heappush(events, (t, 1, i, generation[i]))
            continue
        if gen != generation[k]:
            continue
        e = engines[k]
        r = e.step(t, coalesce=coalesce)
        calls += 1
        for f in r.finished:
            finished += 1
            hits += f.num_cached_tokens
        in_flight[k] = None
        generation[k] += 1
        if not r.idle:
            in_flight[k] = r
            heapq.heappush(events, (r.end_time, 1, k, generation[k]))
        elif (nxt := e.next_event_time()) is not None:
            heapq.heappush(events, (nxt, 1, k, generation[k]))
        else:
            scheduled[k] = False
    steps = sum(e.num_steps for e in engines)
    cpu = time.process_time() - c0
    wall = time.perf_counter() - w0
    sim_end = max(e.busy_time for e in engines)
    print(f"engine: {finished} requests ({prompts / 1e6:.1f}M prompt tokens, hit rate "
          f"{hits / prompts:.2f}) over {num_engines} engines, {steps} steps in {calls} step calls "
          f"(coalesce {'on' if coalesce else 'off'}), {sum(e.num_preemptions for e in engines)} preemptions")
    print(f"engine: {cpu:.2f} CPU s ({wall:.2f} wall s): {steps / cpu:,.0f} steps/s, "
          f"{finished / cpu:,.0f} simulated requests per CPU second; busiest engine "
          f"{sim_end:,.0f} engine-seconds busy")


def write_agentic_trace(path: str, num_requests: int, session_gap_s: float = 20.0) -> int:
    """The engine benchmark's trace as a normalized trace file (block size 64, chained ids)."""
    from kvtop.traces.loader import TraceRequest, write_trace

    trace = synthetic_agentic_trace(num_requests, session_gap_s=session_gap_s)
    turns: dict[int, int] = {}
    out = []
    for arrival, session, n, hashes, max_tokens in trace:
        turns[session] = turns.get(session, 0) + 1
        out.append(TraceRequest(arrival=arrival, session=f"s{session}", turn=turns[session],
                                input_tokens=n, output_tokens=max_tokens, hash_ids=list(hashes),
                                block_size=64, source="bench_sim_server"))
    return write_trace(path, out, {"source": "benchmarks/bench_sim_server.py trace",
                                   "requests": num_requests, "session_gap_s": session_gap_s})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


async def _drive_streams(port: int, streams: int, tokens: int, rounds: int) -> int:
    import aiohttp

    url = f"http://127.0.0.1:{port}/v1/completions"
    total = 0
    async with aiohttp.ClientSession() as session:
        async def one(k: int) -> int:
            body = {"prompt": f"stream {k} " + "word " * 500, "max_tokens": tokens, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with session.post(url, json=body) as resp:
                assert resp.status == 200, await resp.text()
                async for _ in resp.content:
                    pass
            return tokens

        for _ in range(rounds):
            total += sum(await asyncio.gather(*(one(k) for k in range(streams))))
    return total


def bench_server(speed: float, streams: int, tokens: int, rounds: int, interval_ms: float) -> None:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvtop.cli", "sim", "--instances", "1",
                             "--port-base", str(port), "--speed", str(speed),
                             "--stream-interval-ms", str(interval_ms), "--duration", "600"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()    # "instance 0: http://..." once listening
        if "instance 0" not in line:
            raise SystemExit(f"server did not start: {line}{proc.stdout.read()}")
        c0 = _proc_cpu(proc.pid)
        w0 = time.perf_counter()
        total = asyncio.run(_drive_streams(port, streams, tokens, rounds))
        wall = time.perf_counter() - w0
        cpu = _proc_cpu(proc.pid) - c0
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    print(f"server: speed {speed:g}, {streams} concurrent streams x {tokens} tokens x {rounds} "
          f"rounds, stream interval {interval_ms:g} ms: {total} tokens in {wall:.2f} wall s")
    print(f"server: {cpu:.2f} server CPU s = {cpu / total * 1000:.3f} CPU s per 1,000 streamed "
          f"tokens ({total / wall:,.0f} tokens/s wall)")


#: The policies issue 18's must-hold compares (kvtop simulate --policies ... --repeats 16).
ALL_POLICIES = "round_robin,load_only,lmetric,sticky,unified,unified_ab,leastwork,leastwork_kappa"


def fingerprint(path: str, limit: int | None, policies: str, instances: int) -> None:
    import gc
    import hashlib
    import json

    from kvtop.simulate import SimConfig, simulate
    from kvtop.traces.loader import dense_ids, load_trace

    requests = load_trace(path)
    if limit is not None:
        requests = requests[:limit]
    requests = dense_ids(requests)   # as kvtop simulate does (kvtop/simulate.py run)
    gc.collect()
    gc.freeze()   # as kvtop simulate does with its trace (kvtop/simulate.py run)
    total = 0.0
    for policy in policies.split(","):
        c0 = time.process_time()
        records = simulate(requests, policy, SimConfig(instances=instances))
        cpu = time.process_time() - c0
        total += cpu
        digest = hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()[:16]
        print(f"{policy:16} {len(records):6} records  sha256 {digest}  {cpu:6.2f} CPU s "
              f"({len(records) / cpu:,.0f} simulated requests per CPU s)", flush=True)
    print(f"total {total:.2f} CPU s")


def ab(path: str, versions: list[str], limit: int | None, policies: str, instances: int,
       rounds: int) -> None:
    import gc
    import hashlib
    import importlib.util
    import json

    import kvtop.sim.engine as live
    from kvtop.simulate import SimConfig, simulate
    from kvtop.traces.loader import dense_ids, load_trace

    modules = {}
    for spec_text in versions:
        name, sep, file = spec_text.partition("=")
        if not sep or not name or not os.path.isfile(file):
            raise ValueError(f"expected NAME=PATH to an engine.py, got {spec_text!r}")
        spec = importlib.util.spec_from_file_location(f"_ab_engine_{name}", file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module     # dataclasses look their module up by name
        spec.loader.exec_module(module)
        modules[name] = module
    requests = load_trace(path)
    if limit is not None:
        requests = requests[:limit]
    requests = dense_ids(requests)   # as kvtop simulate does (kvtop/simulate.py run)
    gc.collect()
    gc.freeze()   # as kvtop simulate does with its trace (kvtop/simulate.py run)
    cpu: dict[tuple[str, str], list[float]] = {}
    for r in range(rounds):
        for name, module in modules.items():
            for attr in ("Engine", "EngineRequest", "EngineRejected"):
                setattr(live, attr, getattr(module, attr))
            for policy in policies.split(","):
                gc.collect()
                c0 = time.process_time()
                records = simulate(requests, policy, SimConfig(instances=instances))
                took = time.process_time() - c0
                digest = hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()[:16]
                cpu.setdefault((policy, name), []).append(took)
                print(f"round {r}  {name:10} {policy:16} {took:7.2f} CPU s  sha256 {digest}", flush=True)
    for (policy, name), runs in cpu.items():
        runs.sort()
        print(f"{policy:16} {name:10} median {runs[len(runs) // 2]:7.2f} CPU s  all {[round(x, 2) for x in runs]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    e = sub.add_parser("engine")
    e.add_argument("--requests", type=int, default=10_000)
    e.add_argument("--engines", type=int, default=8)
    e.add_argument("--session-gap", type=float, default=20.0,
                   help="mean seconds between new sessions (smaller = more load; 6 overloads 8 H20s)")
    e.add_argument("--no-coalesce", action="store_true",
                   help="one engine step per call, as kvtop sim's server runs it")
    w = sub.add_parser("trace")
    w.add_argument("file", help="output path (.jsonl or .jsonl.gz)")
    w.add_argument("--requests", type=int, default=10_000)
    w.add_argument("--session-gap", type=float, default=20.0)
    f = sub.add_parser("fingerprint")
    f.add_argument("file", help="a normalized trace, e.g. the one `trace` writes")
    f.add_argument("--limit", type=int, default=None, help="first N requests")
    f.add_argument("--policies", default=ALL_POLICIES)
    f.add_argument("--instances", type=int, default=8)
    a = sub.add_parser("ab")
    a.add_argument("file", help="a normalized trace, e.g. the one `trace` writes")
    a.add_argument("versions", nargs="+", help="NAME=PATH of an engine.py, two or more")
    a.add_argument("--limit", type=int, default=None, help="first N requests")
    a.add_argument("--policies", default="round_robin,leastwork")
    a.add_argument("--instances", type=int, default=8)
    a.add_argument("--rounds", type=int, default=2)
    s = sub.add_parser("server")
    s.add_argument("--speed", type=float, default=10.0)
    s.add_argument("--streams", type=int, default=16)
    s.add_argument("--tokens", type=int, default=400)
    s.add_argument("--rounds", type=int, default=2)
    s.add_argument("--stream-interval-ms", type=float, default=20.0)
    args = ap.parse_args()
    if args.what == "engine":
        bench_engine(args.requests, args.engines, args.session_gap, not args.no_coalesce)
    elif args.what == "fingerprint":
        from kvtop.cli import CliError

        try:
            fingerprint(args.file, args.limit, args.policies, args.instances)
        except (CliError, OSError, ValueError, KeyError) as exc:
            raise SystemExit(f"fingerprint: {exc}") from None
    elif args.what == "ab":
        from kvtop.cli import CliError

        try:
            ab(args.file, args.versions, args.limit, args.policies, args.instances, args.rounds)
        except (CliError, OSError, ValueError, KeyError) as exc:
            raise SystemExit(f"ab: {exc}") from None
    elif args.what == "trace":
        n = write_agentic_trace(args.file, args.requests, args.session_gap)
        print(f"wrote {n} requests to {args.file}")
    else:
        bench_server(args.speed, args.streams, args.tokens, args.rounds, args.stream_interval_ms)


if __name__ == "__main__":
    main()
