"""Time the decision-log queries over several routers' logs read as one (``--db A --db B``).

Builds N logs of about ``decisions / N`` decisions each (benchmarks/bench_log.py's synthetic
run, each with its own run id and seed), then times ``kvtop log summary``, ``kvtop report``,
filtered ``kvtop log decisions`` and ``kvtop log why`` over all of them. Compare with
bench_log.py on one log of the same total size. Generation time is not the figure.

    python benchmarks/bench_log_merge.py [--decisions 1000000] [--routers 2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_log import _time, build  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decisions", type=int, default=1_000_000, help="in all the logs together")
    ap.add_argument("--routers", type=int, default=2, help="how many logs")
    ap.add_argument("--keep", metavar="DIR", help="build the logs in DIR and keep them (default: temp dir)")
    ap.add_argument("--repeat", type=int, default=3, help="report the best of N runs")
    args = ap.parse_args(argv)

    from kvtop.cli import main as kvtop_main

    tmp = args.keep or tempfile.mkdtemp(prefix="kvtop-bench-merge-")
    paths = [os.path.join(tmp, f"router{i}.db") for i in range(args.routers)]
    try:
        for i, path in enumerate(paths):
            if not os.path.exists(path):
                t = time.perf_counter()
                build(path, args.decisions // args.routers, seed=7 + i, run_id=f"bench-run-{i}")
                print(f"built {path}: {args.decisions // args.routers:,} decisions in "
                      f"{time.perf_counter() - t:.1f} s ({os.path.getsize(path) / 2**20:.0f} MiB)", flush=True)
        dbs = [a for p in paths for a in ("--db", p)]

        def cli(*a: str) -> None:
            with contextlib.redirect_stdout(io.StringIO()):
                rc = kvtop_main(list(a))
            if rc != 0:
                raise SystemExit(f"kvtop {' '.join(a)} exited {rc}")

        figures = {
            "log summary": _time(f"kvtop log summary, {args.routers} logs", lambda: cli("log", *dbs, "summary"),
                                 args.repeat),
            "report": _time(f"kvtop report, {args.routers} logs", lambda: cli("report", *dbs), args.repeat),
            "decisions": _time("kvtop log decisions --instance vllm-2 --reason retry --limit 100",
                               lambda: cli("log", *dbs, "decisions", "--instance", "vllm-2", "--reason", "retry",
                                           "--limit", "100"), args.repeat),
            "why": _time("kvtop log why r00001234", lambda: cli("log", *dbs, "why", "r00001234"), args.repeat),
            "runs": _time("kvtop log runs", lambda: cli("log", *dbs, "runs"), args.repeat),
        }
        slow = [k for k, v in figures.items() if v > 2.0]
        print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores; "
              + ("all within 2 s" if not slow else f"over 2 s: {', '.join(slow)}"))
        return 1 if slow else 0
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
