"""Two kvtop checkouts side by side on bench_agentic's returning 215k-token turns, turn by turn.

On a shared host the load moves by tens of percent between runs minutes apart (bench_agentic's
peers, which did not change, measured 6.3 and 10.1 ms p50 in two runs four minutes apart), so a
before/after made of separate runs mostly measures the host. Here one session's turns go to both
routers in the same second: each turn is sent straight to the backend (twice, the faster
counts), then to router A and router B in an order that alternates turn by turn. Both routers
run ``--tokenizer`` (bench_agentic's 32k BPE; ``--text``: neither, the text path) and the same
flags as bench_agentic; each runs the
code of its own directory (``python -m kvtop`` started there, with that directory first on
PYTHONPATH, so its parser worker imports the same code).

    python benchmarks/bench_agentic_ab.py --a /tmp/base15 --b . --turns 20

Reported per API and router: added ms p50 / p99 and the router's CPU ms per turn (its process
and its worker), and B minus A per turn (p50), which is what the comparison is about.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_agentic as ba  # noqa: E402
from bench_overhead import free_port, pct  # noqa: E402

from kvtop.procs import stop_process  # noqa: E402


def start_router(code_dir: str, backend: str, tok_dir: Path | None, state_dir: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.path.abspath(code_dir))
    proc = subprocess.Popen([sys.executable, "-m", "kvtop", "route", "--host", "127.0.0.1", "--port", str(port),
                             "--backend", backend, "--policy", "unified", "--db", "none", "--state-dir", state_dir,
                             "--block-size", "16"] + (["--tokenizer", str(tok_dir)] if tok_dir else []),
                            cwd=code_dir, env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    ba.wait_ready(url + "/health", proc)
    return proc, url


async def run(args) -> dict:
    import aiohttp

    tok_dir = None if args.text else ba.build_tokenizer(args.tokenizer_dir)
    texts = ba.corpus(6_000_000)
    procs: list[subprocess.Popen] = []
    bport = free_port()
    procs.append(subprocess.Popen([sys.executable, ba.__file__, "--serve-backend", str(bport)]))
    backend = f"http://127.0.0.1:{bport}"
    ba.wait_ready(backend + "/v1/models", procs[-1])
    tmp = tempfile.mkdtemp(prefix="kvtop-agentic-ab-")
    out: dict = {"a": os.path.abspath(args.a), "b": os.path.abspath(args.b), "text": args.text, "apis": {}}
    try:
        routers = {}
        for name, d in (("a", args.a), ("b", args.b)):
            p, url = start_router(d, backend, tok_dir, tmp)
            procs.append(p)
            routers[name] = (url, p.pid)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            for k, api in enumerate(args.apis.split(",")):
                s = ba.Session(k + 1, texts)
                sid = f"ab-{k}"
                while s.chars() < args.chars - args.turns * s.turn_chars:
                    s.grow()
                first = json.dumps(s.body(api, sid)).encode()
                for url, _ in routers.values():  # the session's past, in both
                    await ba.post(http, url + ba.PATHS[api], first)
                added = {"a": [], "b": []}
                cpu = {"a": [], "b": []}
                for turn in range(args.turns):
                    s.grow()
                    payload = json.dumps(s.body(api, sid)).encode()
                    direct = min([await ba.post(http, backend + ba.PATHS[api], payload) for _ in range(2)])
                    for name in (("a", "b") if turn % 2 == 0 else ("b", "a")):
                        url, pid = routers[name]
                        c0 = ba.tree_cpu_ms(pid)
                        ms = await ba.post(http, url + ba.PATHS[api], payload)
                        cpu[name].append(ba.tree_cpu_ms(pid) - c0)
                        added[name].append(ms - direct)
                diff = [b - a for a, b in zip(added["a"], added["b"])]
                res = {n: {"added_p50_ms": pct(added[n], 0.5), "added_p99_ms": pct(added[n], 0.99),
                           "cpu_p50_ms": pct(cpu[n], 0.5)} for n in ("a", "b")}
                res["b_minus_a_added_p50_ms"] = pct(diff, 0.5)
                res["b_minus_a_cpu_p50_ms"] = pct([b - a for a, b in zip(cpu["a"], cpu["b"])], 0.5)
                out["apis"][api] = res
                print(api, json.dumps(res), flush=True)
    finally:
        for p in procs:
            stop_process(p)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="kvtop checkout A (e.g. a git worktree of the baseline)")
    ap.add_argument("--b", default=".", help="kvtop checkout B (default: this one)")
    ap.add_argument("--apis", default="chat,messages,responses")
    ap.add_argument("--turns", type=int, default=20, help="returning turns per API (default 20)")
    ap.add_argument("--chars", type=int, default=800_000, help="session size in characters (default 800,000)")
    ap.add_argument("--tokenizer-dir", default=os.path.join(tempfile.gettempdir(), "kvtop-bench-tokenizer-32k"))
    ap.add_argument("--text", action="store_true",
                    help="both routers without --tokenizer (the text path: prompts hashed in character chunks)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    for d in (args.a, args.b):
        if not (Path(d) / "kvtop" / "__main__.py").exists():
            ap.error(f"{d!r} is not a kvtop checkout (no kvtop/__main__.py)")
    res = asyncio.run(run(args))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
