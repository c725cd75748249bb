"""What the router measures besides its own decisions: each vLLM's /metrics, GPUs, and
the router's own Prometheus ``GET /metrics``.

A poller task (opened in ``cleanup_ctx``) scrapes every backend's ``/metrics`` about once
a second with a short timeout, samples mapped GPUs through NVML in a worker thread, keeps
short windows of counters for rates, and writes a ``samples`` row per instance every few
seconds. Any source can fail; its error is recorded on the instance and routing goes on.
Both directions of Prometheus text go through prometheus_client: its parser reads the
engines' pages, and the router's own metrics live in a registry per router, exposed with
its encoders.
"""

from __future__ import annotations

import asyncio
import logging
import time
from bisect import bisect_left
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client import metrics as prom_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.utils import floatToGoString
from prometheus_client.exposition import choose_encoder, generate_latest

from router import fleet as fl
from router.engine_metrics import (ENGINE_METRIC_NAMES, MAX_METRICS_BYTES, GpuSampler, InstanceTelemetry,
                                   ParseError, engine_metrics, parse_prometheus)
from router.offload import loads

if TYPE_CHECKING:  # typing only: router/state.py imports this module
    from router.state import RouterState

log = logging.getLogger(__name__)

# -- the router's own /metrics ------------------------------------------------------------------

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
DECISION_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2)


class Histogram:
    """A Prometheus histogram kept as plain counts, exposed by ``RouterCollector`` at scrape
    time exactly as prometheus_client's ``Histogram`` writes one (cumulative ``_bucket`` series
    with its ``le`` labels, ``_count``, ``_sum``, ``_created``). An observation is a bisect and
    two adds on the event loop's thread; prometheus_client's takes a lock for each of its two
    adds, three observations a request on the router's path (docs/performance.md, issue 37
    round 4)."""

    __slots__ = ("name", "documentation", "bounds", "counts", "sum", "created")

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]):
        self.name = name
        self.documentation = documentation
        self.bounds = [float(b) for b in buckets] + [float("inf")]
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        if value == value:   # (a NaN goes in no bucket, only the sum, as prometheus_client's)
            self.counts[bisect_left(self.bounds, value)] += 1  # the first bucket with value <= its bound
        self.sum += value

    def family(self) -> Metric:
        m = Metric(self.name, self.documentation, "histogram")
        total = 0
        for bound, n in zip(self.bounds, self.counts):
            total += n
            m.add_sample(self.name + "_bucket", {"le": floatToGoString(bound)}, float(total))
        m.add_sample(self.name + "_count", {}, float(total))
        m.add_sample(self.name + "_sum", {}, self.sum)
        if getattr(prom_metrics, "_use_created", True):   # prometheus_client's disable_created_metrics()
            m.add_sample(self.name + "_created", {}, self.created)
        return m


class RouterMetrics:
    """Counters fed by the router's decision and outcome events (a ``state.listeners`` entry).

    The counts stay plain dicts and ints, and the latency histograms plain counts (the control
    API's snapshot reads them too; the collector turns them into metric families at scrape
    time, in ``registry``, one per router: tests run several routers in one process, so never
    the global registry).
    """

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.decisions: dict[tuple[str, str], int] = {}
        self.reasons: dict[str, int] = {}
        self.outcomes: dict[str, int] = {}
        #: decisions by (index_source, token_source): exact hits need both KV events and tokens
        self.sources: dict[tuple[str, str], int] = {}
        self.ttft = Histogram("kvtop_ttft_seconds", "time to first token through the router", LATENCY_BUCKETS_S)
        self.e2e = Histogram("kvtop_e2e_seconds", "end-to-end request latency through the router",
                             LATENCY_BUCKETS_S)
        self.decision_latency = Histogram("kvtop_decision_seconds", "time the policy took to pick",
                                          DECISION_BUCKETS_S)
        self.input_tokens = 0
        self.est_hit_tokens = 0
        self.best_hit_tokens = 0
        self.delivered_hit_tokens = 0

    def __call__(self, kind: str, ev: dict[str, Any]) -> None:
        if kind == "decision":
            policy = str(ev.get("policy", "")).partition("@")[0]
            key = (policy, ev.get("reason", ""))
            self.decisions[key] = self.decisions.get(key, 0) + 1
            self.reasons[key[1]] = self.reasons.get(key[1], 0) + 1
            src = (str(ev.get("index_source", "")), str(ev.get("token_source", "")))
            self.sources[src] = self.sources.get(src, 0) + 1
            self.decision_latency.observe((ev.get("decision_us") or 0.0) / 1e6)
            self.input_tokens += ev.get("input_tokens") or 0
            self.est_hit_tokens += ev.get("est_hit") or 0
            self.best_hit_tokens += ev.get("best_hit") or 0
        elif kind == "outcome":
            status = ev.get("status", "unknown")
            self.outcomes[status] = self.outcomes.get(status, 0) + 1
            if ev.get("ttft_ms") is not None:
                self.ttft.observe(ev["ttft_ms"] / 1000)
            if ev.get("e2e_ms") is not None:
                self.e2e.observe(ev["e2e_ms"] / 1000)
            self.delivered_hit_tokens += ev.get("delivered_hit_tokens") or 0


#: The router's per-instance series: (type, name, help, value of a cluster ``InstanceState``;
#: None leaves the instance out).
INSTANCE_SERIES: tuple[tuple[str, str, str, Callable[[Any], float | None]], ...] = (
    ("gauge", "kvtop_instance_healthy", "1 when the instance takes requests", lambda s: int(s.healthy)),
    ("gauge", "kvtop_instance_ejected", "1 while outlier detection keeps the instance out (failing real traffic)",
     lambda s: int(s.ejected)),
    ("counter", "kvtop_instance_ejections_total", "times outlier detection took the instance out",
     lambda s: s.ejections_total),
    ("gauge", "kvtop_instance_num_requests", "requests in flight on the instance (BS_i)",
     lambda s: s.num_requests),
    ("gauge", "kvtop_instance_pending_prefill_tokens", "tokens routed and not yet prefilled (P_i)",
     lambda s: s.pending_prefill_tokens),
    ("gauge", "kvtop_instance_decode_requests", "requests past their first token", lambda s: s.decode_requests),
    ("gauge", "kvtop_instance_sessions", "sessions bound to the instance that the router holds", lambda s: s.sessions),
    ("gauge", "kvtop_instance_decode_tokens", "context tokens of decoding requests (D_i)",
     lambda s: s.ongoing_decode_tokens),
    ("gauge", "kvtop_instance_est_hit_rate", "estimated prefix-hit tokens / input tokens routed, cumulative",
     lambda s: s.est_hit_tokens_total / s.input_tokens_total if s.input_tokens_total else None),
    ("counter", "kvtop_instance_routed_total", "requests routed to the instance", lambda s: s.routed_total),
    ("counter", "kvtop_instance_errors_total", "requests that ended in an error on the instance",
     lambda s: s.errors_total),
)


#: Per instance with KV events (router/kv_events.py): (type, name, help, value of the
#: subscriber's ``SubscriberStats``).
KV_EVENT_SERIES: tuple[tuple[str, str, str, Callable[[Any], float]], ...] = (
    ("counter", "kvtop_instance_kv_event_batches_total", "KV-event batches applied (one per engine step "
     "that changed the cache)", lambda st: st.batches),
    ("counter", "kvtop_instance_kv_events_total", "KV events applied (BlockStored, BlockRemoved, "
     "AllBlocksCleared)", lambda st: st.events),
    ("counter", "kvtop_instance_kv_event_gaps_total", "sequence gaps in the instance's KV events",
     lambda st: st.gaps),
    ("counter", "kvtop_instance_kv_event_replays_total", "replay requests made to fill gaps",
     lambda st: st.replays),
    ("counter", "kvtop_instance_kv_resyncs_total", "gaps nothing could fill: the instance routed on the "
     "estimate until its cache turned over", lambda st: st.resyncs),
    ("counter", "kvtop_instance_kv_restarts_total", "engine restarts seen in the KV events (the index "
     "was cleared)", lambda st: st.restarts),
    ("counter", "kvtop_instance_kv_event_bad_messages_total", "KV-event messages that were not "
     "[topic,] seq, KVEventBatch", lambda st: st.bad_messages),
)
#: The states ``kvtop_instance_kv_events_state`` enumerates (router/kv_events.py).
KV_STATES = ("waiting", "exact", "replaying", "resync", "disconnected", "stopped")


def _kv_families(st: RouterState) -> Iterator[Metric]:
    """The KV-event families: the exact gauge for every instance, the rest for those whose
    events the router follows (no sample for an instance without ``@kv=``)."""
    cluster = st.cluster
    subs = getattr(st, "kv_subscribers", None) or []
    ex = getattr(cluster, "exact", None)  # a stand-in cluster (tests) may have no index
    exact = GaugeMetricFamily("kvtop_instance_kv_index_exact", "1 while the instance's hits come from its "
                              "KV events (exact), 0 while from the router's estimate", labels=["instance"])
    for s in cluster.instances:
        exact.add_metric([s.name], int(ex is not None and ex.is_live(s.index)))
    yield exact
    followed = [(s, sub) for s, sub in zip(cluster.instances, subs) if sub is not None]
    state = GaugeMetricFamily("kvtop_instance_kv_events_state", "1 for the state the instance's KV-event "
                              "subscriber is in (docs/kv-events.md)", labels=["instance", "state"])
    for s, sub in followed:
        for name in KV_STATES:
            state.add_metric([s.name, name], int(sub.stats.state == name))
    yield state
    for kind, name, doc, value in KV_EVENT_SERIES:
        family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=["instance"])
        for s, sub in followed:
            family.add_metric([s.name], value(sub.stats))
        yield family
    blocks = GaugeMetricFamily("kvtop_instance_kv_cached_blocks", "router blocks the instance's KV events "
                               "say it holds", labels=["instance"])
    drift = CounterMetricFamily("kvtop_instance_kv_drift_tokens_total", "|estimated - exact| hit tokens, "
                                "summed over decisions while the instance was exact: how far the router's "
                                "own estimate was from the engine's cache", labels=["instance"])
    drift_in = CounterMetricFamily("kvtop_instance_kv_drift_input_tokens_total", "input tokens of those "
                                   "decisions (drift_tokens / this is the drift's share)", labels=["instance"])
    drift_n = CounterMetricFamily("kvtop_instance_kv_drift_decisions_total", "decisions that compared the "
                                  "estimate with the instance's exact hit", labels=["instance"])
    share = GaugeMetricFamily("kvtop_instance_kv_drift_share", "drift tokens / input tokens since the router "
                              "started (no sample before a decision while exact)", labels=["instance"])
    if ex is not None:
        for s, _ in followed:
            ib = ex.instances[s.index]
            blocks.add_metric([s.name], len(ib.counts))
            drift.add_metric([s.name], ib.drift_tokens)
            drift_in.add_metric([s.name], ib.drift_input_tokens)
            drift_n.add_metric([s.name], ib.drift_samples)
            if ib.drift_input_tokens:
                share.add_metric([s.name], ib.drift_tokens / ib.drift_input_tokens)
    yield from (blocks, drift, drift_in, drift_n, share)


def _fleet_families(st: RouterState) -> Iterator[Metric]:
    """``kvtop_instance_fleet_state`` (one series per state, 1 for the current one, as
    kube-state-metrics does), the drain's sessions still homed, and the expected queue seconds
    per instance as the routing's lookahead prices it (a signal for autoscalers)."""
    router = getattr(st, "router", None)
    if router is None:  # a stand-in state (tests) without a router
        return
    cluster = st.cluster
    f = router.fleet
    state = GaugeMetricFamily("kvtop_instance_fleet_state", "1 for the instance's fleet state: active, "
                              "cordoned (no new sessions), draining (no new requests), removed",
                              labels=["instance", "state"])
    homed = GaugeMetricFamily("kvtop_instance_drain_sessions_homed", "sessions still homed on a draining "
                              "instance (each moves at its next turn); no sample unless draining",
                              labels=["instance"])
    for s in cluster.instances:
        for name in fl.STATES:
            state.add_metric([s.name, name], int(f.states[s.index] == name))
        if f.states[s.index] == fl.DRAINING:
            homed.add_metric([s.name], fl.sessions_homed(cluster, s.index))
    yield state
    yield homed
    queue = GaugeMetricFamily("kvtop_instance_queue_seconds", "seconds of prefill queued on the instance "
                              "ahead of a request routed now, at its measured prefill rate (what "
                              "expected_cost prices as its queue); healthy instances", labels=["instance"])
    for i, wait in cluster.lookahead(loads(cluster), 0, None, None).wait_s.items():
        queue.add_metric([cluster.instances[i].name], wait)
    yield queue
    from router.discovery import metric_families

    yield from metric_families(st)  # kvtop_discovery_ok, _errors_total, _changes_total


class RouterCollector:
    """A prometheus_client collector: the per-instance series, read from the cluster state
    at scrape time, and ``RouterMetrics``' counts and histograms."""

    def __init__(self, tel: Telemetry):
        self.tel = tel

    def collect(self) -> Iterator[Metric]:
        st = self.tel.state
        m = self.tel.metrics
        for kind, name, doc, value in INSTANCE_SERIES:
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=["instance"])
            for s in st.cluster.instances:
                v = value(s)
                if v is not None:
                    family.add_metric([s.name], v)
            yield family
        family = CounterMetricFamily("kvtop_instance_scrape_errors_total", "failed scrapes of the instance's /metrics",
                                     labels=["instance"])
        for it in self.tel.instances:
            family.add_metric([it.name], it.scrape_errors_total)
        yield family
        yield from _kv_families(st)
        yield from _fleet_families(st)
        family = GaugeMetricFamily("kvtop_policy_version", "version of the active policy (increments on every change)",
                                   labels=["policy"])
        family.add_metric([st.slot.policy.name], st.slot.version)
        yield family
        family = CounterMetricFamily("kvtop_decisions_total", "routing decisions by policy and reason",
                                     labels=["policy", "reason"])
        for (policy, reason), n in sorted(m.decisions.items()):
            family.add_metric([policy, reason], n)
        yield family
        family = CounterMetricFamily("kvtop_decisions_by_source_total", "routing decisions by where the chosen "
                                     "hit came from (index_source: exact or estimate) and how the prompt was "
                                     "counted (token_source)", labels=["index_source", "token_source"])
        for (index_source, token_source), n in sorted(m.sources.items()):
            family.add_metric([index_source, token_source], n)
        yield family
        family = CounterMetricFamily("kvtop_outcomes_total", "finished request attempts by status", labels=["status"])
        for status, n in sorted(m.outcomes.items()):
            family.add_metric([status], n)
        yield family
        sup = getattr(st, "supervisor", None)
        if sup is not None:
            deaths = CounterMetricFamily("kvtop_background_task_deaths_total", "times a background task "
                                         "(KV subscriber, health probe, telemetry, writer, parser worker) died; "
                                         "each was logged and restarted (router/supervise.py)", labels=["task", "kind"])
            down = GaugeMetricFamily("kvtop_background_task_degraded", "1 while the task is down or died in "
                                     "the last minute (the state's degraded list)", labels=["task", "kind"])
            bad = {d["task"] for d in st.degraded()}
            for h in sup.tasks.values():
                deaths.add_metric([h.name, h.kind], h.deaths)
                down.add_metric([h.name, h.kind], int(h.name in bad))
            if st.writer is not None:
                down.add_metric(["decision-log", "writer"], int("decision-log" in bad))
            yield deaths
            yield down
        writer = st.writer.health() if st.writer is not None else None
        if writer is not None:
            for kind, name, doc, key in (
                    ("counter", "kvtop_decision_log_rows_written_total", "rows the decision log wrote", "rows_written"),
                    ("counter", "kvtop_decision_log_rows_dropped_total",
                     "rows dropped because the decision log's queue was full", "rows_dropped"),
                    ("counter", "kvtop_decision_log_rows_failed_total", "rows lost to failed writes (disk full, ...)",
                     "rows_failed"),
                    ("gauge", "kvtop_decision_log_queued_rows", "rows waiting to be written", "rows_queued"),
                    ("gauge", "kvtop_decision_log_lag_seconds", "age of the newest written row when rows wait",
                     "lag_s")):
                yield (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, value=writer[key])
        for name, doc, n in (
                ("kvtop_input_tokens_total", "input tokens of routed requests", m.input_tokens),
                ("kvtop_est_hit_tokens_total", "estimated cached tokens on the chosen instance", m.est_hit_tokens),
                ("kvtop_best_hit_tokens_total", "best estimated cached tokens on any instance", m.best_hit_tokens),
                ("kvtop_delivered_hit_tokens_total", "cached tokens the engines reported (usage.cached_tokens)",
                 m.delivered_hit_tokens)):
            yield CounterMetricFamily(name, doc, value=n)
        for hist in (m.ttft, m.e2e, m.decision_latency):
            yield hist.family()


# -- the telemetry service -----------------------------------------------------------------------

class Telemetry:
    """Scrapes, samples and keeps windows for every instance of one router."""

    def __init__(self, state: RouterState, *, scrape_interval_s: float = 1.0, scrape_timeout_s: float = 0.8,
                 sample_every_s: float = 5.0, gpu_sampler: GpuSampler | None = None):
        self.state = state
        self.scrape_interval_s = scrape_interval_s
        self.scrape_timeout_s = scrape_timeout_s
        self.sample_every_s = sample_every_s
        self.instances = [InstanceTelemetry(b.name, b.url, b.gpu) for b in state.config.backends]
        self.gpu = gpu_sampler or GpuSampler()
        #: This router's metrics (never prometheus_client's global registry): the collector's
        #: families first, then the histograms, as ``GET /metrics`` lists them.
        self.registry = CollectorRegistry()
        self.registry.register(RouterCollector(self))
        self.metrics = RouterMetrics(self.registry)
        self.ticks = 0
        self._last_sample_row = 0.0
        self._session: aiohttp.ClientSession | None = None

    # -- one round ---------------------------------------------------------------------
    async def scrape_one(self, it: InstanceTelemetry) -> None:
        try:
            timeout = aiohttp.ClientTimeout(total=self.scrape_timeout_s)
            async with self._session.get(it.url + "/metrics", timeout=timeout) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}")
                body = bytearray()
                async for chunk in r.content.iter_chunked(1 << 16):
                    body += chunk
                    if len(body) > MAX_METRICS_BYTES:
                        raise RuntimeError(f"page over {MAX_METRICS_BYTES:,} bytes")
            text = body.decode("utf-8", errors="replace")
            metrics = parse_prometheus(text, ENGINE_METRIC_NAMES)
            if not metrics:  # say what came instead: an error page, another server's metrics
                raise ParseError(f"no vLLM metric on the page ({len(body):,} bytes: {text[:60]!r})")
            em = engine_metrics(metrics)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, RuntimeError, ValueError) as exc:
            it.scrape_error = f"/metrics: {type(exc).__name__}: {exc}".rstrip(": ")
            it.scrape_errors_total += 1
            return
        now = time.time()
        it.engine, it.scraped_at, it.scrape_error = em, now, None
        if em.prefix_queries is not None:
            it.engine_window.add(now, (em.prefix_queries, em.prefix_hits or 0.0))

    async def sample_gpus(self) -> None:
        mapped = [it for it in self.instances if it.gpu is not None]
        data: dict[int, Any] = {}
        if mapped and self.gpu.available:
            loop = asyncio.get_running_loop()
            try:
                data = await loop.run_in_executor(None, self.gpu.sample, sorted({it.gpu for it in mapped}))
            except Exception as exc:
                data = {it.gpu: f"NVML error: {exc}" for it in mapped}
        for it in self.instances:
            got = data.get(it.gpu) if it.gpu is not None else None
            it.gpu_error = got if isinstance(got, str) else None
            if isinstance(got, tuple):
                it.gpu_util, it.gpu_mem_used, it.gpu_mem_total = got
                it.gpu_source, it.gpu_note = "nvml", None
                continue
            busy = it.engine.busy_ratio if it.engine else None
            it.gpu_mem_used = it.gpu_mem_total = None
            if busy is not None:
                it.gpu_util, it.gpu_source, it.gpu_note = busy * 100.0, "sim_busy_ratio", None
                continue
            it.gpu_util = it.gpu_source = None
            if it.gpu is None:
                it.gpu_note = "n/a: no @gpu=N mapping for this backend"
            elif not self.gpu.available:
                it.gpu_note = f"n/a: {self.gpu.reason}"
            else:
                it.gpu_note = f"n/a: {got}"

    def sample_router(self, now: float) -> None:
        for it, s in zip(self.instances, self.state.cluster.instances):
            it.router_window.add(now, (s.routed_total, s.input_tokens_total, s.est_hit_tokens_total))

    def write_samples(self, now: float) -> None:
        writer = self.state.writer
        if writer is None:
            return
        for it, s in zip(self.instances, self.state.cluster.instances):
            eng = it.engine_json(now)
            writer.put("samples", {
                "run_id": self.state.run_id, "ts": now, "instance": s.name, "healthy": int(s.healthy),
                "num_requests": s.num_requests, "pending_prefill_tokens": s.pending_prefill_tokens,
                "decode_requests": s.decode_requests, "decode_tokens": s.ongoing_decode_tokens,
                "est_hit_rate": (s.est_hit_tokens_total / s.input_tokens_total) if s.input_tokens_total else None,
                "engine_hit_rate": eng["prefix_hit_rate_recent"] if eng["prefix_hit_rate_recent"] is not None
                else eng["prefix_hit_rate"],
                "engine_prefix_queries": it.engine.prefix_queries if it.engine else None,
                "engine_prefix_hits": it.engine.prefix_hits if it.engine else None,
                "kv_usage": eng["kv_usage"], "gpu_util": it.gpu_util, "gpu_mem_used": it.gpu_mem_used,
            })

    async def tick(self) -> None:
        now = time.time()
        self.sample_router(now)
        await asyncio.gather(*(self.scrape_one(it) for it in self.instances if not it.removed),
                             return_exceptions=True)
        await self.sample_gpus()
        if now - self._last_sample_row >= self.sample_every_s:
            self._last_sample_row = now
            self.write_samples(now)
        self.ticks += 1

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # telemetry must never take the router down
                log.warning("telemetry round failed: %r", exc)
            await asyncio.sleep(max(0.05, self.scrape_interval_s - (loop.time() - t0)))

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> asyncio.Task:
        self._session = aiohttp.ClientSession()
        if any(it.gpu is not None for it in self.instances):
            await asyncio.get_running_loop().run_in_executor(None, self.gpu.init)
        else:
            self.gpu.reason = "NVML not used: no backend is mapped with @gpu=N"
        sup = getattr(self.state, "supervisor", None)
        if sup is not None:  # the poller catches each round's errors; this catches the rest
            return sup.spawn("telemetry", self.run, kind="telemetry",
                             fallback="restarted; engine figures go stale meanwhile")
        return asyncio.get_running_loop().create_task(self.run(), name="kvtop-telemetry")

    async def stop(self, task: asyncio.Task) -> None:
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        if self._session is not None:
            await self._session.close()
        if self.gpu.available:
            await asyncio.get_running_loop().run_in_executor(None, self.gpu.shutdown)

    # -- views ---------------------------------------------------------------------------
    def instance_rates(self, i: int, now: float) -> dict[str, float | None]:
        s = self.state.cluster.instances[i]
        d = self.instances[i].router_window.delta(now, (s.routed_total, s.input_tokens_total,
                                                        s.est_hit_tokens_total))
        if d is None:
            return {"request_rate": None, "est_hit_rate_recent": None}
        dt, (dreq, dinp, dhit) = d
        return {"request_rate": dreq / dt if dt >= 0.5 else None,
                "est_hit_rate_recent": (dhit / dinp) if dinp > 0 else None}

    def render_metrics(self) -> str:
        """The router's own Prometheus text exposition (format 0.0.4)."""
        return generate_latest(self.registry).decode()


TELEMETRY = web.AppKey("telemetry", Telemetry)


async def metrics_handler(request: web.Request) -> web.Response:
    """``GET /metrics`` in the format the scraper asks for (Prometheus text, or OpenMetrics
    when its Accept header says so), as prometheus_client's own handlers choose."""
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    return web.Response(body=encoder(request.app[TELEMETRY].registry),
                        headers={"Content-Type": content_type})


def setup(app: web.Application, state: RouterState) -> Telemetry:
    """Create the telemetry service, feed it events, serve ``GET /metrics``, run the poller."""
    cfg = state.config
    tel = Telemetry(state, scrape_interval_s=getattr(cfg, "scrape_interval_s", 1.0))
    app[TELEMETRY] = tel
    state.listeners.append(tel.metrics)
    app.router.add_get("/metrics", metrics_handler)

    async def poller(app: web.Application) -> AsyncIterator[None]:
        task = await tel.start()
        try:
            yield
        finally:
            await tel.stop(task)

    app.cleanup_ctx.append(poller)
    return tel
