"""Make experiment streams from normalized traces: interleave sessions (build), cap turns (cap).

``build_stream`` picks whole sessions (a session travels with its sub-agents) in a seeded
order, gives each a start time, keeps its internal gaps, and renames hash ids so that ids
from different inputs (or repeated copies of a session) never collide. Pure: no I/O.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvtop.traces.loader import TraceRequest

DEFAULT_WINDOW_S = 300.0


@dataclass
class _Group:
    """A root session and its sub-agent sessions, from one input."""

    input_index: int
    root: str
    requests: list[TraceRequest] = field(default_factory=list)

    @property
    def root_turns(self) -> int:
        return sum(1 for r in self.requests if r.session == self.root)


def _groups(inputs: Sequence[Sequence[TraceRequest]]) -> list[_Group]:
    out: list[_Group] = []
    for i, reqs in enumerate(inputs):
        by_root: dict[str, _Group] = {}
        for r in reqs:
            root = r.parent or r.session
            g = by_root.get(root)
            if g is None:
                g = by_root[root] = _Group(i, root)
                out.append(g)
            g.requests.append(r)
    return out


def _compress_gaps(reqs: list[TraceRequest], max_gap: float | None) -> list[float]:
    """Arrivals relative to the group's first, with every idle gap clamped to ``max_gap``."""
    order = sorted(range(len(reqs)), key=lambda k: reqs[k].arrival)
    rel = [0.0] * len(reqs)
    t0 = reqs[order[0]].arrival
    prev_orig, cur = t0, 0.0
    for k in order:
        gap = reqs[k].arrival - prev_orig
        if max_gap is not None:
            gap = min(gap, max_gap)
        cur += gap
        prev_orig = reqs[k].arrival
        rel[k] = cur
    return rel


@dataclass
class BuildResult:
    requests: list[TraceRequest]
    header: dict[str, Any]


def build_stream(inputs: Sequence[Sequence[TraceRequest]], *, sessions: int | None = None,
                 rate: float | None = None, window: float | None = None,
                 stagger: float | None = None, seed: int = 0,
                 shared_prefix_tokens: int = 0, max_gap: float | None = None,
                 min_turns: int = 1, duration: float | None = None,
                 isolate_sessions: bool = False, keep_times: bool = False,
                 input_names: Sequence[str] = ()) -> BuildResult:
    """Interleave the sessions of ``inputs`` into one stream sorted by arrival.

    * Sessions are taken in a seeded random order (``seed``); with ``sessions=N`` the first N
      (cycling with fresh id namespaces when N exceeds what there is); with ``rate=R`` as many
      as it takes for the requests arriving inside the window to reach R per second; else all.
    * Start times: ``stagger=S`` puts session k at k*S; otherwise each start is uniform in
      [0, window) (default 300 s), drawn from the same seeded generator.
    * ``keep_times`` keeps every session's own start instead (to merge streams built already).
    * A session keeps its internal gaps (``max_gap`` clamps each idle gap, compressing hours
      of think time, and each ``think_time`` too, which closed-loop replay and simulation
      wait instead of the gap); ``duration`` drops requests arriving after it.
    * Ids are renumbered densely per (input, copy) namespace - or per session with
      ``isolate_sessions`` - so only genuinely shared blocks keep equal ids.
    * ``shared_prefix_tokens=T`` maps each session's first floor(T / block_size) blocks (as
      its first request has them) to one shared id set per block size: the assumption that all
      sessions share one system prompt and tool schema.
    * Turns are renumbered 1.. per session by arrival.
    """
    if sessions is not None and rate is not None:
        raise ValueError("give at most one of sessions and rate")
    if stagger is not None and window is not None:
        raise ValueError("give at most one of stagger and window")
    if rate is not None and stagger is not None:
        raise ValueError("rate needs a window, not a stagger")
    if keep_times and (window is not None or stagger is not None or rate is not None):
        raise ValueError("keep_times excludes window, stagger and rate")
    if window is None and stagger is None and not keep_times:
        window = DEFAULT_WINDOW_S
    groups = [g for g in _groups(inputs) if g.root_turns >= min_turns]
    if not groups:
        raise ValueError("no sessions to build from")
    rng = random.Random(seed)
    order = list(range(len(groups)))
    rng.shuffle(order)

    # Names: keep session ids unless two inputs use the same one.
    names_per_input: dict[str, set[int]] = {}
    for g in groups:
        for r in g.requests:
            names_per_input.setdefault(r.session, set()).add(g.input_index)
    clash = any(len(v) > 1 for v in names_per_input.values())

    ids: dict[tuple, int] = {}

    def new_id(key: tuple) -> int:
        got = ids.get(key)
        if got is None:
            got = ids[key] = len(ids)
        return got

    def session_name(g: _Group, name: str, copy: int) -> str:
        if clash:
            name = f"in{g.input_index}/{name}"
        return f"{name}~{copy}" if copy else name

    out: list[TraceRequest] = []
    picked = 0
    in_window = 0
    limit = sessions if sessions is not None else (None if rate is not None else len(groups))
    while True:
        if limit is not None and picked >= limit:
            break
        if rate is not None:
            if in_window / window >= rate:
                break
            if picked >= 100 * len(groups):
                raise ValueError(f"rate {rate} not reachable: {in_window / window:.2f} req/s "
                                 f"after {picked} sessions")
        g = groups[order[picked % len(groups)]]
        copy = picked // len(groups)
        if keep_times:
            start = min(r.arrival for r in g.requests)
        elif stagger is not None:
            start = picked * stagger
        else:
            start = rng.uniform(0.0, window)
        picked += 1
        rel = _compress_gaps(g.requests, max_gap)
        # Per-session shared-prefix maps, from each session's first request.
        shared: dict[str, dict[int, tuple]] = {}
        if shared_prefix_tokens > 0:
            for r, t in sorted(zip(g.requests, rel), key=lambda x: x[1]):
                if r.session not in shared:
                    k = shared_prefix_tokens // r.block_size
                    shared[r.session] = {h: ("shared", r.block_size, pos)
                                         for pos, h in enumerate(r.hash_ids[:k])}
        ns = ("s", g.input_index, g.root, copy) if isolate_sessions else ("f", g.input_index, copy)
        for r, t in zip(g.requests, rel):
            arrival = start + t
            if duration is not None and arrival > duration:
                continue
            smap = shared.get(r.session, {})
            think = r.think_time
            if max_gap is not None and think is not None and think > max_gap:
                think = max_gap
            out.append(replace(
                r, arrival=arrival, think_time=think, session=session_name(g, r.session, copy),
                parent=session_name(g, r.parent, copy) if r.parent else None,
                hash_ids=[new_id(smap[h]) if h in smap else new_id(ns + (h,))
                          for h in r.hash_ids]))
            if window is not None and arrival < window:
                in_window += 1
    out.sort(key=lambda r: r.arrival)
    turns: dict[str, int] = {}
    for r in out:
        r.turn = turns.get(r.session, 0) + 1
        turns[r.session] = r.turn
    header: dict[str, Any] = {
        "built_by": "kvtop trace build",
        "inputs": list(input_names),
        "seed": seed,
        "sessions_picked": picked,
        "start_times": ("kept from the inputs" if keep_times
                        else f"k * {stagger} s" if stagger is not None
                        else f"uniform in [0, {window}) s"),
        "max_gap_s": max_gap,
        "duration_s": duration,
        "id_namespace": "per session" if isolate_sessions else "per input file and copy",
        "shared_prefix_tokens": shared_prefix_tokens,
    }
    if shared_prefix_tokens:
        header["assumption"] = (
            f"each session's first floor({shared_prefix_tokens} / block_size) blocks are "
            "remapped to one shared id set: all sessions are assumed to share one system "
            "prompt and tool schema, which the source data does not show")
    return BuildResult(out, header)


def cap_turns(requests: Sequence[TraceRequest], max_turns: int) -> list[TraceRequest]:
    """Each session cut to its first ``max_turns`` turns (by arrival): the ``capped`` control.

    A sub-agent session is cut the same way and kept only if it started before its parent's
    first dropped turn (it was spawned from a kept turn).
    """
    if max_turns < 1:
        raise ValueError("max_turns must be >= 1")
    by_session: dict[str, list[TraceRequest]] = {}
    for r in sorted(requests, key=lambda r: r.arrival):
        by_session.setdefault(r.session, []).append(r)
    cut_at: dict[str, float] = {}  # session -> arrival of its first dropped turn
    for name, reqs in by_session.items():
        cut_at[name] = reqs[max_turns].arrival if len(reqs) > max_turns else math.inf
    keep: list[TraceRequest] = []
    for name, reqs in by_session.items():
        parent = reqs[0].parent
        if parent is not None and parent in cut_at and reqs[0].arrival >= cut_at[parent]:
            continue
        keep.extend(reqs[:max_turns])
    keep.sort(key=lambda r: r.arrival)
    return keep
