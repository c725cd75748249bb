"""Decision-log writer throughput: decision rows per second sustained into SQLite.

Usage: python benchmarks/bench_writer.py [--rows 200000]

Rows are shaped like the router's (Decision.row() with 8 candidates' score terms, which the
writer thread serializes to JSON). The clock runs from the first put to the moment every
row is committed. Target (issue "Router core"): >= 20,000 decisions/s.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import sqlite_utils

from store.writer import Writer


def row(k: int) -> dict:
    return {
        "run_id": "bench", "ts": time.time(), "request_id": f"r{k}", "attempt": 1, "session_id": f"s{k % 500}",
        "session_source": "header", "turn": k % 40, "policy": "unified", "policy_version": 1,
        "instance": f"i{k % 8}", "instance_index": k % 8, "reason": "affinity_stick", "route_class": "HEAVY+",
        "input_tokens": 120_000, "token_source": "tokens", "est_hit_tokens": 118_272,
        "best_hit_tokens": 118_272, "best_hit_instance": f"i{k % 8}", "new_prefill_tokens": 1_728,
        "offload": 0, "decision_us": 31.5, "t_proxy_recv": time.time(),
        "scores": [{"instance": f"i{i}", "hit": 0, "new": 120_000, "P": 5_000, "BS": 3, "D": 400_000,
                    "score": 375_000.0} for i in range(8)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    args = ap.parse_args()
    rows = [row(k) for k in range(args.rows)]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.db")
        w = Writer(path, max_queued=args.rows).start()  # throughput: nothing dropped
        t0 = time.perf_counter()
        for r in rows:
            w.put("decisions", r)
        w.flush(timeout=600)
        elapsed = time.perf_counter() - t0
        w.close()
        n = sqlite_utils.Database(path)["decisions"].count
        size = os.path.getsize(path) / 1e6
    print(f"{n:,} decision rows in {elapsed:.2f} s: {n / elapsed:,.0f} rows/s "
          f"({w.batches} batches, {w.rows_failed} failed, {size:.0f} MB)")


if __name__ == "__main__":
    main()
