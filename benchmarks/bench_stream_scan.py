"""What the proxy's stream scan costs per chunk: ``StreamScan.feed`` over 20,000 chat chunks,
with and without a ``"usage":null`` key in each, best of 5.

    python benchmarks/bench_stream_scan.py /work/wt/base    # another checkout, side by side
    python benchmarks/bench_stream_scan.py                  # this one
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[1]))
from router.forward import StreamScan  # noqa: E402

CHUNKS = {
    "with usage:null": b'data: {"id":"cmpl-1","object":"chat.completion.chunk","choices":[{"index":0,'
                       b'"delta":{"content":"tok "}}],"usage":null}\n\n',
    "without usage": b'data: {"id":"cmpl-1","object":"chat.completion.chunk","choices":[{"index":0,'
                     b'"delta":{"content":"tok "}}]}\n\n',
}

for name, ev in CHUNKS.items():
    best = 1e9
    for _ in range(5):
        s = StreamScan()
        t = time.perf_counter()
        for _ in range(20000):
            s.feed(ev)
        best = min(best, time.perf_counter() - t)
    print(f"{name}: {best / 20000 * 1e6:.2f} us/chunk")
