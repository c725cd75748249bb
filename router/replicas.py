"""Router replicas that route as one: each replica shares its own in-flight load per instance.

Every replica sees the engines' caches (KV events) but only its own requests' load. Here
each replica publishes, over ZeroMQ PUB/SUB (brokerless: no daemon to run; pyzmq already
carries the KV events), a snapshot of its own per-instance accounting (router/cluster.py:
pending prefill tokens, requests, decoding tokens and requests, and the seconds of prefill
it has queued there) right after each of its decisions (at most one snapshot per
``MIN_GAP_S``) and every ``interval_s`` (the heartbeat). Each replica subscribes to the others and, when it prices a request, adds the
latest fresh snapshot of every peer to its own exact counters (``Replicas.apply``, called
from ``RoutingCore.view``: every policy and shadow sees the sum). Its own requests stay
exact; a peer's contribution is at most one interval (plus the network) old. The same
socket carries the replicas' session records (router/replica_sessions.py).

A peer unheard for ``stale_s`` is left out of the sum; with every peer left out the replica
routes on its own view and says so: a log line at each transition, the state snapshot and
/health (``degraded`` and ``replicas``), /metrics (``kvtop_replica_*``) and each decision's
``replica_view`` (the event stream; not a SQLite column). Snapshots are keyed by instance
URL (then name), never by index: fleets may list their instances in another order. A
message that is not a well-formed snapshot of this version is dropped and counted by
reason; nothing a peer sends can stop the subscriber. docs/replicas.md has the design.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from router.cluster import Candidate, Cluster, ClusterView
from router.replica_sessions import KIND as SESSIONS_KIND
from router.replica_sessions import SessionShare, _int, _num

if TYPE_CHECKING:  # pragma: no cover
    from router.supervise import Supervisor

log = logging.getLogger("kvtop.route")

#: The wire version; a snapshot of another version is dropped (``reason="version"``).
VERSION = 1
TOPIC = b"kvtop.replica"
#: A snapshot larger than this is dropped unread (8 instances take ~1 KB; 4,096 about 400 KB).
MAX_MESSAGE_BYTES = 1 << 20
#: ZeroMQ itself drops a connection whose peer sends more than this in one message.
ZMQ_MAX_MESSAGE_BYTES = 4 << 20
MAX_INSTANCES = 4096
DEFAULT_INTERVAL_S = 0.05
#: Decisions publish at once, but at most one snapshot per this many seconds.
MIN_GAP_S = 0.005
DEFAULT_STALE_S = 0.5
#: A peer unheard this many staleness bounds is gone: its sessions' requests in flight are released.
GONE_STALE = 10
#: The load fields a snapshot carries per instance (its ``load`` list), in this order.
FIELDS = ("pending_prefill_tokens", "num_requests", "ongoing_decode_tokens", "decode_requests", "wait_s")
ENDPOINT = re.compile(r"^(tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.*-]+):\d{1,5}|ipc://.+)$")

SHARED, OWN = "shared", "own"


def check_endpoint(flag: str, value: str) -> str:
    """A ZeroMQ endpoint this module accepts (tcp://HOST:PORT or ipc://PATH); ValueError else."""
    if not isinstance(value, str) or not ENDPOINT.match(value):
        raise ValueError(f"{flag} {value!r}: expected tcp://HOST:PORT or ipc://PATH")
    if value.startswith("tcp://") and not 0 < int(value.rsplit(":", 1)[1]) < 65536:
        raise ValueError(f"{flag} {value!r}: port must be 1-65535")
    return value


@dataclass(slots=True)
class Peer:
    """What this replica knows of one configured peer endpoint."""

    endpoint: str
    replica: str | None = None  # the id its snapshots carry
    seq: int = -1
    received_at: float | None = None  # monotonic, this host's clock: freshness never trusts the peer's
    sent_ts: float | None = None  # the peer's wall clock at publishing (shown, not used)
    loads: dict[int, tuple[int, int, int, int, float]] = field(default_factory=dict)  # by OUR index
    entries: list[dict[str, Any]] = field(default_factory=list)  # as received, re-matched on a fleet change
    received: int = 0
    gaps: int = 0  # snapshots it published that never arrived (sequence jumps)
    fresh: bool = False
    lost_at: float | None = None  # wall clock of its last fresh -> stale transition

    def age(self, now: float) -> float | None:
        return None if self.received_at is None else now - self.received_at


class Replicas:
    """One replica's side of the shared view: its publisher, its peers, and the sum it adds."""

    def __init__(self, cluster: Cluster, replica_id: str, *, bind: str | None, peers: list[str],
                 interval_s: float = DEFAULT_INTERVAL_S, stale_s: float = DEFAULT_STALE_S,
                 clock=time.monotonic):
        if interval_s <= 0 or stale_s <= 0:
            raise ValueError("the replica interval and staleness bound must be positive")
        self.cluster = cluster
        self.replica_id = replica_id
        self.bind = bind
        self.peers = [Peer(p) for p in peers]
        self.interval_s = interval_s
        self.stale_s = stale_s
        self.clock = clock
        self.seq = 0
        self.published = 0
        self.dropped: dict[str, int] = {}
        self.mode = OWN
        self._sum: dict[int, list[float]] = {}  # our index -> summed fresh peers' FIELDS
        self._expires = math.inf  # when the freshest-to-expire peer in the sum goes stale
        self._keys: dict[str, int] = {}
        self._keyed_for = -1
        self._ctx = None  # the publisher's (plain) ZeroMQ context
        self._actx = None  # the subscribers' (asyncio) one
        self._pub = None
        self._subs: list[Any] = []
        self._tasks: list[asyncio.Task] = []
        self._soon = False  # a publish is scheduled for the end of this turn of the loop
        self._sent_at = -math.inf
        #: the session records shared with the peers (router/replica_sessions.py)
        self.share = SessionShare(cluster, replica_id, self._locate, publish=bind is not None, clock=clock)
        self.share.wake = self._schedule

    # -- the hot path: what a decision adds -----------------------------------------
    def apply(self, view: ClusterView) -> str:
        """Add the fresh peers' load to ``view``'s candidates (and its lookahead's queued
        seconds); returns the view used, ``shared`` or ``own``. O(candidates)."""
        if self.clock() >= self._expires:
            self.refresh()
        add = self._sum
        if add:
            for c in view.candidates:
                a = add.get(c.index)
                if a is not None:
                    c.pending_prefill += int(a[0])
                    c.num_requests += int(a[1])
                    c.decode_tokens += int(a[2])
                    c.decode_requests += int(a[3])
            la = view.lookahead
            if la is not None:
                wait = la.wait_s
                for i, a in add.items():
                    if i in wait:
                        wait[i] += a[4]
        # the request this view prices is dispatched in the same turn of the loop: publish
        # right after it, so peers learn of new load in milliseconds, not an interval
        self._schedule()
        return self.mode

    def bound(self, session_id: str, instance: int, input_tokens: int, est_hit: int, new_turn: bool,
              arrival: float | None) -> None:
        """An own request was dispatched and its session bound (``RoutingCore.dispatch``)."""
        self.share.bound(session_id, instance, input_tokens, est_hit, new_turn, arrival)

    def _schedule(self) -> None:
        """Publish at the end of this turn of the loop (at most one snapshot per MIN_GAP_S: a
        burst of decisions and ends shares one)."""
        if self._pub is None or self._soon:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a unit test driving the router directly)
            return
        wait = self._sent_at + MIN_GAP_S - self.clock()
        if wait > 0:
            loop.call_later(wait, self._send)
        else:
            loop.call_soon(self._send)
        self._soon = True

    def refresh(self) -> None:
        """Recompute freshness, the mode and the sum; log each transition."""
        now = self.clock()
        self._rekey()
        total: dict[int, list[float]] = {}
        expires = math.inf
        fresh = 0
        for p in self.peers:
            age = p.age(now)
            ok = age is not None and age <= self.stale_s
            if ok != p.fresh:
                p.fresh = ok
                if ok:
                    log.info("replica peer %s (%s) fresh: its load joins the shared view", p.endpoint, p.replica)
                else:
                    p.lost_at = time.time()
                    log.warning("replica peer %s (%s) lost: no snapshot for %.2f s (bound %.2f s); its load is "
                                "left out", p.endpoint, p.replica, age if age is not None else float("nan"),
                                self.stale_s)
            if not ok:
                continue
            fresh += 1
            expires = min(expires, p.received_at + self.stale_s)
            for i, load in p.loads.items():
                t = total.get(i)
                if t is None:
                    total[i] = list(load)
                else:
                    for k in range(5):
                        t[k] += load[k]
        self._sum = total
        self._expires = expires
        mode = SHARED if fresh else OWN
        if mode != self.mode and self.peers:
            if mode == SHARED:
                log.info("replicas: routing on the shared view (%d of %d peers fresh)", fresh, len(self.peers))
            else:
                log.warning("replicas: no peer is fresh; routing on this replica's own view")
        self.mode = mode

    def _rekey(self) -> None:
        """Our instance URL and name -> index, rebuilt when the fleet changed size; the
        peers' entries are matched again then."""
        insts = self.cluster.instances
        if self._keyed_for == len(insts):
            return
        keys: dict[str, int] = {}
        for s in insts:
            keys.setdefault("n:" + s.name, s.index)
            if s.url:
                keys["u:" + s.url.rstrip("/")] = s.index
        self._keys = keys
        self._keyed_for = len(insts)
        for p in self.peers:
            p.loads = self._match(p.entries)

    def _locate(self, url: str, name: str) -> int | None:
        """Our index of a peer's instance, by URL, then by name."""
        self._rekey()
        i = self._keys.get("u:" + url.rstrip("/")) if url else None
        return self._keys.get("n:" + name) if i is None else i

    def _match(self, entries: list[dict[str, Any]]) -> dict[int, tuple[int, int, int, int, float]]:
        out: dict[int, tuple[int, int, int, int, float]] = {}
        keys = self._keys
        for e in entries:
            i = keys.get("u:" + e["url"].rstrip("/")) if e["url"] else None
            if i is None:
                i = keys.get("n:" + e["name"])
            if i is not None:
                out[i] = e["load"]
        return out

    # -- what this replica publishes -------------------------------------------------
    def own_loads(self) -> list[dict[str, Any]]:
        """This replica's own per-instance accounting, keyed by URL and name."""
        cl = self.cluster
        insts = cl.instances
        wait = cl.lookahead([Candidate(s.index, s.name, 0, 0, 0, 0, 0) for s in insts], 0, None, None).wait_s
        return [{"url": s.url, "name": s.name,
                 "load": [s.pending_prefill_tokens, s.num_requests, s.ongoing_decode_tokens, s.decode_requests,
                          round(wait.get(s.index, 0.0), 6)]}
                for s in insts]

    def message(self, loads: list[dict[str, Any]]) -> bytes:
        self.seq += 1
        return json.dumps({"kvtop_replica": VERSION, "replica": self.replica_id, "seq": self.seq,
                           "ts": time.time(), "interval_s": self.interval_s, "instances": loads},
                          separators=(",", ":")).encode()

    # -- what peers send ---------------------------------------------------------------
    def receive(self, peer: Peer, frames: list[bytes]) -> bool:
        """Take one message from ``peer``; False (and counted by reason) when it is dropped."""
        why = self._check(peer, frames)
        if isinstance(why, dict):  # a session message (router/replica_sessions.py)
            why = self.share.receive(peer.endpoint, why)
            if why is None:
                return True
        if isinstance(why, str):
            self.dropped[why] = self.dropped.get(why, 0) + 1
            return False
        replica, seq, ts, entries = why
        if replica != peer.replica:  # a new peer, or the peer restarted: its sequence starts over
            peer.replica, peer.seq = replica, seq - 1
        elif seq <= peer.seq:
            self.dropped["old_seq"] = self.dropped.get("old_seq", 0) + 1
            return False
        peer.gaps += max(0, seq - peer.seq - 1) if peer.seq >= 0 else 0
        peer.seq = seq
        peer.sent_ts = ts
        peer.received_at = self.clock()
        peer.received += 1
        peer.entries = entries
        self._rekey()
        peer.loads = self._match(entries)
        self.refresh()
        return True

    def _check(self, peer: Peer, frames: list[bytes]):
        if len(frames) != 2 or frames[0] != TOPIC:
            return "malformed"
        raw = frames[1]
        if len(raw) > MAX_MESSAGE_BYTES:
            return "too_large"
        try:
            msg = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return "not_json"
        if isinstance(msg, dict) and SESSIONS_KIND in msg:
            return msg
        if not isinstance(msg, dict) or "kvtop_replica" not in msg:
            return "malformed"
        if not _int(msg["kvtop_replica"]) or msg["kvtop_replica"] != VERSION:  # true == 1 in Python
            return "version"
        replica, seq, ts, insts = msg.get("replica"), msg.get("seq"), msg.get("ts"), msg.get("instances")
        if not (isinstance(replica, str) and 0 < len(replica) <= 200 and _int(seq) and _num(ts)
                and isinstance(insts, list) and len(insts) <= MAX_INSTANCES):
            return "malformed"
        if replica == self.replica_id:
            return "self"  # our own snapshot (a peer list that names our own bind)
        entries = []
        for e in insts:
            if not isinstance(e, dict):
                return "malformed"
            url, name, load = e.get("url", ""), e.get("name", ""), e.get("load")
            if not (isinstance(url, str) and isinstance(name, str) and len(url) <= 2048 and len(name) <= 512
                    and isinstance(load, list) and len(load) == 5 and all(_int(x) for x in load[:4])
                    and _num(load[4])):
                return "malformed"
            entries.append({"url": url, "name": name,
                            "load": (load[0], load[1], load[2], load[3], float(load[4]))})
        return replica, seq, float(ts), entries

    # -- sockets -----------------------------------------------------------------------
    def open_publisher(self) -> None:
        """Bind the PUB socket now (a taken port is a start-up error, ValueError)."""
        if self.bind is None:
            return
        import zmq

        self._ctx = zmq.Context()
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 256)
        pub.setsockopt(zmq.IPV6, 1)
        try:
            pub.bind(self.bind)
        except zmq.ZMQError as exc:
            pub.close()
            self._ctx.term()
            self._ctx = None
            raise ValueError(f"--replica-bind {self.bind}: {exc}") from None
        self._pub = pub

    async def start(self, supervisor: Supervisor) -> None:
        import zmq
        import zmq.asyncio

        actx = zmq.asyncio.Context()
        self._actx = actx
        for k, p in enumerate(self.peers):
            sock = actx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 256)
            sock.setsockopt(zmq.MAXMSGSIZE, ZMQ_MAX_MESSAGE_BYTES)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
            sock.connect(p.endpoint)
            self._subs.append(sock)
            self._tasks.append(supervisor.spawn(
                f"replica-peer-{k}", lambda p=p, s=sock: self._listen(p, s), kind="replica-peer",
                fallback="that peer's load is left out until it is heard again"))
        self._tasks.append(supervisor.spawn("replica-publisher", self._publish, kind="replica-publisher",
                                            fallback="peers see this replica's load go stale"))
        if self.peers:
            log.info("replicas: %s, following %d peer(s): %s (interval %.0f ms, stale after %.0f ms)",
                     f"publishing on {self.bind}" if self.bind else "not publishing", len(self.peers),
                     ", ".join(p.endpoint for p in self.peers), self.interval_s * 1e3, self.stale_s * 1e3)

    async def _listen(self, peer: Peer, sock) -> None:
        while True:
            frames = await sock.recv_multipart()
            self.receive(peer, frames)

    async def _publish(self) -> None:
        """Every interval: publish (the heartbeat, and what finishes and first tokens changed)
        and check freshness, so a lost peer is reported without a decision. A decision
        publishes at once besides (``apply``)."""
        while True:
            await asyncio.sleep(self.interval_s)
            if self.clock() >= self._expires or (self.peers and self._expires == math.inf):
                self.refresh()
            self.expire_peers()
            self._send()

    def expire_peers(self) -> None:
        """A peer unheard for ``GONE_STALE`` staleness bounds is gone (a stall of a busy host
        lasts less): what it held in flight is released (router/replica_sessions.py)."""
        now = self.clock()
        for p in self.peers:
            if p.received_at is not None and now - p.received_at > GONE_STALE * self.stale_s:
                self.share.forget_peer(p.endpoint)

    def _send(self) -> None:
        import zmq

        self._soon = False
        if self._pub is None:
            return
        self._sent_at = self.clock()
        try:
            self._pub.send_multipart([TOPIC, self.message(self.own_loads())], flags=zmq.NOBLOCK)
            self.published += 1
            if self.share.due():
                msg = self.share.message()
                if msg is not None:
                    self._pub.send_multipart([TOPIC, msg], flags=zmq.NOBLOCK)
                if self.share.pending or self.share.reconciling:  # more than one message holds: the rest soon
                    self._schedule()
        except zmq.Again:  # no room at a slow subscriber: the next snapshot replaces this one
            return

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping
                pass
        self._tasks = []
        for s in self._subs:
            s.close()
        self._subs = []
        if self._actx is not None:
            self._actx.term()
            self._actx = None
        if self._pub is not None:
            self._pub.close()
            self._pub = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # -- what it shows -----------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The state snapshot's ``replicas``: which peers, fresh or not, and what they add."""
        self.refresh()
        now = self.clock()
        names = self.cluster.instances
        return {
            "replica_id": self.replica_id, "bind": self.bind, "mode": self.mode,
            "interval_s": self.interval_s, "stale_s": self.stale_s,
            "peers_fresh": sum(p.fresh for p in self.peers), "published": self.published,
            "dropped": dict(self.dropped),
            "peers": [{"endpoint": p.endpoint, "replica": p.replica, "fresh": p.fresh,
                       "age_s": None if p.age(now) is None else round(p.age(now), 4), "seq": p.seq,
                       "received": p.received, "gaps": p.gaps, "instances_matched": len(p.loads)}
                      for p in self.peers],
            "peer_load": {names[i].name: dict(zip(FIELDS, (round(x, 4) for x in a)))
                          for i, a in sorted(self._sum.items())},
            "sessions": self.share.snapshot(),
        }

    def degraded(self) -> list[dict[str, Any]]:
        """A degraded entry per configured peer that is not fresh (the state's ``degraded``)."""
        if not self.peers:
            return []
        self.refresh()
        now = self.clock()
        fresh = sum(p.fresh for p in self.peers)
        view = f"routing on own view + {fresh} fresh peer(s)" if fresh else "routing on this replica's own view"
        out = []
        for k, p in enumerate(self.peers):
            if p.fresh:
                continue
            age = p.age(now)
            out.append({"task": f"replica-peer-{k}", "kind": "replica-peer", "deaths": 0, "restarts": 0,
                        "running": False, "since": p.lost_at,
                        "last_error": (f"{p.endpoint}: never heard" if age is None
                                       else f"{p.endpoint}: no snapshot for {age:.2f} s"),
                        "fallback": f"its load is left out; {view}"})
        return out

    def collect(self) -> Iterator[Any]:
        """``kvtop_replica_*`` for /metrics (a prometheus_client collector's ``collect``)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self.refresh()
        now = self.clock()
        yield GaugeMetricFamily("kvtop_replica_peers", "replica peers configured (--replica-peer)",
                                value=len(self.peers))
        yield GaugeMetricFamily("kvtop_replica_peers_fresh", "replica peers heard within the staleness bound",
                                value=sum(p.fresh for p in self.peers))
        view = GaugeMetricFamily("kvtop_replica_view", "1 for the view decisions use now: shared (own + fresh "
                                 "peers' load) or own (no peer fresh)", labels=["mode"])
        for m in (SHARED, OWN):
            view.add_metric([m], int(self.mode == m))
        yield view
        yield CounterMetricFamily("kvtop_replica_snapshots_published_total", "load snapshots this replica "
                                  "published", value=self.published)
        got = CounterMetricFamily("kvtop_replica_snapshots_received_total", "snapshots accepted per peer",
                                  labels=["peer"])
        age = GaugeMetricFamily("kvtop_replica_peer_age_seconds", "seconds since the peer's last snapshot "
                                "(absent before the first)", labels=["peer"])
        for p in self.peers:
            got.add_metric([p.endpoint], p.received)
            if p.received_at is not None:
                age.add_metric([p.endpoint], now - p.received_at)
        yield got
        yield age
        bad = CounterMetricFamily("kvtop_replica_snapshots_dropped_total", "peer messages dropped, by reason",
                                  labels=["reason"])
        for reason, n in sorted(self.dropped.items()):
            bad.add_metric([reason], n)
        yield bad
        load = GaugeMetricFamily("kvtop_replica_peer_requests", "fresh peers' in-flight requests on the instance "
                                 "(added to this replica's own when it prices)", labels=["instance"])
        for i, a in sorted(self._sum.items()):
            load.add_metric([self.cluster.instances[i].name], a[1])
        yield load


# -- the router's wiring -------------------------------------------------------------------

def add_arguments(p) -> None:
    p.add_argument("--replica-bind", default=None, metavar="tcp://HOST:PORT",
                   help="router replicas (docs/replicas.md): publish this replica's in-flight load per "
                        "instance and its session records on this ZeroMQ endpoint for its peers")
    p.add_argument("--replica-peer", action="append", default=[], metavar="tcp://HOST:PORT",
                   help="another replica's --replica-bind: its in-flight load is added to this one's when "
                        "pricing, its session records join this one's (repeat for each peer)")
    p.add_argument("--replica-interval-ms", type=float, default=DEFAULT_INTERVAL_S * 1e3, metavar="MS",
                   help="publish at least this often (the heartbeat, and what finishes changed); "
                        "every decision publishes at once besides (default 50)")
    p.add_argument("--replica-stale-ms", type=float, default=DEFAULT_STALE_S * 1e3, metavar="MS",
                   help="a peer unheard this long is left out; none fresh: routing on the own view "
                        "(default 500)")


def config_kwargs(args) -> dict[str, Any]:
    """The RouterConfig fields of the flags above, validated (ValueError with the flag)."""
    bind = check_endpoint("--replica-bind", args.replica_bind) if args.replica_bind is not None else None
    peers = [check_endpoint("--replica-peer", p) for p in args.replica_peer]
    if bind is not None and bind in peers:
        raise ValueError(f"--replica-peer {bind} is this replica's own --replica-bind")
    if len(set(peers)) != len(peers):
        raise ValueError("--replica-peer: each peer once")
    if not (math.isfinite(args.replica_interval_ms) and args.replica_interval_ms > 0):
        raise ValueError("--replica-interval-ms must be positive")
    if not (math.isfinite(args.replica_stale_ms) and args.replica_stale_ms > args.replica_interval_ms):
        raise ValueError("--replica-stale-ms must be larger than --replica-interval-ms")
    return {"replica_bind": bind, "replica_peers": peers, "replica_interval_s": args.replica_interval_ms / 1e3,
            "replica_stale_s": args.replica_stale_ms / 1e3}


def from_config(cluster: Cluster, config) -> Replicas | None:
    """The replica side of a router, or None when it has no --replica-bind or --replica-peer."""
    if config.replica_bind is None and not config.replica_peers:
        return None
    return Replicas(cluster, config.run_id, bind=config.replica_bind, peers=list(config.replica_peers),
                    interval_s=config.replica_interval_s, stale_s=config.replica_stale_s)


def setup(app, rep: Replicas | None, supervisor: Supervisor, registry) -> None:
    """Bind the publisher (a start-up error if it cannot), add the metrics to ``registry``
    (the telemetry's), run the sockets with the app under the router's ``supervisor``."""
    if rep is None:
        return
    rep.open_publisher()
    registry.register(_Collector(rep))

    async def sockets(_app) -> AsyncIterator[None]:
        await rep.start(supervisor)
        try:
            yield
        finally:
            await rep.stop()

    app.cleanup_ctx.append(sockets)


class _Collector:
    def __init__(self, rep: Replicas):
        self.rep = rep

    def collect(self):
        return self.rep.collect()
