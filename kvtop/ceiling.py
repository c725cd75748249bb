"""The prefix ceiling a report sets each arm's APC against (issue 38): the share of its input
tokens an infinite contiguous prefix cache could have served (``kvtop trace stats``' figure).

- ``kvtop simulate``: over the trace it ran (the trace's own block size); with ``--from-db``,
  over the recorded requests it re-runs;
- ``kvtop report`` on results files: over the trace named in the file's header, when that
  file is still there, the first as many requests as the file holds (``replay --limit``);
- ``kvtop report --db``: over each policy's requests of the run, from the block chains the
  decision log keeps (the router's blocks, 512 tokens by default: a coarser grain than the
  trace's, so this ceiling can be a little lower than the trace's; the report says so).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

_TRACE_CEILINGS: dict[tuple[str, int, int], float | None] = {}
_TRACES: dict[tuple[str, int, int], list[Any] | None] = {}


def of_requests(requests: Sequence[Any]) -> float | None:
    """The token ceiling of trace requests (``kvtop.traces.stats.prefix_ceiling``); None when
    they have no input."""
    from kvtop.traces.stats import prefix_ceiling

    if not any(getattr(r, "input_tokens", 0) for r in requests):
        return None
    return prefix_ceiling(requests)[1]


def trace_requests(path: str | None, count: int) -> list[Any] | None:
    """The first ``count`` requests (by arrival, as ``kvtop replay`` sends them) of the trace at
    ``path``, read once per file and count; None when it is gone or unreadable."""
    if not path or not isinstance(path, str) or not os.path.isfile(path) or count <= 0:
        return None
    key = (os.path.abspath(path), int(os.path.getmtime(path)), count)
    if key not in _TRACES:
        try:
            from kvtop.traces.loader import load_trace

            requests = sorted(load_trace(path, on_error="skip"), key=lambda r: r.arrival)
            _TRACES.clear()   # one trace at a time: a report's arms share theirs
            _TRACES[key] = requests[:count]
        except (OSError, ValueError):
            _TRACES[key] = None
    return _TRACES[key]


def of_trace_file(path: str | None, count: int) -> float | None:
    """The ceiling of the first ``count`` requests (by arrival, as ``kvtop replay`` sends them)
    of the trace at ``path``; None when it is gone or unreadable."""
    if not path or not isinstance(path, str) or not os.path.isfile(path) or count <= 0:
        return None
    key = (os.path.abspath(path), int(os.path.getmtime(path)), count)
    if key not in _TRACE_CEILINGS:
        requests = trace_requests(path, count)
        _TRACE_CEILINGS[key] = None if requests is None else of_requests(requests)
    return _TRACE_CEILINGS[key]


def of_log(path: str, run_id: str | None = None) -> dict[str, float]:
    """Per policy of a run of the decision log at ``path``: the share of its requests' input
    tokens whose leading blocks an earlier request of the run had sent (any policy's: the
    cache would have held them), at the router's block size. Empty when the log has no
    block chains."""
    from kvtop.cli import CliError
    from store.chains import ChainDecoder
    from store.recorded import read_recorded_run

    try:
        got = read_recorded_run(path, run_id)
    except (CliError, OSError, LookupError):
        return {}
    bs = int(got.config.get("block_size") or 512)
    dec = ChainDecoder()
    seen: set[int] = set()
    hit: dict[str, int] = {}
    total: dict[str, int] = {}
    for row in got.decisions:
        chain = dec.decode(row["request_id"], row["blocks_parent"], row["blocks"])
        inp = row["input_tokens"] or 0
        pol = row["policy"]
        if chain is None or pol is None:
            continue
        k = 0
        for h in chain:
            if h not in seen:
                break
            k += 1
        seen.update(chain[k:])
        hit[pol] = hit.get(pol, 0) + min(k * bs, inp)
        total[pol] = total.get(pol, 0) + inp
    return {p: hit[p] / total[p] for p in total if total[p]}
