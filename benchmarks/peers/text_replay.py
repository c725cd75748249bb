"""`kvtop replay` with text prompts, so every router in a comparison gets the same request.

sglang-router rejects token-id prompts (``prompt: data did not match any variant of untagged
enum StringOrArray``), so the peer benchmark sends text to every arm. Each token id becomes
one piece of exactly four characters, a space and three letters (``" abc"``): the simulated
vLLM's tokenizer cuts it back into exactly one token, and kvtop's text fallback (4 characters
a token) counts it exactly, so input lengths, block boundaries and shared prefixes are those of
the token-id replay. Use ``--vocab-size 17576`` (26**3) so the mapping is one to one.

    python benchmarks/peers/text_replay.py TRACE --target URL ...   (same flags as kvtop replay)
"""

from __future__ import annotations

import json
import string
import sys
from typing import Any

from kvtop import replay as _replay

LETTERS = string.ascii_lowercase
VOCAB = len(LETTERS) ** 3  # 17,576 distinct pieces
_PIECES = [" " + a + b + c for a in LETTERS for b in LETTERS for c in LETTERS]


def ids_to_text(ids: list[int]) -> str:
    """One 4-character piece per id (ids taken modulo 26**3)."""
    return "".join(_PIECES[i % VOCAB] for i in ids)


def _text_payload(self: Any, index: int, req: Any) -> bytes:
    body: dict[str, Any] = {
        "prompt": ids_to_text(self.tokens(req, index)),
        "max_tokens": max(1, int(req.output_tokens)),
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if self.model:
        body["model"] = self.model
    return json.dumps(body, separators=(",", ":")).encode()


def main(argv: list[str] | None = None) -> int:
    _replay._Runner._payload = _text_payload  # the only change: text instead of ids
    from kvtop.cli import main as kvtop_main
    return kvtop_main(["replay", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
