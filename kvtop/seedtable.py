"""The seed table's arithmetic: latency percentiles, APC, balance and per-class TTFT.

Pure functions over a ``RequestColumns`` source (counts, exact sums, k-th smallest values):
result records (the dicts ``kvtop replay`` writes, one per request) or, for ``kvtop report
--db``, SQL over the decision log (``store.arms.SegmentColumns``), so ``kvtop report``,
the offline simulator and tests compute every figure the same way. Latencies stay in
milliseconds in the rows; the formatters show seconds.
"""

from __future__ import annotations

import csv
import io
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from router.classes import CLASSES, HEAVY_COLO, HEAVY_P2P, route_class
from store import stats
from store.stats import percentile  # noqa: F401  (kvtop.tui and tests import it from here)

#: APC sources, in order of preference.
APC_ENGINE = "engine"  # the engines' own vllm:prefix_cache_{hits,queries}_total counters
APC_USAGE = "usage"  # Σ usage.prompt_tokens_details.cached_tokens / Σ input over ok requests
APC_NONE = "none"  # neither is known

#: Route classes in report order: the length classes, then the offload split of HEAVY.
CLASS_ORDER: tuple[str, ...] = tuple(name for name, _, _ in CLASSES) + (HEAVY_P2P, HEAVY_COLO)


def ranked_percentile(values: Values, q: float) -> float | None:
    """``store.stats.percentile`` (q in 0-100, linear) of a ``Values``: reads only the one or
    two ranks around the position."""
    def ranks(lo: int, hi: int) -> tuple[float, float]:
        low = values.kth(lo)
        return low, (low if hi == lo else values.kth(hi))

    return stats.ranked_percentile(values.n, q, ranks)


def mean(values: Sequence[float]) -> float | None:
    """The mean, from the correctly rounded sum (``math.fsum``): the same float whatever the
    order of the values, so a database's sum matches a list's exactly."""
    return math.fsum(values) / len(values) if values else None


# --- column sources -----------------------------------------------------------------------
# Every figure below is a count, a sum, or a k-th smallest value of one column over one arm's
# requests. A source answers those three questions; records answer them from a list, the
# decision log (store.arms) from SQL counts and latency columns, without a dict per request.

class Values(Protocol):
    """One column's present values over a set of requests."""

    @property
    def n(self) -> int: ...

    def total(self) -> float:
        """The correctly rounded sum (``math.fsum``'s)."""

    def kth(self, k: int) -> float:
        """The k-th smallest value, from 0."""


class RequestColumns(Protocol):
    """One arm's requests as the seed table reads them."""

    def counts(self) -> tuple[int, int]:
        """(requests, ok requests)."""

    def ok_values(self, column: str, route_class: str | None = None) -> Values:
        """``column`` over ok requests that have it (of one route class, when given)."""

    def class_counts(self) -> dict[str, tuple[int, int]]:
        """Per route class with any request: (ok requests with a TTFT, failed requests)."""

    def instance_counts(self) -> dict[str, int]:
        """Requests per instance, ok or not, over requests that name one."""

    def usage_tokens(self) -> tuple[int, int]:
        """(Σ cached_tokens, Σ input_tokens) over ok requests that reported cached tokens."""


class SortedValues:
    """``Values`` of a list, sorted once."""

    def __init__(self, values: Iterable[float]):
        self.data = sorted(values)

    @property
    def n(self) -> int:
        return len(self.data)

    def total(self) -> float:
        return math.fsum(self.data)

    def kth(self, k: int) -> float:
        return self.data[k]


class RecordColumns:
    """``RequestColumns`` of result records (the dicts ``kvtop replay`` writes)."""

    def __init__(self, records: Iterable[Mapping[str, Any]]):
        self.records = list(records)
        self.ok = _ok(self.records)
        self._values: dict[tuple[str, str | None], SortedValues] = {}

    def counts(self) -> tuple[int, int]:
        return len(self.records), len(self.ok)

    def ok_values(self, column: str, route_class: str | None = None) -> SortedValues:
        key = (column, route_class)
        if key not in self._values:
            rows = self.ok if route_class is None else \
                [r for r in self.ok if record_class(r) == route_class]
            self._values[key] = SortedValues(_present(rows, column))
        return self._values[key]

    def class_counts(self) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        for r in self.records:
            cls = record_class(r)
            timed, failed = out.get(cls, (0, 0))
            if r.get("status") != "ok":
                failed += 1
            elif r.get("ttft_ms") is not None:
                timed += 1
            out[cls] = (timed, failed)
        return out

    def instance_counts(self) -> dict[str, int]:
        return dict(Counter(str(r["instance"]) for r in self.records if r.get("instance")))

    def usage_tokens(self) -> tuple[int, int]:
        cached = total = 0
        for r in self.ok:
            if r.get("cached_tokens") is None or not r.get("input_tokens"):
                continue
            cached += int(r["cached_tokens"])
            total += int(r["input_tokens"])
        return cached, total


def _ok(records: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in records if r.get("status") == "ok"]


def _present(records: Iterable[Mapping[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in records if r.get(key) is not None]


def _columns(source: RequestColumns | Iterable[Mapping[str, Any]]) -> RequestColumns:
    return source if hasattr(source, "ok_values") else RecordColumns(source)  # type: ignore[arg-type]


def _mean(values: Values) -> float | None:
    return values.total() / values.n if values.n else None


def apc_from_engine(counters: Mapping[str, Any] | None) -> float | None:
    """hits / queries from engine counter deltas (``{"queries", "hits"}``), or None."""
    if not counters:
        return None
    queries, hits = counters.get("queries"), counters.get("hits")
    if not queries or hits is None:  # no queries: the ratio means nothing
        return None
    return float(hits) / float(queries)


def apc_from_usage(records: Iterable[Mapping[str, Any]] | RequestColumns) -> float | None:
    """Σ cached_tokens / Σ input_tokens over ok requests that reported cached_tokens.

    Requests without ``cached_tokens`` (an engine that does not report it) are left out of
    both sums rather than counted as misses; None when no ok request reported it.
    """
    cached, total = _columns(records).usage_tokens()
    return cached / total if total else None


def choose_apc(records: Sequence[Mapping[str, Any]] | RequestColumns,
               apc: Mapping[str, Any] | None = None) -> tuple[float | None, str]:
    """(APC, source). Engine counters win when given and meaningful, then usage, then none.

    ``apc`` is either engine counter deltas ``{"queries": Δ, "hits": Δ}`` (a results file's
    header) or an already computed ``{"value": v, "source": s}`` (the decision log).
    The engines' counters are preferred because they count every prefill the engine did,
    including retries and requests the client gave up on, in the engine's own blocks.
    """
    if apc:
        if "value" in apc and apc.get("value") is not None:
            return float(apc["value"]), str(apc.get("source") or APC_ENGINE)
        value = apc_from_engine(apc)
        if value is not None:
            return value, APC_ENGINE
    value = apc_from_usage(records)
    if value is not None:
        return value, APC_USAGE
    return None, APC_NONE


def balance(records: Iterable[Mapping[str, Any]] | RequestColumns,
            instances: Iterable[str] | None = None) -> tuple[float | None, dict[str, int], str]:
    """(max:min requests per instance, requests per instance, note).

    Counts every request that was routed (has an ``instance``), ok or not: balance is about
    where the router sent work. ``instances`` names instances that may have received
    nothing; an instance with zero requests makes the ratio ``inf``. None when no record
    names an instance (e.g. replay straight at one engine, which sends no instance header).
    """
    per: Counter[str] = Counter({name: 0 for name in instances or ()})
    per.update(_columns(records).instance_counts())
    counts = dict(sorted(per.items()))
    if not any(counts.values()):
        return None, counts, "no instance recorded"
    idle = [name for name, n in counts.items() if n == 0]
    if idle:
        return math.inf, counts, "no requests on " + ",".join(idle)
    return max(counts.values()) / min(counts.values()), counts, ""


def seed_row(records: Sequence[Mapping[str, Any]] | RequestColumns,
             apc: Mapping[str, Any] | None = None, *, instances: Iterable[str] | None = None,
             ceiling: float | None = None) -> dict[str, Any]:
    """One arm's row of the seed table, from records or any ``RequestColumns``.

    Latencies are over ok requests only (an error has no meaningful TTFT); TPOT only over
    requests with more than one output token, since it is undefined for the others.
    ``ceiling``: the traffic's prefix ceiling (kvtop/ceiling.py), shown beside the APC.
    """
    source = _columns(records)
    requests, ok = source.counts()
    ttft, e2e = source.ok_values("ttft_ms"), source.ok_values("e2e_ms")
    apc_value, apc_source = choose_apc(source, apc)
    bal, per_instance, bal_note = balance(source, instances)
    return {
        "requests": requests,
        "ok": ok,
        "errors": requests - ok,
        "ttft_mean_ms": _mean(ttft),
        "ttft_p90_ms": ranked_percentile(ttft, 90),
        "e2e_mean_ms": _mean(e2e),
        "e2e_p90_ms": ranked_percentile(e2e, 90),
        "e2e_p99_ms": ranked_percentile(e2e, 99),
        "tpot_p90_ms": ranked_percentile(source.ok_values("tpot_ms"), 90),
        "apc": apc_value,
        "apc_source": apc_source,
        "apc_ceiling": ceiling,
        "balance": bal,
        "requests_per_instance": per_instance,
        "balance_note": bal_note,
    }


def record_class(record: Mapping[str, Any]) -> str:
    """The record's route class: the router's when recorded (it knows about offload), else by length."""
    return record.get("route_class") or route_class(int(record.get("input_tokens") or 0))


def class_rows(records: Iterable[Mapping[str, Any]] | RequestColumns) -> dict[str, dict[str, Any]]:
    """Per route class: ``{count, errors, ttft_mean, ttft_p50, ttft_p90}`` (TTFT in ms).

    ``count`` is the class's ok requests with a TTFT, the ones the statistics cover;
    ``errors`` the class's failed requests. Classes with no requests are left out; the
    order is report order (WARM, MEDIUM, HEAVY, HEAVY+, HEAVY_P2P, HEAVY_COLO).
    """
    source = _columns(records)
    order = {name: i for i, name in enumerate(CLASS_ORDER)}
    out: dict[str, dict[str, Any]] = {}
    counts = source.class_counts()
    for cls in sorted(counts, key=lambda c: (order.get(c, len(order)), c)):
        values = source.ok_values("ttft_ms", cls)
        out[cls] = {"count": values.n, "errors": counts[cls][1], "ttft_mean": _mean(values),
                    "ttft_p50": ranked_percentile(values, 50), "ttft_p90": ranked_percentile(values, 90)}
    return out


# --- formatting -------------------------------------------------------------------------

def _seconds(ms: float | None) -> str:
    return "-" if ms is None else f"{ms / 1000:.3f}"


def _apc(row: Mapping[str, Any]) -> str:
    if row["apc"] is None:
        return "-"
    text = f"{row['apc'] * 100:.1f}% ({row['apc_source']})"
    ceiling = row.get("apc_ceiling")
    if ceiling:  # the share of the ceiling reached, then the ceiling
        text += f" = {row['apc'] / ceiling * 100:.1f}% of {ceiling * 100:.1f}%"
    return text


def _balance(row: Mapping[str, Any]) -> str:
    b = row["balance"]
    if b is None:
        return "-"
    text = "inf" if math.isinf(b) else f"{b:.2f}"
    return f"{text} ({row['balance_note']})" if row["balance_note"] else text


#: (header, row -> display text, row -> CSV value) for the seed table.
SEED_COLUMNS: list[tuple[str, Any, Any]] = [
    ("requests", lambda r: str(r["requests"]), lambda r: r["requests"]),
    ("ok", lambda r: str(r["ok"]), lambda r: r["ok"]),
    ("errors", lambda r: str(r["errors"]), lambda r: r["errors"]),
    ("TTFT mean s", lambda r: _seconds(r["ttft_mean_ms"]), lambda r: r["ttft_mean_ms"]),
    ("TTFT p90 s", lambda r: _seconds(r["ttft_p90_ms"]), lambda r: r["ttft_p90_ms"]),
    ("E2E mean s", lambda r: _seconds(r["e2e_mean_ms"]), lambda r: r["e2e_mean_ms"]),
    ("E2E p90 s", lambda r: _seconds(r["e2e_p90_ms"]), lambda r: r["e2e_p90_ms"]),
    ("E2E p99 s", lambda r: _seconds(r["e2e_p99_ms"]), lambda r: r["e2e_p99_ms"]),
    ("TPOT p90 ms", lambda r: "-" if r["tpot_p90_ms"] is None else f"{r['tpot_p90_ms']:.1f}",
     lambda r: r["tpot_p90_ms"]),
    ("APC", _apc, lambda r: r["apc"]),
    ("balance max:min", _balance, lambda r: r["balance"]),
]
#: CSV header names (units in the name, values unrounded, ms as in the records).
SEED_CSV_HEADERS = ["requests", "ok", "errors", "ttft_mean_ms", "ttft_p90_ms", "e2e_mean_ms",
                    "e2e_p90_ms", "e2e_p99_ms", "tpot_p90_ms", "apc", "balance"]

CLASS_COLUMNS: list[tuple[str, Any, Any]] = [
    ("count", lambda r: str(r["count"]), lambda r: r["count"]),
    ("errors", lambda r: str(r["errors"]), lambda r: r["errors"]),
    ("TTFT mean s", lambda r: _seconds(r["ttft_mean"]), lambda r: r["ttft_mean"]),
    ("TTFT p50 s", lambda r: _seconds(r["ttft_p50"]), lambda r: r["ttft_p50"]),
    ("TTFT p90 s", lambda r: _seconds(r["ttft_p90"]), lambda r: r["ttft_p90"]),
]
CLASS_CSV_HEADERS = ["count", "errors", "ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms"]


def _grid(headers: list[str], lines: list[list[str]], fmt: str) -> str:
    n_labels = 2 if headers[:2] == ["arm", "class"] else 1  # left-aligned; numbers go right
    if fmt == "md":
        def esc(cell: str) -> str:
            return cell.replace("|", "\\|")
        out = ["| " + " | ".join(esc(h) for h in headers) + " |",
               "|" + "|".join("---" if i < n_labels else "---:" for i in range(len(headers))) + "|"]
        out += ["| " + " | ".join(esc(c) for c in line) + " |" for line in lines]
        return "\n".join(out)
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h)
              for i, h in enumerate(headers)]

    def fmt_line(cells: list[str], n_labels: int) -> str:
        return "  ".join(c.ljust(w) if i < n_labels else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([fmt_line(headers, n_labels)] + [fmt_line(line, n_labels) for line in lines])


def _csv(headers: list[str], lines: list[list[Any]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(headers)
    for line in lines:
        w.writerow(["" if v is None else v for v in line])
    return buf.getvalue().rstrip("\n")


def format_seed_table(rows: Sequence[tuple[str, Mapping[str, Any]]], fmt: str = "text") -> str:
    """The seed table, one line per ``(arm label, seed_row)``, as ``text``, ``md`` or ``csv``."""
    if fmt == "csv":
        return _csv(["arm"] + SEED_CSV_HEADERS + ["apc_source", "apc_ceiling"],
                    [[label] + [csv_of(r) for _, _, csv_of in SEED_COLUMNS]
                     + [r["apc_source"], r.get("apc_ceiling")] for label, r in rows])
    _check_fmt(fmt)
    return _grid(["arm"] + [h for h, _, _ in SEED_COLUMNS],
                 [[label] + [show(r) for _, show, _ in SEED_COLUMNS] for label, r in rows], fmt)


def format_class_table(arms: Sequence[tuple[str, Mapping[str, Mapping[str, Any]]]],
                       fmt: str = "text") -> str:
    """Per-class TTFT, one line per (arm, class), from ``(arm label, class_rows)`` pairs."""
    if fmt == "csv":
        return _csv(["arm", "class"] + CLASS_CSV_HEADERS,
                    [[label, cls] + [csv_of(r) for _, _, csv_of in CLASS_COLUMNS]
                     for label, classes in arms for cls, r in classes.items()])
    _check_fmt(fmt)
    return _grid(["arm", "class"] + [h for h, _, _ in CLASS_COLUMNS],
                 [[label, cls] + [show(r) for _, show, _ in CLASS_COLUMNS]
                  for label, classes in arms for cls, r in classes.items()], fmt)


#: The session table's columns: (header, key in store.sessions.summarize, statistic).
SESSION_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("done mean", "completion_s", "mean"), ("done p50", "completion_s", "p50"),
    ("done p90", "completion_s", "p90"), ("done max", "completion_s", "max"),
    ("fleet mean", "fleet_s", "mean"), ("fleet p90", "fleet_s", "p90"),
    ("client mean", "client_s", "mean"), ("client p90", "client_s", "p90"),
)


def format_session_table(rows: Sequence[tuple[str, Mapping[str, Any]]], fmt: str = "text") -> str:
    """Session completion time per arm, from ``(arm label, store.sessions.summarize(...))``.

    ``done``: a session's first arrival to its last answer's end; ``fleet``: the time it had a
    request in the fleet; ``client``: the rest, its own time between turns. Seconds."""
    if fmt == "csv":
        return _csv(["arm", "sessions", "requests"] + [f"{key}_{stat}" for _, key, stat in SESSION_COLUMNS],
                    [[label, s["sessions"], s["requests"]] + [s[key][stat] for _, key, stat in SESSION_COLUMNS]
                     for label, s in rows])
    _check_fmt(fmt)

    def sec(v: float | None) -> str:
        return "-" if v is None else f"{v:,.1f}"

    return _grid(["arm", "sessions"] + [f"{h} s" for h, _, _ in SESSION_COLUMNS],
                 [[label, f"{s['sessions']:,}"] + [sec(s[key][stat]) for _, key, stat in SESSION_COLUMNS]
                  for label, s in rows], fmt)


def session_table(arms: Sequence[tuple[str, Iterable[Mapping[str, Any]]]], fmt: str = "text") -> str:
    """The session table of ``(arm label, result records)`` pairs (``kvtop simulate``'s and
    what-if's records: a request's start is its ``arrival``, or ``sent_at`` for replay's), with
    its title line in text and md; empty when no arm has a session."""
    from store.sessions import from_records, summarize

    rows = [(label, summarize(items)) for label, records in arms if (items := from_records(records))]
    if not rows:
        return ""
    table = format_session_table(rows, fmt)
    if fmt == "csv":
        return table
    title = ("Sessions (first arrival to last answer; fleet: a request in flight; client: between turns)"
             if fmt == "text" else "## Sessions (first arrival to last answer)\n")
    return f"{title}\n{table}"


def _check_fmt(fmt: str) -> None:
    if fmt not in ("text", "md", "csv"):
        raise ValueError(f"unknown table format {fmt!r} (text, md or csv)")
