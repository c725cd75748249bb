"""Cost of the router's telemetry: rendering its own ``GET /metrics``, feeding it one decision
and one outcome (the per-request listener call), and parsing one vLLM ``/metrics`` page.

No server, no network: a fake router state with N instances and a few thousand events
already counted, then tight loops; each figure is the best of ``--repeat`` runs (the shared
machine is noisy). Run: ``python benchmarks/bench_telemetry.py`` (prints µs per call); to
compare with an older telemetry module: ``git show REV:router/telemetry.py > /tmp/old.py``
then ``--module /tmp/old.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
import time
from types import ModuleType, SimpleNamespace

from router.cluster import InstanceState

POLICIES = ("unified", "lmetric", "leastwork")
REASONS = ("argmin", "tie_rr", "affinity_stick", "affinity_new", "overload_break", "cache_gate_miss")


def fake_state(n: int) -> SimpleNamespace:
    backends = [SimpleNamespace(name=f"i{k}", url=f"http://127.0.0.1:{9000 + k}", gpu=None) for k in range(n)]
    instances = [InstanceState(k, f"i{k}", num_requests=k % 7, pending_prefill_tokens=1000 * k,
                               ongoing_decode_tokens=50_000 + k, decode_requests=k % 5, routed_total=100 * k,
                               input_tokens_total=10**6 * (k + 1), est_hit_tokens_total=5 * 10**5 * (k + 1),
                               errors_total=k % 3) for k in range(n)]
    return SimpleNamespace(config=SimpleNamespace(backends=backends), cluster=SimpleNamespace(instances=instances),
                           slot=SimpleNamespace(policy=SimpleNamespace(name="unified"), version=3),
                           writer=None, run_id="bench")


def events(rng: random.Random, k: int) -> list[tuple[str, dict]]:
    out = []
    for _ in range(k):
        out.append(("decision", {"policy": f"{rng.choice(POLICIES)}@1", "reason": rng.choice(REASONS),
                                 "decision_us": rng.uniform(5, 500), "input_tokens": rng.randrange(100, 200_000),
                                 "est_hit": rng.randrange(0, 100), "best_hit": rng.randrange(0, 100)}))
        out.append(("outcome", {"status": rng.choice(("ok", "ok", "ok", "error")), "ttft_ms": rng.uniform(1, 9000),
                                "e2e_ms": rng.uniform(10, 90_000), "delivered_hit_tokens": rng.randrange(0, 99)}))
    return out


def vllm_page(engines: int = 2, histograms: int = 14, buckets: int = 20) -> str:
    """A vLLM-sized exposition: gauges, counters and histograms for ``engines`` DP ranks."""
    lines = []
    for name, kind in (("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
                       ("vllm:kv_cache_usage_perc", "gauge"), ("vllm:prefix_cache_queries", "counter"),
                       ("vllm:prefix_cache_hits", "counter"), ("vllm:prompt_tokens", "counter"),
                       ("vllm:generation_tokens", "counter"), ("vllm:num_preemptions", "counter")):
        full = name + "_total" if kind == "counter" else name
        lines += [f"# HELP {full} {name}.", f"# TYPE {full} {kind}"]
        lines += [f'{full}{{engine="{e}",model_name="qwen"}} {1234.0 * (e + 1)}' for e in range(engines)]
    for h in range(histograms):
        name = f"vllm:histogram_{h}_seconds"
        lines += [f"# HELP {name} Histogram {h}.", f"# TYPE {name} histogram"]
        for e in range(engines):
            lab = f'engine="{e}",model_name="qwen"'
            lines += [f'{name}_bucket{{{lab},le="{0.01 * 2 ** b}"}} {float(b * 10)}' for b in range(buckets)]
            lines += [f'{name}_bucket{{{lab},le="+Inf"}} 200.0', f"{name}_count{{{lab}}} 200.0",
                      f"{name}_sum{{{lab}}} 123.4"]
    return "\n".join(lines) + "\n"


REPEAT = 5


def per_call_us(fn, min_s: float = 0.3) -> float:
    """Best of ``REPEAT`` timed loops of at least ``min_s`` each: µs per call."""
    best = float("inf")
    for _ in range(REPEAT):
        calls, t0 = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_s and calls >= 10:
                break
        best = min(best, elapsed / calls * 1e6)
    return best


def load(path: str | None) -> ModuleType:
    if path is None:
        from router import telemetry
        return telemetry
    spec = importlib.util.spec_from_file_location("telemetry_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def main() -> None:
    global REPEAT
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", default="8,64")
    ap.add_argument("--events", type=int, default=5000, help="decisions (and as many outcomes) counted first")
    ap.add_argument("--repeat", type=int, default=REPEAT, help="timed loops per figure; the best is shown")
    ap.add_argument("--module", help="a telemetry.py file to measure instead of router/telemetry.py")
    args = ap.parse_args()
    REPEAT = args.repeat
    telemetry = load(args.module)
    Telemetry, engine_metrics, parse_prometheus = (telemetry.Telemetry, telemetry.engine_metrics,
                                                   telemetry.parse_prometheus)
    rng = random.Random(1)
    for n in (int(x) for x in args.instances.split(",")):
        tel = Telemetry(fake_state(n))
        for kind, ev in events(rng, args.events):
            tel.metrics(kind, ev)
        text = tel.render_metrics()
        us = per_call_us(tel.render_metrics)
        print(f"render /metrics, {n:>3} instances: {us:8.1f} µs per render ({len(text):,} bytes)")
    feed = events(rng, 2000)
    tel = Telemetry(fake_state(8))

    def feed_all() -> None:
        for kind, ev in feed:
            tel.metrics(kind, ev)

    print(f"listener, one decision + one outcome: {per_call_us(feed_all) / 2000:8.2f} µs")
    page = vllm_page()
    print(f"parse one whole vLLM /metrics ({len(page):,} bytes, {page.count(chr(10))} lines): "
          f"{per_call_us(lambda: engine_metrics(parse_prometheus(page))):8.1f} µs")
    names = getattr(telemetry, "ENGINE_METRIC_NAMES", None)  # the scrape reads only these lines
    if names is not None:
        print(f"parse the same page as the scrape does (its {len(names)} names): "
              f"{per_call_us(lambda: engine_metrics(parse_prometheus(page, names))):8.1f} µs")
    gpus = telemetry.GpuSampler()
    if gpus.init():  # one NVML sample of GPU 0 (utilisation + memory), in the scrape's thread
        try:
            print(f"NVML sample of one GPU (utilisation + memory): "
                  f"{per_call_us(lambda: gpus.sample([0])):8.1f} µs")
        finally:
            gpus.shutdown()
    else:
        print(f"NVML sample: n/a ({gpus.reason})")


if __name__ == "__main__":
    main()
