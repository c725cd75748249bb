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
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from router import fleet as fl
from router.offload import loads

if TYPE_CHECKING:  # typing only: router/state.py imports this module
    from router.state import RouterState

log = logging.getLogger(__name__)

# -- Prometheus text parsing --------------------------------------------------------------

Sample = tuple[dict[str, str], float]

#: A /metrics page larger than this is refused, not buffered (vLLM's is ~50 KB per engine).
MAX_METRICS_BYTES = 8 << 20
#: At most this much of a page's text is parsed when the caller names what it reads (the
#: router's 13 names take ~1 KB an engine); it bounds the parse at ~40 ms whatever comes.
MAX_NAMED_BYTES = 256 << 10


class ParseError(ValueError):
    """A /metrics page with nothing usable in it; the message says why."""


def parse_prometheus(text: str, names: Collection[str] | None = None) -> dict[str, list[Sample]]:
    """Parse Prometheus text exposition into ``{sample name: [(labels, value), ...]}`` with
    prometheus_client's parser.

    ``names``: keep only these sample names. Lines are picked by name before parsing, so
    the router parses the dozen lines it reads, not vLLM's ~700 (prometheus_client's parser
    takes ~9 ms for a whole vLLM page); more than ``MAX_NAMED_BYTES`` of them is a
    ``ParseError``. Timestamps and types are dropped. A line the parser
    rejects is skipped rather than failing the whole page (one odd metric must not hide the
    rest); a page with sample lines and not one good one raises ``ParseError``.
    """
    lines = text.splitlines()
    if names is not None:
        lines = _lines_named(lines, names)
    try:
        return _samples(text_string_to_metric_families("\n".join(lines) + "\n"))
    except Exception:  # a parser of untrusted text: any failure means "some line is bad"
        pass
    out: dict[str, list[Sample]] = {}
    bad = 0
    first_error = ""
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            for name, got in _samples(text_string_to_metric_families(line + "\n")).items():
                out.setdefault(name, []).extend(got)
        except Exception as exc:
            bad += 1
            first_error = first_error or f"{line[:80]!r}: {exc}".rstrip(": ")
    if bad and not out:
        raise ParseError(f"no sample parses ({bad} bad lines; first {first_error})")
    return out


def _lines_named(lines: list[str], names: Collection[str]) -> list[str]:
    """The sample lines of ``lines`` whose metric name is one of ``names``."""
    prefixes = tuple(names)
    kept = []
    size = 0
    for line in lines:
        if line.startswith(prefixes):  # cheap (C) first pass; then the exact name
            end = len(line)
            for stop in ("{", " ", "\t"):
                i = line.find(stop, 0, end)
                if i >= 0:
                    end = i
            if line[:end] in names:
                kept.append(line)
                size += len(line) + 1
                if size > MAX_NAMED_BYTES:
                    raise ParseError(f"over {MAX_NAMED_BYTES:,} bytes of {line[:end]} and the like")
    return kept


def _samples(families: Iterable[Metric]) -> dict[str, list[Sample]]:
    out: dict[str, list[Sample]] = {}
    for family in families:
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, float(s.value)))
    return out


# -- what the router reads from an engine ---------------------------------------------------

# Current name first, then deprecated ones (vLLM renamed gpu_cache_usage_perc and the
# gpu_prefix_cache_* counters; counters appear with and without the _total suffix).
RUNNING = ("vllm:num_requests_running",)
WAITING = ("vllm:num_requests_waiting",)
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries",
                  "vllm:gpu_prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries")
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits",
               "vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits")
BUSY_RATIO = ("kvtop_sim:busy_ratio",)
#: Every sample name ``engine_metrics`` reads: the scrape parses only these lines.
ENGINE_METRIC_NAMES = frozenset(RUNNING + WAITING + KV_USAGE + PREFIX_QUERIES + PREFIX_HITS + BUSY_RATIO)


@dataclass
class EngineMetrics:
    """One scrape, reduced over the ``engine`` (DP rank) and ``model_name`` labels.

    Counts and counters are summed over series; ratios (KV usage, busy ratio) are averaged.
    ``names`` records which metric name each value came from (current or deprecated).
    """

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    busy_ratio: float | None = None
    names: dict[str, str] = field(default_factory=dict)


def _pick(metrics: dict[str, list[Sample]], names: Iterable[str], mean: bool = False
          ) -> tuple[float | None, str | None]:
    for name in names:
        series = metrics.get(name)
        if series:
            values = [v for _, v in series if not math.isnan(v)]
            if not values:
                return None, name
            total = sum(values)
            return (total / len(values) if mean else total), name
    return None, None


def engine_metrics(metrics: dict[str, list[Sample]]) -> EngineMetrics:
    em = EngineMetrics()
    for attr, names, mean in (("running", RUNNING, False), ("waiting", WAITING, False),
                              ("kv_usage", KV_USAGE, True), ("prefix_queries", PREFIX_QUERIES, False),
                              ("prefix_hits", PREFIX_HITS, False), ("busy_ratio", BUSY_RATIO, True)):
        value, name = _pick(metrics, names, mean)
        setattr(em, attr, value)
        if name:
            em.names[attr] = name
    return em


# -- windows ---------------------------------------------------------------------------------

class CounterWindow:
    """Timestamped samples of cumulative counters; rates over the last ``window_s``."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.samples: deque[tuple[float, tuple[float, ...]]] = deque()

    def add(self, t: float, values: tuple[float, ...]) -> None:
        if self.samples and any(v < p for v, p in zip(values, self.samples[-1][1])):
            self.samples.clear()  # a counter went backwards: the engine restarted
        self.samples.append((t, values))
        while len(self.samples) > 2 and t - self.samples[1][0] >= self.window_s:
            self.samples.popleft()

    def delta(self, now: float, current: tuple[float, ...]) -> tuple[float, tuple[float, ...]] | None:
        """(seconds, per-counter increase) from the oldest kept sample to ``current``."""
        if not self.samples:
            return None
        t0, v0 = self.samples[0]
        dt = now - t0
        if dt <= 0:
            return None
        return dt, tuple(c - p for c, p in zip(current, v0))


# -- per-instance telemetry --------------------------------------------------------------------

@dataclass
class InstanceTelemetry:
    name: str
    url: str
    gpu: int | None
    engine: EngineMetrics | None = None
    scraped_at: float | None = None
    scrape_error: str | None = None
    scrape_errors_total: int = 0
    engine_window: CounterWindow = field(default_factory=lambda: CounterWindow(30.0))
    router_window: CounterWindow = field(default_factory=lambda: CounterWindow(10.0))
    gpu_util: float | None = None  # percent
    gpu_mem_used: float | None = None  # bytes
    gpu_mem_total: float | None = None
    gpu_source: str | None = None  # nvml | sim_busy_ratio
    gpu_note: str | None = None  # "n/a: <reason>" when nothing is known
    gpu_error: str | None = None
    removed: bool = False  # taken out of the fleet (router/fleet_api.py): no longer scraped

    def engine_json(self, now: float) -> dict[str, Any]:
        em = self.engine
        out: dict[str, Any] = {"running": None, "waiting": None, "kv_usage": None,
                               "prefix_hit_rate": None, "prefix_hit_rate_recent": None,
                               "busy_ratio": None, "metric_names": {},
                               "scraped_at": self.scraped_at,
                               "age_s": round(now - self.scraped_at, 3) if self.scraped_at else None,
                               "error": self.scrape_error, "errors_total": self.scrape_errors_total}
        if em is None:
            return out
        out.update(running=em.running, waiting=em.waiting, kv_usage=em.kv_usage,
                   busy_ratio=em.busy_ratio, metric_names=dict(em.names))
        if em.prefix_queries:
            out["prefix_hit_rate"] = (em.prefix_hits or 0.0) / em.prefix_queries
        if em.prefix_queries is not None and self.scraped_at is not None:
            d = self.engine_window.delta(self.scraped_at, (em.prefix_queries, em.prefix_hits or 0.0))
            if d and d[1][0] > 0:
                out["prefix_hit_rate_recent"] = d[1][1] / d[1][0]
        return out

    def gpu_json(self) -> dict[str, Any]:
        return {"util_pct": self.gpu_util, "mem_used_bytes": self.gpu_mem_used,
                "mem_total_bytes": self.gpu_mem_total, "source": self.gpu_source,
                "note": self.gpu_note, "error": self.gpu_error, "index": self.gpu}


# -- GPU sampling ------------------------------------------------------------------------------

class GpuSampler:
    """NVML utilisation and memory for GPU indexes; blocking calls, run it in a thread."""

    def __init__(self):
        self.available = False
        self.reason: str | None = None
        self._nvml: Any = None
        self._handles: dict[int, Any] = {}
        self._v2: dict[int, bool] = {}  # per GPU: whether nvmlDeviceGetMemoryInfo_v2 answers

    def init(self) -> bool:
        try:
            import pynvml  # from the nvidia-ml-py package

            pynvml.nvmlInit()
        except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, driver errors
            self.reason = f"NVML not available: {type(exc).__name__}: {exc}".rstrip(": ")
            return False
        self._nvml = pynvml
        # what a driver or nvidia-ml-py without the v2 memory call raises (names vary by version)
        self._no_v2 = (AttributeError, TypeError) + tuple(
            getattr(pynvml, n) for n in ("NVMLError_FunctionNotFound", "NVMLError_NotSupported",
                                         "NVMLError_ArgumentVersionMismatch") if hasattr(pynvml, n))
        self.available = True
        return True

    def sample(self, indexes: Iterable[int]) -> dict[int, tuple[float, float, float] | str]:
        """{index: (util %, mem used bytes, mem total bytes) or an error string}."""
        out: dict[int, tuple[float, float, float] | str] = {}
        nv = self._nvml
        for i in indexes:
            try:
                h = self._handles.get(i)
                if h is None:
                    h = self._handles[i] = nv.nvmlDeviceGetHandleByIndex(i)
                util = nv.nvmlDeviceGetUtilizationRates(h)
                out[i] = (float(util.gpu), *self._memory(i, h))
            except Exception as exc:
                out[i] = f"NVML error on GPU {i}: {exc}"
        return out

    def _memory(self, i: int, h: Any) -> tuple[float, float]:
        """(used, total) bytes as nvidia-smi shows them: NVML's v2 call, whose "used" leaves out
        the memory the driver reserves (about 480 MiB on an H100, counted as used by the v1 call
        on an idle GPU); the v1 call on a driver or device (a MIG or vGPU instance) without v2,
        decided per GPU on its first reading."""
        nv = self._nvml
        v2 = self._v2.get(i)
        if v2 is not False:
            try:
                mem = nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2)
                self._v2[i] = True
                return float(mem.used), float(mem.total)
            except self._no_v2:
                if v2:
                    raise   # it answered before: an error to show, not a silent switch
                self._v2[i] = False  # this GPU (driver, binding) has no v2: v1 for good
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        return float(mem.used), float(mem.total)

    def shutdown(self) -> None:
        if self.available:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self.available = False


# -- the router's own /metrics ------------------------------------------------------------------

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
DECISION_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2)


class RouterMetrics:
    """Counters fed by the router's decision and outcome events (a ``state.listeners`` entry).

    The counts stay plain dicts and ints (the control API's snapshot reads them too; the
    collector turns them into metric families at scrape time); the latency histograms are
    prometheus_client ``Histogram``s in ``registry``, one per router (tests run several
    routers in one process, so never the global registry).
    """

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.decisions: dict[tuple[str, str], int] = {}
        self.reasons: dict[str, int] = {}
        self.outcomes: dict[str, int] = {}
        #: decisions by (index_source, token_source): exact hits need both KV events and tokens
        self.sources: dict[tuple[str, str], int] = {}
        self.ttft = Histogram("kvtop_ttft_seconds", "time to first token through the router",
                              buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.e2e = Histogram("kvtop_e2e_seconds", "end-to-end request latency through the router",
                             buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.decision_latency = Histogram("kvtop_decision_seconds", "time the policy took to pick",
                                          buckets=DECISION_BUCKETS_S, registry=self.registry)
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


def _kv_families(st: Any) -> Iterator[Metric]:
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


def _fleet_families(st: Any) -> Iterator[Metric]:
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


class RouterCollector:
    """A prometheus_client collector: the per-instance series, read from the cluster state
    at scrape time, and ``RouterMetrics``' counts (its histograms are collected on their own)."""

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
