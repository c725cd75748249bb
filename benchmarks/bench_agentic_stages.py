"""Where the parser's worker spends a returning 215k-token turn: its stages called in this
process on bench_agentic's growing session, each timed alone in thread CPU, median of the turns.

    python benchmarks/bench_agentic_stages.py --api chat
    cd /tmp/base && PYTHONPATH=. python /path/to/benchmarks/bench_agentic_stages.py   # older code

Stages: JSON (orjson), validation (read_body), template, tokens (with the previous turn's
tokens reused where the code can: ``Tokenizer.ids_after``, else ``Tokenizer.ids``), block
hashes (the previous turn's reused for the shared prefix), the answer pickled as the worker
sends it. It runs whichever ``router`` package is first on the path, so the same command
measures an older checkout too (the ``hasattr`` branches).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_agentic as ba  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--api", default="chat", choices=sorted(ba.PATHS))
    ap.add_argument("--turns", type=int, default=24)
    ap.add_argument("--chars", type=int, default=800_000, help="session size in characters (default 800,000)")
    ap.add_argument("--tokenizer-dir", default=os.path.join(tempfile.gettempdir(), "kvtop-bench-tokenizer-32k"))
    args = ap.parse_args()

    from router.http import parse_json
    from router.request import Counted, count_prompt, hash_blocks, read_body, route_request
    from router.tokenizer import Tokenizer

    tok = Tokenizer(str(ba.build_tokenizer(args.tokenizer_dir)), parallel=False)  # as in the worker
    s = ba.Session(1, ba.corpus(6_000_000))
    while s.chars() < args.chars - args.turns * s.turn_chars:
        s.grow()
    raws = []
    for _ in range(args.turns + 1):
        s.grow()
        raws.append(json.dumps(s.body(args.api, "stages")).encode())
    prev = count_prompt(read_body(parse_json(raws[0]), args.api).prompt, 16, tok)
    reuse = hasattr(tok, "ids_after")
    kw = {"blocks_as_list": False} if "blocks_as_list" in route_request.__code__.co_varnames else {}
    names = ("json", "validation", "template", "tokens", "block hashes", "answer pickled", "total")
    ms: dict[str, list[float]] = {n: [] for n in names}
    clock = time.thread_time
    for raw in raws[1:]:
        t0 = clock()
        body = parse_json(raw)
        t1 = clock()
        parsed = read_body(body, args.api)
        t2 = clock()
        text = tok.render(parsed.prompt)
        t3 = clock()
        if reuse:
            ids, pieces, common = tok.ids_after(text, prev.tokens, prev.pieces)
        else:
            ids, pieces, common = tok.ids(text), None, None
        t4 = clock()
        extra = {"common": common} if reuse else {}
        blocks = hash_blocks(ids, 16, prev_tokens=prev.tokens, prev_blocks=prev.blocks, **extra)
        t5 = clock()
        prev = Counted(len(ids), blocks, "tokenizer", ids, pieces) if reuse else Counted(len(ids), blocks, "tokenizer", ids)
        pickle.dumps((1, True, route_request(parsed, prev, **kw)), pickle.HIGHEST_PROTOCOL)
        t6 = clock()
        for n, a, b in zip(names, (t0, t1, t2, t3, t4, t5, t0), (t1, t2, t3, t4, t5, t6, t6)):
            ms[n].append((b - a) * 1000)
    print(args.api, prev.input_tokens, "tokens;",
          ", ".join(f"{n} {sorted(v)[len(v) // 2]:.2f}" for n, v in ms.items()), "ms")


if __name__ == "__main__":
    main()
