"""Convert public traces to kvtop's JSONL format, build request streams, cap turns, describe.

  kvtop trace convert SRC... --format weka|mooncake|azure [--out FILE] [--max-input N]
  kvtop trace build IN... --out FILE [--window S | --stagger S] [--sessions N | --rate R]
  kvtop trace cap IN --max-turns 8 --out FILE
  kvtop trace stats FILE [--format text|json]

Format and methods: docs/traces.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvtop.cli import CliError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="trace_cmd", metavar="COMMAND", required=True)

    p = sub.add_parser("convert", help="convert a public trace to the normalized JSONL format",
                       description="Convert WEKA Claude Code, Mooncake or Azure 2023 traces.")
    p.add_argument("src", metavar="SRC", nargs="+",
                   help="files, or for weka directories or globs of trace_NNNN.json.gz files")
    p.add_argument("--format", required=True, choices=("weka", "mooncake", "azure"),
                   dest="src_format")
    p.add_argument("--out", default="-", help="output file (.gz to compress); default stdout")
    p.add_argument("--max-input", type=int, default=200_000, metavar="TOKENS",
                   help="cap input at the serving max_model_len (default 200000; 0 = no cap)")
    p.add_argument("--drop-over", action="store_true",
                   help="drop requests over --max-input instead of truncating them")
    p.add_argument("--on-error", choices=("skip", "fail"), default="skip",
                   help="malformed input: warn and skip (default) or stop")

    p = sub.add_parser("build", help="interleave sessions into one request stream",
                       description="Pick sessions (seeded), stagger their starts, keep their "
                                   "internal gaps, namespace their block ids.")
    p.add_argument("inputs", nargs="+", metavar="IN", help="normalized trace files")
    p.add_argument("--out", required=True)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--sessions", type=int, metavar="N", help="number of sessions")
    size.add_argument("--rate", type=float, metavar="R",
                      help="add sessions until the window holds R requests/s")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--window", type=float, metavar="S",
                      help="session starts uniform in [0, S) seconds (default 300)")
    when.add_argument("--stagger", type=float, metavar="S",
                      help="session k starts at k*S seconds")
    when.add_argument("--keep-times", action="store_true",
                      help="keep each session's own start time (merge streams built already)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shared-prefix-tokens", type=int, default=0, metavar="T",
                   help="map each session's first floor(T/block_size) blocks to one shared set "
                        "(assumes one shared system prompt; recorded in the header)")
    p.add_argument("--max-gap", type=float, metavar="S",
                   help="clamp every idle gap inside a session to S seconds")
    p.add_argument("--duration", type=float, metavar="S",
                   help="drop requests arriving after S seconds")
    p.add_argument("--min-turns", type=int, default=1, metavar="K",
                   help="only sessions with at least K turns")
    p.add_argument("--isolate-sessions", action="store_true",
                   help="one id namespace per session (drops cross-session sharing)")
    p.add_argument("--on-error", choices=("skip", "fail"), default="skip")

    p = sub.add_parser("cap", help="truncate each session to its first N turns",
                       description="The `capped` control: each session keeps its first N turns.")
    p.add_argument("input", metavar="IN")
    p.add_argument("--max-turns", type=int, default=8, metavar="N")
    p.add_argument("--out", required=True)
    p.add_argument("--on-error", choices=("skip", "fail"), default="skip")

    p = sub.add_parser("stats", help="describe a normalized trace",
                       description="Counts, length percentiles, class mix, rate, prefix ceiling.")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--format", choices=("text", "json"), default="text", dest="out_format")
    p.add_argument("--on-error", choices=("skip", "fail"), default="skip")


def _write(out: str, requests, header) -> int:
    from kvtop.traces.loader import write_trace

    if out == "-":
        from kvtop.traces.loader import FORMAT_VERSION

        sys.stdout.write(json.dumps({"kvtop_trace": FORMAT_VERSION, **header}) + "\n")
        for r in requests:
            sys.stdout.write(r.to_json() + "\n")
        return len(requests)
    try:
        return write_trace(out, requests, header)
    except OSError as exc:
        raise CliError(f"cannot write {out}: {exc.strerror or exc}") from None


def _say(msg: str) -> None:
    print(msg, file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    return {"convert": _convert, "build": _build, "cap": _cap, "stats": _stats}[args.trace_cmd](args)


def _convert(args: argparse.Namespace) -> int:
    from kvtop.traces.convert import CONVERTERS, CapReport, cap_input, expand_sources

    files = [f for src in args.src for f in expand_sources(src)]
    for src in args.src:
        if args.src_format != "weka" and Path(src).is_dir():
            raise CliError(f"{src} is a directory; give the {args.src_format} file itself")
    if args.max_input < 0:
        raise CliError("--max-input must be >= 0")
    reqs = CONVERTERS[args.src_format](files, on_error=args.on_error)
    report = CapReport()
    reqs = cap_input(reqs, args.max_input, drop=args.drop_over, report=report)
    if not report.total:   # every later verb rejects an empty trace: say so here, at the cause
        raise CliError(f"no {args.src_format} requests in {', '.join(args.src)} "
                       f"(is --format right?); nothing written")
    header = {
        "converted_from": args.src_format,
        "inputs": [f.name for f in files],
        "max_input": args.max_input,
        "over_max_input": "dropped" if args.drop_over else "truncated",
        "capped": report.capped, "dropped": report.dropped,
    }
    if args.src_format == "azure":
        header["caveat"] = ("Azure 2023 has no prefix hashes or sessions: every request is its "
                            "own session with empty hash_ids; only arrival and lengths are real")
    if args.src_format == "mooncake":
        header["caveat"] = "sessions derived from hash-id chains (docs/traces.md); think_time null"
    n = _write(args.out, reqs, header)
    sessions = len({r.session for r in reqs})
    _say(f"converted {len(files)} file(s): {n} requests, {sessions} sessions -> {args.out}")
    if args.max_input:
        _say(report.line(args.max_input))
    return 0


def _build(args: argparse.Namespace) -> int:
    from kvtop.traces.build import build_stream
    from kvtop.traces.loader import load_trace

    for name, v in (("--sessions", args.sessions), ("--rate", args.rate),
                    ("--window", args.window), ("--stagger", args.stagger)):
        if v is not None and v <= 0:
            raise CliError(f"{name} must be positive")
    inputs = [load_trace(p, on_error=args.on_error) for p in args.inputs]
    try:
        result = build_stream(
            inputs, sessions=args.sessions, rate=args.rate, window=args.window,
            stagger=args.stagger, seed=args.seed, shared_prefix_tokens=args.shared_prefix_tokens,
            max_gap=args.max_gap, min_turns=args.min_turns, duration=args.duration,
            isolate_sessions=args.isolate_sessions, keep_times=args.keep_times,
            input_names=[Path(p).name for p in args.inputs])
    except ValueError as exc:
        raise CliError(str(exc)) from None
    n = _write(args.out, result.requests, result.header)
    sessions = len({r.session for r in result.requests})
    span = result.requests[-1].arrival if result.requests else 0.0
    _say(f"built {n} requests, {sessions} sessions ({result.header['sessions_picked']} picked), "
         f"span {span:,.0f} s -> {args.out}")
    return 0


def _cap(args: argparse.Namespace) -> int:
    from kvtop.traces.build import cap_turns
    from kvtop.traces.loader import load_trace, read_header

    if args.max_turns < 1:
        raise CliError("--max-turns must be >= 1")
    reqs = load_trace(args.input, on_error=args.on_error)
    if not reqs:
        raise CliError(f"{args.input}: no requests")  # like stats, build and convert
    kept = cap_turns(reqs, args.max_turns)
    header = dict(read_header(args.input) or {})
    header.pop("kvtop_trace", None)
    header["capped_turns"] = args.max_turns
    n = _write(args.out, kept, header)
    _say(f"kept {n} of {len(reqs)} requests (first {args.max_turns} turns per session) "
         f"-> {args.out}")
    return 0


def _finite(obj):
    """NaN (no data) becomes null so the output stays valid JSON."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, float) and obj != obj:
        return None
    return obj


def _stats(args: argparse.Namespace) -> int:
    from kvtop.traces.loader import load_trace
    from kvtop.traces.stats import format_stats, trace_stats

    reqs = load_trace(args.file, on_error=args.on_error)
    if not reqs:
        raise CliError(f"{args.file}: no requests")
    s = trace_stats(reqs)
    if args.out_format == "json":
        print(json.dumps(_finite(s), indent=2))
    else:
        print(format_stats(s))
    return 0
