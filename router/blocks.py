"""Chained block hashing of prompts, shared by the router's prefix index and the simulated engine.

A block's hash covers its parent's hash and its own tokens, so two prompts share block k's
hash exactly when their first (k+1)*block_size tokens are equal, as in vLLM's prefix cache.
Only full blocks are hashed: a trailing partial block can never be a cache hit.

When a prompt arrives as text and no tokenizer is configured, the router cannot know the
tokens. It then hashes fixed character chunks instead (``CHARS_PER_TOKEN`` characters per
token, so ``block_size * CHARS_PER_TOKEN`` characters per block) and estimates the token
count as ``ceil(len(text) / CHARS_PER_TOKEN)``. Equal text prefixes still give equal block
hashes, which is what the cache estimate needs; the token count is an approximation, and
every decision records which method was used (``token_source``).

Text chunks are hashed with CRC-32 of their UTF-8 bytes, chained through the int-tuple hash
(0.49 ms for an 800 KB agentic prompt; blake2b takes 1.6 ms). Python's own string hash (0.28
ms) is seeded per process, and the router hashes bodies over 4 MB in its parser's worker
process: the same text then hashed differently on the loop and in the worker (and in each
new worker), so a session's turns lost their shared prefix once one crossed 4 MB. Two
different chunks after the same parent collide with probability 2^-32, harmless for a cache
estimate.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from zlib import crc32

#: Characters per token assumed by the text fallback (English prose and code average 3.5-4.5).
CHARS_PER_TOKEN = 4

#: Hash of the (empty) parent of a prompt's first block.
ROOT_HASH = 0



def hash_token_blocks(tokens: Sequence[int], block_size: int) -> list[int]:
    """Return the chained hashes of every full block of ``tokens``.

    CPython hashes ints and tuples without a per-process seed (unlike str and bytes), so
    ``hash((parent, block_tuple))`` is stable across processes and runs, and it is the
    fastest chained hash available without a C extension (about 1.8 ms for 200k tokens).
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    tokens = tokens if isinstance(tokens, (list, tuple)) else list(tokens)
    out: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start:start + block_size])))
        out.append(parent)
    return out


def hash_text_blocks(text: str, block_size: int) -> list[int]:
    """The text fallback: chained hashes of ``block_size * CHARS_PER_TOKEN``-character chunks,
    the same in every process (see the module docstring)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    chunk_chars = block_size * CHARS_PER_TOKEN
    stop = len(text) - chunk_chars + 1
    out: list[int] = []
    parent = ROOT_HASH
    if text.isascii():  # one encoding, sliced without copies (what per-chunk encoding gives)
        data = memoryview(text.encode("ascii"))
        for start in range(0, stop, chunk_chars):
            parent = hash((parent, crc32(data[start:start + chunk_chars])))
            out.append(parent)
    else:
        for start in range(0, stop, chunk_chars):
            chunk = text[start:start + chunk_chars].encode("utf-8", "surrogatepass")
            parent = hash((parent, crc32(chunk)))
            out.append(parent)
    return out


def estimate_text_tokens(text: str) -> int:
    """Token count the text fallback assumes for ``text``."""
    return -(-len(text) // CHARS_PER_TOKEN)


def valid_token_ids(tokens: object) -> bool:
    """True when ``tokens`` is a list of non-negative ints that fit in 64 bits.

    One C-level pass: ``array('Q')`` raises TypeError for a non-integer and OverflowError
    for a negative or oversized value (6x faster than a Python loop on 200k tokens).
    JSON ``true``/``false`` are ints to Python and pass as 1/0; the backend sees the body
    unchanged and judges them itself.
    """
    if not isinstance(tokens, list):
        return False
    try:
        array("Q", tokens)
    except (TypeError, OverflowError):
        return False
    return True


def regroup_block_ids(hash_ids: Sequence[int], id_block_size: int, block_size: int,
                      num_tokens: int) -> list[int]:
    """Chained hashes at ``block_size`` from a trace's chained ids at ``id_block_size``.

    Traces carry one chained id per ``id_block_size`` tokens. Because the ids are chained, a
    coarser block is identified by the id of its last fine block; a finer block is derived
    as ``hash((id, k))`` for its position k inside the coarse one (still chained, since the
    id already covers the whole prefix). Only full blocks of ``num_tokens`` are returned,
    so the result is what ``hash_token_blocks`` would give on equivalent tokens, up to the
    hash values themselves.
    """
    nblocks = num_tokens // block_size
    if nblocks == 0 or not hash_ids:
        return []
    if block_size % id_block_size == 0:
        step = block_size // id_block_size
        usable = min(nblocks, len(hash_ids) // step)
        ids = hash_ids[step - 1:usable * step:step]   # ids at k*step + step-1, k < usable
        return ids if type(ids) is list else list(ids)   # a list's slice is a new list already
    if id_block_size % block_size == 0:
        per = id_block_size // block_size
        out: list[int] = []
        for k in range(nblocks):
            coarse, j = divmod(k, per)
            if coarse >= len(hash_ids):
                break
            out.append(hash((hash_ids[coarse], j)))
        return out
    raise ValueError(f"block size {block_size} and trace block size {id_block_size} do not nest")
