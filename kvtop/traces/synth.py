"""Synthetic token ids for a trace request, so replay exercises a real prefix cache.

Each hash id maps to its own fixed ``block_size`` tokens (SHAKE-128 of the id, so the same on every machine and run), so two
requests share exactly the blocks their ``hash_ids`` share; the rest of the prompt (the part
after the last listed block) is a tail seeded by a per-request salt, so no two requests share
it. Blocks are cached in an LRU, so a session's next turn only draws its new blocks.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from collections import OrderedDict
from typing import Protocol

#: Token ids below this are left out: many vocabularies keep special tokens at the bottom.
MIN_TOKEN_ID = 100
_CACHE_BLOCKS = 65536


class _Request(Protocol):
    input_tokens: int
    hash_ids: list[int]
    block_size: int


class _BlockCache:
    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[tuple[int, int, int], list[int]] = OrderedDict()

    def get(self, hash_id: int, block_size: int, vocab_size: int) -> list[int]:
        key = (hash_id, block_size, vocab_size)
        blocks = self._blocks
        got = blocks.get(key)
        if got is not None:
            blocks.move_to_end(key)
            return got
        got = _draw(b"kvtop-block:%d" % hash_id, block_size, vocab_size)
        blocks[key] = got
        if len(blocks) > self.max_blocks:
            blocks.popitem(last=False)
        return got

    def clear(self) -> None:
        self._blocks.clear()


_cache = _BlockCache(_CACHE_BLOCKS)


@functools.lru_cache(maxsize=16)
def _high_byte_table(vocab_size: int) -> bytes:
    """translate() table mapping a random byte to the high byte of a token id in range."""
    lo, hi = MIN_TOKEN_ID // 256 + 1, vocab_size // 256 - 1  # high bytes [lo, hi] stay in range
    return bytes(lo + b % (hi - lo + 1) for b in range(256))


_HIGH = 1 if sys.byteorder == "little" else 0


def _draw(seed: bytes, n: int, vocab_size: int) -> list[int]:
    """n token ids from an extendable-output hash of ``seed`` (SHAKE-128).

    Two random bytes per token; the high byte is mapped into range with one translate(), so
    the whole run is a handful of C calls (no Python loop per token). Ids fall in
    [256 * (MIN_TOKEN_ID // 256 + 1), 256 * (vocab_size // 256)); tiny vocabularies use modulo.
    """
    raw = bytearray(hashlib.shake_128(seed).digest(2 * n))
    if vocab_size >= 4 * 256 + MIN_TOKEN_ID:
        raw[_HIGH::2] = raw[_HIGH::2].translate(_high_byte_table(vocab_size))
        return memoryview(raw).cast("H").tolist()
    return [v % vocab_size for v in memoryview(raw).cast("H")]


def tokens_for_request(req: _Request, *, vocab_size: int = 32000,
                       request_salt: int | str) -> list[int]:
    """Exactly ``req.input_tokens`` token ids for ``req``.

    Block k is the tokens of ``req.hash_ids[k]`` (the same id always gives the same tokens;
    different ids differ); a last block that does not fit whole (Mooncake hashes the partial
    last block) is cut. Tokens past the listed blocks come from ``request_salt``: give every
    request its own salt (e.g. session and turn, or a request id) so tails never match.
    """
    n = req.input_tokens
    bs = req.block_size
    out: list[int] = []
    if n <= 0:
        return out
    get = _cache.get
    full = min(len(req.hash_ids), n // bs)
    for h in req.hash_ids[:full]:
        out += get(h, bs, vocab_size)
    rest = n - len(out)
    if rest and full < len(req.hash_ids):
        # A partial last block keyed by its own id: still shared with an equal id.
        out += get(req.hash_ids[full], bs, vocab_size)[:rest]
        rest = n - len(out)
    if rest:
        out += _draw(f"kvtop-tail:{request_salt}".encode(), rest, vocab_size)
    return out


def clear_cache() -> None:
    """Forget cached blocks (tests and memory-sensitive callers)."""
    _cache.clear()
