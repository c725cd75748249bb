"""Derive session ids from chained prefix-block ids, for traces that have none (Mooncake).

Request B continues request A's conversation when B's ``hash_ids`` begin with A's. A trie of
chain keys remembers, per node, the most recent request that passed through it and the
sessions that did; each new request links to the most recent request at its deepest matched
node when either rule of the traces README holds (see ``derive_sessions``). Pure: no I/O.
Measured against the WEKA Claude Code files' true sessions in tests/test_traces.py and
docs/traces.md.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

#: Chain key of the empty prefix.
_ROOT = 0


@dataclass(frozen=True, slots=True)
class Link:
    """Where one request landed: its session (index of the session's first request),
    its 1-based turn, and the request it continues (None for a first turn)."""

    session: int
    turn: int
    parent: int | None
    depth: int  # matched prefix blocks with ``parent`` (0 for a first turn)


def derive_sessions(hash_ids: Sequence[Sequence[int]], block_size: int, *,
                    min_ratio: float = 0.5, hub_min_tokens: int = 8192,
                    hub_max_sessions: int = 2) -> list[Link]:
    """Link each request (given in arrival order) to the session it most likely continues.

    Request ``i`` walks its chain keys to the deepest node ``d`` already seen and takes the
    most recent request ``p`` there. It joins ``p``'s session as the next turn when
      * ``d >= max(2, ceil(min_ratio * (len(p) - 1)))`` - it extends most of ``p``'s context; or
      * ``d * block_size >= hub_min_tokens`` and at most ``hub_max_sessions`` sessions have
        passed through that node - a long private prefix, which recovers turns after a
        compaction or edit while refusing hub prefixes (system prompts, tool schemas).
    Otherwise it starts a new session. The turn is one more than the session's turns so far.
    """
    # node key -> [most recent request index, set of sessions through it (capped)]
    nodes: dict[Hashable, list] = {}
    links: list[Link] = []
    session_turns: dict[int, int] = {}
    cap = hub_max_sessions + 1
    for i, ids in enumerate(hash_ids):
        key: Hashable = _ROOT
        depth = 0
        node = None
        for h in ids:
            nxt = hash((key, h))
            got = nodes.get(nxt)
            if got is None:
                break
            key, node, depth = nxt, got, depth + 1
        parent: int | None = None
        if node is not None:
            p = node[0]
            p_len = len(hash_ids[p])
            need = max(2, math.ceil(min_ratio * (p_len - 1)))
            if depth >= need or (depth * block_size >= hub_min_tokens
                                 and len(node[1]) <= hub_max_sessions):
                parent = p
        if parent is None:
            session = i
            turn = 1
            depth = 0
        else:
            session = links[parent].session
            turn = session_turns[session] + 1
        session_turns[session] = turn
        links.append(Link(session, turn, parent, depth))
        # Record this request along its whole chain.
        key = _ROOT
        for h in ids:
            key = hash((key, h))
            got = nodes.get(key)
            if got is None:
                nodes[key] = [i, {session}]
            else:
                got[0] = i
                if len(got[1]) < cap:
                    got[1].add(session)
    return links


@dataclass(frozen=True, slots=True)
class DerivationScore:
    """How derived sessions compare with true ones."""

    requests: int
    true_sessions: int
    derived_sessions: int
    purity: float       # share of requests in their derived session's majority true session
    split_rate: float   # share of true sessions spread over more than one derived session


def score_derivation(truth: Sequence[Hashable], derived: Sequence[Hashable]) -> DerivationScore:
    """Purity and split rate of ``derived`` session labels against ``truth`` (same order)."""
    if len(truth) != len(derived):
        raise ValueError("truth and derived must have the same length")
    by_derived: dict[Hashable, dict[Hashable, int]] = {}
    by_true: dict[Hashable, set] = {}
    for t, d in zip(truth, derived):
        counts = by_derived.setdefault(d, {})
        counts[t] = counts.get(t, 0) + 1
        by_true.setdefault(t, set()).add(d)
    n = len(truth)
    majority = sum(max(c.values()) for c in by_derived.values())
    split = sum(1 for ds in by_true.values() if len(ds) > 1)
    return DerivationScore(
        requests=n,
        true_sessions=len(by_true),
        derived_sessions=len(by_derived),
        purity=majority / n if n else 1.0,
        split_rate=split / len(by_true) if by_true else 0.0,
    )
