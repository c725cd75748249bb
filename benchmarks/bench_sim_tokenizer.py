"""What ``kvtop route --tokenizer kvtop-sim`` costs the router per prompt: rendering and
tokenizing an agent's Messages body with the simulator's tokenizer (router/sim_tokenizer.py),
cold and as a returning turn (its previous turn's tokens reused), against the
4-characters-a-token approximation. Medians of ``--repeat`` runs, one thread, in-process.

    python benchmarks/bench_sim_tokenizer.py            # ~200k-token turn, ~10k new tokens
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtop.replay import agent_body  # noqa: E402
from router.request import count_prompt, read_body  # noqa: E402
from router.sim_tokenizer import SimTokenizer  # noqa: E402


def _median_ms(f, repeat: int):
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = f()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times), out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=200_000, help="the returning turn's prompt, in trace tokens")
    p.add_argument("--new", type=int, default=10_000, help="of which new since the previous turn")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args(argv)
    ids = [(k * 7919) % 150_000 for k in range(args.tokens)]
    before = read_body(agent_body("messages", ids[:args.tokens - args.new], "s", 16), "messages").prompt
    after = read_body(agent_body("messages", ids, "s", 16), "messages").prompt
    tok = SimTokenizer()
    cold, prev = _median_ms(lambda: count_prompt(before, args.block_size, tok), args.repeat)
    warm, counted = _median_ms(lambda: count_prompt(after, args.block_size, tok, prev), args.repeat)
    approx, estimated = _median_ms(lambda: count_prompt(after, args.block_size, None), args.repeat)
    print(f"prompt {counted.input_tokens:,} tokens (approximation: {estimated.input_tokens:,})")
    print(f"cold turn, rendered and tokenized: {cold:.1f} ms")
    print(f"returning turn ({args.new:,} trace tokens new): {warm:.1f} ms")
    print(f"the approximation, same turn: {approx:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
