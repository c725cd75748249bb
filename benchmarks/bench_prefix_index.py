"""Cost of the router's estimated prefix cache (router/prefix_index.py) on 215k-token agentic turns.

    python benchmarks/bench_prefix_index.py [--turns 40] [--cold 20] [--instances 1]

bench_agentic's shape at ``kvtop route --block-size 16`` with the default capacity (265,000
tokens = 16,562 blocks per instance): sessions of a shared 20k-token system prompt (1,250
blocks) plus their own turns, ~13,300 blocks at 215k tokens, every instance's cache full.

- ``returning``: the last session of each instance comes back, turn after turn, each turn
  its previous blocks plus 150 new ones (a tool call and its result, ~2,400 tokens), growing to
  13,300 blocks by its last turn; the cache is full, so each turn also evicts ~150 blocks;
- ``cold``: fresh sessions' first turns, ~12,000 new blocks each, evicting as many.

Prints p50 / max ms of ``PrefixIndex.insert`` and its ``flush`` (wall and thread CPU) per kind. It imports
``router.prefix_index`` as Python finds it, so a baseline runs with ``PYTHONPATH`` set to
its checkout (the module's path is printed).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

BLOCK_SIZE = 16
CAPACITY_BLOCKS = 265_000 // BLOCK_SIZE
SYSTEM_BLOCKS = 1_250
SESSION_BLOCKS = 13_300
TURN_BLOCKS = 150


def chain(rng: random.Random, n: int) -> list[int]:
    return [rng.getrandbits(62) for _ in range(n)]


def timed(fn, *args) -> tuple[float, float]:
    w0, c0 = time.perf_counter(), time.thread_time()
    fn(*args)
    return (time.perf_counter() - w0) * 1e3, (time.thread_time() - c0) * 1e3


def run(turns: int, cold: int, instances: int, seed: int) -> dict[str, list[tuple[float, float]]]:
    import router.prefix_index as pi

    print(f"router.prefix_index from {pi.__file__}")
    rng = random.Random(seed)
    idx = pi.PrefixIndex(instances, CAPACITY_BLOCKS, BLOCK_SIZE)
    flush = getattr(idx, "flush", lambda: None)  # an insert may be left pending until flushed

    def insert(instance: int, blocks: list[int], tag: str) -> None:
        idx.insert(instance, blocks, tag)
        flush()
    system = chain(rng, SYSTEM_BLOCKS)
    out: dict[str, list[tuple[float, float]]] = {"cold": [], "returning": []}
    sessions = []
    for k in range(max(cold, 2 * instances)):  # fills every cache; the later ones are timed
        blocks = system + chain(rng, SESSION_BLOCKS - SYSTEM_BLOCKS)
        t = timed(insert, k % instances, blocks, f"s{k}")
        if k >= 2 * instances:
            out["cold"].append(t)
        sessions.append(blocks)
    # the last sessions come back in turn, each growing to SESSION_BLOCKS by its last turn
    back = [len(sessions) - 1 - j for j in range(min(instances, len(sessions)))]
    start = max(SYSTEM_BLOCKS, SESSION_BLOCKS - TURN_BLOCKS * -(-turns // len(back)))
    for k in back:
        sessions[k] = sessions[k][:start]
    for t in range(turns):
        k = back[t % len(back)]
        sessions[k] = sessions[k] + chain(rng, TURN_BLOCKS)
        out["returning"].append(timed(insert, k % instances, sessions[k], f"s{k}"))
    # a cross-check that the index still answers: the last session holds its whole chain
    assert idx.match(sessions[-1])[(len(sessions) - 1) % instances] == len(sessions[-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=40, help="returning turns timed")
    ap.add_argument("--cold", type=int, default=20, help="cold sessions inserted (the first fill the caches)")
    ap.add_argument("--instances", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if args.turns < 1 or args.cold < 1 or args.instances < 1:
        raise SystemExit("--turns, --cold and --instances must be at least 1")
    res = run(args.turns, args.cold, args.instances, args.seed)
    for kind, ts in res.items():
        if not ts:
            continue
        wall = [w for w, _ in ts]
        cpu = [c for _, c in ts]
        print(f"{kind:10} n={len(ts):3}  wall p50 {statistics.median(wall):6.2f} max {max(wall):6.2f} ms"
              f"  cpu p50 {statistics.median(cpu):6.2f} max {max(cpu):6.2f} ms")


if __name__ == "__main__":
    main()
