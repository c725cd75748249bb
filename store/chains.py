"""Compact block-hash chains in the decision log, for what-if replay (``kvtop simulate --from-db``).

A decision row keeps the prompt's chained block hashes (router/blocks.py) so that its traffic
can be re-run offline under another policy. Stored whole, a 200k-token prompt is 390 hashes
(3 KB packed); but an agentic turn repeats its session's previous prompt and appends a little,
so each row stores only what is new against its session's previous row::

    blocks_parent = the request_id of the session's previous decision (NULL: none kept)
    blocks        = "K:BASE64"  (the first K hashes are the parent's; BASE64 packs the rest
                                 as little-endian signed 64-bit integers, unpadded urlsafe)

Decoding walks a run's rows in any order that has parents first (``ts`` order does) and
rebuilds each chain from its parent's. A row whose parent is missing (a dropped row, a crash)
cannot be rebuilt; ``ChainDecoder.decode`` returns None for it and the caller counts it.

The encoder keeps the last chain of at most ``max_sessions`` sessions (least recently seen
dropped first; a dropped session's next row is stored whole), as packed arrays: 8 bytes a
block, 3 KB for a 200k-token session.
"""

from __future__ import annotations

import base64
from array import array
from collections import OrderedDict
from collections.abc import Sequence

_MASK = (1 << 64) - 1
_SIGN = 1 << 63


def _pack(blocks: Sequence[int]) -> array:
    try:
        return array("q", blocks)
    except OverflowError:  # hashes from elsewhere (trace ids): keep 64 bits, equality preserved
        return array("q", [((b & _MASK) ^ _SIGN) - _SIGN for b in blocks])


def _common_prefix(a: array, b: array) -> int:
    """Length of the common prefix of two arrays: a binary search of C-level slice compares."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # invariant: a[:lo] == b[:lo], a[:hi+1] != b[:hi+1] at the end
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _b64(a: array) -> str:
    return base64.urlsafe_b64encode(a.tobytes()).rstrip(b"=").decode("ascii")


def _unb64(s: str) -> array:
    raw = base64.b64decode(s + "=" * (-len(s) % 4), altchars=b"-_", validate=True)
    if len(raw) % 8:
        raise ValueError("block chain is not a whole number of 8-byte hashes")
    out = array("q")
    out.frombytes(raw)
    return out


class ChainEncoder:
    """Encodes each decision's chain against its session's previous one (see the module doc)."""

    def __init__(self, max_sessions: int = 4096):
        self.max_sessions = max_sessions
        self._last: OrderedDict[str, tuple[str, array]] = OrderedDict()

    def encode(self, session_id: str | None, request_id: str, blocks: Sequence[int]) -> tuple[str | None, str]:
        """Return (blocks_parent, blocks) for this row and remember its chain."""
        chain = _pack(blocks)
        parent, k = None, 0
        if session_id is not None:
            prev = self._last.get(session_id)
            if prev is not None:
                k = _common_prefix(prev[1], chain)
                if k:
                    parent = prev[0]
            self._last[session_id] = (request_id, chain)
            self._last.move_to_end(session_id)
            while len(self._last) > self.max_sessions:
                self._last.popitem(last=False)
        return parent, f"{k}:{_b64(chain[k:])}"


class ChainDecoder:
    """Rebuilds chains from rows met parents first; keeps every decoded chain of the run."""

    def __init__(self) -> None:
        self._chains: dict[str, array] = {}

    def decode(self, request_id: str, parent: str | None, blocks: str | None) -> list[int] | None:
        """The row's chain, or None when it cannot be rebuilt (no column, a missing parent,
        a malformed value)."""
        if not blocks or not isinstance(blocks, str):
            return None
        k_text, sep, rest = blocks.partition(":")
        if not sep or not k_text.isdigit():
            return None
        k = int(k_text)
        try:
            tail = _unb64(rest)
        except ValueError:
            return None
        if k:
            base = self._chains.get(parent) if parent is not None else None
            if base is None or len(base) < k:
                return None
            chain = base[:k] + tail
        else:
            chain = tail
        self._chains[request_id] = chain
        return chain.tolist()
