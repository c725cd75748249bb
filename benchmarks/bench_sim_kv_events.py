"""What kvtop sim's KV events (on by default) cost the simulated server: the same agentic load
against one instance with and without ``--no-kv-events``, the server's CPU seconds compared.

    python benchmarks/bench_sim_kv_events.py [--sessions 8] [--turns 12] [--rounds 3]

Each session's turn is its previous prompt plus 1-4k new token ids (prompts grow to ~30k),
sent as non-streamed completions with max_tokens 1 at --speed 1000 and
--num-gpu-blocks 8000 (128k tokens, a few sessions: evictions), one request at a time, so the engine's
BlockStored/BlockRemoved traffic, not decoding, dominates. Arms alternate for --rounds rounds.
Prints each arm's server CPU s (user + sys from /proc) per round and the median ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from kvtop.procs import free_port_run




def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_arm(events: bool, prompts: list[list[int]]) -> tuple[float, float]:
    base = free_port_run(3)
    cmd = [sys.executable, "-m", "kvtop", "sim", "--port-base", str(base), "--speed", "1000",
           "--num-gpu-blocks", "8000", "--duration", "600"]
    if not events:
        cmd.append("--no-kv-events")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline().startswith("instance 0:")
        c0, t0 = cpu_s(proc.pid), time.perf_counter()
        for p in prompts:
            body = json.dumps({"model": "m", "prompt": p, "max_tokens": 1}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{base}/v1/completions", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                r.read()
        return cpu_s(proc.pid) - c0, time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rng = random.Random(7)
    ctx = [[] for _ in range(args.sessions)]
    prompts = []
    for _ in range(args.turns):
        for s in range(args.sessions):
            ctx[s] = ctx[s] + [rng.randrange(30_000) for _ in range(rng.randrange(1000, 4000))]
            prompts.append(ctx[s])
    tokens = sum(len(p) for p in prompts)
    ratios = []
    for k in range(args.rounds):
        on, wall_on = one_arm(True, prompts)
        off, wall_off = one_arm(False, prompts)
        ratios.append(on / off)
        print(f"round {k + 1}: events {on:.2f} CPU s ({wall_on:.1f} s wall), no events {off:.2f} CPU s "
              f"({wall_off:.1f} s wall)  ratio {on / off:.3f}", flush=True)
    print(f"{len(prompts)} requests, {tokens:,} prompt tokens each arm; median CPU ratio events/none "
          f"{statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
