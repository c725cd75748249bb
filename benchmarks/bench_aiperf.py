"""A third-party load generator through kvtop: aiperf's streaming chat benchmark (200 requests by
default) sent through ``kvtop route`` and straight to the instance behind it, interleaved.

One simulated vLLM instance (``kvtop sim``, its own process) serves both runs; the router
(``kvtop route``, decision log on, as users run it) fronts it alone, so the difference between
the two is what the proxy adds: parsing, routing, logging, relaying each SSE event. aiperf counts
tokens with a small local BPE tokenizer (benchmarks/bench_agentic.py builds it; aiperf would
otherwise download one), uses the server's token counts, and sends ``ignore_eos`` so every answer
is ``--osl`` tokens long.

    pip install aiperf                       # into any venv; --aiperf names its executable
    python benchmarks/bench_aiperf.py --aiperf /tmp/aiperf-venv/bin/aiperf
    python benchmarks/bench_aiperf.py --aiperf ... --rounds 3 --concurrency 1 --json out.json

Every process binds 127.0.0.1. On a 2-core machine aiperf's worker processes, the router and the
simulated instance share the cores; the figures are a ceiling of the whole loop.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--aiperf", default=shutil.which("aiperf") or "aiperf", help="aiperf executable")
    p.add_argument("--requests", type=int, default=200, help="requests per aiperf run (default 200)")
    p.add_argument("--concurrency", type=int, default=1, help="aiperf concurrency (default 1: latency, "
                                                                "no queueing)")
    p.add_argument("--repeat", type=int, default=2, help="rounds of (direct, kvtop), order alternating")
    p.add_argument("--isl", type=int, default=512, help="input tokens per request (default 512)")
    p.add_argument("--osl", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument("--speed", type=float, default=100.0, help="kvtop sim --speed (default 100: the "
                                                             "engine's time is small beside HTTP's)")
    p.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                   help="an extra `kvtop route` argument (repeatable), e.g. --router-arg=--db --router-arg=none")
    p.add_argument("--json", default=None, metavar="FILE", help="write every run's figures here")
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, seconds: float = 30) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{url} did not come up")


def _tokenizer(cache: Path) -> Path:
    spec = importlib.util.spec_from_file_location("_bench_agentic", HERE / "bench_agentic.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build_tokenizer(cache / "tok-4000", vocab=4000, corpus_bytes=400_000)


def run_aiperf(args, url: str, tok: Path, out: Path) -> dict:
    cmd = [args.aiperf, "profile", "--model", "sim", "--tokenizer", str(tok), "--url", url,
           "--endpoint-type", "chat", "--streaming", "--request-count", str(args.requests),
           "--concurrency", str(args.concurrency), "--synthetic-input-tokens-mean", str(args.isl),
           "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(args.osl),
           "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
           "--random-seed", "1", "--artifact-dir", str(out), "--ui-type", "none"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"aiperf failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    d = json.loads((out / "profile_export_aiperf.json").read_text())
    errors = sum(int(e.get("count", 1)) for e in d.get("error_summary") or [])
    return {"requests": int(d["request_count"]["avg"]), "errors": errors,
            "ttft_p50_ms": d["time_to_first_token"]["p50"], "ttft_p90_ms": d["time_to_first_token"]["p90"],
            "latency_p50_ms": d["request_latency"]["p50"], "itl_p50_ms": d["inter_token_latency"]["p50"],
            "output_tokens_avg": d["output_token_count"]["avg"],
            "throughput_rps": d["request_throughput"]["avg"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="kvtop-aiperf-"))
    tok = _tokenizer(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvtop-bench")
    sim_port, router_port = _free_port(), _free_port()
    procs = []
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "kvtop", "sim", "--port-base", str(sim_port),
                                       "--speed", str(args.speed), "--no-kv-events"],
                                      stdout=subprocess.DEVNULL, stderr=open(tmp / "sim.err", "w")))
        sim = f"http://127.0.0.1:{sim_port}"
        _wait(sim + "/health")
        db = tmp / "kvtop.db"
        procs.append(subprocess.Popen([sys.executable, "-m", "kvtop", "route", "--backend", sim,
                                       "--port", str(router_port), "--db", str(db), "--state-dir", str(tmp / "state"),
                                       *args.router_arg],
                                      stdout=subprocess.DEVNULL, stderr=open(tmp / "route.err", "w")))
        kvtop = f"http://127.0.0.1:{router_port}"
        _wait(kvtop + "/health")
        runs: list[dict] = []
        for k in range(args.repeat):
            order = [("direct", sim), ("kvtop", kvtop)]
            for name, url in order if k % 2 == 0 else order[::-1]:
                fig = run_aiperf(args, url, tok, tmp / f"{name}-{k}")
                runs.append({"target": name, "round": k, **fig})
                print(f"round {k} {name:6s} requests {fig['requests']} errors {fig['errors']}  "
                      f"TTFT p50 {fig['ttft_p50_ms']:.2f} ms p90 {fig['ttft_p90_ms']:.2f} ms  "
                      f"latency p50 {fig['latency_p50_ms']:.2f} ms  ITL p50 {fig['itl_p50_ms']:.3f} ms  "
                      f"{fig['throughput_rps']:.1f} req/s", flush=True)
        time.sleep(1.0)  # the router's decision log flushes
        import sqlite3

        statuses = {}
        if db.exists():
            with sqlite3.connect(db) as c:
                statuses = dict(c.execute("select status, count(*) from outcomes group by status").fetchall())
        print(f"kvtop's decision log: outcomes by status {statuses}")
        for name in ("direct", "kvtop"):
            mine = [r for r in runs if r["target"] == name]
            med = sorted(r["ttft_p50_ms"] for r in mine)[len(mine) // 2]
            print(f"{name:6s} TTFT p50 (median of {len(mine)} runs) {med:.2f} ms")
        d = sorted(r["ttft_p50_ms"] for r in runs if r["target"] == "direct")
        v = sorted(r["ttft_p50_ms"] for r in runs if r["target"] == "kvtop")
        added = [b - a for a, b in zip((r["ttft_p50_ms"] for r in runs if r["target"] == "direct"),
                                       (r["ttft_p50_ms"] for r in runs if r["target"] == "kvtop"))]
        print(f"added TTFT p50 by kvtop, per round: {', '.join(f'{a:+.2f} ms' for a in added)}")
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs, "outcomes": statuses,
                                                   "direct_p50s": d, "kvtop_p50s": v}, indent=1))
        return 0
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    sys.exit(main())
