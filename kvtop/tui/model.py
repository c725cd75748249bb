"""The dashboard's pure core: what the feed delivered, kept bounded, and how it reads as text.

``Collected`` takes every event as it arrives (also while the view is paused) and keeps the
latest snapshot, a bounded decision buffer and short histories for the charts. The row
functions turn a snapshot into table cells; ``render_once`` is ``attach --once``.
No Textual here.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvtop.seedtable import percentile

SPARK = "▁▂▃▄▅▆▇█"
HISTORY = 600  # samples kept per series: 10 min at 1 Hz, 2.5 min at 4 Hz

# (key, label, width). The keys are the DataTable column keys and the sort keys.
INSTANCE_COLUMNS: list[tuple[str, str, int]] = [
    ("name", "instance", 10), ("health", "health", 6), ("requests", "req", 5), ("backlog_tokens", "backlog", 8),
    ("backlog_s", "bl s", 6), ("decode_requests", "dreq", 4), ("decode_tokens", "dtok", 6),
    ("est_hit", "est%", 5), ("engine_hit", "eng%", 5), ("kv", "KV%", 5), ("gpu_util", "GPU%", 4),
    ("gpu_mem", "GPU mem", 9), ("trend", "backlog trend", 13),
]
SORT_KEYS = [k for k, _, _ in INSTANCE_COLUMNS if k != "trend"]


# -- thresholds: light / moderate / heavy, as nvitop does --------------------------------------

@dataclass(frozen=True)
class Threshold:
    moderate: float
    heavy: float

    def level(self, value: float | None) -> int:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return 0
        return 2 if value >= self.heavy else 1 if value >= self.moderate else 0


THRESHOLDS = {
    "backlog_s": Threshold(2.0, 10.0),
    "kv": Threshold(0.80, 0.95),
    "gpu_util": Threshold(70.0, 95.0),
    "requests": Threshold(16, 48),
}


def sparkline(values: list[float], width: int = 12) -> str:
    vals = values[-width:]
    if not vals:
        return ""
    top = max(vals)
    if top <= 0:
        return SPARK[0] * len(vals)
    return "".join(SPARK[min(7, int(v / top * 7.999))] for v in vals)


def fmt_int(n: Any) -> str:
    if n is None:
        return "n/a"
    n = float(n)
    if abs(n) >= 10_000_000:
        return f"{n / 1e6:.0f}M"
    if abs(n) >= 100_000:
        return f"{n / 1e3:.0f}k"
    return f"{int(n):,}"


def fmt_pct(x: Any) -> str:
    return "n/a" if x is None else f"{100 * float(x):.1f}"


def fmt_secs(s: Any) -> str:
    if s is None:
        return "n/a"
    s = float(s)
    return f"{s:.2f}" if s < 10 else f"{s:.1f}" if s < 100 else f"{s:.0f}"


def fmt_duration(s: float | None) -> str:
    if s is None:
        return "n/a"
    s = int(max(0, s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def fmt_bytes(b: Any) -> str:
    if b is None:
        return "n/a"
    return f"{float(b) / 2**30:.1f}G"


def gpu_cells(gpu: dict[str, Any] | None) -> tuple[str, str, str | None]:
    """(util, mem, reason when n/a). The reason is shortened for the cell, full in --once."""
    gpu = gpu or {}
    util, used, total = gpu.get("util_pct"), gpu.get("mem_used_bytes"), gpu.get("mem_total_bytes")
    if util is None and used is None:
        why = gpu.get("error") or gpu.get("note") or "no GPU sampler"
        why = str(why).removeprefix("n/a: ").removeprefix("n/a:")
        return "n/a", "n/a", why.strip()
    mem = f"{fmt_bytes(used)}/{fmt_bytes(total)}" if total else fmt_bytes(used)
    return ("n/a" if util is None else f"{float(util):.0f}"), mem, None


def instance_values(inst: dict[str, Any]) -> dict[str, Any]:
    """Sortable raw values of one instance row (None sorts first)."""
    eng = inst.get("engine") or {}
    gpu = inst.get("gpu") or {}
    return {
        "name": inst.get("name", "?"),
        "health": 1 if inst.get("healthy") else 0,
        "requests": inst.get("num_requests") or 0,
        "backlog_tokens": inst.get("pending_prefill_tokens") or 0,
        "backlog_s": inst.get("backlog_s"),
        "decode_requests": inst.get("decode_requests") or 0,
        "decode_tokens": inst.get("decode_tokens") or 0,
        "est_hit": inst.get("est_hit_rate_recent", inst.get("est_hit_rate")) if inst.get(
            "est_hit_rate_recent") is not None else inst.get("est_hit_rate"),
        "engine_hit": eng.get("prefix_hit_rate_recent") if eng.get("prefix_hit_rate_recent") is not None
        else eng.get("prefix_hit_rate"),
        "kv": eng.get("kv_usage"),
        "gpu_util": gpu.get("util_pct"),
        "gpu_mem": gpu.get("mem_used_bytes"),
    }


def sort_value(v: Any) -> tuple[int, Any]:
    return (0, 0) if v is None else (1, v)


# -- what the feed delivered ------------------------------------------------------------------

@dataclass
class Collected:
    """Everything the worker received, bounded. Written by the worker, read by the apply timer."""

    max_decisions: int = 2000
    snapshot: dict[str, Any] | None = None
    snapshot_seq: int = 0
    connected: bool = False
    error: str | None = None
    retry_at: float | None = None
    decisions: deque = field(default_factory=deque)
    decision_seq: int = 0  # total decisions ever received; the view applies those above its mark
    config_events: deque = field(default_factory=lambda: deque(maxlen=50))
    dropped: int = 0
    # histories for the charts: (ts, value)
    backlog: dict[str, deque] = field(default_factory=dict)
    hit_rate: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    engine_hit_rate: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    ttft_ms: deque = field(default_factory=lambda: deque(maxlen=5000))  # (ts, ttft) per outcome
    _last_totals: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        self.decisions = deque(maxlen=self.max_decisions)

    def ingest(self, kind: str, payload: Any) -> None:
        if kind == "state":
            self._state(payload)
        elif kind == "decision":
            self.decision_seq += 1
            self.decisions.append((self.decision_seq, payload))
        elif kind == "outcome":
            if payload.get("ttft_ms") is not None:
                self.ttft_ms.append((payload.get("ts") or time.time(), float(payload["ttft_ms"])))
        elif kind == "config":
            self.config_events.append(payload)
        elif kind == "dropped":
            self.dropped += int(payload.get("decisions_sampled_out", 0)) + int(payload.get("overflow", 0))
        elif kind == "_status":
            self.connected = bool(payload.get("connected"))
            self.error = payload.get("error")
            retry = payload.get("retry_in_s")
            self.retry_at = time.time() + retry if retry else None

    def _state(self, snap: dict[str, Any]) -> None:
        self.snapshot = snap
        self.snapshot_seq += 1
        ts = float(snap.get("ts") or time.time())
        engine_rates = []
        for inst in snap.get("instances", []):
            ring = self.backlog.get(inst["name"])
            if ring is None:
                ring = self.backlog[inst["name"]] = deque(maxlen=HISTORY)
            ring.append((ts, float(inst.get("pending_prefill_tokens") or 0)))
            r = (inst.get("engine") or {}).get("prefix_hit_rate_recent")
            if r is not None:
                engine_rates.append(r)
        tot = snap.get("totals") or {}
        inp, hit = float(tot.get("input_tokens_total") or 0), float(tot.get("est_hit_tokens_total") or 0)
        # Hit rate over the last interval, not since start: the chart should show change.
        if self._last_totals is not None and inp > self._last_totals[0]:
            rate = (hit - self._last_totals[1]) / (inp - self._last_totals[0])
            self.hit_rate.append((ts, 100 * rate))
        elif self._last_totals is None and tot.get("est_hit_rate") is not None:
            self.hit_rate.append((ts, 100 * float(tot["est_hit_rate"])))
        self._last_totals = (inp, hit)
        if engine_rates:
            self.engine_hit_rate.append((ts, 100 * sum(engine_rates) / len(engine_rates)))

    def ttft_series(self, window_s: float, now: float, bucket_s: float | None = None
                    ) -> tuple[list[float], list[float], list[float]]:
        """(times, p50, p90) of TTFT over ``window_s``, one point per bucket."""
        bucket_s = bucket_s or max(1.0, window_s / 30)
        buckets: dict[int, list[float]] = {}
        for ts, v in self.ttft_ms:
            if ts >= now - window_s:
                buckets.setdefault(int(ts // bucket_s), []).append(v)
        xs, p50, p90 = [], [], []
        for b in sorted(buckets):
            vals = buckets[b]
            xs.append(b * bucket_s + bucket_s / 2 - now)
            p50.append(percentile(vals, 50))
            p90.append(percentile(vals, 90))
        return xs, p50, p90


def doc_summary(doc: str | None) -> str:
    """A policy docstring's first paragraph as one line (its first line alone stops mid-sentence)."""
    first = (doc or "").strip().split("\n\n", 1)[0]
    return " ".join(line.strip() for line in first.splitlines())


# -- decisions ---------------------------------------------------------------------------------

def decision_matches(ev: dict[str, Any], query: str) -> bool:
    """``reason:argmin instance:i0 session:abc`` fields, or bare words matched anywhere."""
    for word in query.split():
        key, sep, want = word.partition(":")
        if sep and key in ("reason", "instance", "session", "class", "policy"):
            if want.lower() not in str(ev.get(key, "")).lower():
                return False
        elif not any(word.lower() in str(ev.get(k, "")).lower()
                     for k in ("reason", "instance", "session", "class", "policy", "request_id")):
            return False
    return True


def terms_summary(terms: Any, chosen: str | None) -> str:
    """The chosen candidate's terms in one short string."""
    if not isinstance(terms, list):
        return ""
    for t in terms:
        if isinstance(t, dict) and t.get("instance") == chosen:
            parts = [f"{k}={_short(v)}" for k, v in t.items() if k != "instance"]
            return " ".join(parts)
    return f"{len(terms)} candidates"


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, int) and abs(v) >= 10_000:
        return fmt_int(v)
    return str(v)


# -- attach --once -------------------------------------------------------------------------------

def render_once(snap: dict[str, Any], policies: dict[str, Any] | None = None) -> str:
    """One plain-text snapshot: router line, policy and knobs, instances table, totals."""
    r = snap.get("router", {})
    tot = snap.get("totals", {})
    lines = [f"kvtop router {r.get('url', '?')}  run {r.get('run_id', '?')}  up {fmt_duration(r.get('uptime_s'))}"
             f"{'  READ-ONLY' if r.get('readonly') else ''}{'  DRAINING' if r.get('draining') else ''}",
             f"policy {r.get('policy', '?')}  knobs "
             + (", ".join(f"{k}={v}" for k, v in sorted((r.get('knobs') or {}).items())) or "-")]
    headers = ["instance", "health", "req", "backlog_tok", "backlog_s", "dec_req", "dec_tok",
               "est_hit%", "eng_hit%", "kv%", "gpu%", "gpu_mem"]
    rows = []
    notes = []
    for inst in snap.get("instances", []):
        v = instance_values(inst)
        util, mem, why = gpu_cells(inst.get("gpu"))
        if why:
            notes.append(f"{v['name']}: gpu n/a: {why}")
        rows.append([v["name"], "up" if v["health"] else "DOWN", str(v["requests"]), str(v["backlog_tokens"]),
                     fmt_secs(v["backlog_s"]), str(v["decode_requests"]), str(v["decode_tokens"]),
                     fmt_pct(v["est_hit"]), fmt_pct(v["engine_hit"]), fmt_pct(v["kv"]), util, mem])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt_row = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                      for i, (c, w) in enumerate(zip(cells, widths)))
    lines += ["", fmt_row(headers)] + [fmt_row(row) for row in rows]
    lines += ["", "totals  " + "  ".join([
        f"in_flight={tot.get('in_flight', 0)}", f"requests={tot.get('num_requests', 0)}",
        f"backlog_tok={tot.get('pending_prefill_tokens', 0)}", f"backlog_s={fmt_secs(tot.get('backlog_s'))}",
        f"routed={tot.get('routed_total', 0)}", f"est_hit%={fmt_pct(tot.get('est_hit_rate'))}",
        f"req/s={float(tot.get('request_rate') or 0):.2f}", f"errors={tot.get('errors_total', 0)}",
        f"healthy={tot.get('healthy_instances', 0)}/{len(snap.get('instances', []))}"])]
    aff = snap.get("affinity") or {}
    if aff:
        lines.append(f"sessions {aff.get('sessions', 0)}  moved {aff.get('moved_sessions', 0)}  per instance "
                     + " ".join(f"{k}={n}" for k, n in (aff.get("per_instance") or {}).items()))
    if snap.get("decisions_by_reason"):
        lines.append("reasons  " + " ".join(f"{k}={n}" for k, n in sorted(snap["decisions_by_reason"].items())))
    if snap.get("outcomes_by_status"):
        lines.append("outcomes " + " ".join(f"{k}={n}" for k, n in sorted(snap["outcomes_by_status"].items())))
    lines += notes
    return "\n".join(lines) + "\n"
