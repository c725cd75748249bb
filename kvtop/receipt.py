"""A decision's receipt: why one request went where it did, as the dashboard and
``kvtop log why`` both show it.

The same decision reaches us in two shapes: the router's event (``session``, ``class``,
``est_hit``; docs/control-api.md) and the decision log's row (``session_id``,
``route_class``, ``est_hit_tokens``; docs/decision-log.md). ``from_row`` turns a row into the
event shape, and everything else here reads that one shape. One number format throughout:
integers with thousands separators, never exponent notation, one precision per column of
the candidates table; times as local wall clock plus milliseconds from the router's receipt
of the request.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from router.policies.base import REASONS

#: Per-request times the router records (Unix seconds), in the order they happen.
TIMELINE = (("t_proxy_recv", "received"), ("ts", "decided"), ("t_prefill_sent", "prefill sent"),
            ("t_prefill_done", "prefill done"), ("t_first_token", "first token"), ("t_done", "done"))
#: Event fields the receipt's head shows; anything else the event carries is listed after it.
SHOWN = frozenset({"ts", "request_id", "attempt", "session", "turn", "class", "input_tokens", "instance",
                   "reason", "policy", "est_hit", "best_hit", "best_hit_instance", "new_prefill",
                   "decision_us", "terms", "index_source", "migrated_from", "run_id", "token_source",
                   "session_source", "instance_index", "blocks", "blocks_parent", "id", "shadow",
                   "estimate_hit"}
                  | {k for k, _ in TIMELINE})
# Decision-log column -> event field, where they differ.
_ROW_NAMES = {"session_id": "session", "route_class": "class", "est_hit_tokens": "est_hit",
              "best_hit_tokens": "best_hit", "new_prefill_tokens": "new_prefill", "scores": "terms",
              "shadows": "shadow", "estimate_hit_tokens": "estimate_hit"}


def fmt_num(v: Any) -> str:
    """One format for every number on a receipt: ``11,776``, ``16,600``, ``0.0523``, ``1.25``.

    Integers (and integral floats) get thousands separators; other floats keep about four
    significant digits without exponent notation. None is ``–``; text passes through.
    """
    if v is None:
        return "–"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if v.is_integer() and abs(v) < 1e18:
            return f"{int(v):,}"
        a = abs(v)
        if a >= 1000:
            return f"{v:,.0f}"
        if a >= 100:
            return f"{v:.1f}"
        if a >= 1:
            return f"{v:.2f}"
        if a >= 0.001:
            return f"{v:.4f}"
        return f"{v:.7f}".rstrip("0")
    return f"{v:,}"


def _is_whole(v: Any) -> bool:
    return isinstance(v, int) or (isinstance(v, float) and math.isfinite(v) and v.is_integer() and abs(v) < 1e18)


def column_decimals(values: list[Any]) -> int | None:
    """The one precision for a column of a receipt: None when every number in it is whole
    (``fmt_num``'s integers), else the decimals that give its smallest non-zero magnitude three
    significant digits (0 to 6), so ``0.341``, ``1.365`` and ``12.500`` line up in one column
    instead of ``0.3412``, ``1.36`` and ``12.50``."""
    nums = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    if all(_is_whole(v) for v in nums):
        return None
    smallest = min((abs(v) for v in nums if v), default=1.0)
    return max(0, min(6, 2 - math.floor(math.log10(smallest))))


def fmt_in_column(v: Any, decimals: int | None) -> str:
    """``v`` in its column's precision (``column_decimals``); text and None as ``fmt_num``."""
    if decimals is None or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return fmt_num(v)
    return f"{v:,.{decimals}f}"


def fmt_clock(ts: Any, *, millis: bool = True) -> str:
    """Local wall-clock time of a Unix timestamp: ``14:03:05.123``."""
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts) or ts <= 0:
        return "–"
    text = time.strftime("%H:%M:%S", time.localtime(ts))
    return f"{text}.{int(ts % 1 * 1000):03d}" if millis else text


def fmt_ms(ms: Any) -> str:
    """A duration in milliseconds: ``0.8 ms``, ``315.4 ms``, ``12,345 ms``."""
    if not isinstance(ms, (int, float)) or isinstance(ms, bool) or not math.isfinite(ms):
        return "–"
    return f"{ms:,.1f} ms" if abs(ms) < 10_000 else f"{ms:,.0f} ms"


def fmt_us(us: Any) -> str:
    """A short duration in microseconds, in the timeline's precision: ``41.5 µs``."""
    if not isinstance(us, (int, float)) or isinstance(us, bool) or not math.isfinite(us):
        return "–"
    return f"{us:,.1f} µs"


def from_row(row: dict[str, Any], outcome: dict[str, Any] | None = None) -> dict[str, Any]:
    """A decision-log row (and its outcome's times) in the router's event shape."""
    ev = {_ROW_NAMES.get(k, k): v for k, v in row.items()}
    ev["policy"] = f"{row.get('policy')}@{row.get('policy_version')}"
    ev.pop("policy_version", None)
    if outcome:
        for k in ("t_first_token", "t_done"):
            if outcome.get(k) is not None:
                ev[k] = outcome[k]
    return ev


def reason_text(reason: Any) -> str:
    """The reason code and what it means (router/policies/base.py's closed vocabulary)."""
    meaning = REASONS.get(str(reason))
    return f"{reason} ({meaning})" if meaning else str(reason)


def timeline(ev: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(label, local time, ms after the router received the request) for each recorded time."""
    times = [(label, ev.get(key)) for key, label in TIMELINE]
    times = [(label, t) for label, t in times
             if isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0]
    if not times:
        return []
    t0 = times[0][1]
    return [(label, fmt_clock(t), "+" + fmt_ms((t - t0) * 1000) if n else "") for n, (label, t) in enumerate(times)]


def timeline_line(ev: dict[str, Any]) -> str:
    """The timeline on one line: ``received 14:03:05.123 · decided +0.8 ms · ...``."""
    parts = timeline(ev)
    if not parts:
        return ""
    first = f"{parts[0][0]} {parts[0][1]}"
    return " · ".join([first] + [f"{label} {rel}" for label, _, rel in parts[1:]])


def candidates(terms: Any, chosen: Any) -> tuple[list[str], list[tuple[bool, list[str]]]]:
    """Column names and one row per candidate (is it the chosen one, its cells), every
    term of every candidate in its column's one precision (``column_decimals``), in the order
    the policy listed them."""
    rows = [t for t in terms if isinstance(t, dict)] if isinstance(terms, list) else []
    cols: list[str] = []
    for t in rows:
        for k in t:
            if k not in cols:
                cols.append(k)
    if "instance" in cols:
        cols.remove("instance")
        cols.insert(0, "instance")
    decimals = {c: column_decimals([t.get(c) for t in rows]) for c in cols}
    return cols, [(t.get("instance") == chosen, [fmt_in_column(t.get(c), decimals[c]) for c in cols]) for t in rows]


#: How the input was counted (a decision's token_source), in words.
TOKEN_SOURCES = {"tokens": "sent as token ids", "tokenizer": "counted by the model's tokenizer",
                 "text_approx": "estimated from the text"}


def head_lines(ev: dict[str, Any]) -> list[str]:
    """The receipt's head as plain lines: request, session, the pick and its reason, hits."""
    lines = [f"request {ev.get('request_id', '?')}  attempt {ev.get('attempt', '?')}  policy {ev.get('policy', '?')}"
             + (f"  run {ev['run_id']}" if ev.get("run_id") else ""),
             f"session {ev.get('session', '?')}  turn {ev.get('turn', '?')}  class {ev.get('class', '?')}  "
             f"input {fmt_num(ev.get('input_tokens'))} tok"
             + (f" ({TOKEN_SOURCES.get(ev['token_source'], ev['token_source'])})" if ev.get("token_source") else ""),
             f"→ {ev.get('instance', '?')}  reason {reason_text(ev.get('reason', '?'))}",
             f"est hit {fmt_num(ev.get('est_hit'))} tok ({source_text(ev)})  "
             f"best {fmt_num(ev.get('best_hit'))} on {ev.get('best_hit_instance') or '–'}  "
             f"new prefill {fmt_num(ev.get('new_prefill'))}  policy ran {fmt_us(ev.get('decision_us'))}"]
    if ev.get("migrated_from"):
        lines.append(f"migrated from {ev['migrated_from']}")
    shadow = shadow_text(ev.get("shadow"))
    if shadow:
        lines.append(shadow)
    extra = extras(ev)
    if extra:
        lines.append("  ".join(f"{k} {v}" for k, v in extra))
    when = timeline_line(ev)
    if when:
        lines.append(when)
    return lines


def shadow_text(picks: Any) -> str:
    """The shadow policies' picks on one decision (router/shadow.py), one line; '' for none."""
    if isinstance(picks, str):
        try:
            picks = json.loads(picks)
        except ValueError:
            return ""
    if not isinstance(picks, list):
        return ""
    parts = []
    for p in picks:
        if not isinstance(p, dict) or not p.get("policy"):
            continue
        saved = p.get("saved")
        est = "" if not isinstance(saved, (int, float)) or not saved else \
            f", est. prefill {'saved' if saved > 0 else 'added'} {fmt_num(abs(saved))} tok"
        parts.append(f"{p['policy']} → {p.get('instance', '?')} ({p.get('reason', '?')}{est})")
    return ("shadows: " + "; ".join(parts)) if parts else ""


def source_text(ev: dict[str, Any]) -> str:
    """Where the chosen hit came from; beside an exact one (KV events), what the router's own
    estimate said."""
    source = ev.get("index_source") or "estimate"
    if source == "exact" and ev.get("estimate_hit") is not None:
        return f"exact; the estimate said {fmt_num(ev['estimate_hit'])}"
    return source


def extras(ev: dict[str, Any]) -> list[tuple[str, str]]:
    """Fields beyond the head (offload, admission), formatted; empty and zero ones left out."""
    out = []
    for k, v in ev.items():
        if k in SHOWN or v in (None, "", 0, 0.0) or isinstance(v, (dict, list)):
            continue
        out.append((k, fmt_ms(v) if k.endswith("_ms") else fmt_num(v)))
    return out


def render_text(ev: dict[str, Any], outcome: dict[str, Any] | None = None) -> str:
    """The whole receipt as plain text (``kvtop log why``): head, candidates table, outcome."""
    lines = head_lines(ev)
    cols, rows = candidates(ev.get("terms"), ev.get("instance"))
    if rows:
        widths = [max([len(c)] + [len(cells[i]) for _, cells in rows]) for i, c in enumerate(cols)]

        def line(mark: str, cells: list[str]) -> str:
            return (mark + "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                     for i, (c, w) in enumerate(zip(cells, widths)))).rstrip()

        lines += ["", f"candidates ({len(rows)}; ▶ chosen)", line("  ", cols)]
        lines += [line("▶ " if chosen else "  ", cells) for chosen, cells in rows]
    else:
        lines += ["", "candidates: none recorded"]
    lines.append("")
    if outcome is None:
        lines.append("outcome: none recorded (still running, or the router stopped first)")
    else:
        parts = [f"outcome {outcome.get('status', '?')}"]
        if outcome.get("http_status") not in (None, 200):
            parts.append(f"HTTP {outcome['http_status']}")
        for key, label in (("ttft_ms", "TTFT"), ("e2e_ms", "E2E"), ("tpot_ms", "TPOT")):
            if outcome.get(key) is not None:
                parts.append(f"{label} {fmt_ms(outcome[key])}")
        if outcome.get("output_tokens") is not None:
            parts.append(f"output {fmt_num(outcome['output_tokens'])} tok")
        if outcome.get("delivered_hit_tokens") is not None:
            parts.append(f"engine cached {fmt_num(outcome['delivered_hit_tokens'])} tok")
        lines.append("  ".join(parts))
        if outcome.get("error"):
            lines.append(f"error: {outcome['error']}")
    return "\n".join(lines)
