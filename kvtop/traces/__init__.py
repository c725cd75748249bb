"""Trace tools: the normalized JSONL request format, converters from public traces, stream
building, session derivation, statistics and token synthesis (docs/traces.md)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from kvtop.traces.loader import TraceRequest, iter_trace, load_trace, write_trace

SAMPLE_TRACE = "sample_trace.jsonl.gz"

__all__ = ["TraceRequest", "iter_trace", "load_trace", "write_trace", "sample_trace_path"]


def sample_trace_path() -> Path:
    """Path of the small bundled sample trace (see kvtop/data/ATTRIBUTION.md)."""
    return Path(str(resources.files("kvtop") / "data" / SAMPLE_TRACE))
