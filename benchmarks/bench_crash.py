"""What a SIGKILL costs the decision log: load at the highest rate, kill, count the lost rows.

A trivial backend (bench_overhead's) answers at once; ``kvtop route --db FILE`` sits in front;
``--concurrency`` clients send non-streaming completions for ``--seconds`` and remember every
answered request id (``X-Kvtop-Request-Id``) with the time its answer arrived. Then the
router gets SIGKILL, and the script checks the file: ``PRAGMA integrity_check``, and which
answered requests have no decision row. Each lost request's age at the kill is the loss
window. Repeated ``--repeat`` times; every process binds 127.0.0.1 and stops by itself.

    python benchmarks/bench_crash.py --seconds 60 --repeat 5      # the figures in reliability.md
    python benchmarks/bench_crash.py --seconds 10 --repeat 1      # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_overhead as bo  # noqa: E402  (the trivial backend and process helpers)

from kvtop.procs import stop_process  # noqa: E402


async def load(url: str, seconds: float, concurrency: int) -> tuple[dict[str, float], int]:
    import aiohttp

    answered: dict[str, float] = {}
    errors = 0
    body = json.dumps({"model": "tiny", "prompt": bo.PROMPT, "max_tokens": 8}).encode()
    deadline = time.monotonic() + seconds

    async def worker(http) -> None:
        nonlocal errors
        while time.monotonic() < deadline:
            try:
                async with http.post(url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    if r.status == 200:
                        answered[r.headers["X-Kvtop-Request-Id"]] = time.time()
                    else:
                        errors += 1
            except aiohttp.ClientError:
                errors += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return answered, errors


def one_run(args: argparse.Namespace, backend_url: str, tmp: str, k: int) -> dict[str, float]:
    port = bo.free_port()
    db = str(Path(tmp) / f"crash-{k}.db")
    proc = subprocess.Popen([sys.executable, "-m", "kvtop", "route", "--host", "127.0.0.1", "--port", str(port),
                             "--backend", backend_url, "--policy", "lmetric", "--db", db, "--state-dir", tmp,
                             "--health-interval", "0"], stdout=subprocess.DEVNULL,
                            stderr=open(Path(tmp) / f"crash-{k}.stderr", "wb"))
    try:
        bo.wait_ready(f"http://127.0.0.1:{port}/v1/models", proc)
        answered, errors = asyncio.run(load(f"http://127.0.0.1:{port}", args.seconds, args.concurrency))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            log = json.loads(r.read())["decision_log"]
        killed_at = time.time()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        stop_process(proc)
    conn = sqlite3.connect(db)
    integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
    logged = {r[0] for r in conn.execute("SELECT request_id FROM decisions")}
    outcomes = conn.execute("SELECT count(*) FROM outcomes").fetchone()[0]
    conn.close()
    # what the router told its operator (store/writer.py warns when its full queue drops rows)
    said = [ln for ln in (Path(tmp) / f"crash-{k}.stderr").read_text(errors="replace").splitlines()
            if "decision log:" in ln]
    lost = [t for rid, t in answered.items() if rid not in logged]
    # what the kill took: rows still queued or being written. A row the full queue dropped
    # earlier is counted by the router (/metrics) and is not part of the kill's window.
    at_kill = [t for t in lost if t >= killed_at - 10.0]
    window = killed_at - min(at_kill) if at_kill else 0.0
    rate = len(answered) / args.seconds
    return {"answered": len(answered), "req_per_s": rate, "errors": errors, "integrity": integrity,
            "lost_decisions": len(lost), "lost_share": len(lost) / max(1, len(answered)),
            "lost_at_kill": len(at_kill),
            "loss_window_s": window, "outcome_rows": outcomes, "dropped_before_kill": log["rows_dropped"],
            "queued_at_kill": log["rows_queued"], "drop_warnings": len(said)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="kvtop-crash-")
    bport = bo.free_port()
    backend = subprocess.Popen([sys.executable, bo.__file__, "--serve-backend", str(bport)])
    backend_url = f"http://127.0.0.1:{bport}"
    rows = []
    try:
        bo.wait_ready(backend_url + "/v1/models", backend)
        for k in range(args.repeat):
            r = one_run(args, backend_url, tmp, k)
            rows.append(r)
            print(f"run {k + 1}: {r['answered']:,} answered ({r['req_per_s']:,.0f}/s), integrity {r['integrity']}, "
                  f"lost {r['lost_decisions']} decisions ({r['lost_share']:.2%}), {r['lost_at_kill']} of them to the kill "
                  f"(window {r['loss_window_s']:.2f} s); "
                  f"{r['dropped_before_kill']} rows dropped by the full queue during the run, "
                  f"{r['queued_at_kill']} queued just before the kill; "
                  f"{r['drop_warnings']} decision-log warnings on the router's stderr",
                  flush=True)
    finally:
        stop_process(backend)
        for f in [*Path(tmp).glob("crash-*.db*"), *Path(tmp).glob("crash-*.stderr")]:
            f.unlink()
    print(f"\nworst of {len(rows)}: lost {max(r['lost_at_kill'] for r in rows)} decisions to the kill, "
          f"window {max(r['loss_window_s'] for r in rows):.2f} s; integrity "
          f"{'ok every time' if all(r['integrity'] == 'ok' for r in rows) else 'FAILED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
