"""Program-level priority: the router sets vLLM's per-request ``priority`` field.

vLLM started with ``--scheduling-policy priority`` orders its waiting queue by each request's
``priority`` (lower first), then arrival, and when a running request needs blocks it
preempts the running request of the largest ``(priority, arrival)``. The router is the one
place that knows a request's session, so it can make an agent's later turns overtake new
sessions' first turns (program-level first-come-first-served, as Continuum, arXiv 2511.02230,
argues for multi-turn agents). The ``priority`` router feature (router/features.py):

``off``           the router sets nothing (the default)
``session_fcfs``  the session's rank in the order sessions first reached the router (0, 1, 2,
                  ...): every turn of an earlier session goes before any turn of a later one
                  waiting on the same instance
``cost``          the request's new prefill tokens on the instance it was routed to, in
                  ``COST_BUCKET_TOKENS`` units: cheap requests (returning turns that hit
                  their cache) first, arrival order within a bucket. Shortest-prefill-first
                  can keep a long prompt waiting while cheaper ones keep arriving.

A client's own ``priority`` is left alone: the router then sets nothing, and the decision row
records NULL. The value set is the decision's ``priority`` column (store/schema.py).

Every backend must run with ``--scheduling-policy priority``: vLLM under ``fcfs`` refuses a
nonzero priority with a 400 ("Got priority N but Priority scheduling is not enabled."), so
with the feature on against such a fleet every request but the first session's fails.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from router.body import Chunks, as_bytes

PRIORITY_MODES = ("off", "session_fcfs", "cost")
#: ``cost``: new prefill tokens per priority step.
COST_BUCKET_TOKENS = 1024
#: Sessions whose rank is remembered; beyond it the longest-unseen session is forgotten (it
#: comes back, if ever, as a new session: last in line).
MAX_SESSIONS = 1_000_000


class SessionOrder:
    """Each session's rank in the order sessions first asked for a decision."""

    def __init__(self, max_sessions: int = MAX_SESSIONS):
        self._rank: OrderedDict[str, int] = OrderedDict()
        self._next = 0
        self.max_sessions = max_sessions

    def rank(self, session_id: str) -> int:
        r = self._rank.get(session_id)
        if r is None:
            r = self._rank[session_id] = self._next
            self._next += 1
            if len(self._rank) > self.max_sessions:
                self._rank.popitem(last=False)
        else:
            self._rank.move_to_end(session_id)
        return r


def priority_for(mode: str, decision: Any, order: SessionOrder) -> int | None:
    """The priority ``mode`` gives a routed decision; None for ``off``."""
    if mode == "session_fcfs":
        return order.rank(decision.request.session_id)
    if mode == "cost":
        return max(0, decision.new_prefill_tokens) // COST_BUCKET_TOKENS
    return None


def client_priority(raw: bytes | Chunks, body: Any) -> bool:
    """Did the client set ``priority`` itself (a top-level key of its JSON body)?"""
    if isinstance(body, dict):
        return "priority" in body
    data = as_bytes(raw)
    if b'"priority"' not in data:   # the common case: no such word anywhere, no parse
        return False
    try:
        parsed = json.loads(data)
    except ValueError:
        return False
    return isinstance(parsed, dict) and "priority" in parsed


def with_priority(raw: bytes | Chunks, body: Any, priority: int) -> tuple[bytes, Any]:
    """The body with ``"priority": N`` as its first key: the raw bytes spliced (no re-encoding
    of a prompt of megabytes) and, when the router holds the parsed body, a shallow copy of it
    with the key (the offload legs re-encode that one)."""
    data = as_bytes(raw)
    i = data.find(b"{")
    if i < 0 or data[:i].strip():
        raise ValueError("the body is not a JSON object")
    rest = data[i + 1:]
    sep = b"" if rest.lstrip().startswith(b"}") else b","
    spliced = b"".join((data[:i + 1], b'"priority":', str(int(priority)).encode(), sep, rest))
    return spliced, ({**body, "priority": priority} if isinstance(body, dict) else body)


def apply(decision: Any, raw: bytes | Chunks, body: Any) -> tuple[bytes | Chunks, Any]:
    """What goes upstream for a routed request: with the router's priority (the decision's
    ``priority``, set by the pipeline) unless the client set its own; then the decision records
    None. Unchanged when the feature is off."""
    if decision.extra.get("priority") is None:
        return raw, body
    if client_priority(raw, body):
        decision.extra["priority"] = None
        return raw, body
    return with_priority(raw, body, decision.extra["priority"])
