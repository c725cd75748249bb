"""CPU cost of ``kvtop attach`` and its launch time, on a synthetic feed (no router needed).

For 8, 64 and 256 instances with 10,000 sessions: state snapshots arrive at 4 Hz with 50
decisions/s and the view applies at 4 Hz, for --seconds on the Overview tab (table, mini
chart at 1 Hz) and the Decisions tab. Reports CPU as % of one core (process time / wall
time; the synthetic data is built beforehand so it is not counted) and the time from
constructing the app to the first frame with every instance row drawn.

  python benchmarks/bench_attach.py [--seconds 10] [--instances 8 64 256] [--repeat 3]

With --repeat N each figure is the median of N runs (the machine may be shared).
Targets: <= 15% of one core at 64 and at 256 instances (overview); first full frame <= 1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import statistics
import time

from kvtop.tui import synthetic as syn
from kvtop.tui.app import KvtopApp
from kvtop.tui.tabs import OverviewTab
from kvtop.tui.feed import FakeFeed

SESSIONS = 10_000
FULL = False  # --full: every instance a row (z), not condensed from 64 instances


def feed_for(n: int) -> FakeFeed:
    return FakeFeed(policies=copy.deepcopy(syn.POLICIES), sessions=syn.sessions(200, n))


async def first_frame(n: int) -> float:
    feed = feed_for(n)
    feed.push("state", syn.snapshot(n, 0.0, sessions=SESSIONS))
    t0 = time.perf_counter()
    app = KvtopApp(feed, url="bench", hz=4.0)
    app.compact = False if FULL else None
    async with app.run_test(size=(120, 40)) as pilot:
        table = app.query_one("#instances")
        # every instance row, or from 64 instances (condensed) every row that fits
        while table.row_count < (app.query_one(OverviewTab).compact_rows() if app.compact_active(n) else n):
            await asyncio.sleep(0.005)
        await pilot.pause()  # the frame with the rows is composed
        return time.perf_counter() - t0


async def cpu(n: int, seconds: float, tab: str) -> float:
    snaps = [syn.snapshot(n, t * 0.25, sessions=SESSIONS) for t in range(int(seconds * 4) + 8)]
    decisions = [syn.decision(k, n) for k in range(int(seconds * 50) + 50)]
    feed = feed_for(n)
    app = KvtopApp(feed, url="bench", hz=4.0)
    app.compact = False if FULL else None
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press(tab)
        await asyncio.sleep(1.0)  # warm up: first layout, first plot
        c0, w0 = time.process_time(), time.perf_counter()
        k = 0
        for i, snap in enumerate(snaps):
            if time.perf_counter() - w0 >= seconds:
                break
            feed.push("state", snap)
            for _ in range(12):  # ~50 decisions/s
                feed.push("decision", decisions[k % len(decisions)])
                k += 1
            await asyncio.sleep(max(0.0, w0 + (i + 1) * 0.25 - time.perf_counter()))
        c1, w1 = time.process_time(), time.perf_counter()
    return 100 * (c1 - c0) / (w1 - w0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--instances", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--repeat", type=int, default=1, help="report the median of this many runs")
    ap.add_argument("--full", action="store_true", help="every instance a row (as z), not condensed from 64")
    args = ap.parse_args()
    global FULL
    FULL = args.full
    print(f"kvtop attach on a synthetic feed: 4 Hz snapshots, ~50 decisions/s, {SESSIONS:,} sessions, 120x40"
          + (f"; medians of {args.repeat} runs" if args.repeat > 1 else "") + ("; every row (--full)" if FULL else ""))
    for n in args.instances:
        ff, ov, de = [], [], []
        for _ in range(args.repeat):
            ff.append(asyncio.run(first_frame(n)))
            ov.append(asyncio.run(cpu(n, args.seconds, "1")))
            de.append(asyncio.run(cpu(n, args.seconds, "4")))
        med = statistics.median
        print(f"{n:3d} instances: CPU {med(ov):5.1f}% of one core (overview), {med(de):5.1f}% (decisions); "
              f"first full frame {med(ff) * 1000:.0f} ms"
              + (f"  [overview {' '.join(f'{x:.1f}' for x in ov)}; decisions {' '.join(f'{x:.1f}' for x in de)}]"
                 if args.repeat > 1 else ""))

if __name__ == "__main__":
    main()
