"""vLLM's Prometheus metrics for one simulated instance, rendered as text without a client library.

Names, types, labels (``model_name``, ``engine``) and histogram buckets follow vLLM's
``v1/metrics/loggers.py``; counters are exposed as ``<name>_total`` under ``# TYPE <name>
counter``, as prometheus_client does. Counters and gauges are read from the engine at scrape
time; histograms are fed from the engine's step results by the server.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtop.sim.engine import Engine, FinishedRequest
from router.telemetry import Histogram as RouterHistogram

# vLLM loggers.py bucket lists.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


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


def _fmt(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    return repr(float(v))


class Histogram(RouterHistogram):
    """A vLLM histogram: the router's implementation, named, with HELP/TYPE and float counts."""

    __slots__ = ("name", "help")

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]):
        super().__init__(buckets)
        self.name = name
        self.help = help_text

    def render(self, labels: str, out: list[str]) -> None:  # type: ignore[override]
        out.append(f"# HELP {self.name} {self.help}")
        out.append(f"# TYPE {self.name} histogram")
        out.extend(super().render(self.name, labels, float_counts=True))


class SimMetrics:
    """The /metrics page of one instance."""

    def __init__(self, engine: Engine, model_name: str, engine_label: str = "0"):
        self.engine = engine
        self.labels = f'engine="{engine_label}",model_name="{model_name}"'
        L = engine.max_model_len
        tokens = build_1_2_5_buckets(L)
        self.h_ttft = Histogram("vllm:time_to_first_token_seconds",
                                "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.h_itl = Histogram("vllm:inter_token_latency_seconds",
                               "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.h_tpot = Histogram("vllm:request_time_per_output_token_seconds",
                                "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.h_e2e = Histogram("vllm:e2e_request_latency_seconds",
                               "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.h_queue = Histogram("vllm:request_queue_time_seconds",
                                 "Histogram of time spent in WAITING phase for request.",
                                 REQUEST_LATENCY_BUCKETS)
        self.h_inference = Histogram("vllm:request_inference_time_seconds",
                                     "Histogram of time spent in RUNNING phase for request.",
                                     REQUEST_LATENCY_BUCKETS)
        self.h_prefill = Histogram("vllm:request_prefill_time_seconds",
                                   "Histogram of time spent in PREFILL phase for request.",
                                   REQUEST_LATENCY_BUCKETS)
        self.h_decode = Histogram("vllm:request_decode_time_seconds",
                                  "Histogram of time spent in DECODE phase for request.",
                                  REQUEST_LATENCY_BUCKETS)
        self.h_prompt = Histogram("vllm:request_prompt_tokens",
                                  "Number of prefill tokens processed.", tokens)
        self.h_generation = Histogram("vllm:request_generation_tokens",
                                      "Number of generation tokens processed.", tokens)
        self.h_max_tokens = Histogram("vllm:request_params_max_tokens",
                                      "Histogram of the max_tokens request parameter.", tokens)
        self.h_iteration = Histogram("vllm:iteration_tokens_total",
                                     "Histogram of number of tokens per engine_step.",
                                     ITERATION_TOKEN_BUCKETS)
        self.histograms = [self.h_ttft, self.h_itl, self.h_tpot, self.h_e2e, self.h_queue,
                           self.h_inference, self.h_prefill, self.h_decode, self.h_prompt,
                           self.h_generation, self.h_max_tokens, self.h_iteration]
        self.busy_ratio_fn = lambda: 0.0

    def observe_finished(self, f: FinishedRequest, max_tokens: int) -> None:
        if f.finish_reason == "abort":
            return
        self.h_e2e.observe(f.finish_time - f.arrival_time)
        self.h_prompt.observe(f.num_prompt_tokens)
        self.h_generation.observe(f.num_output_tokens)
        self.h_max_tokens.observe(max_tokens)
        if f.scheduled_time is not None:
            if f.queued_time is not None:
                self.h_queue.observe(max(0.0, f.scheduled_time - f.queued_time))
            self.h_inference.observe(f.finish_time - f.scheduled_time)
            if f.first_token_time is not None:
                self.h_prefill.observe(f.first_token_time - f.scheduled_time)
        if f.first_token_time is not None:
            self.h_decode.observe(f.finish_time - f.first_token_time)
            if f.num_output_tokens > 1:
                self.h_tpot.observe((f.finish_time - f.first_token_time) / (f.num_output_tokens - 1))

    def render(self) -> str:
        e = self.engine
        lb = self.labels
        out: list[str] = []

        def gauge(name: str, help_text: str, value: float, labels: str = lb) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} gauge")
            out.append(f"{name}{{{labels}}} {_fmt(value)}")

        def counter(name: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} counter")
            for labels, value in samples:
                out.append(f"{name}_total{{{labels}}} {_fmt(value)}")

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
              e.num_running)
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
              e.num_waiting)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", e.kv_usage)
        counter("vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                [(lb, e.prefix_queries)])
        counter("vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.", [(lb, e.prefix_hits)])
        counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                [(lb, e.num_preemptions)])
        counter("vllm:prompt_tokens", "Number of prefill tokens processed.", [(lb, e.prompt_tokens)])
        counter("vllm:generation_tokens", "Number of generation tokens processed.",
                [(lb, e.generation_tokens)])
        counter("vllm:request_success", "Count of successfully processed requests.",
                [(f'{lb},finished_reason="{reason}"', e.request_success.get(reason, 0))
                 for reason in ("stop", "length", "abort")])
        cfg = (f'block_size="{e.block_size}",cache_dtype="auto",enable_prefix_caching="True",'
               f'gpu_memory_utilization="0.9",num_cpu_blocks="None",'
               f'num_gpu_blocks="{e.num_gpu_blocks}",{lb}')
        gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", 1.0, cfg)
        for h in self.histograms:
            h.render(lb, out)
        gauge("kvtop_sim:busy_ratio",
              "Fraction of recent engine time spent in steps (stand-in for GPU utilisation).",
              self.busy_ratio_fn())
        gauge("kvtop_sim:num_cached_blocks", "Blocks holding a cached prefix hash.",
              e.num_cached_blocks)
        out.append("")
        return "\n".join(out)
