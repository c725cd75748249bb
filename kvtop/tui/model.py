"""The dashboard's pure core: what the feed delivered, kept bounded, and how it reads as text.

``Collected`` takes every event as it arrives (also while the view is paused) and keeps the
latest snapshot, a bounded decision buffer and short histories for the charts. The row
functions turn a snapshot into table cells; ``render_once`` is ``attach --once``.
No Textual here.
"""

from __future__ import annotations

import math
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvtop.receipt import fmt_num
from kvtop.seedtable import percentile

SPARK = "▁▂▃▄▅▆▇█"
#: A value the router did not send (or sent as something unreadable): one mark everywhere.
MISSING = "–"
HISTORY = 600  # samples kept per series: 10 min at 1 Hz, 2.5 min at 4 Hz

# (key, label, width). The keys are the DataTable column keys and the sort keys.
INSTANCE_COLUMNS: list[tuple[str, str, int]] = [
    # What an operator reads first comes first: at 120 columns everything up to dtok is on
    # screen, the rest scrolls sideways with the instance name pinned.
    ("name", "instance", 10), ("health", "health", 10), ("requests", "req", 5), ("backlog_tokens", "backlog", 8),
    ("backlog_s", "bl s", 6), ("ttft_p50", "TTFT", 6), ("ttft_p90", "p90", 6), ("est_hit", "est%", 5),
    ("engine_hit", "eng%", 5), ("errors", "err", 4), ("kv", "KV%", 5), ("gpu_util", "GPU%", 4),
    ("decode_requests", "dreq", 4), ("decode_tokens", "dtok", 6), ("gpu_mem", "GPU mem", 9),
    ("trend", "backlog trend", 13),
]
#: Shown only when the router reports it (``instances[i].prefill_tps_measured``), appended.
MEASURED_TPS_COLUMN = ("prefill_tps", "pf tok/s", 8)
#: The instance table's TTFT percentiles are over this many seconds of outcomes.
RECENT_S = 60.0
SORT_KEYS = [k for k, _, _ in INSTANCE_COLUMNS if k != "trend"]
#: The overview opens sorted by load: the largest prefill backlog first, as top sorts by CPU.
DEFAULT_SORT = "backlog_tokens"
#: Column key -> (what the sort line calls it, what the column means: the help's legend).
COLUMN_HELP: dict[str, tuple[str, str]] = {
    "name": ("instance", "the vLLM instance's name"),
    "health": ("health", "● up; ✖ DOWN (its probe or a connect failed); ⏏ ejected (its requests kept "
                         "failing); ⊘ cordoned (no new sessions); ⇣ draining / drained (no new requests; "
                         "its sessions move at their next turn); ✕ removed; the reason or the drain's "
                         "progress is under the table"),
    "requests": ("requests", "requests in flight on the instance (BS)"),
    "backlog_tokens": ("prefill backlog", "prompt tokens sent whose first token has not come back (P)"),
    "backlog_s": ("backlog seconds", "that backlog in seconds at the engine's measured prefill speed "
                  "(the state's backlog_source says which)"),
    "decode_requests": ("decoding requests", "requests past their first token, decoding"),
    "decode_tokens": ("decoding tokens", "context tokens of the decoding requests (D)"),
    "est_hit": ("router est. hit %", "the router's estimated prefix-cache hit rate, recent requests"),
    "engine_hit": ("engine hit %", "the engine's own prefix-cache hit rate, recent"),
    "ttft_p50": ("TTFT p50", f"median time to first token of its requests, last {RECENT_S:.0f} s"),
    "ttft_p90": ("TTFT p90", f"90th percentile time to first token, last {RECENT_S:.0f} s"),
    "errors": ("errors", "requests that failed on this instance since the router started"),
    "prefill_tps": ("measured prefill rate", "prefill tokens per second the router measured on it"),
    "kv": ("KV use", "the engine's KV-cache usage"),
    "gpu_util": ("GPU utilisation", "GPU busy % (high is good: the GPU is working)"),
    "gpu_mem": ("GPU memory", "GPU memory used / total"),
    "trend": ("backlog trend", "the prefill backlog over the last frames"),
}


def column_legend(key: str) -> str | None:
    """What an instance-table column means, as its header tooltip and the help's legend say it."""
    entry = COLUMN_HELP.get(key)
    return f"{entry[0]}: {entry[1]}" if entry else None


def natural_key(name: str) -> tuple:
    """``i2`` before ``i10``: digit runs compare as numbers."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def is_number(v: Any) -> bool:
    """A JSON number (not a bool, not NaN or infinite): what the formatters and thresholds accept."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


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
    "requests": Threshold(16, 48),
}


#: GPU utilisation from which the cell reads as busy, in the theme's success colour: a busy
#: GPU is the fleet working, not a warning (nvitop's heavy red read as trouble).
GPU_BUSY_PCT = 70.0
#: A prefix-hit rate below this is drawn bold in the warning colour: agentic sessions
#: normally hit most of their prompt, so a low rate is where the cache is being lost.
LOW_HIT_RATE = 0.25


#: From this many instances the overview adds the fleet strips: one character per instance.
FLEET_MIN = 16
#: From this many instances the overview condenses: only the rows that fit on screen (busiest
#: first by the current sort), the rest summed on one line; ``z`` switches it off and on.
COMPACT_MIN = 64


def fleet_strips(insts: list[dict[str, Any]], width: int) -> list[tuple[str, list[tuple[str, int]]]]:
    """The fleet at a glance, for 16 to hundreds of instances: per instance (in name order)
    one character of backlog (bar height relative to the busiest, level 0-2 from
    ``THRESHOLDS["backlog_s"]``) and one of the router's recent estimated hit rate (height =
    rate; level 1 below ``LOW_HIT_RATE``); ``✖`` for an instance that is down or ejected.

    Returns (label, [(character, level)]) lines, each at most ``width`` characters of cells,
    the backlog lines first. Height carries the value, so colour is never the only signal.
    """
    ordered = sorted(insts, key=lambda i: natural_key(str(i.get("name", ""))))
    top = max((float(i.get("pending_prefill_tokens") or 0) for i in ordered), default=0.0)
    backlog, hit = [], []
    for inst in ordered:
        if not inst.get("healthy"):
            backlog.append(("✖", 2))
            hit.append(("✖", 2))
            continue
        pending = float(inst.get("pending_prefill_tokens") or 0)
        level = THRESHOLDS["backlog_s"].level(inst.get("backlog_s") if is_number(inst.get("backlog_s")) else None)
        backlog.append((SPARK[min(7, int(pending / top * 7.999))] if top > 0 else SPARK[0], level))
        rate = inst.get("est_hit_rate_recent")
        rate = rate if is_number(rate) else inst.get("est_hit_rate")
        if is_number(rate):
            hit.append((SPARK[min(7, max(0, int(float(rate) * 7.999)))], 1 if rate < LOW_HIT_RATE else 0))
        else:
            hit.append(("·", 0))
    width = max(8, width)
    lines: list[tuple[str, list[tuple[str, int]]]] = []
    for label, cells in (("backlog", backlog), ("est hit", hit)):
        for k in range(0, len(cells), width):
            lines.append((label if k == 0 else "", cells[k:k + width]))
    return lines


def sparkline(values: list[float], width: int = 12) -> str:
    vals = values[-width:]
    if not vals:
        return ""
    top = max(vals)
    if top <= 0:
        return SPARK[0] * len(vals)
    return "".join(SPARK[min(7, int(v / top * 7.999))] for v in vals)


def fmt_int(n: Any) -> str:
    if not is_number(n):
        return MISSING
    n = float(n)
    if abs(n) >= 10_000_000:
        return f"{n / 1e6:.0f}M"
    if abs(n) >= 100_000:
        return f"{n / 1e3:.0f}k"
    return f"{int(n):,}"


def fit_id(ident: str, width: int) -> str:
    """An id cut to ``width`` in the middle, so the tail (an agent's or a turn's number) survives."""
    if len(ident) <= width:
        return ident
    head = max(1, (width - 1) // 2)
    return ident[:head] + "…" + ident[len(ident) - (width - 1 - head):]


def fmt_pct(x: Any) -> str:
    return f"{100 * float(x):.1f}" if is_number(x) else MISSING


def fmt_secs(s: Any) -> str:
    if not is_number(s):
        return MISSING
    s = float(s)
    return f"{s:.2f}" if s < 10 else f"{s:.1f}" if s < 100 else f"{s:.0f}"


def fmt_latency(ms: Any) -> str:
    """A latency in its natural unit, narrow: ``85ms``, ``812ms``, ``3.8s``, ``52s``."""
    if not is_number(ms):
        return "–"
    ms = float(ms)
    if ms < 1000:
        return f"{ms:.0f}ms"
    return f"{ms / 1000:.1f}s" if ms < 10_000 else f"{ms / 1000:.0f}s"


def fmt_duration(s: float | None) -> str:
    if not is_number(s):
        return MISSING
    s = int(max(0, s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def fmt_bytes(b: Any) -> str:
    if not is_number(b):
        return MISSING
    return f"{float(b) / 2**30:.1f}G"


def gpu_cells(gpu: dict[str, Any] | None) -> tuple[str, str, str | None]:
    """(util, mem, reason when n/a). The reason is shortened for the cell, full in --once."""
    gpu = gpu or {}
    util, used, total = gpu.get("util_pct"), gpu.get("mem_used_bytes"), gpu.get("mem_total_bytes")
    if util is None and used is None:
        why = gpu.get("error") or gpu.get("note") or "no GPU sampler"
        why = str(why).removeprefix("n/a: ").removeprefix("n/a:")
        return MISSING, MISSING, why.strip()
    mem = f"{fmt_bytes(used)}/{fmt_bytes(total)}" if total else fmt_bytes(used)
    return (MISSING if util is None else f"{float(util):.0f}"), mem, None


def health_state(inst: dict[str, Any]) -> tuple[str, str | None]:
    """("up" | "down" | "ejected", the reason when not up) from the router's health section."""
    h = inst.get("health") or {}
    if inst.get("healthy"):
        return "up", None
    why = h.get("last_error") if isinstance(h.get("last_error"), str) else None
    if h.get("ejected"):
        left = h.get("ejected_for_s")
        return "ejected", (why or "failed requests") + (f" (back in {left:.0f} s)" if is_number(left) else "")
    return "down", why or "not answering"


#: The router's fleet states (router/fleet.py) and the dashboard's keys that change them.
FLEET_STATES = ("active", "cordoned", "draining", "removed")
FLEET_AFTER = {"cordon": "cordoned", "drain": "draining", "uncordon": "active", "remove": "removed"}
FLEET_VERBS = {"cordon": "no new sessions; its sessions keep coming",
               "drain": "no new requests: each of its sessions moves at its next turn, in-flight requests finish",
               "uncordon": "back in rotation for new sessions and requests",
               "remove": "out of the fleet: its prefix index, sessions and counters are forgotten"}


def fleet_state(inst: dict[str, Any]) -> str:
    """The instance's fleet state; ``active`` when the router does not report one (an older router)."""
    s = inst.get("fleet_state")
    return s if s in FLEET_STATES else "active"


def drain_progress(inst: dict[str, Any]) -> tuple[int | None, int | None, bool]:
    """(sessions still homed, requests in flight, drained) of a draining instance (``state.drain``)."""
    d = inst.get("drain") if isinstance(inst.get("drain"), dict) else {}
    homed = d.get("sessions_homed") if is_number(d.get("sessions_homed")) else None
    in_flight = d.get("in_flight") if is_number(d.get("in_flight")) else inst.get("num_requests")
    in_flight = int(in_flight) if is_number(in_flight) else None
    return (int(homed) if homed is not None else None), in_flight, bool(d.get("drained")) or in_flight == 0


def fleet_note(inst: dict[str, Any], sessions: Any = None) -> str | None:
    """One line on an instance out of rotation, under the table: a drain's progress (sessions
    still homed there, requests in flight), a cordon's sessions; None while it is active."""
    name, state = inst.get("name", "?"), fleet_state(inst)
    if state == "draining":
        homed, in_flight, drained = drain_progress(inst)
        homed_s = f"{fmt_int(homed)} session{'' if homed == 1 else 's'} still homed (each moves at its next turn)"
        if drained:
            return f"{name} drained: nothing in flight, {homed_s}; x removes it"
        return f"{name} draining: {fmt_int(in_flight)} request{'' if in_flight == 1 else 's'} in flight, {homed_s}"
    if state == "cordoned":
        n = f"its {fmt_int(sessions)} sessions keep coming" if is_number(sessions) else "its sessions keep coming"
        return f"{name} cordoned: no new sessions, {n}; u uncordons"
    if state == "removed":
        return f"{name} removed"
    return None


def instance_values(inst: dict[str, Any], ttft: tuple[float | None, float | None] = (None, None)
                    ) -> dict[str, Any]:
    """Sortable raw values of one instance row (None sorts first); ``ttft`` is its recent
    (p50, p90) from ``Collected.instance_ttft``."""
    eng = inst.get("engine") or {}
    gpu = inst.get("gpu") or {}
    errors = inst.get("errors") or {}
    return {
        "name": inst.get("name", "?"),
        "health": 1 if inst.get("healthy") else 0,
        "ttft_p50": ttft[0],
        "ttft_p90": ttft[1],
        "errors": errors.get("requests_total") if is_number(errors.get("requests_total")) else None,
        "prefill_tps": inst.get("prefill_tps_measured"),
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


# -- what the router sent, checked -------------------------------------------------------------

# The fields the dashboard reads, by where they sit. A value of another type becomes None
# (drawn as "–") and is reported once; dicts and lists that are not are replaced by empty ones.
_INSTANCE_NUMBERS = ("num_requests", "pending_prefill_tokens", "backlog_s", "decode_requests", "decode_tokens",
                     "routed_total", "input_tokens_total", "est_hit_tokens_total", "est_hit_rate",
                     "est_hit_rate_recent", "request_rate", "prefill_tps_measured")
_SECTION_NUMBERS = {
    "engine": ("kv_usage", "prefix_hit_rate", "prefix_hit_rate_recent", "running", "waiting"),
    "gpu": ("util_pct", "mem_used_bytes", "mem_total_bytes"),
    "health": ("ejected_for_s", "ejections", "consecutive_errors"),
    "errors": ("requests_total",),
}
_TOTAL_NUMBERS = ("in_flight", "num_requests", "pending_prefill_tokens", "backlog_s", "decode_requests",
                  "routed_total", "input_tokens_total", "est_hit_tokens_total", "est_hit_rate", "request_rate",
                  "errors_total", "healthy_instances")


def clean_snapshot(snap: Any) -> tuple[dict[str, Any] | None, list[str]]:
    """A state snapshot safe to draw, and what was wrong with it (empty when nothing was).

    None when the snapshot cannot be read at all (not an object, ``instances`` not a list).
    Only the fields the dashboard reads are checked; everything else passes through.
    """
    if not isinstance(snap, dict):
        return None, [f"state is a JSON {type(snap).__name__}, not an object"]
    if not isinstance(snap.get("instances"), list):
        return None, [f"state.instances is {type(snap.get('instances')).__name__}, not a list"]
    problems: list[str] = []
    out = dict(snap)
    for key in ("router", "totals", "affinity", "decisions_by_reason", "outcomes_by_status"):
        if not isinstance(out.get(key), dict):
            if out.get(key) is not None:
                problems.append(f"state.{key} is {type(out[key]).__name__}, not an object")
            out[key] = {}
    if out.get("ts") is not None and not is_number(out["ts"]):
        problems.append(f"state.ts is {type(out['ts']).__name__}")
        out["ts"] = None
    tot = dict(out.get("totals") or {})
    for k in _TOTAL_NUMBERS:
        if tot.get(k) is not None and not is_number(tot[k]):
            problems.append(f"totals.{k} is {type(tot[k]).__name__}")
            tot[k] = None
    out["totals"] = tot
    for key in ("decisions_by_reason", "outcomes_by_status"):
        counts = out.get(key) or {}
        out[key] = {str(k): v for k, v in counts.items() if is_number(v)}
    aff = dict(out.get("affinity") or {})
    per = aff.get("per_instance")
    aff["per_instance"] = {str(k): v for k, v in per.items() if is_number(v)} if isinstance(per, dict) else {}
    out["affinity"] = aff
    insts = []
    seen: set[str] = set()
    for n, inst in enumerate(out["instances"]):
        if not isinstance(inst, dict) or not isinstance(inst.get("name"), str) or not inst["name"]:
            problems.append(f"instances[{n}] has no name")
            continue
        if inst["name"] in seen:
            problems.append(f"instances[{n}] repeats the name {inst['name']!r}")
            continue
        seen.add(inst["name"])
        inst = dict(inst)
        for k in _INSTANCE_NUMBERS:
            if inst.get(k) is not None and not is_number(inst[k]):
                problems.append(f"{inst['name']}.{k} is {type(inst[k]).__name__}")
                inst[k] = None
        for section, fields in _SECTION_NUMBERS.items():
            sec = inst.get(section)
            if sec is None:
                continue
            if not isinstance(sec, dict):
                problems.append(f"{inst['name']}.{section} is {type(sec).__name__}, not an object")
                inst[section] = {}
                continue
            sec = inst[section] = dict(sec)
            for k in fields:
                if sec.get(k) is not None and not is_number(sec[k]):
                    problems.append(f"{inst['name']}.{section}.{k} is {type(sec[k]).__name__}")
                    sec[k] = None
        insts.append(inst)
    out["instances"] = insts
    return out, problems


_DECISION_NUMBERS = ("ts", "attempt", "turn", "input_tokens", "est_hit", "best_hit", "new_prefill", "decision_us")
_DECISION_TEXT = ("request_id", "session", "class", "instance", "reason", "policy", "best_hit_instance")


def clean_decision(ev: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A decision event safe to draw: numbers are numbers or None, names are strings, terms a list of objects."""
    out = dict(ev)
    problems = []
    for k in _DECISION_NUMBERS:
        if out.get(k) is not None and not is_number(out[k]):
            problems.append(f"decision.{k} is {type(out[k]).__name__}")
            out[k] = None
    for k in _DECISION_TEXT:
        if out.get(k) is not None and not isinstance(out[k], str):
            out[k] = str(out[k])
    terms = out.get("terms")
    if terms is not None and not (isinstance(terms, list) and all(isinstance(t, dict) for t in terms)):
        problems.append("decision.terms is not a list of objects")
        out["terms"] = [t for t in terms if isinstance(t, dict)] if isinstance(terms, list) else []
    return out, problems


# -- what the feed delivered ------------------------------------------------------------------

@dataclass
class Collected:
    """Everything the worker received, bounded. Written by the worker, read by the apply timer."""

    max_decisions: int = 2000
    snapshot: dict[str, Any] | None = None
    snapshot_seq: int = 0
    connected: bool = False
    ever_connected: bool = False  # until the first connection the view says "connecting", not red
    error: str | None = None
    retry_at: float | None = None
    connects: int = 0  # connections made: above 1, the router may have restarted behind the view
    disconnected_at: float | None = None  # wall time the connection was lost (None while connected)
    decisions: deque = field(default_factory=deque)
    decision_seq: int = 0  # total decisions ever received; the view applies those above its mark
    config_events: deque = field(default_factory=lambda: deque(maxlen=50))
    dropped: int = 0
    malformed: int = 0  # events dropped or repaired because they were not what the API says
    malformed_error: str | None = None  # the latest such problem, for the banner
    # histories for the charts: (ts, value)
    backlog: dict[str, deque] = field(default_factory=dict)
    hit_rate: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    engine_hit_rate: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    ttft_ms: deque = field(default_factory=lambda: deque(maxlen=5000))  # (ts, ttft) per outcome
    #: per instance, (ts, ttft) of its recent outcomes: the instance table's TTFT columns
    ttft_by_instance: dict[str, deque] = field(default_factory=dict)
    _last_totals: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        self.decisions = deque(maxlen=self.max_decisions)

    def _malformed(self, error: str) -> None:
        self.malformed += 1
        self.malformed_error = error

    def ingest(self, kind: str, payload: Any) -> None:
        """Keep one event. One that is not shaped as docs/control-api.md says is dropped (or,
        for a state snapshot, repaired) and counted; it never raises."""
        if kind == "_malformed":
            self._malformed(str(payload.get("error")))
            return
        if kind in ("state", "decision", "outcome", "config", "dropped") and not isinstance(payload, dict):
            self._malformed(f"a {kind!r} event is a JSON {type(payload).__name__}, not an object")
            return
        if kind == "state":
            snap, problems = clean_snapshot(payload)
            if problems:
                self._malformed("state: " + "; ".join(problems[:3]) + (" ..." if len(problems) > 3 else ""))
            if snap is not None:
                self._state(snap)
        elif kind == "decision":
            ev, problems = clean_decision(payload)
            if problems:
                self._malformed("; ".join(problems))
            self.decision_seq += 1
            self.decisions.append((self.decision_seq, ev))
        elif kind == "outcome":
            ttft, ts = payload.get("ttft_ms"), payload.get("ts")
            if is_number(ttft):
                at = ts if is_number(ts) else time.time()
                self.ttft_ms.append((at, float(ttft)))
                name = payload.get("instance")
                if isinstance(name, str):
                    ring = self.ttft_by_instance.get(name)
                    if ring is None:
                        if len(self.ttft_by_instance) >= 4096:  # a fleet, not an unbounded set of names
                            return
                        ring = self.ttft_by_instance[name] = deque(maxlen=1000)
                    ring.append((at, float(ttft)))
            elif ttft is not None:
                self._malformed(f"outcome.ttft_ms is {type(ttft).__name__}")
        elif kind == "config":
            ev = dict(payload)
            for k in ("before", "after"):
                # a shadow change carries the shadow lists before and after
                if not isinstance(ev.get(k), (dict, list, type(None))):
                    self._malformed(f"config.{k} is {type(ev[k]).__name__}, not an object")
                    ev[k] = {}
            self.config_events.append(ev)
        elif kind == "dropped":
            self.dropped += sum(int(v) for v in (payload.get("decisions_sampled_out"), payload.get("overflow"))
                                if is_number(v))
        elif kind == "_status":
            was = self.connected
            self.connected = bool(payload.get("connected"))
            if self.connected:
                self.connects += 1  # the app drops what it fetched from the router on a reconnect
                self.disconnected_at = None
            elif was or self.disconnected_at is None:
                self.disconnected_at = time.time()  # since when the view is stale
            self.ever_connected = self.ever_connected or self.connected
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

    def instance_ttft(self, name: str, now: float, window_s: float = RECENT_S) -> tuple[float | None, float | None]:
        """(p50, p90) TTFT in ms of ``name``'s outcomes over the last ``window_s``; None without any."""
        ring = self.ttft_by_instance.get(name)
        if not ring:
            return None, None
        while ring and ring[0][0] < now - window_s:  # outcomes arrive in time order: drop the old
            ring.popleft()
        vals = [v for ts, v in ring if ts >= now - window_s]
        if not vals:
            return None, None
        return percentile(vals, 50), percentile(vals, 90)

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
            # The current bucket's midpoint can lie after ``now``: drawn at the edge, since a
            # series with no point inside the x range makes plotext's legend raise.
            xs.append(max(-window_s, min(0.0, b * bucket_s + bucket_s / 2 - now)))
            p50.append(percentile(vals, 50))
            p90.append(percentile(vals, 90))
        return xs, p50, p90


def doc_summary(doc: str | None) -> str:
    """A policy docstring's first paragraph as one line (its first line alone stops mid-sentence)."""
    first = (doc or "").strip().split("\n\n", 1)[0]
    return " ".join(line.strip() for line in first.splitlines())


def _knob_text(v: Any) -> str:
    return "–" if v is None else str(v)


def config_change_text(ev: dict[str, Any]) -> str:
    """One ``config`` event as the policy tab's change log says it: who changed what, with
    each changed knob's old and new value (the router sends both whole knob sets)."""
    when = time.strftime("%H:%M:%S", time.localtime(float(ev.get("ts") or 0))) if is_number(ev.get("ts")) else "--:--:--"
    kind = str(ev.get("kind") or "?")
    before = ev.get("before") if isinstance(ev.get("before"), dict) else {}
    after = ev.get("after") if isinstance(ev.get("after"), dict) else {}
    # several routers (attach URL URL ...): which one changed
    where = f"{ev['router']} " if isinstance(ev.get("router"), str) else ""
    head = f"{when} {where}{ev.get('who') or '?'}: "
    if kind in ("policy", "knobs", "run"):
        label = lambda side: f"{side.get('policy', '?')}@{side.get('version', '?')}"  # noqa: E731
        if kind == "run":
            return head + f"router started with {label(after)}"
        changes = []
        for section, prefix in (("knobs", ""), ("features", "router: ")):
            old = before.get(section) if isinstance(before.get(section), dict) else {}
            new = after.get(section) if isinstance(after.get(section), dict) else {}
            if kind == "policy" and section == "knobs":
                continue  # another policy's knobs: not a change of the same knob
            for name in sorted(set(old) | set(new)):
                if old.get(name) != new.get(name):
                    changes.append(f"{prefix}{name} {_knob_text(old.get(name))} → {_knob_text(new.get(name))}")
        if kind == "policy":
            text = f"policy {label(before)} → {label(after)} (knobs at their defaults)"
        else:
            text = f"knobs {label(before)} → {label(after)}"
        return head + text + (": " + ", ".join(changes) if changes else ": no value changed")
    if kind == "health":
        state = "healthy again" if after.get("healthy") else f"unhealthy: {after.get('reason') or '?'}"
        return head + f"{after.get('instance', '?')} {state}"
    if kind == "shadow":
        return head + shadow_change_text(ev.get("before"), ev.get("after"))
    if kind == "fleet":
        name = after.get("instance") or before.get("instance") or "?"
        if after.get("action") == "add":
            return head + f"fleet: added {name} ({after.get('url') or '?'})"
        forced = " (forced: its in-flight requests were cut off)" if after.get("force") else ""
        return head + f"fleet: {name} {before.get('state', '?')} → {after.get('state', '?')}{forced}"
    if kind == "restart":  # added by the dashboard when the run id changes under it
        return f"{when} ── the router restarted (run {after.get('run_id', '?')}, {after.get('policy', '?')}): " \
               "the changes above were the old run's"
    return head + f"{kind} {ev.get('before')!s:.60} → {ev.get('after')!s:.60}"


def _shadow_label(spec: Any) -> str:
    if isinstance(spec, str):
        return spec
    if not isinstance(spec, dict):
        return "?"
    knobs = spec.get("knobs") if isinstance(spec.get("knobs"), dict) else {}
    return str(spec.get("policy", "?")) + (" (" + ", ".join(f"{k}={v}" for k, v in sorted(knobs.items())) + ")"
                                           if knobs else "")


def shadow_change_text(before: Any, after: Any) -> str:
    """A shadow change as the change log says it: what was added and removed, or dropped and why."""
    if isinstance(after, dict) and after.get("dropped"):
        return f"shadow {after['dropped']} dropped by the router: {after.get('why') or '?'}"
    old = [_shadow_label(x) for x in before] if isinstance(before, list) else []
    new = [_shadow_label(x) for x in after] if isinstance(after, list) else []
    added = [x for x in new if x not in old]
    removed = [x for x in old if x not in new]
    parts = [f"+{x}" for x in added] + [f"-{x}" for x in removed]
    now = ", ".join(new) or "none"
    return f"shadows {' '.join(parts) or 'unchanged'} (now: {now})"


# -- decisions ---------------------------------------------------------------------------------

def decision_matches(ev: dict[str, Any], query: str) -> bool:
    """``reason:argmin instance:i0 session:abc`` fields, or bare words matched anywhere."""
    for word in query.split():
        key, sep, want = word.partition(":")
        if sep and key in ("reason", "instance", "session", "class", "policy", "router"):
            if want.lower() not in str(ev.get(key, "")).lower():
                return False
        elif not any(word.lower() in str(ev.get(k, "")).lower()
                     for k in ("reason", "instance", "session", "class", "policy", "request_id", "router")):
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
    return fmt_num(v)  # the receipt's one number format: 16,613, never 1.66e+04


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
               "est_hit%", "eng_hit%", "errors", "kv%", "gpu%", "gpu_mem"]
    rows = []
    notes = []
    for inst in snap.get("instances", []):
        v = instance_values(inst)
        util, mem, why = gpu_cells(inst.get("gpu"))
        if why:
            notes.append(f"{v['name']}: gpu – ({why})")
        state, reason = health_state(inst)
        if reason:
            notes.insert(0, f"{v['name']}: {state}: {reason}")
        rows.append([v["name"], {"up": "up", "down": "DOWN", "ejected": "EJECTED"}[state], str(v["requests"]),
                     str(v["backlog_tokens"]), fmt_secs(v["backlog_s"]), str(v["decode_requests"]),
                     str(v["decode_tokens"]), fmt_pct(v["est_hit"]), fmt_pct(v["engine_hit"]),
                     MISSING if v["errors"] is None else str(v["errors"]), fmt_pct(v["kv"]), util, mem])
    drifts = [drift_of(inst) for inst in snap.get("instances", [])]
    if any(d != (None, None) for d in drifts):  # KV events: the estimate's drift and the hits' source
        headers.append("kv_drift")
        for row, d in zip(rows, drifts):
            row.append(fmt_drift(*d))
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


# -- several routers in front of the same instances (kvtop attach URL URL ...) ------------------

#: Shown when an instance reports KV events (``instances[i].kv_events``): how far the router's
#: estimate would have been from the engine's own record, and where its hits come from now.
DRIFT_COLUMN = ("drift", "drift", 11)
#: Shown when the dashboard watches several routers: each router's share of the instance's
#: requests in flight.
SHARE_COLUMN = ("share", "in-flight share", 16)
#: The instance table's columns that appear only when the data has them, in the legend's order.
OPTIONAL_COLUMNS = [MEASURED_TPS_COLUMN, DRIFT_COLUMN, SHARE_COLUMN]
COLUMN_HELP.update({
    "drift": ("KV drift", "share of prompt tokens the router's estimate would have been off from the "
                          "engine's KV events (the highest of the routers'), then the index source: "
                          "exact (events), estimate (none), or the subscriber's state (resync, ...)"),
    "share": ("in-flight share", "each router's share of the requests in flight on the instance, "
                                 "in the order of the routers line above (r1/r2/...)"),
})

_SUMMED = ("num_requests", "pending_prefill_tokens", "backlog_s", "decode_requests", "decode_tokens",
           "ongoing_tokens", "routed_total", "input_tokens_total", "est_hit_tokens_total", "request_rate")
#: Worst first: what the drift cell says when routers disagree about an instance's index.
_SOURCE_RANK = ("disconnected", "stopped", "resync", "replaying", "waiting", "estimate", "exact")


def drift_of(inst: dict[str, Any]) -> tuple[float | None, str | None]:
    """(drift share, index source) of one instance; (None, None) without KV events."""
    kv = inst.get("kv_events")
    if not isinstance(kv, dict):
        return None, None
    drift = kv.get("drift") if isinstance(kv.get("drift"), dict) else {}
    share = drift.get("share") if is_number(drift.get("share")) else None
    state = kv.get("state") if isinstance(kv.get("state"), str) else None
    source = inst.get("index_source") if isinstance(inst.get("index_source"), str) else None
    # The subscriber's own state says more than "estimate" while it recovers (resync, replaying).
    if state and state != "exact" and state in _SOURCE_RANK:
        source = state
    return share, source or state


def fmt_drift(share: float | None, source: str | None) -> str:
    if share is None and source is None:
        return "–"
    return f"{fmt_pct(share) + '%' if share is not None else '–'} {source or '?'}"


def _add(a: Any, b: Any) -> Any:
    if is_number(a) and is_number(b):
        return a + b
    return a if is_number(a) else b


def merge_router_snapshots(snaps: list[tuple[str, dict[str, Any] | None]], selected: int = 0) -> dict[str, Any]:
    """One snapshot of several routers in front of the same instances (matched by backend URL).

    ``snaps`` is (label, cleaned snapshot or None) per router. Per instance: the load the
    routers put on it summed (in flight, backlog, decode), the estimated hit rate weighted by
    each router's input tokens, up only where every router sees it up, the engine and GPU
    as the first router reporting it saw them, the worst KV-event drift, and ``routers``:
    label -> requests in flight from that router. ``router`` is the selected router's section
    (policy, control), ``routers`` one summary per router for the header.
    """
    live = [(k, label, s) for k, (label, s) in enumerate(snaps) if s]
    merged: dict[str, dict[str, Any]] = {}
    order: list[str] = []
    pick = next((s for k, _, s in live if k == selected), live[0][2] if live else {})
    for k, label, snap in live:
        for inst in snap.get("instances", []):
            key = str(inst.get("url") or inst.get("name"))
            share = inst.get("num_requests") if is_number(inst.get("num_requests")) else 0
            m = merged.get(key)
            if m is None:
                m = merged[key] = dict(inst)
                m["routers"] = {}
                m["errors"] = dict(inst.get("errors") or {})
                order.append(key)
                m["_drift"] = [drift_of(inst)]
                m["_recent"] = [(inst.get("est_hit_rate_recent"), inst.get("input_tokens_total"))]
            else:
                for f in _SUMMED:
                    m[f] = _add(m.get(f), inst.get(f))
                errs = inst.get("errors") or {}
                m["errors"]["requests_total"] = _add(m["errors"].get("requests_total"), errs.get("requests_total"))
                if m.get("healthy") and not inst.get("healthy"):
                    m["healthy"], m["health"] = False, inst.get("health")
                for sec in ("engine", "gpu"):
                    if not m.get(sec) and inst.get(sec):
                        m[sec] = inst[sec]
                m["_drift"].append(drift_of(inst))
                m["_recent"].append((inst.get("est_hit_rate_recent"), inst.get("input_tokens_total")))
            m["routers"][label] = share
    instances = []
    for key in order:
        m = merged[key]
        inp, hit = m.get("input_tokens_total"), m.get("est_hit_tokens_total")
        m["est_hit_rate"] = hit / inp if is_number(inp) and inp and is_number(hit) else None
        rec = [(r, w if is_number(w) and w > 0 else 1.0) for r, w in m.pop("_recent") if is_number(r)]
        m["est_hit_rate_recent"] = sum(r * w for r, w in rec) / sum(w for _, w in rec) if rec else None
        drifts = m.pop("_drift")
        shares = [s for s, _ in drifts if s is not None]
        sources = [src for _, src in drifts if src is not None]
        if shares or sources:
            worst = min(sources, key=lambda s: _SOURCE_RANK.index(s) if s in _SOURCE_RANK else 0) if sources else None
            m["kv_events"] = {"state": worst, "drift": {"share": max(shares) if shares else None}}
            m["index_source"] = worst
        for label, _ in snaps:
            m["routers"].setdefault(label, 0)
        instances.append(m)
    totals: dict[str, Any] = {}
    for _, _, snap in live:
        for f, v in (snap.get("totals") or {}).items():
            if is_number(v):
                totals[f] = _add(totals.get(f), v)
    inp, hit = totals.get("input_tokens_total"), totals.get("est_hit_tokens_total")
    totals["est_hit_rate"] = hit / inp if is_number(inp) and inp and is_number(hit) else None
    totals["healthy_instances"] = sum(1 for i in instances if i.get("healthy"))
    affinity: dict[str, Any] = {"per_instance": {}}
    counts: dict[str, dict[str, Any]] = {"decisions_by_reason": {}, "outcomes_by_status": {}}
    for _, _, snap in live:
        aff = snap.get("affinity") or {}
        for f in ("sessions", "moved_sessions", "moves"):
            if is_number(aff.get(f)):
                affinity[f] = affinity.get(f, 0) + aff[f]
        for name, n in (aff.get("per_instance") or {}).items():
            affinity["per_instance"][name] = affinity["per_instance"].get(name, 0) + n
        for sec, acc in counts.items():
            for name, n in (snap.get(sec) or {}).items():
                acc[name] = acc.get(name, 0) + n
    summaries = []
    for k, (label, snap) in enumerate(snaps):
        r = (snap or {}).get("router") or {}
        tot = (snap or {}).get("totals") or {}
        summaries.append({"label": label, "url": r.get("url"), "policy": r.get("policy"),
                          "request_rate": tot.get("request_rate"), "in_flight": tot.get("in_flight"),
                          "healthy_instances": tot.get("healthy_instances"),
                          "instances": len((snap or {}).get("instances", [])), "readonly": r.get("readonly"),
                          "draining": r.get("draining"), "selected": k == selected, "seen": snap is not None,
                          "replicas": replica_view(snap)})
    out = dict(pick)
    out.update({"ts": max((float(s.get("ts") or 0) for _, _, s in live), default=0.0) or None,
                "instances": instances, "totals": totals, "affinity": affinity, "routers": summaries, **counts})
    return out


# -- the header: one line, whatever the width -------------------------------------------------

def fit_segments(segments: list[tuple[str, str, int]], width: int) -> list[tuple[str, str]]:
    """The header's fields that fit on one line of ``width`` cells, in their order.

    ``segments`` is (text, style, priority); the lowest priority goes first until the rest fit
    (ties: the rightmost goes first). A field that alone is wider than the line is cut with an
    ellipsis, so the line never wraps and the screen below it never moves.
    """
    keep = list(range(len(segments)))

    def total(ix: list[int]) -> int:
        return sum(len(segments[i][0]) for i in ix)

    while keep and total(keep) > width:
        drop = min(keep, key=lambda i: (segments[i][2], -i))
        if len(keep) == 1:
            break
        keep.remove(drop)
    out = [(segments[i][0], segments[i][1]) for i in keep]
    used = sum(len(t) for t, _ in out)
    if out and used > width:  # one field wider than the line
        text, style = out[-1]
        room = max(1, width - (used - len(text)))
        out[-1] = (text[:room - 1] + "…", style)
    return out


def health_line(snap: dict[str, Any]) -> str:
    """The fleet's health in one line (the overview keeps it whatever the size or fleet)."""
    tot = snap.get("totals") or {}
    insts = snap.get("instances") or []
    states = [fleet_state(i) for i in insts]
    insts = [i for i, s in zip(insts, states) if s != "removed"]  # out of the fleet: neither up nor down
    n = len(insts)
    down = [health_state(i)[0] for i in insts if not i.get("healthy")]
    parts = [f"{tot.get('healthy_instances', n - len(down)) if is_number(tot.get('healthy_instances')) else n - len(down)}"
             f"/{n} up"]
    if down.count("down"):
        parts.append(f"✖ {down.count('down')} down")
    if down.count("ejected"):
        parts.append(f"⏏ {down.count('ejected')} ejected")
    for state, mark in (("cordoned", "⊘"), ("draining", "⇣"), ("removed", "✕")):
        if states.count(state):
            parts.append(f"{mark} {states.count(state)} {state}")
    parts.append(f"in flight {fmt_int(tot.get('in_flight'))}")
    parts.append(f"backlog {fmt_int(tot.get('pending_prefill_tokens'))} tok {fmt_secs(tot.get('backlog_s'))} s")
    parts.append(f"decode {fmt_int(tot.get('decode_requests'))}")
    hit = tot.get("est_hit_rate")
    parts.append(f"est hit {fmt_pct(hit)}%" if is_number(hit) else "est hit –")
    parts.append(f"errors {fmt_int(tot.get('errors_total'))}")
    parts.append(f"routed {fmt_int(tot.get('routed_total'))}")
    return " · ".join(parts)


def degraded_tasks(snap: dict[str, Any]) -> list[str]:
    """``state.degraded``: the router's background tasks that died (absent: none), as names."""
    out = []
    for d in snap.get("degraded") or [] if isinstance(snap.get("degraded"), list) else []:
        if isinstance(d, str):
            out.append(d)
        elif isinstance(d, dict):
            name = d.get("task") or d.get("name") or d.get("component") or "?"
            out.append(str(name))
    return out


def replica_view(snap: dict[str, Any] | None) -> str | None:
    """``state.replicas`` (router replicas, docs/replicas.md) in a few words: the view the router
    prices with and its peers fresh, the lost ones named; None for a router without replicas."""
    rep = (snap or {}).get("replicas")
    if not isinstance(rep, dict):
        return None
    peers = [p for p in rep.get("peers") or [] if isinstance(p, dict)] if isinstance(rep.get("peers"), list) else []
    fresh = sum(1 for p in peers if p.get("fresh") is True)
    lost = [str(p.get("endpoint")) for p in peers if p.get("fresh") is not True]
    text = (f"shared view {fresh}/{len(peers)} peers fresh" if rep.get("mode") == "shared"
            else f"OWN VIEW {fresh}/{len(peers)} peers fresh")
    return text + (f" (lost: {', '.join(lost)})" if lost else "")
