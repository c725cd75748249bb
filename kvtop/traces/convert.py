"""Converters from the public traces' own formats to the normalized format (``loader.py``).

* WEKA Claude Code (``trace_NNNN.json.gz``, one session per file, 64-token blocks with ids
  local to the file): ids become ``NNNN * 10**7 + id`` (NNNN = the number in the file name,
  so a file keeps its namespace whichever files are converted with it); each sub-agent
  becomes its own session ``weka-NNNN/<agent_id>`` with ``parent`` set and arrivals offset by
  its spawn time; every session starts at arrival 0 (``trace build`` staggers them).
* Mooncake (``{"timestamp" ms, "input_length", "output_length", "hash_ids"}``, 512-token
  blocks, ids global to the file, no sessions): sessions derived with ``sessions.py``;
  ``think_time`` is null (the trace has no response times).
* Azure 2023 CSVs (``TIMESTAMP,ContextTokens,GeneratedTokens``): no hashes, so every request
  is its own one-turn session with empty ``hash_ids``: only arrival and length shape are real.
"""

from __future__ import annotations

import csv
import glob
import gzip
import json
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from kvtop.cli import CliError
from kvtop.traces.loader import TraceRequest
from kvtop.traces.sessions import derive_sessions

#: WEKA ids are namespaced as ``file_number * WEKA_NAMESPACE + local_id`` (local ids < 40k).
WEKA_NAMESPACE = 10**7
WEKA_BLOCK_SIZE = 64
MOONCAKE_BLOCK_SIZE = 512
#: Azure has no blocks; this is only the nominal block size written on its lines.
AZURE_BLOCK_SIZE = 64

FORMATS = ("weka", "mooncake", "azure")


@dataclass
class CapReport:
    """What ``cap_input`` did."""

    total: int = 0
    capped: int = 0
    dropped: int = 0

    def line(self, max_input: int) -> str:
        return (f"input cap {max_input:,} tokens: {self.capped} of {self.total} requests "
                f"truncated, {self.dropped} dropped")


def cap_input(requests: Iterable[TraceRequest], max_input: int, *, drop: bool = False,
              report: CapReport | None = None) -> list[TraceRequest]:
    """Requests with input over ``max_input`` truncated to it (``hash_ids`` cut to the blocks
    that fit whole), or dropped when ``drop``; counts go to ``report``."""
    report = report if report is not None else CapReport()
    out: list[TraceRequest] = []
    for req in requests:
        report.total += 1
        if max_input and req.input_tokens > max_input:
            if drop:
                report.dropped += 1
                continue
            report.capped += 1
            req.input_tokens = max_input
            req.hash_ids = req.hash_ids[: max_input // req.block_size]
        out.append(req)
    return out


def _warn_or_fail(msg: str, on_error: str) -> None:
    if on_error == "fail":
        raise CliError(msg)
    print(f"warning: {msg} (skipped)", file=sys.stderr)


def expand_sources(src: str) -> list[Path]:
    """A file, a directory (its ``trace_*.json*`` files) or a glob, sorted by name."""
    p = Path(src)
    if p.is_dir():
        files = sorted(p.glob("trace_*.json*"))
    elif p.exists():
        files = [p]
    else:
        files = sorted(Path(f) for f in glob.glob(src))
    if not files:
        raise CliError(f"no input found at {src}")
    return files


# ---------------------------------------------------------------- WEKA Claude Code

_NUM = re.compile(r"(\d+)")


def _weka_file_number(path: Path, index: int) -> int:
    m = _NUM.findall(path.name)
    return int(m[-1]) if m else index


def convert_weka_session(doc: dict[str, Any], file_number: int, *,
                         source: str = "weka") -> list[TraceRequest]:
    """The requests of one WEKA session document (parent and sub-agents), arrival = t."""
    base = file_number * WEKA_NAMESPACE
    block = int(doc.get("block_size") or WEKA_BLOCK_SIZE)
    root = f"weka-{file_number:04d}"
    out: list[TraceRequest] = []

    def one(entry: dict[str, Any], session: str, offset: float, parent: str | None) -> TraceRequest:
        return TraceRequest(
            arrival=offset + float(entry["t"]), session=session, turn=0,
            input_tokens=int(entry["in"]), output_tokens=int(entry["out"]),
            hash_ids=[base + int(h) for h in entry.get("hash_ids") or ()],
            block_size=block,
            think_time=None if entry.get("think_time") is None else float(entry["think_time"]),
            parent=parent, source=source)

    for n, entry in enumerate(doc["requests"]):
        if entry.get("type") == "subagent":
            agent = str(entry.get("agent_id") or f"agent_{n:03d}")
            spawn = float(entry["t"])
            for sub in entry.get("requests") or ():
                out.append(one(sub, f"{root}/{agent}", spawn, root))
        else:
            out.append(one(entry, root, 0.0, None))
    return out


def convert_weka(files: list[Path], *, on_error: str = "skip") -> list[TraceRequest]:
    out: list[TraceRequest] = []
    for index, path in enumerate(files):
        try:
            opener = gzip.open if path.name.endswith(".gz") else open
            with opener(path, "rt", encoding="utf-8") as fh:
                doc = json.load(fh)
            out.extend(convert_weka_session(doc, _weka_file_number(path, index)))
        except (OSError, EOFError, ValueError, KeyError, TypeError) as exc:
            _warn_or_fail(f"{path}: not a WEKA trace file: {exc!r}", on_error)
    return finish(out)


# ---------------------------------------------------------------- Mooncake

def convert_mooncake(files: list[Path], *, on_error: str = "skip",
                     source: str = "mooncake") -> list[TraceRequest]:
    """Mooncake JSONL; ids of each file after the first are offset past the previous file's."""
    out: list[TraceRequest] = []
    offset = 0
    for path in files:
        rows: list[tuple[float, int, int, list[int]]] = []
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    ids = [offset + int(h) for h in obj["hash_ids"]]
                    rows.append((float(obj["timestamp"]) / 1000.0, int(obj["input_length"]),
                                 int(obj["output_length"]), ids))
                except (ValueError, KeyError, TypeError) as exc:
                    _warn_or_fail(f"{path}:{lineno}: malformed Mooncake line: {exc!r}", on_error)
        rows.sort(key=lambda r: r[0])  # stable: ties keep file order
        links = derive_sessions([r[3] for r in rows], MOONCAKE_BLOCK_SIZE)
        stem = path.name.split(".")[0]
        for (arrival, n_in, n_out, ids), link in zip(rows, links):
            out.append(TraceRequest(arrival, f"mc-{stem}-{link.session}", link.turn, n_in, n_out,
                                    ids, MOONCAKE_BLOCK_SIZE, None, None, source))
        offset = max([offset] + [max(r[3]) + 1 for r in rows if r[3]])
    return finish(out, renumber=False)


# ---------------------------------------------------------------- Azure 2023

def _azure_time(text: str) -> datetime:
    text = text.strip()
    if "." in text:  # 7 fractional digits upstream; datetime takes at most 6
        head, frac = text.split(".", 1)
        text = f"{head}.{frac[:6]}"
    return datetime.fromisoformat(text)


def convert_azure(files: list[Path], *, on_error: str = "skip") -> list[TraceRequest]:
    out: list[TraceRequest] = []
    for path in files:
        kind = "code" if "code" in path.name.lower() else "conv" if "conv" in path.name.lower() \
            else path.stem
        rows: list[tuple[datetime, int, int]] = []
        with open(path, newline="", encoding="utf-8") as fh:
            reader = csv.reader(fh)
            header = next(reader, None)
            if not header or [h.strip() for h in header[:3]] != \
                    ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
                raise CliError(f"{path}: not an Azure 2023 CSV (header {header!r})")
            for lineno, row in enumerate(reader, 2):
                try:
                    rows.append((_azure_time(row[0]), int(row[1]), int(row[2])))
                except (ValueError, IndexError) as exc:
                    _warn_or_fail(f"{path}:{lineno}: malformed Azure row: {exc!r}", on_error)
        if not rows:
            continue
        t0 = min(r[0] for r in rows)
        for n, (ts, n_in, n_out) in enumerate(rows):
            out.append(TraceRequest((ts - t0).total_seconds(), f"azure-{kind}-{n}", 1, n_in,
                                    n_out, [], AZURE_BLOCK_SIZE, None, None, f"azure-{kind}"))
    return finish(out)


# ---------------------------------------------------------------- shared

def finish(requests: list[TraceRequest], *, renumber: bool = True) -> list[TraceRequest]:
    """Sort by arrival (stable) and, when ``renumber``, number turns 1.. within each session."""
    requests.sort(key=lambda r: r.arrival)
    if renumber:
        turns: dict[str, int] = {}
        for r in requests:
            r.turn = turns.get(r.session, 0) + 1
            turns[r.session] = r.turn
    return requests


CONVERTERS: dict[str, Callable[..., list[TraceRequest]]] = {
    "weka": convert_weka,
    "mooncake": convert_mooncake,
    "azure": convert_azure,
}
