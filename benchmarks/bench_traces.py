"""Measure the trace tools on the real traces: session derivation vs the WEKA truth, token
synthesis speed. Run: python benchmarks/bench_traces.py [N_WEKA_FILES]  (default: all)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from kvtop.traces import synth
from kvtop.traces.convert import convert_weka
from kvtop.traces.loader import TraceRequest
from kvtop.traces.sessions import derive_sessions, score_derivation

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"


def derivation(n_files: int | None) -> None:
    files = sorted((TRACES / "weka_claude_code").glob("trace_*.json.gz"))[:n_files]
    reqs = convert_weka(files)  # namespaced per file, every session from t=0, sorted by t
    for label, kw in (("hybrid", {}), ("strict-only", {"min_ratio": 1.0, "hub_min_tokens": 10**12})):
        t0 = time.perf_counter()
        links = derive_sessions([r.hash_ids for r in reqs], 64, **kw)
        score = score_derivation([r.session for r in reqs], [ln.session for ln in links])
        print(f"{label:12s} files {len(files)} requests {score.requests} true streams "
              f"{score.true_sessions} derived {score.derived_sessions} purity "
              f"{score.purity:.3f} split {score.split_rate:.3f} "
              f"({time.perf_counter() - t0:.1f} s)")


def synthesis() -> None:
    base = 9 * 10**9
    fresh = TraceRequest(0.0, "s", 1, 200_000, 1, list(range(base, base + 3125)), 64)
    t0 = time.perf_counter()
    synth.tokens_for_request(fresh, request_salt="a")
    t1 = time.perf_counter()
    synth.tokens_for_request(fresh, request_salt="b")
    t2 = time.perf_counter()
    print(f"synth 200k tokens: {1e3 * (t1 - t0):.1f} ms uncached, {1e3 * (t2 - t1):.1f} ms cached")


if __name__ == "__main__":
    synthesis()
    derivation(int(sys.argv[1]) if len(sys.argv) > 1 else None)
