"""What the router reads from its engines and GPUs: each vLLM's /metrics page parsed with
prometheus_client's parser (bounded), the engine figures routing uses, counter windows for
rates, per-instance telemetry and NVML GPU sampling. router/telemetry.py polls them and
exposes the router's own /metrics.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("router.telemetry")


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
