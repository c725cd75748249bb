"""The normalized trace format: one request per JSONL line, ordered by arrival.

Every converter writes it and every consumer (replay, the offline simulator, the demo) reads it
through ``load_trace`` / ``iter_trace``. A line is::

    {"arrival": 12.5, "session": "weka-0001", "turn": 3, "input_tokens": 71175,
     "output_tokens": 169, "hash_ids": [10000001, ...], "block_size": 64,
     "think_time": 12.0, "parent": null, "source": "weka"}

``hash_ids`` are chained prefix-block ids (integers within 64 bits): an equal id at position k means equal first
(k+1)*block_size tokens. An optional first line ``{"kvtop_trace": 1, ...}`` carries metadata;
loaders skip it (``read_header`` returns it). Files ending in ``.gz`` are read and written
gzip-compressed.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from itertools import repeat
from pathlib import Path
from typing import Any, TextIO

import orjson

from kvtop.cli import CliError

FORMAT_VERSION = 1

#: Field order of a line, as written.
FIELDS = ("arrival", "session", "turn", "input_tokens", "output_tokens", "hash_ids",
          "block_size", "think_time", "parent", "source")


@dataclass(slots=True)
class TraceRequest:
    """One request of a normalized trace (see the module docstring for each field)."""

    arrival: float
    session: str
    turn: int
    input_tokens: int
    output_tokens: int
    hash_ids: list[int] = field(default_factory=list)
    block_size: int = 64
    think_time: float | None = None
    parent: str | None = None
    source: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


def open_text(path: str | Path, mode: str = "r") -> TextIO:
    """Open a trace file as text, transparently gzip-compressed when it ends in ``.gz``."""
    path = Path(path)
    if str(path).endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, mode + "b"), encoding="utf-8")
    return open(path, mode, encoding="utf-8")


#: The longest trace line read (bytes): a Claude Code turn of 894k tokens in 64-token blocks is
#: ~300 KB. A longer one (a device such as /dev/zero, a file that is not a trace) is refused
#: before it is held whole.
MAX_LINE_BYTES = 16 * 1024 * 1024


def _check_path(path: str | Path) -> Path:
    p = Path(path)
    if not p.exists():
        raise CliError(f"trace file not found: {p}")
    if p.is_dir():
        raise CliError(f"expected a trace file, got a directory: {p}")
    if p.is_char_device() or p.is_block_device():
        raise CliError(f"expected a trace file, got a device: {p}")
    return p


def _parse(obj: Any) -> TraceRequest:
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    try:
        arrival = float(obj["arrival"])
        session = obj["session"]
        turn = obj["turn"]
        input_tokens = obj["input_tokens"]
        output_tokens = obj["output_tokens"]
        hash_ids = obj["hash_ids"]
        block_size = obj["block_size"]
    except KeyError as exc:
        raise ValueError(f"missing field {exc.args[0]!r}") from None
    if not math.isfinite(arrival) or arrival < 0:
        raise ValueError(f"bad arrival {obj['arrival']!r}")
    if not isinstance(session, str) or not session:
        raise ValueError("session must be a non-empty string")
    for name, value in (("turn", turn), ("input_tokens", input_tokens),
                        ("output_tokens", output_tokens), ("block_size", block_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if turn < 1 or block_size < 1:
        raise ValueError("turn and block_size must be >= 1")
    if not isinstance(hash_ids, list) or not all(map(isinstance, hash_ids, repeat(int))):
        raise ValueError("hash_ids must be a list of integers")
    think = obj.get("think_time")
    parent = obj.get("parent")
    if parent is not None and not isinstance(parent, str):
        raise ValueError("parent must be a string or null")
    return TraceRequest(arrival, session, turn, input_tokens, output_tokens, hash_ids,
                        block_size, None if think is None else float(think), parent,
                        str(obj.get("source") or ""))


def read_header(path: str | Path) -> dict[str, Any] | None:
    """The header object of a trace file, or None when it has none."""
    with open_text(_check_path(path)) as fh:
        first = fh.readline(MAX_LINE_BYTES)
    try:
        obj = json.loads(first)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) and "kvtop_trace" in obj else None


def iter_trace(path: str | Path, *, on_error: str = "skip") -> Iterator[TraceRequest]:
    """Yield the requests of a normalized trace file in file order.

    A malformed line is reported with its 1-based line number: a warning on stderr with
    ``on_error="skip"``, a ``CliError`` with ``on_error="fail"``. Blank lines are ignored.
    """
    if on_error not in ("skip", "fail"):
        raise ValueError("on_error must be 'skip' or 'fail'")
    p = _check_path(path)
    last_ids: dict[str, list[int]] = {}   # each session's previous hash_ids, for _share_prefix
    try:
        # Bytes and orjson: a 10,000-request agentic trace (112 MB gzipped, 12M hash ids) loads
        # in 2.2-2.4 CPU s instead of 3.0 (half of what is left is gunzip). What orjson refuses
        # (NaN, Infinity) is read again by json and judged as before; an integer past 64 bits
        # comes back from orjson as a float, so a hash id must fit in 64 bits.
        with (gzip.open(p, "rb") if str(p).endswith(".gz") else open(p, "rb")) as fh:
            lineno = 0
            while line := fh.readline(MAX_LINE_BYTES + 1):
                lineno += 1
                if len(line) > MAX_LINE_BYTES:
                    raise CliError(f"{p}:{lineno}: a line longer than {MAX_LINE_BYTES:,} bytes: "
                                   "not a kvtop trace (kvtop trace convert writes one)")
                if not line.strip():
                    continue
                try:
                    try:
                        obj = orjson.loads(line)
                    except orjson.JSONDecodeError:
                        obj = json.loads(line)   # a UnicodeDecodeError is a ValueError too
                    if lineno == 1 and isinstance(obj, dict) and "kvtop_trace" in obj:
                        continue
                    req = _parse(obj)
                except ValueError as exc:  # JSONDecodeError is a ValueError
                    msg = f"{p}:{lineno}: malformed trace line: {exc}"
                    if on_error == "fail":
                        raise CliError(msg) from None
                    print(f"warning: {msg} (skipped)", file=sys.stderr)
                    continue
                prev = last_ids.get(req.session)
                if prev is not None:
                    _share_prefix(prev, req.hash_ids)
                last_ids[req.session] = req.hash_ids
                yield req
    except (OSError, EOFError) as exc:
        raise CliError(f"cannot read trace {p}: {exc}") from None


def _share_prefix(prev: list[int], ids: list[int]) -> None:
    """Make ``ids`` reuse ``prev``'s int objects for the prefix the two lists share.

    A session's turn repeats the previous turn's ids and adds some, but JSON parsing gives every
    line its own int objects: on the 10,000-request agentic benchmark trace, 11.7M ids of which
    0.8M distinct. Shared objects keep the heap small (one object per distinct block of a
    session rather than one per turn that repeats it) and let the simulator's dict lookups and
    list comparisons of a returning turn's blocks match by identity, on objects already in the
    CPU's caches. Values are unchanged, so nothing a consumer computes changes."""
    m = _common_prefix(prev, ids)
    if m:
        ids[:m] = prev[:m]


def _common_prefix(prev: Sequence[int], ids: Sequence[int]) -> int:
    """Length of the prefix two id lists share, by slice comparisons: all of it in one C-level
    pass in the common case, else by bisection, keeping only prefixes checked equal."""
    m = min(len(prev), len(ids))
    if not m or prev[0] != ids[0]:
        return 0
    if prev[:m] != ids[:m]:
        lo, hi = 1, m - 1   # prev[:lo] == ids[:lo]; the longest equal prefix is at most hi
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if prev[:mid] == ids[:mid]:
                lo = mid
            else:
                hi = mid - 1
        m = lo
    return m


def dense_ids(requests: Iterable[TraceRequest]) -> list[TraceRequest]:
    """The requests with each distinct hash id replaced by a small int (1, 2, ... in order of
    first appearance), for the offline simulator; everything else unchanged.

    Ids are compared for equality (a chain's block k is the same block exactly when its id is)
    or, for engine blocks finer than the trace's, hashed with their position (``hash((id, j))``,
    router/blocks.py), which a 64-bit collision aside keeps every equality as it was; so this
    changes no result of a simulation (the fingerprints of all policies on the agentic
    benchmark trace are the same), but it makes one run of that trace 1.1-2x cheaper
    (docs/simulator.md, "Cost"). Trace ids are random 64-bit values whose int objects
    lie wherever each line was parsed: every hash, comparison and dict probe of an engine's
    block cache read one of them, mostly a cache miss. Small ints hash and compare in one digit,
    are allocated one after the other in the order sessions first use them, and every equal id
    is one object. A session's turn takes its previous turn's dense list for the prefix they
    share, so only new ids are looked up (0.8M of the 11.7M on that trace). Given an iterator
    (``iter_trace``), each line's own ids can go as soon as it is converted."""
    table: dict[int, int] = {}
    setdefault = table.setdefault
    last: dict[str, tuple[list[int], list[int]]] = {}   # session -> its previous ids, dense ids
    out = []
    for r in requests:
        ids = r.hash_ids
        prev = last.get(r.session)
        m = _common_prefix(prev[0], ids) if prev is not None else 0
        dense = prev[1][:m] if m else []
        dense += [setdefault(h, len(table) + 1) for h in ids[m:]]
        last[r.session] = (ids, dense)
        out.append(replace(r, hash_ids=dense))
    return out


def load_trace(path: str | Path, *, on_error: str = "skip") -> list[TraceRequest]:
    """All requests of a normalized trace file (see ``iter_trace``)."""
    return list(iter_trace(path, on_error=on_error))


def write_trace(path: str | Path, requests: Iterable[TraceRequest],
                header: dict[str, Any] | None = None) -> int:
    """Write requests (already in arrival order) as JSONL; returns how many were written.

    ``header``, when given, becomes the first line with ``"kvtop_trace": 1`` added. A path
    ending in ``.gz`` is gzip-compressed (with a zero mtime, so equal content gives equal bytes).
    """
    p = Path(path)
    n = 0
    if str(p).endswith(".gz"):
        raw = gzip.GzipFile(p, "wb", compresslevel=6, mtime=0)
        fh: TextIO = io.TextIOWrapper(raw, encoding="utf-8")
    else:
        fh = open(p, "w", encoding="utf-8")
    with fh:
        if header is not None:
            fh.write(json.dumps({"kvtop_trace": FORMAT_VERSION, **header}, separators=(",", ":")))
            fh.write("\n")
        for req in requests:
            fh.write(req.to_json())
            fh.write("\n")
            n += 1
    return n
