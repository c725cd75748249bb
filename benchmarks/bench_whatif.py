"""How far to trust a what-if: record demo runs with a shadow, replay each with --from-db.

Each round runs ``kvtop demo --headless --policy unified --shadow leastwork --db FILE`` (the
bundled sample trace on 4 ``kvtop sim`` instances at 10x, all on 127.0.0.1, stopping by
itself), then ``kvtop simulate --from-db FILE --format csv`` twice: with the time scale fitted
from the run's own TTFTs, and with ``--speed`` given as the demo's. It prints, per round and as
the mean over rounds, the recorded and re-simulated TTFT p50/p90, E2E p99 and APC, the
re-simulation's errors, leastwork's what-if, and what the stored block chains and shadow
picks cost per decision in the file.

    python benchmarks/bench_whatif.py --repeat 3            # the figures in docs/experiments.md
    python benchmarks/bench_whatif.py --repeat 1 --duration 40   # a quick look
"""

from __future__ import annotations

import argparse
import csv
import io
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def kvtop(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtop", *args], capture_output=True, text=True,
                          timeout=timeout)


def whatif(db: str, extra: list[str]) -> dict[str, dict[str, float]]:
    r = kvtop("simulate", "--from-db", db, "--format", "csv", *extra, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"kvtop simulate --from-db failed: {r.stderr.strip()}")
    rows = {}
    for row in csv.DictReader(io.StringIO(r.stdout)):
        rows[row["arm"]] = {k: float(v) if v not in ("", "None") else float("nan")
                            for k, v in row.items() if k != "arm"}
    rows["_note"] = {"stderr": r.stderr.strip().splitlines()[0] if r.stderr.strip() else ""}  # type: ignore[dict-item]
    return rows


def storage(db: str) -> dict[str, float]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    n, blocks, shadows, whole = conn.execute(
        "SELECT count(*), avg(coalesce(length(blocks), 0) + coalesce(length(blocks_parent), 0)), "
        "avg(coalesce(length(shadows), 0)), sum(blocks_parent IS NULL) FROM decisions").fetchone()
    conn.close()
    return {"decisions": n, "chain_bytes": blocks, "shadow_bytes": shadows, "chains_whole": whole}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3, help="recorded runs (default 3)")
    p.add_argument("--duration", type=float, default=None, help="seconds per run (default: the whole trace)")
    p.add_argument("--speed", type=float, default=10.0, help="the demo's speed (default 10)")
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="kvtop-whatif-"))
    rounds = []
    for k in range(args.repeat):
        db = str(tmp / f"run{k}.db")
        t0 = time.time()
        cmd = ["demo", "--headless", "--policy", "unified", "--shadow", "leastwork", "--db", db,
               "--speed", f"{args.speed:g}"]
        if args.duration:
            cmd += ["--duration", f"{args.duration:g}"]
        r = kvtop(*cmd, timeout=1200)
        if r.returncode != 0:
            raise SystemExit(f"kvtop demo failed: {r.stderr.strip()[-500:]}")
        fitted = whatif(db, [])
        given = whatif(db, ["--speed", f"{args.speed:g}"])
        st = storage(db)
        rounds.append((fitted, given, st))
        print(f"round {k + 1}: recorded in {time.time() - t0:.0f} s; {fitted['_note']['stderr']}", file=sys.stderr)

    def show(label: str, pick) -> None:
        print(f"\n{label}")
        print("| round | arm | TTFT p50 ms | TTFT p90 ms | E2E p99 ms | APC | TTFT p50 err | TTFT p90 err | APC err (pts) |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        errs = []
        for k, rd in enumerate(rounds):
            rows = pick(rd)
            rec = next(v for a, v in rows.items() if a.startswith("recorded"))
            for arm, v in rows.items():
                if arm == "_note":
                    continue
                e = ""
                if arm == "sim unified":
                    e50 = (v["ttft_p50_ms"] / rec["ttft_p50_ms"] - 1) * 100
                    e90 = (v["ttft_p90_ms"] / rec["ttft_p90_ms"] - 1) * 100
                    eapc = (v["apc"] - rec["apc"]) * 100
                    errs.append((e50, e90, eapc))
                    e = f" {e50:+.1f}% | {e90:+.1f}% | {eapc:+.1f} |"
                else:
                    e = " | | |"
                print(f"| {k + 1} | {arm} | {v['ttft_p50_ms']:.1f} | {v['ttft_p90_ms']:.1f} | {v['e2e_p99_ms']:.0f} "
                      f"| {v['apc'] * 100:.1f}% |{e}")
        if errs:
            m = [statistics.mean(abs(e[i]) for e in errs) for i in range(3)]
            w = [max(abs(e[i]) for e in errs) for i in range(3)]
            print(f"\nre-simulating unified, |error| mean / worst over {len(errs)} rounds: TTFT p50 {m[0]:.1f}% / "
                  f"{w[0]:.1f}%, TTFT p90 {m[1]:.1f}% / {w[1]:.1f}%, APC {m[2]:.1f} / {w[2]:.1f} points")

    show("time scale fitted from each run's TTFTs", lambda rd: rd[0])
    show(f"time scale given (--speed {args.speed:g})", lambda rd: rd[1])
    print("\nstorage per decision: " + "; ".join(
        f"round {k + 1}: {st['decisions']:.0f} decisions, block chain {st['chain_bytes']:.0f} B, "
        f"shadow picks {st['shadow_bytes']:.0f} B, {st['chains_whole']:.0f} chains stored whole"
        for k, (_, _, st) in enumerate(rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
