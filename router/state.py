"""A running router's configuration and mutable state: the pipeline, the policy slot, the records.

``RouterState`` is also the live pipeline's sink: every decision and outcome goes to the
SQLite writer, the control API's decision ring and the listeners (event stream, metrics),
each from the same typed record (router/core.Decision, router/pipeline.Outcome).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from router.body import MemoryReturn
from router.build import build_router
from router.calibration import DEFAULT_PRIOR, PrefillPrior
from router.cluster import Cluster
from router.core import Decision, PolicySlot, RoutingCore
from router.features import Features
from router.kv_wiring import attach_index
from router.lifecycle import Lifecycle
from router.pipeline import Outcome, Pipeline
from router import replicas
from router.shadow import Shadows, parse_specs
from router.supervise import Supervisor
from router.policies import DEFAULT_POLICY
from router.settings import Settings
from aiohttp import web

from router.parsing import BodyParser
from router.tokenizer import load_tokenizer
from store.chains import ChainEncoder
from store.schema import SCHEMA_VERSION
from store.writer import Writer

log = logging.getLogger("kvtop.route")

#: Default estimated-cache capacity per instance: one H20 running Qwen3-30B-A3B holds about
#: 265k tokens of KV (vllm-engine-model.md).
DEFAULT_CAPACITY_TOKENS = 265_000


@dataclass
class Backend:
    name: str
    url: str
    gpu: int | None = None
    kv_events: str | None = None  # vLLM's KV-event PUB endpoint, e.g. tcp://host:5557 (router/kv_events.py)
    kv_replay: str | None = None  # its replay (ROUTER) endpoint, e.g. tcp://host:5558


@dataclass
class RouterConfig:
    backends: list[Backend]
    policy: str = DEFAULT_POLICY
    knobs: dict[str, Any] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 8000
    db: str | None = "kvtop.db"
    block_size: int = 512
    capacity_tokens: int = DEFAULT_CAPACITY_TOKENS
    session_header: str = "X-Session-ID"
    tokenizer: str | None = None
    max_input_tokens: int | None = 1_000_000
    max_body_bytes: int = 64 * 1024 * 1024
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    decision_ring: int = 2000
    run_id: str = field(default_factory=lambda: time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6])
    argv: str = ""
    # TLS: the listener (--tls-cert/--tls-key) and a private CA for https:// backends
    tls_cert: str | None = None
    tls_key: str | None = None
    backend_ca_file: str | None = None
    # control plane (router/control.py)
    control_token: str | None = None
    control_token_file: str | None = None
    control_readonly: bool = False
    state_dir: str | None = None
    # telemetry (router/telemetry.py): backlog seconds = pending_prefill_tokens / this rate
    assumed_prefill_tps: float = 5000.0
    scrape_interval_s: float = 1.0
    # reliability (router/health.py, router/limits.py, docs/reliability.md); 0 = no bound
    max_inflight: int = 10_000
    max_inflight_per_instance: int = 4_096
    max_buffered_bytes: int = 512 * 1024 * 1024  # request bodies held at once (0 = no bound)
    max_viewers: int = 64  # event-stream viewers at once (0 = no bound)
    client_timeout_s: float = 60.0
    total_timeout_s: float | None = None
    first_byte_timeout_s: float | None = 30.0  # streaming requests and prefill legs (router/proxy.py)
    max_answer_bytes: int = 256 * 1024 * 1024
    health_interval_s: float = 0.5
    health_timeout_s: float = 1.0
    health_backoff_max_s: float = 5.0
    # outlier detection (router/health.py): failed attempts in a row that eject (0 = off), and
    # the first ejection's length (it grows with each ejection)
    outlier_consecutive: int = 5
    outlier_ejection_s: float = 10.0
    # KV events (router/kv_events.py, docs/kv-events.md): how long blocks just routed count as
    # cached on an exact instance before its events confirm them
    kv_speculative_ttl_s: float = 2.0
    # shadow policies (router/shadow.py): asked on every request, never applied
    shadows: list[str] = field(default_factory=list)
    shadow_budget_ms: float = 5.0
    # discovery (router/discovery.py, docs/fleet.md): a watched backends file, DNS names, and
    # the starting backends each source put there, as it said them (before @kv=auto was asked)
    backends_file: str | None = None
    backend_dns: list[str] = field(default_factory=list)
    backend_srv: list[str] = field(default_factory=list)
    dns_server: str | None = None
    dns_interval_s: float = 5.0
    discovery_drain_timeout_s: float = 300.0
    discovered: dict[str, list[Backend]] = field(default_factory=dict)  # as each source said them
    # router replicas (router/replicas.py, docs/replicas.md): share in-flight load with peers
    replica_bind: str | None = None
    replica_peers: list[str] = field(default_factory=list)
    replica_interval_s: float = 0.05
    replica_stale_s: float = 0.5

    @property
    def capacity_blocks(self) -> int:
        return max(1, self.capacity_tokens // self.block_size)


class RouterState:
    """Everything mutable about a running router, stored once under ``app[STATE]``."""

    def __init__(self, config: RouterConfig):
        self.config = config
        # --knob takes policy and router-level feature knobs together (router/settings.py)
        settings = Settings.parse(config.policy, config.knobs)
        self.shadows = Shadows(parse_specs(config.shadows), budget_ms=config.shadow_budget_ms,
                               on_drop=self._shadow_dropped)
        self.deferred = _Later()
        self.router = build_router(
            settings, [b.name for b in config.backends], self, urls=[b.url for b in config.backends],
            block_size=config.block_size, capacity_blocks=config.capacity_blocks,
            prefill_prior=PrefillPrior(config.assumed_prefill_tps, DEFAULT_PRIOR.attention_tokens),
            clock=time.time, on_admit=_wake, shadows=self.shadows, defer=self.deferred,
            background=_Steps(), full=self.full_instances)
        self.shadows.restart(self.router.slot.label)  # no counts yet: names what they compare with
        self.kv_index = attach_index(self.cluster, config.backends,
                                     speculative_ttl_s=config.kv_speculative_ttl_s)
        self.kv_subscribers: list = []  # router/kv_events.Subscriber per backend (None: no events)
        #: the peers' in-flight load, added to every view (router/replicas.py); None: one router
        self.replicas = replicas.from_config(self.cluster, config)
        self.router.core.peers = self.replicas
        self.chains = ChainEncoder()  # compact block chains in decision rows (store/chains.py)
        self.tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else None
        self.parser = BodyParser(config, self.tokenizer)
        #: every background task's deaths (router/supervise.py); ``degraded()`` shows them
        self.supervisor = Supervisor()
        self.parser.supervisor = self.supervisor
        self.run_id = config.run_id
        self.started_at = time.time()
        self.writer: Writer | None = None
        self.upstream = None  # router.upstream.Pool: every call to a backend goes through it
        self.app = None
        self.health = None  # router.health.HealthChecker
        self.discovery = None  # router.discovery.Discovery: the watched file and DNS names, if any
        self.ring: deque[dict[str, Any]] = deque(maxlen=config.decision_ring)
        #: Called with ("decision" | "outcome" | "config" | "health", payload) on the loop thread.
        self.listeners: list[Callable[[str, dict[str, Any]], None]] = []
        self.counts: dict[str, int] = {"requests": 0, "bad_requests": 0, "no_instance": 0,
                                       "retries": 0, "rejected": 0}
        self.outcome_counts: dict[str, int] = {}
        self.draining = False
        self.body_bytes = 0  # request body bytes held now (router/limits.py body_room)
        self.memory = MemoryReturn()  # gives large bodies' freed memory back (router/body.py)

    def full_instances(self) -> tuple[int, ...]:
        """Indices of instances at ``max_inflight_per_instance``: the lifecycle excludes them
        from a pick, and refuses a request when every candidate is full (router/limits.py)."""
        limit = self.config.max_inflight_per_instance
        if not limit:
            return ()
        return tuple(s.index for s in self.cluster.instances if s.num_requests >= limit)

    @property
    def core(self) -> RoutingCore:
        return self.router.core

    @property
    def pipeline(self) -> Pipeline:
        return self.router.pipeline

    @property
    def lifecycle(self) -> Lifecycle:
        return self.router.lifecycle

    @property
    def cluster(self) -> Cluster:
        return self.router.cluster

    def degraded(self) -> list[dict[str, Any]]:
        """Background work that is down or died lately (router/supervise.py), and a decision
        log losing rows: what /health, the state snapshot (``degraded``), /metrics and the
        dashboard's header show. Empty when all is well."""
        out = self.supervisor.degraded()
        if self.replicas is not None:
            out += self.replicas.degraded()
        w = self.writer.health() if self.writer is not None else None
        if w is not None and w["degraded"]:
            out.append({"task": "decision-log", "kind": "writer", "deaths": w.get("thread_deaths", 0),
                        "restarts": w.get("thread_deaths", 0), "running": True,
                        "last_error": w["last_error"] or (f"{w['rows_dropped']} rows dropped"
                                                          if w["rows_dropped"] else f"lag {w['lag_s']} s"),
                        "since": None, "fallback": "routing goes on; decision rows are being lost or late"})
        return out

    @property
    def slot(self) -> PolicySlot:
        return self.router.slot

    @property
    def settings(self) -> Settings:
        return self.router.settings

    @property
    def features(self) -> Features:
        return self.router.settings.features

    # -- the pipeline's sink ---------------------------------------------------------
    def emit(self, kind: str, payload: dict[str, Any]) -> None:
        for fn in list(self.listeners):
            try:
                fn(kind, payload)
            except Exception:  # a viewer must never break routing
                log.exception("listener failed")

    def decision(self, d: Decision) -> None:
        if self.writer:
            row = d.row(self.run_id)
            r = d.request
            if d.attempt == 1:  # what-if replay re-runs each request once, from its first attempt
                row["blocks_parent"], row["blocks"] = self.chains.encode(r.session_id, r.request_id, r.blocks)
            self.writer.put("decisions", row)
        ev = d.event()
        self.ring.append(ev)
        self.emit("decision", ev)

    def outcome(self, d: Decision, o: Outcome) -> None:
        row = o.row(d, self.run_id)
        self.outcome_counts[o.status] = self.outcome_counts.get(o.status, 0) + 1
        if self.health is not None:
            self.health.observe(d.instance, o.status)
        if self.writer:
            self.writer.put("outcomes", row)
        self.emit("outcome", row)

    def record_config(self, kind: str, who: str, before: Any, after: Any) -> dict[str, Any]:
        row = {"run_id": self.run_id, "ts": time.time(), "kind": kind, "who": who,
               "policy_version": self.slot.version, "before": before, "after": after}
        if self.writer:
            self.writer.put("config_events", row)
        self.emit("config", row)
        return row

    # -- shadows --------------------------------------------------------------------
    def set_shadows(self, specs: Any, who: str) -> dict[str, Any]:
        """Replace the shadow set (raises ShadowError, changing nothing); audited."""
        parsed = parse_specs(specs)
        before = [{"policy": n, "knobs": dict(sh.policy.knobs)} for n, sh in self.shadows.shadows.items()]
        self.shadows.set(parsed)
        after = [{"policy": n, "knobs": dict(sh.policy.knobs)} for n, sh in self.shadows.shadows.items()]
        self.record_config("shadow", who, before, after)
        return self.shadows.summary()

    def _shadow_dropped(self, name: str, why: str) -> None:
        log.warning("shadow policy %s dropped: %s", name, why)
        self.record_config("shadow", "router", {"policy": name}, {"dropped": name, "why": why})

    # -- control --------------------------------------------------------------------
    def set_policy(self, name: str | None, knobs: dict[str, Any] | None, who: str,
                   *, merge: bool = False) -> PolicySlot:
        """Validate completely, then swap in one step (router/build.Router.apply). Raises
        KnobError, changing nothing. ``merge`` keeps the current knobs and changes only those
        given (PATCH semantics); ``knobs`` may mix policy and router-level feature knobs
        (router/settings.py); feature knobs always merge."""
        current, old_settings = self.slot, self.settings
        new = old_settings.update(name, knobs, merge=merge)
        before = {"policy": current.policy.name, "version": current.version, "knobs": current.policy.knobs,
                  "features": old_settings.features.knobs}
        slot = self.router.apply(new)
        if (slot.policy.name, slot.policy.knobs) != (current.policy.name, current.policy.knobs):
            self.shadows.restart(slot.label)  # agreement is with the active policy: a new one, new counts
        after = {"policy": slot.policy.name, "version": slot.version, "knobs": slot.policy.knobs,
                 "features": new.features.knobs}
        self.record_config("policy" if new.policy != current.policy.name else "knobs", who, before, after)
        return slot

    def run_row(self, ended: bool = False) -> dict[str, Any]:
        cfg = self.config
        safe = {k: v for k, v in asdict(cfg).items() if k not in ("control_token",)}
        return {"run_id": self.run_id, "started_at": self.started_at,
                "ended_at": time.time() if ended else None, "host": cfg.host, "port": cfg.port,
                "policy": cfg.policy, "backends": [asdict(b) for b in cfg.backends], "config": safe,
                "argv": cfg.argv, "kvtop_version": _version(), "schema_version": SCHEMA_VERSION}


#: The app key of the one RouterState (``request.app[STATE]``).
STATE = web.AppKey("state", RouterState)


class _Later:
    """The live pipeline's defer: queued work runs together ``delay_s`` after the first of it,
    on the loop. A decision waiting for its shadow picks is written when its attempt ends
    (router/pipeline.py) or by this timer, whichever comes first: requests shorter than
    ``delay_s`` pay for their shadows after their answer, longer ones' decisions show up at
    most ``delay_s`` late, and a burst of requests costs one timer."""

    def __init__(self, delay_s: float = 0.05):
        self.delay_s = delay_s
        self.items: list[Callable[[], None]] = []
        self.handle: asyncio.TimerHandle | None = None

    def __call__(self, fn: Callable[[], None]) -> None:
        if self.handle is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a unit test driving the state directly): now
                fn()
                return
            self.handle = loop.call_later(self.delay_s, self.run)
        self.items.append(fn)

    def run(self) -> None:
        """Run everything queued (the timer, or the shutdown path before the writer closes)."""
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
        items, self.items = self.items, []
        for fn in items:
            try:
                fn()
            except Exception:  # one bad record must not lose the others
                log.exception("deferred decision record failed")


class _Steps:
    """The live pipeline's background: each function given runs one step per turn of the loop
    (``loop.call_soon``, so the sockets are read between two steps) until it returns True.
    A function already stepping is not started twice. Without a running loop (a unit test
    driving the state directly) it runs to the end at once."""

    def __init__(self) -> None:
        self.active: list[Callable[[], bool]] = []

    def __call__(self, fn: Callable[[], bool]) -> None:
        if fn in self.active:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            while not fn():
                pass
            return
        self.active.append(fn)  # its first step too after the sockets (a request just written)
        loop.call_soon(self._step, fn)

    def _step(self, fn: Callable[[], bool]) -> None:
        try:
            done = fn()
        except Exception:  # noqa: BLE001 - a failed step must not stop the loop's other work
            log.exception("background step failed")
            done = True
        if done:
            self.active.remove(fn)
        else:
            asyncio.get_running_loop().call_soon(self._step, fn)


def _wake(flow) -> None:
    """The live pipeline's on_admit: the request waiting in the admission queue may go."""
    fut = flow.waiter
    if fut is not None and not fut.done():
        fut.set_result(None)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kvtop")
    except Exception:
        return "unknown"
