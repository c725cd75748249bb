"""Router replicas share their session records, so each prices a session's turn as one router would.

router/replicas.py shares each replica's in-flight load. What ``expected_cost`` reads beyond
the load comes from the cluster's session records (router/lookahead.py ``SessionInfo``): the
session's bound instance and turn (stickiness, ``p_next``), and, per instance, the other
sessions bound there with their turns, gaps, last context and whether a request of theirs is
in flight (``queue_s``, ``keep_s`` and ``evict_s``'s odds of return; the fleet's mean gap).
A replica that sees only its own requests holds only its own sessions' records, and only its
own turns of them when clients are spread per request.

Here each replica publishes, on its replica PUB socket and as a second message kind, the
facts that build those records, as its own requests make them:

- ``["b", session, url, name, input_tokens, est_hit, new_turn, age_s, arrival_age_s]``: a
  request of the session was dispatched to the instance (``Cluster.bind_session``);
- ``["d", session, age_s]``: one of its requests ended (``Cluster.session_done``);
- ``["a", session, input_tokens]``: its last request was counted again (``Cluster.amend``);
- ``["l", [[session, n], ...], gen, part, parts]``: every ``RECONCILE_S``, the sessions with
  requests of this replica in flight, as of when part 0 was made, in ``parts`` parts of at
  most ``RECONCILE_PART`` sessions, one part a message: a peer that missed a ``d`` (a message
  lost at a full queue) ends what it still holds of this replica's and the list does not,
  once every part of the generation arrived in order. A request dispatched after part 0
  (its ``b`` arrives after it) is not in the list: the peer counts those and never ends them
  for it. (A two-element ``["l", list]`` is one part.)

Times travel as ages (seconds before the message was sent), never wall clock: the receiver
places each fact on its own clock. A peer applies them to its own cluster's session table
(``bind_session`` / ``session_done`` / ``amend_session``): the same records, the same bound
(``--max-sessions``: past it the least recently active is forgotten) and the same ageing out
of the lookahead. The peer's own books (tickets, instance counters, the counters-at-zero
invariant) are never touched. What a peer holds in flight is tracked per peer (bounded), and
released when that peer goes stale or restarts: a dead replica's requests leave its
sessions idle, not busy for ever.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any

from router.cluster import Cluster

KIND = "kvtop_replica_sessions"
#: The wire version of the session message; another is dropped (``reason="version"``).
VERSION = 1
#: Facts in one message (a burst beyond waits for the next one).
MAX_FACTS = 2048
#: Facts waiting to be sent; past this the oldest are dropped (and counted): a replica with no
#: subscriber draining it never grows without bound.
MAX_PENDING = 16_384
#: Sessions with requests in flight tracked per peer; a bind beyond is dropped (and counted).
MAX_TRACKED = 65_536
MAX_SESSION_ID = 512
#: Send the list of own sessions in flight at least this often (the reconciliation).
RECONCILE_S = 1.0
#: Sessions in one part of that list (a part a message: 1,024 ids of 512 characters fit the
#: receiver's 1 MiB message bound beside a message's other facts only when those are few, so
#: ids that long are rare in practice; typical ids are under 64).
RECONCILE_PART = 1024


class SessionShare:
    """One replica's session facts: those it publishes and those its peers sent."""

    def __init__(self, cluster: Cluster, replica_id: str, locate: Callable[[str, str], int | None], *,
                 publish: bool, clock=time.monotonic):
        self.cluster = cluster
        self.replica_id = replica_id
        self.locate = locate  # (url, name) -> our instance index, or None
        self.publish = publish
        self.clock = clock
        self.seq = 0
        self.pending: list[list[Any]] = []
        self._stamps: list[float] = []  # the cluster clock of each pending fact
        self.own_busy: dict[str, int] = {}  # own sessions with requests in flight
        self._reconciled = -math.inf
        self._recon_gen = 0
        self._recon_parts: list[list[list[Any]]] = []  # the parts of the list not yet sent
        self._recon_total = 0
        self.wake: Callable[[], None] | None = None  # asks for a publish soon (``Replicas._schedule``)
        self.sent = 0  # facts published
        self.lost = 0  # facts dropped before sending (the pending queue was full)
        self.applied = {"b": 0, "d": 0, "a": 0, "l": 0}
        self.ignored: dict[str, int] = {}  # facts received and not applied, by reason
        #: per peer endpoint: [its replica id, its last session seq, session -> its requests in
        #: flight, the reconciliation in progress (_Recon) or None]
        self.peers: dict[str, list[Any]] = {}
        self.gaps = 0  # session messages peers sent that never arrived
        if publish:
            cluster.session_listener = self

    # -- what this replica publishes -----------------------------------------------------
    def _push(self, fact: list[Any]) -> None:
        if len(self.pending) >= MAX_PENDING:
            del self.pending[0], self._stamps[0]
            self.lost += 1
        self.pending.append(fact)
        self._stamps.append(self.cluster.clock())
        if self.wake is not None:
            self.wake()

    def bound(self, session_id: str, instance: int, input_tokens: int, est_hit: int, new_turn: bool,
              arrival: float | None) -> None:
        """An own request of the session was dispatched (``RoutingCore.dispatch``)."""
        if not self.publish or session_id is None or len(session_id) > MAX_SESSION_ID:
            return
        s = self.cluster.instances[instance]
        now = self.cluster.clock()
        self.own_busy[session_id] = self.own_busy.get(session_id, 0) + 1
        self._push(["b", session_id, s.url, s.name, int(input_tokens), int(est_hit), int(bool(new_turn)), 0.0,
                    None if arrival is None else max(0.0, now - arrival)])

    def done(self, session_id: str) -> None:
        """An own request of the session ended (``Cluster.finish``)."""
        n = self.own_busy.get(session_id)
        if n is None:
            return
        if n > 1:
            self.own_busy[session_id] = n - 1
        else:
            del self.own_busy[session_id]
        self._push(["d", session_id, 0.0])

    def amended(self, session_id: str, input_tokens: int) -> None:
        if session_id in self.own_busy or session_id in self.cluster.sessions:
            if len(session_id) <= MAX_SESSION_ID:
                self._push(["a", session_id, int(input_tokens)])

    @property
    def reconciling(self) -> bool:
        """Parts of the list of sessions in flight are still to be sent."""
        return bool(self._recon_parts)

    def due(self) -> bool:
        return bool(self.pending) or bool(self._recon_parts) or (
            self.publish and self.clock() - self._reconciled >= RECONCILE_S)

    def message(self) -> bytes | None:
        """The next session message (facts, ages as of now, and the in-flight list when due),
        or None when there is nothing to say."""
        if not self.publish:
            return None
        now = self.cluster.clock()
        facts = []
        for fact, at in zip(self.pending[:MAX_FACTS], self._stamps):
            if fact[0] == "b":
                fact[7] = round(max(0.0, now - at), 6)
                if fact[8] is not None:
                    fact[8] = round(fact[8] + fact[7], 6)
            elif fact[0] == "d":
                fact[2] = round(max(0.0, now - at), 6)
            facts.append(fact)
        del self.pending[:len(facts)], self._stamps[:len(facts)]
        mono = self.clock()
        if (not self._recon_parts and not self.pending and mono - self._reconciled >= RECONCILE_S
                and len(self.own_busy) <= MAX_RECON_PARTS * RECONCILE_PART):  # (more: peers track no more)
            live = [[sid, n] for sid, n in self.own_busy.items()]
            self._recon_parts = [live[k:k + RECONCILE_PART] for k in range(0, len(live), RECONCILE_PART)] or [[]]
            self._recon_total = len(self._recon_parts)
            self._recon_gen += 1
            self._reconciled = mono
        if self._recon_parts:
            part = self._recon_total - len(self._recon_parts)
            facts.append(["l", self._recon_parts.pop(0), self._recon_gen, part, self._recon_total])
        if not facts:
            return None
        self.seq += 1
        self.sent += len(facts)
        return json.dumps({KIND: VERSION, "replica": self.replica_id, "seq": self.seq, "facts": facts},
                          separators=(",", ":")).encode()

    # -- what peers send -----------------------------------------------------------------
    def receive(self, endpoint: str, msg: dict[str, Any]) -> str | None:
        """Apply one session message from the peer at ``endpoint`` (already parsed); a reason
        when it is dropped whole."""
        if not _int(msg[KIND]) or msg[KIND] != VERSION:
            return "version"
        replica, seq, facts = msg.get("replica"), msg.get("seq"), msg.get("facts")
        if not (isinstance(replica, str) and 0 < len(replica) <= 200 and _int(seq) and isinstance(facts, list)
                and len(facts) <= MAX_FACTS + 1):
            return "malformed"
        if replica == self.replica_id:
            return "self"
        st = self.peers.get(endpoint)
        if st is None or st[0] != replica:  # a new peer, or it restarted: what it held went with it
            self.forget_peer(endpoint)
            st = self.peers[endpoint] = [replica, -1, {}, None]
        elif seq <= st[1]:
            return "old_seq"
        elif st[1] >= 0:
            self.gaps += seq - st[1] - 1
        st[1] = seq
        now = self.cluster.clock()
        for fact in facts:
            why = self._apply(st, fact, now)
            if why is not None:
                self.ignored[why] = self.ignored.get(why, 0) + 1
        return None

    def _apply(self, st: list[Any], f: Any, now: float) -> str | None:
        if not isinstance(f, list) or not f:
            return "malformed"
        kind = f[0]
        if kind == "l":
            return self._reconcile(st, f)
        busy = st[2]
        if len(f) < 2 or not isinstance(f[1], str) or not 0 < len(f[1]) <= MAX_SESSION_ID:
            return "malformed"
        sid = f[1]
        cl = self.cluster
        if kind == "b":
            if not (len(f) == 9 and isinstance(f[2], str) and isinstance(f[3], str) and len(f[2]) <= 2048
                    and len(f[3]) <= 512 and _int(f[4]) and _int(f[5]) and f[6] in (0, 1) and _num(f[7])
                    and (f[8] is None or _num(f[8]))):
                return "malformed"
            i = self.locate(f[2], f[3])
            if i is None:
                return "unknown_instance"
            if sid not in busy and len(busy) >= MAX_TRACKED:
                return "too_many"
            cl.bind_session(sid, i, f[4], min(f[5], f[4]), new_turn=bool(f[6]),
                            arrival=None if f[8] is None else now - f[8], at=now - f[7])
            busy[sid] = busy.get(sid, 0) + 1
            if st[3] is not None:  # dispatched after the list in progress was made
                st[3].since[sid] = st[3].since.get(sid, 0) + 1
        elif kind == "d":
            if not (len(f) == 3 and _num(f[2])):
                return "malformed"
            n = busy.get(sid)
            if n is None:  # a request we never heard start (we joined later): nothing of it is held
                return "untracked"
            self._release(busy, sid, 1, now - f[2])
        elif kind == "a":
            if not (len(f) == 3 and _int(f[2])):
                return "malformed"
            cl.amend_session(sid, f[2])
        else:
            return "malformed"
        self.applied[kind] += 1
        return None

    def _reconcile(self, st: list[Any], f: list[Any]) -> str | None:
        if len(f) == 2:
            f = [*f, None, 0, 1]
        if not (len(f) == 5 and isinstance(f[1], list) and len(f[1]) <= MAX_FACTS
                and (f[2] is None or _int(f[2])) and _int(f[3]) and _int(f[4]) and f[3] < f[4] <= MAX_RECON_PARTS):
            return "malformed"
        entries: dict[str, int] = {}
        for e in f[1]:
            if not (isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and _int(e[1])):
                return "malformed"
            entries[e[0]] = e[1]
        gen, part, parts = f[2], f[3], f[4]
        rec = st[3]
        if part == 0:
            rec = st[3] = _Recon(gen, parts)
        elif rec is None or rec.gen != gen or rec.parts != parts or rec.next != part:
            st[3] = None  # a part of it was lost: wait for the next list
            return "partial"
        if len(rec.live) + len(entries) > MAX_TRACKED:
            st[3] = None
            return "too_many"
        rec.live.update(entries)
        rec.next = part + 1
        if rec.next < parts:
            return None
        st[3] = None
        busy, live, since = st[2], rec.live, rec.since
        for sid, n in list(busy.items()):
            extra = n - live.get(sid, 0) - since.get(sid, 0)
            if extra > 0:  # its end never reached us
                self._release(busy, sid, extra, None)
        self.applied["l"] += 1
        return None

    def _release(self, busy: dict[str, int], sid: str, n: int, at: float | None) -> None:
        left = busy[sid] - n
        if left > 0:
            busy[sid] = left
        else:
            del busy[sid]
        for _ in range(n):
            self.cluster.session_done(sid, at)

    def forget_peer(self, endpoint: str) -> int:
        """The peer at ``endpoint`` went stale or restarted: end what it held in flight (its
        clients' connections went with it). Returns the requests released."""
        st = self.peers.pop(endpoint, None)
        busy = st[2] if st is not None else None
        if not busy:
            return 0
        n = 0
        for sid, k in list(busy.items()):
            self._release(busy, sid, k, None)
            n += k
        return n

    def snapshot(self) -> dict[str, Any]:
        """The state's ``replicas.sessions``."""
        return {"published": self.sent, "pending": len(self.pending), "lost": self.lost, "gaps": self.gaps,
                "applied": dict(self.applied), "ignored": dict(self.ignored),
                "own_in_flight": sum(self.own_busy.values()),
                "peer_in_flight": {e: sum(st[2].values()) for e, st in self.peers.items()}}


#: Parts in one list (65,536 sessions at most: the peer tracks no more).
MAX_RECON_PARTS = 64


class _Recon:
    """A peer's list of sessions in flight, while its parts arrive."""

    __slots__ = ("gen", "parts", "next", "live", "since")

    def __init__(self, gen: int | None, parts: int):
        self.gen, self.parts, self.next = gen, parts, 1
        self.live: dict[str, int] = {}
        self.since: dict[str, int] = {}  # requests dispatched after part 0 (not in the list)


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 53


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
