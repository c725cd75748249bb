"""vLLM's Prometheus metrics for one simulated instance, exposed with prometheus_client as vLLM does.

Names, types, labels (``model_name``, ``engine``), help texts and histogram buckets follow
vLLM 0.32's ``v1/metrics/loggers.py``; each instance has its own registry. Gauges and counters
are read from the engine at scrape time (a collector); histograms are prometheus_client
histograms fed by the server from the engine's step results, with vLLM's definitions
(``v1/metrics/stats.py``):

* TTFT: arrival (the frontend receiving the request) to the first token.
* inter-token latency: between consecutive tokens of a request (one observation per token).
* queue: QUEUED (the engine core takes the request in, between steps) to the first SCHEDULED;
  prefill: first SCHEDULED to the first token; decode: first to last token; inference: first
  SCHEDULED to the last token. A preemption does not restart any of them.
* time per output token, per request: decode time / (output tokens - 1), 0 for one token.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtop.sim.engine import Engine, FinishedRequest

__all__ = ["SimMetrics", "CONTENT_TYPE", "build_1_2_5_buckets"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM loggers.py bucket lists.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
LABELS = ("engine", "model_name")


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    out: list[int] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10 ** exponent
            if v > max_value:
                return tuple(out)
            out.append(v)
        exponent += 1


class _EngineCollector(Collector):
    """Gauges and counters, read from the engine (and the server's busy ratio) at scrape time."""

    def __init__(self, metrics: "SimMetrics"):
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.m
        e = m.engine
        lv = list(m.label_values)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(lv, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(lv, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    e.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    e.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    e.kv_usage)
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.", e.prefix_queries)
        yield counter("vllm:prefix_cache_hits",
                      "Prefix cache hits, in terms of number of cached tokens.", e.prefix_hits)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      e.num_preemptions)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", e.prompt_tokens)
        yield counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
                      m.prompt_tokens_cached)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      e.generation_tokens)
        success = CounterMetricFamily("vllm:request_success",
                                      "Count of successfully processed requests.",
                                      labels=(*LABELS, "finished_reason"))
        for reason in ("stop", "length", "abort"):
            success.add_metric([*lv, reason], e.request_success.get(reason, 0))
        yield success
        cfg = {"block_size": str(e.block_size), "cache_dtype": "auto",
               "enable_prefix_caching": "True", "gpu_memory_utilization": "0.9",
               "num_cpu_blocks": "None", "num_gpu_blocks": str(e.num_gpu_blocks),
               "engine": lv[0], "model_name": lv[1]}
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=list(cfg))
        info.add_metric(list(cfg.values()), 1.0)
        yield info
        yield gauge("kvtop_sim:busy_ratio",
                    "Fraction of recent engine time spent in steps (stand-in for GPU utilisation).",
                    m.busy_ratio_fn())
        yield gauge("kvtop_sim:num_cached_blocks", "Blocks holding a cached prefix hash.",
                    e.num_cached_blocks)


class SimMetrics:
    """The /metrics page of one instance: its own prometheus_client registry."""

    def __init__(self, engine: Engine, model_name: str, engine_label: str = "0"):
        self.engine = engine
        self.label_values = (engine_label, model_name)
        self.registry = CollectorRegistry(auto_describe=False)
        self.prompt_tokens_cached = 0
        self.busy_ratio_fn = lambda: 0.0
        tokens = build_1_2_5_buckets(engine.max_model_len)

        def hist(name: str, doc: str, buckets) -> Histogram:
            h = Histogram(name, doc, labelnames=LABELS, buckets=buckets, registry=self.registry)
            return h.labels(*self.label_values)

        self.h_ttft = hist("vllm:time_to_first_token_seconds",
                           "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.h_itl = hist("vllm:inter_token_latency_seconds",
                          "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.h_tpot = hist("vllm:request_time_per_output_token_seconds",
                           "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.h_e2e = hist("vllm:e2e_request_latency_seconds",
                          "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.h_queue = hist("vllm:request_queue_time_seconds",
                            "Histogram of time spent in WAITING phase for request.",
                            REQUEST_LATENCY_BUCKETS)
        self.h_inference = hist("vllm:request_inference_time_seconds",
                                "Histogram of time spent in RUNNING phase for request.",
                                REQUEST_LATENCY_BUCKETS)
        self.h_prefill = hist("vllm:request_prefill_time_seconds",
                              "Histogram of time spent in PREFILL phase for request.",
                              REQUEST_LATENCY_BUCKETS)
        self.h_decode = hist("vllm:request_decode_time_seconds",
                             "Histogram of time spent in DECODE phase for request.",
                             REQUEST_LATENCY_BUCKETS)
        self.h_prompt = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                             tokens)
        self.h_generation = hist("vllm:request_generation_tokens",
                                 "Number of generation tokens processed.", tokens)
        self.h_max_tokens = hist("vllm:request_params_max_tokens",
                                 "Histogram of the max_tokens request parameter.", tokens)
        self.h_prefill_computed = hist(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).", tokens)
        self.h_iteration = hist("vllm:iteration_tokens_total",
                                "Histogram of number of tokens per engine_step.",
                                ITERATION_TOKEN_BUCKETS)
        self.registry.register(_EngineCollector(self))

    def observe_finished(self, f: FinishedRequest, max_tokens: int) -> None:
        """One finished request, with vLLM's interval definitions (module docstring)."""
        if f.finish_reason == "abort":
            return   # vLLM records no request stats for a request the client aborted
        self.h_e2e.observe(f.finish_time - f.arrival_time)
        self.h_prompt.observe(f.num_prompt_tokens)
        self.h_generation.observe(f.num_output_tokens)
        self.h_max_tokens.observe(max_tokens)
        self.h_prefill_computed.observe(max(0, f.num_prompt_tokens - f.num_cached_tokens))
        self.prompt_tokens_cached += f.num_cached_tokens
        last = f.finish_time
        if f.scheduled_time is not None:
            if f.queued_time is not None:
                self.h_queue.observe(max(0.0, f.scheduled_time - f.queued_time))
            self.h_inference.observe(last - f.scheduled_time)
            if f.first_token_time is not None:
                self.h_prefill.observe(f.first_token_time - f.scheduled_time)
        if f.first_token_time is not None:
            decode = last - f.first_token_time
            self.h_decode.observe(decode)
            self.h_tpot.observe(decode / (f.num_output_tokens - 1) if f.num_output_tokens > 1 else 0.0)

    def render(self) -> bytes:
        """The exposition text (``CONTENT_TYPE``)."""
        return generate_latest(self.registry)
