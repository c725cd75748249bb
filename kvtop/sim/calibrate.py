"""Fit the simulated engine's step-time model to a running vLLM: ``kvtop sim calibrate URL``.

It times one vLLM instance with streamed completions of random token ids (no tokenizer
involved), replays every measured scenario through the engine itself to learn which steps it
makes (chunks, batch sizes, admissions, attention and KV-read work), and solves for the
coefficients that make those steps add up to the measured times:

    frontend_overhead_s   per request: HTTP, input processing, output path
    frontend_s_per_token  per prompt token, before scheduling (parsing, validation, hashing)
    t_fixed, t_req        per step, per scheduled request
    t_new_req             per request scheduled for the first time (input-batch setup)
    b                     per computed token (linear layers)
    c                     prefill attention, per sum(2*q*ctx + q^2)
    kappa                 decode attention, per context token of every decoding request

Two clocks: vLLM's request histograms carry the engine core's own timestamps (prefill time,
per-request TPOT), which a busy host cannot distort the way it bunches the tokens a client
reads; the step terms are fitted to those, then the frontend terms to the client's TTFT with
the steps fixed (non-negative least squares on relative residuals). Without the histograms,
everything is fitted to the client's figures. Measured (``Plan``; about 20 s against the tiny
CPU model): cold TTFT over prompt lengths; TTFT of a prompt seen before (all but its last
block cached) and of a cached prompt extended by new tokens; time per output token at batch
1, 2, 4 and 8 with short and long contexts; the TTFT of a few-token prompt. What the client
cannot see (token budget, max sequences, weights) comes from a built-in prior (``--base``).

The result is a profile file (``kvtop.sim.profiles.profile_to_toml``) recording where, when
and against what it was measured, with every figure and its fitted value.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import platform
import random
import socket
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

from kvtop.sim.engine import Engine, EngineRequest
from kvtop.sim.profiles import PROFILES, Profile, get_profile, profile_to_toml

__all__ = ["Figure", "Plan", "StreamTiming", "VllmClient", "fit", "measure", "calibrate",
           "scenario_features", "predict", "profile_from_fit", "write_profile", "fit_table"]

#: Coefficients the fit solves for, in this order.
COEFFICIENTS = ("frontend_overhead_s", "frontend_s_per_token", "t_fixed", "t_req", "t_new_req",
                "b", "c", "kappa")
TOKEN_LOW, TOKEN_HIGH = 10, 8000   # random prompt ids: inside any vocabulary, past the specials


# ----------------------------------------------------------------------------- the client

#: Two tokens closer than this were not produced by two engine steps: the client (or the API
#: server) was descheduled and read a backlog at once, so the sample's timing is not the engine's.
BUNCHED_GAP_S = 50e-6


def tpot_skip(output_tokens: int) -> int:
    """Index of the token TPOT is timed from: a quarter into the answer, past the first
    events (which a busy API server sometimes delivers late, in a burst)."""
    return (output_tokens - 1) // 4 if output_tokens >= 8 else 0


@dataclass
class StreamTiming:
    """One streamed completion as the client saw it (seconds from sending)."""

    ttft: float
    e2e: float
    first_token: float
    last_token: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int | None
    events: int
    event_times: list[float] = field(default_factory=list, repr=False)

    @property
    def tpot(self) -> float | None:
        """Time per output token from token ``tpot_skip(n)`` to the last: the engine's
        decode pace, unlike (last - first) / (n - 1) insensitive to a late first event."""
        n = self.output_tokens
        if n < 2:
            return None
        q = tpot_skip(n)
        if q and self.events == n and len(self.event_times) == n:
            return (self.event_times[-1] - self.event_times[q]) / (n - 1 - q)
        return (self.last_token - self.first_token) / (n - 1)

    @property
    def disturbed(self) -> bool:
        """True when tokens arrived bunched (see ``BUNCHED_GAP_S``): the first two together,
        or more than a tenth of all gaps; such a sample times the host, not the engine."""
        t = self.event_times
        if len(t) < 2:
            return False
        gaps = [b - a for a, b in zip(t, t[1:])]
        if gaps[0] < BUNCHED_GAP_S:
            return True
        return sum(1 for g in gaps if g < BUNCHED_GAP_S) > len(gaps) / 10


class VllmClient:
    """Streamed /v1/completions of token ids against one vLLM (or ``kvtop sim``) base URL.

    Each request runs in a worker thread on its own keep-alive ``http.client`` connection, so
    token timestamps are taken as bytes arrive (aiohttp's line iterator was seen to hand over
    a whole SSE answer at once, now and then, which ruins per-token timing)."""

    def __init__(self, base: str, model: str | None = None, timeout_s: float = 600.0,
                 max_concurrency: int = 32):
        from concurrent.futures import ThreadPoolExecutor
        from urllib.parse import urlsplit

        self.base = base.rstrip("/")
        parts = urlsplit(self.base)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base!r}")
        self._scheme, self._host = parts.scheme, parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._prefix = parts.path.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency,
                                        thread_name_prefix="kvtop-calibrate")
        self._local = threading.local()

    async def __aenter__(self) -> "VllmClient":
        if self.model is None:
            self.model = (await self.models())[0]["id"]
        return self

    async def __aexit__(self, *exc) -> None:
        self._pool.shutdown(wait=True)

    def _conn(self, fresh: bool = False) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None or fresh:
            if conn is not None:
                conn.close()
            cls = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
            conn = cls(self._host, self._port, timeout=self.timeout_s)
            self._local.conn = conn
        return conn

    def _request(self, method: str, path: str, body: bytes | None, on_response):
        """Send on this thread's connection (reconnecting once if the server closed it)."""
        headers = {"Content-Type": "application/json"} if body is not None else {}
        for attempt in (0, 1):
            conn = self._conn(fresh=attempt > 0)
            try:
                conn.request(method, self._prefix + path, body=body, headers=headers)
                t0 = time.perf_counter()
                resp = conn.getresponse()
            except (http.client.HTTPException, ConnectionError, BrokenPipeError):
                if attempt:
                    raise
                continue
            try:
                return on_response(resp, t0)
            finally:
                resp.read()          # drain, so the connection can carry the next request
                if resp.will_close:
                    self._local.conn = None
                    conn.close()
        raise RuntimeError("unreachable")

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _get_blocking(self, path: str) -> str:
        def read(resp, _t0):
            data = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"{self.base}{path}: HTTP {resp.status}")
            return data.decode("utf-8", "replace")
        return self._request("GET", path, None, read)

    async def get_text(self, path: str) -> str:
        return await self._run(self._get_blocking, path)

    async def get_json(self, path: str) -> Any:
        return json.loads(await self.get_text(path))

    async def models(self) -> list[dict]:
        return (await self.get_json("/v1/models"))["data"]

    def _complete_blocking(self, ids: Sequence[int], max_tokens: int) -> StreamTiming:
        body = json.dumps({"model": self.model, "prompt": list(ids), "max_tokens": max_tokens,
                           "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        sent = time.perf_counter()

        def read(resp, _t0):
            if resp.status != 200:
                raise RuntimeError(f"{self.base}: HTTP {resp.status}: "
                                   f"{resp.read()[:300].decode('utf-8', 'replace')}")
            first = last = None
            events = 0
            times: list[float] = []
            usage: dict = {}
            while True:
                raw = resp.readline()
                if not raw:
                    break
                if not raw.startswith(b"data:"):
                    continue
                now = time.perf_counter() - sent
                data = raw[5:].strip()
                if data == b"[DONE]":
                    break
                if b'"usage":{' in data or b'"usage": {' in data:
                    ev = json.loads(data)
                    usage = ev.get("usage") or usage
                    if not ev.get("choices"):
                        continue
                events += 1
                times.append(now)
                if first is None:
                    first = now
                last = now
            end = time.perf_counter() - sent
            if first is None:
                first = last = end
            details = usage.get("prompt_tokens_details") or {}
            return StreamTiming(ttft=first, e2e=end, first_token=first, last_token=last,
                                output_tokens=int(usage.get("completion_tokens", events)),
                                prompt_tokens=int(usage.get("prompt_tokens", len(ids))),
                                cached_tokens=details.get("cached_tokens"), events=events,
                                event_times=times)

        return self._request("POST", "/v1/completions", body, read)

    async def complete(self, ids: Sequence[int], max_tokens: int) -> StreamTiming:
        """One streamed completion; times count from handing the request to the socket."""
        return await self._run(self._complete_blocking, ids, max_tokens)


def random_ids(n: int, seed: int | str) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n)]


async def server_facts(client: VllmClient) -> dict[str, Any]:
    """What the server says about itself: model, context, cache geometry, version."""
    from prometheus_client.parser import text_string_to_metric_families

    facts: dict[str, Any] = {}
    models = await client.models()
    facts["model"] = models[0]["id"]
    if models[0].get("max_model_len"):
        facts["max_model_len"] = int(models[0]["max_model_len"])
    try:
        facts["vllm_version"] = (await client.get_json("/version")).get("version")
    except Exception:
        pass
    try:
        text = await client.get_text("/metrics")
        for family in text_string_to_metric_families(text):
            if family.name == "vllm:cache_config_info":
                labels = family.samples[0].labels
                for key in ("block_size", "num_gpu_blocks"):
                    if str(labels.get(key, "")).isdigit():
                        facts[key] = int(labels[key])
    except Exception:
        pass
    return facts


# ----------------------------------------------------------------------------- engine-side clocks

#: vLLM's request histograms that use the engine core's own timestamps (v1/metrics/stats.py):
#: prefill = first SCHEDULED -> first token, TPOT = (last - first token) / (tokens - 1). A busy
#: client or API server cannot distort them; kvtop sim exposes the same, with the same meaning.
ENGINE_PREFILL = "vllm:request_prefill_time_seconds"
ENGINE_TPOT = "vllm:request_time_per_output_token_seconds"


async def engine_histograms(client: VllmClient) -> dict[str, tuple[float, float]] | None:
    """(sum, count) of each ENGINE_* histogram, summed over label sets; None if absent."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = await client.get_text("/metrics")
    except (OSError, RuntimeError, http.client.HTTPException):
        return None
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name in (ENGINE_PREFILL, ENGINE_TPOT):
            acc = out.setdefault(family.name, [0.0, 0.0])
            for sample in family.samples:
                if sample.name == family.name + "_sum":
                    acc[0] += sample.value
                elif sample.name == family.name + "_count":
                    acc[1] += sample.value
    if len(out) < 2:
        return None
    return {k: (v[0], v[1]) for k, v in out.items()}


class EngineClock:
    """Per-sample engine-side figures from histogram deltas around each measured request."""

    def __init__(self, client: VllmClient):
        self.client = client
        self.last: dict[str, tuple[float, float]] | None = None

    async def start(self, settle_s: float = 0.05, timeout_s: float = 2.0) -> bool:
        """Open a window once the counts are still: a request that finished just before
        (a 1-token warm-up records TPOT 0) must not be counted in it."""
        deadline = time.monotonic() + timeout_s
        self.last = await engine_histograms(self.client)
        while self.last is not None and time.monotonic() < deadline:
            await asyncio.sleep(settle_s)
            now = await engine_histograms(self.client)
            if now == self.last:
                break
            self.last = now
        return self.last is not None

    async def delta(self, name: str, requests: int, timeout_s: float = 3.0) -> float | None:
        """Mean of ``name`` over the next ``requests`` finished requests (vLLM records a request's
        stats just after its last output, so poll until the count has moved)."""
        if self.last is None:
            return None
        deadline = time.monotonic() + timeout_s
        while True:
            now = await engine_histograms(self.client)
            if now is None:
                return None
            s0, c0 = self.last[name]
            s1, c1 = now[name]
            if c1 - c0 >= requests or time.monotonic() > deadline:
                self.last = now
                return (s1 - s0) / (c1 - c0) if c1 > c0 else None
            await asyncio.sleep(0.01)


# ----------------------------------------------------------------------------- scenarios

#: The drift check times a cold prompt of this many tokens (less where the server's context is
#: shorter) right after the warm-up and again at the end, each after one unrecorded run of that
#: length (a shape's first run on vLLM's CPU backend is slower); beyond ``DRIFT_WARN``
#: (relative) the engine's speed moved while it was measured.
DRIFT_REFERENCE_TOKENS = 1024
DRIFT_WARN = 0.15


@dataclass
class Figure:
    """One measured scenario: client samples (TTFT, or TPOT for ``tpot``) and, where the server
    exposes them, engine-side samples (prefill time, or per-request TPOT).

    ``kind``: ``frontend`` (a few-token prompt), ``cold`` (nothing cached), ``repeat`` (the
    same prompt again: all but its last block cached), ``extend`` (a cached prompt plus new
    tokens), ``tpot`` (``batch`` simultaneous streams of ``max_tokens`` on cached prompts).
    ``tokens`` is the prompt length, ``cached`` the prefix sent before."""

    kind: str
    tokens: int
    cached: int = 0
    batch: int = 1
    max_tokens: int = 2
    samples: list[float] = field(default_factory=list)
    engine_samples: list[float] = field(default_factory=list)

    @property
    def measured(self) -> float:
        return statistics.median(self.samples)

    @property
    def engine_measured(self) -> float | None:
        return statistics.median(self.engine_samples) if self.engine_samples else None

    @property
    def label(self) -> str:
        if self.kind == "tpot":
            return f"tpot batch {self.batch} ctx {self.tokens}"
        if self.kind == "extend":
            return f"extend {self.cached}+{self.tokens - self.cached}"
        return f"{self.kind} {self.tokens}"

    def to_dict(self) -> dict[str, Any]:
        d = {"kind": self.kind, "tokens": self.tokens, "cached": self.cached,
             "batch": self.batch, "max_tokens": self.max_tokens,
             "samples": [round(x, 6) for x in self.samples]}
        if self.engine_samples:
            d["engine_samples"] = [round(x, 6) for x in self.engine_samples]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Figure":
        return cls(kind=d["kind"], tokens=int(d["tokens"]), cached=int(d.get("cached", 0)),
                   batch=int(d.get("batch", 1)), max_tokens=int(d.get("max_tokens", 2)),
                   samples=[float(x) for x in d["samples"]],
                   engine_samples=[float(x) for x in d.get("engine_samples", [])])


@dataclass(frozen=True)
class _RecordingProfile(Profile):
    """A profile whose step time is a constant and which writes down every step's terms."""

    log: list = field(default_factory=list, compare=False, repr=False)

    def step_time(self, num_tokens, num_reqs, attn_sum, decode_ctx_sum, num_new_reqs=0):
        self.log.append((num_tokens, num_reqs, attn_sum, decode_ctx_sum, num_new_reqs))
        return 1e-3


Step = tuple[int, int, float, int, int]   # num_tokens, num_reqs, attn_sum, decode_ctx_sum, new


@dataclass
class Features:
    """What a figure is made of: the frontend it pays (requests, prompt tokens) and the steps
    it spans; the prediction is ``profile.frontend_s(tokens) * frontend +
    sum(step_time(s) for s in steps) * scale`` (scale averages over requests and tokens)."""

    frontend: float
    frontend_tokens: int
    steps: list[Step]
    scale: float = 1.0


def scenario_features(figure: Figure, limits: Profile, side: str = "client") -> Features:
    """Run ``figure``'s scenario through the engine (with ``limits``' scheduler settings) and
    return what its ``side`` figure spans: ``client`` TTFT = frontend + every step up to the
    first token, client TPOT timed from token ``tpot_skip(n)``; ``engine`` prefill = the steps
    only, engine TPOT = every step after the first token."""
    rec = _RecordingProfile(**{f: getattr(limits, f) for f in (
        "name", "description", "model", "block_size", "num_gpu_blocks", "max_num_batched_tokens",
        "max_num_seqs", "max_model_len", "long_prefill_token_threshold")})
    engine = Engine(rec, frontend_overhead_s=0.0)
    bs = engine.block_size
    from router.blocks import hash_token_blocks

    def run(requests: list[EngineRequest]) -> tuple[dict[str, list[int]], list[Step]]:
        """Drive until idle; (request id -> index of the step that gave each token, steps)."""
        for r in requests:
            engine.add_request(r)
        emitted: dict[str, list[int]] = {r.request_id: [] for r in requests}
        t = 0.0
        start = len(rec.log)
        while engine.has_work():
            res = engine.step(t)
            if res.idle:
                t = engine.next_event_time() or t
                continue
            k = len(rec.log) - 1 - start
            for rid in res.emitted:
                emitted[rid].append(k)
            t = res.end_time
        return emitted, rec.log[start:]

    n = figure.tokens
    if figure.kind == "tpot":
        prompts = [random_ids(n, f"tpot-{i}") for i in range(figure.batch)]
        run([EngineRequest(f"w{i}", n, hash_token_blocks(p, bs), 1, 0.0)
             for i, p in enumerate(prompts)])
        reqs = [EngineRequest(f"d{i}", n, hash_token_blocks(p, bs), figure.max_tokens, 0.0)
                for i, p in enumerate(prompts)]
        emitted, steps = run(reqs)
        q = tpot_skip(figure.max_tokens) if side == "client" else 0
        spans: list[Step] = []
        for r in reqs:
            at = emitted[r.request_id]
            spans.extend(steps[at[q] + 1:at[-1] + 1])
        return Features(0.0, 0, spans, 1.0 / (len(reqs) * (figure.max_tokens - 1 - q)))
    ids = random_ids(n, "scenario")
    if figure.cached:
        warm = ids[:figure.cached]
        run([EngineRequest("warm", len(warm), hash_token_blocks(warm, bs), 1, 0.0)])
    emitted, steps = run([EngineRequest("m", n, hash_token_blocks(ids, bs), figure.max_tokens, 0.0)])
    front = 1.0 if side == "client" else 0.0
    return Features(front, n, steps[:emitted["m"][0] + 1])


def step_terms(profile: Profile, step: Step) -> tuple[list[float], float]:
    """A step's coefficient terms ``[t_fixed, t_req, t_new_req, b, c, kappa]`` and its
    constant (the weight-read time when that, not ``b * N``, bounds the linear layers)."""
    num_tokens, num_reqs, attn, ctx, new = step
    weights = profile.weight_read_s(num_tokens) if (profile.w_dense or profile.w_experts) else 0.0
    if weights > profile.b * num_tokens:
        return [1.0, num_reqs, new, 0.0, attn, ctx], weights
    return [1.0, num_reqs, new, num_tokens, attn, ctx], 0.0


def predict(profile: Profile, feats: Features) -> float:
    return (feats.frontend * profile.frontend_s(feats.frontend_tokens)
            + sum(profile.step_time(*s) for s in feats.steps) * feats.scale)


# ----------------------------------------------------------------------------- the fit

def _nnls(rows: list[list[float]], ys: list[float]) -> list[float]:
    """min ||A x - y|| with x >= 0 (columns scaled, normal equations, active set: the most
    negative coefficient is pinned to 0 and the rest re-solved). Small k only."""
    k = len(rows[0])
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(k)]
    free = [j for j in range(k) if any(r[j] for r in rows)]
    while True:
        x = [0.0] * k
        if free:
            m = len(free)
            ata = [[sum(r[i] * r[j] for r in rows) / (scale[i] * scale[j]) for j in free]
                   for i in free]
            aty = [sum(r[i] * y for r, y in zip(rows, ys)) / scale[i] for i in free]
            for col in range(m):          # Gauss-Jordan with partial pivoting
                piv = max(range(col, m), key=lambda q: abs(ata[q][col]))
                ata[col], ata[piv] = ata[piv], ata[col]
                aty[col], aty[piv] = aty[piv], aty[col]
                if abs(ata[col][col]) < 1e-15:
                    continue
                for q in range(m):
                    if q != col and ata[q][col]:
                        f = ata[q][col] / ata[col][col]
                        ata[q] = [a - f * b for a, b in zip(ata[q], ata[col])]
                        aty[q] -= f * aty[col]
            for idx, j in enumerate(free):
                d = ata[idx][idx]
                x[j] = aty[idx] / d / scale[j] if abs(d) >= 1e-15 else 0.0
        neg = [j for j in free if x[j] < 0]
        if not neg:
            return x
        free.remove(min(neg, key=lambda j: x[j] * scale[j]))


STEP_COEFFICIENTS = ("t_fixed", "t_req", "t_new_req", "b", "c", "kappa")
FRONTEND_COEFFICIENTS = ("frontend_overhead_s", "frontend_s_per_token")


@dataclass
class Observation:
    label: str
    measured: float
    features: Features


def _solve(observations: Sequence[Observation], prior: Profile, free: Sequence[str]) -> Profile:
    """Non-negative least squares on relative residuals for the ``free`` coefficients, the
    others as in ``prior``; re-linearised until the weight-read-bound steps settle."""
    current = prior
    for _ in range(6):
        rows, ys = [], []
        for ob in observations:
            y, ft = ob.measured, ob.features
            terms = [0.0] * 6
            const = 0.0
            for s in ft.steps:
                t, w = step_terms(current, s)
                terms = [a + b for a, b in zip(terms, t)]
                const += w
            full = dict(zip(COEFFICIENTS, [ft.frontend, ft.frontend * ft.frontend_tokens,
                                           *(x * ft.scale for x in terms)]))
            const = const * ft.scale + sum(full[c] * getattr(current, c)
                                           for c in COEFFICIENTS if c not in free)
            rows.append([full[c] / y for c in free])
            ys.append((y - const) / y)
        updated = replace(current, **dict(zip(free, _nnls(rows, ys))))
        if updated == current:
            break
        current = updated
    return current


@dataclass
class FitResult:
    coefficients: dict[str, float]
    rows: list[dict[str, Any]]          # per figure and side: measured, fitted, ratio
    rms_rel: float
    max_rel: float
    method: str = "engine+client"

    def table(self) -> str:
        lines = [f"{'figure':<36} {'measured':>10} {'fitted':>10} {'fit/meas':>8}"]
        for r in self.rows:
            lines.append(f"{r['figure']:<36} {r['measured_s'] * 1e3:>8.2f}ms "
                         f"{r['fitted_s'] * 1e3:>8.2f}ms {r['ratio']:>8.3f}")
        lines.append(f"relative residuals: rms {self.rms_rel:.1%}, max {self.max_rel:.1%} "
                     f"({self.method})")
        return "\n".join(lines)


def fit(figures: Sequence[Figure], limits: Profile) -> FitResult:
    """Coefficients for ``figures`` given the scheduler settings (and weight-read terms) of
    ``limits``. With engine-side samples: the step coefficients from them (prefill times and
    per-request TPOT, the engine's own clock), then the frontend terms from the client TTFTs
    with the steps fixed. Without: everything from the client figures at once."""
    engine_obs = [Observation(f"engine {'tpot' if f.kind == 'tpot' else 'prefill'} "
                              f"{f.label.removeprefix('tpot ')}",
                              f.engine_measured, scenario_features(f, limits, "engine"))
                  for f in figures if f.engine_measured]
    client_obs = [Observation(f"client {'ttft' if f.kind != 'tpot' else 'tpot'} "
                              f"{f.label.removeprefix('tpot ')}",
                              f.measured, scenario_features(f, limits, "client"))
                  for f in figures if f.samples]
    if engine_obs:
        method = "steps from engine-side figures, frontend from client TTFT"
        steps = _solve(engine_obs, limits, STEP_COEFFICIENTS)
        ttft_obs = [o for o, f in zip(client_obs, [f for f in figures if f.samples])
                    if f.kind != "tpot"]
        current = _solve(ttft_obs, steps, FRONTEND_COEFFICIENTS)
        report = engine_obs + client_obs
    else:
        # Every client TTFT pays one frontend and one admission: t_new_req is not separable
        # from frontend_overhead_s there, so it stays the prior's and the frontend takes it.
        method = "all from client figures"
        current = _solve(client_obs, limits, [c for c in COEFFICIENTS if c != "t_new_req"])
        report = client_obs
    rows, rels = [], []
    for ob in report:
        pred = predict(current, ob.features)
        rels.append(pred / ob.measured - 1.0)
        rows.append({"figure": ob.label, "measured_s": ob.measured, "fitted_s": pred,
                     "ratio": pred / ob.measured})
    rms = math.sqrt(sum(r * r for r in rels) / len(rels)) if rels else 0.0
    return FitResult({c: getattr(current, c) for c in COEFFICIENTS}, rows, rms,
                     max((abs(r) for r in rels), default=0.0), method)


# ----------------------------------------------------------------------------- measuring

@dataclass
class Plan:
    """What ``measure`` times. Lengths beyond the server's context are dropped; cold lengths
    stop growing once a cold TTFT exceeds ``max_cold_ttft_s`` (slow machines)."""

    cold: tuple[int, ...] = (128, 512, 1024, 2048, 3072, 4096, 6144, 8192, 12288)
    repeat: tuple[int, ...] = (1024, 4096, 8192, 12288)
    extend: tuple[tuple[int, int], ...] = ((1024, 1024), (4096, 1024), (4096, 2048), (8192, 2048))
    tpot_batches: tuple[int, ...] = (1, 2, 4, 8)
    tpot_contexts: tuple[int, ...] = (256, 4096)
    tpot_tokens: int = 96
    frontend_tokens: int = 8
    repeats: int = 3
    #: Decode figures take more samples: they are cheap (a few hundred ms each) and a step of a
    #: few ms moves 10-20% between samples on a shared host, which a median of 3 did not absorb.
    tpot_repeats: int = 5
    retries: int = 2
    max_cold_ttft_s: float = 5.0

    @classmethod
    def quick(cls) -> "Plan":
        return cls(cold=(128, 1024, 4096, 8192), repeat=(4096,), extend=((4096, 1024),),
                   tpot_batches=(1, 4, 8), tpot_contexts=(256, 4096), tpot_tokens=64, repeats=2,
                   tpot_repeats=2)

    def total_requests(self) -> int:
        n_tpot = sum(self.tpot_batches) * len(self.tpot_contexts) * self.tpot_repeats
        warm = max(self.tpot_batches, default=0) * len(self.tpot_contexts)
        return (self.repeats * (3 + len(self.cold) + len(self.repeat) + len(self.extend)) + 2
                + len(self.repeat) + len(self.extend) + n_tpot + warm + 3)


async def measure(client: VllmClient, plan: Plan, max_model_len: int,
                  progress: Callable[[str, int], None] = lambda what, n: None,
                  stats: dict[str, int] | None = None) -> list[Figure]:
    """Time everything in ``plan`` against ``client``, one figure per scenario (samples are
    the repeats). ``progress(what, requests_done)`` is called after each request. A TTFT
    sample whose first tokens arrived bunched (``StreamTiming.disturbed``) is measured again
    with fresh ids where the scenario needs them, up to ``plan.retries`` times; ``stats``
    counts retries and samples kept disturbed."""
    salt = random.randrange(1 << 30)   # fresh ids each run: nothing is cached from before
    ctx_cap = max_model_len - max(plan.tpot_tokens, 2) - 1
    figures: list[Figure] = []
    stats = stats if stats is not None else {}
    stats.setdefault("retried", 0)
    stats.setdefault("still_disturbed", 0)
    clock = EngineClock(client)

    async def ttft(fig: Figure, make_ids: Callable[[int], list[int]], what: str) -> None:
        for attempt in range(plan.retries + 1):
            await clock.start()
            t = await client.complete(make_ids(attempt), 2)
            engine = await clock.delta(ENGINE_PREFILL, 1)
            if not t.disturbed:
                break
            if attempt < plan.retries:
                stats["retried"] += 1
        else:
            stats["still_disturbed"] += 1
        fig.samples.append(t.ttft)
        if engine is not None:
            fig.engine_samples.append(engine)
        progress(what, 1)

    def fresh(n: int, tag: str) -> Callable[[int], list[int]]:
        return lambda attempt: random_ids(n, f"{salt}-{tag}-{attempt}")

    for k in range(3):   # warm the HTTP path and the engine
        await client.complete(random_ids(64, f"{salt}-warm-{k}"), 2)
        progress("warm-up", 1)

    ref_tokens = min(DRIFT_REFERENCE_TOKENS, ctx_cap)

    async def speed_check(tag: str) -> Figure:
        await client.complete(random_ids(ref_tokens, f"{salt}-{tag}-warm"), 2)
        progress("speed check", 1)
        ref = Figure("cold", ref_tokens)
        for k in range(plan.repeats):
            await ttft(ref, fresh(ref_tokens, f"{tag}-{k}"), "speed check")
        return ref

    first = await speed_check("drift-start") if ref_tokens > 0 else None

    fig = Figure("frontend", plan.frontend_tokens)
    for k in range(plan.repeats):
        await ttft(fig, fresh(plan.frontend_tokens, f"fe-{k}"), "frontend")
    figures.append(fig)

    cold_prompts: dict[int, list[int]] = {}
    for n in plan.cold:
        if n > ctx_cap:
            continue
        fig = Figure("cold", n)
        for k in range(plan.repeats):
            make = fresh(n, f"cold-{n}-{k}")
            await ttft(fig, make, f"cold TTFT {n}")
            cold_prompts[n] = make(0)   # sent at least once: re-sent (cached) below
        figures.append(fig)
        if fig.measured > plan.max_cold_ttft_s:
            break

    for n in plan.repeat:
        if n > ctx_cap:
            continue
        ids = cold_prompts.get(n) or random_ids(n, f"{salt}-rep-{n}")
        await client.complete(ids, 2)      # cached now, whatever happened before
        progress(f"repeat TTFT {n}", 1)
        fig = Figure("repeat", n, cached=n)
        for k in range(plan.repeats):
            await ttft(fig, lambda attempt, ids=ids: ids, f"repeat TTFT {n}")
        figures.append(fig)

    for base, extra in plan.extend:
        if base + extra > ctx_cap:
            continue
        prefix = cold_prompts.get(base) or random_ids(base, f"{salt}-ext-{base}")
        await client.complete(prefix, 2)
        progress(f"extend TTFT {base}+{extra}", 1)
        fig = Figure("extend", base + extra, cached=base)
        for k in range(plan.repeats):
            suffix = fresh(extra, f"ext-{base}-{extra}-{k}")
            await ttft(fig, lambda attempt, s=suffix: prefix + s(attempt),
                       f"extend TTFT {base}+{extra}")
        figures.append(fig)

    top = max(plan.tpot_batches, default=0)
    for ctx in plan.tpot_contexts:
        ctx = min(ctx, ctx_cap)
        prompts = [random_ids(ctx, f"{salt}-tpot-{ctx}-{i}") for i in range(top)]
        for p in prompts:   # cache every prompt: the timed runs are decode
            await client.complete(p, 1)
            progress(f"TPOT warm-up ctx {ctx}", 1)
        for batch in plan.tpot_batches:
            fig = Figure("tpot", ctx, cached=ctx, batch=batch, max_tokens=plan.tpot_tokens)
            what = f"TPOT batch {batch} ctx {ctx}"
            for k in range(plan.tpot_repeats):
                await clock.start()
                runs = await asyncio.gather(*(client.complete(p, plan.tpot_tokens)
                                              for p in prompts[:batch]))
                engine = await clock.delta(ENGINE_TPOT, batch)
                if engine is not None:
                    fig.engine_samples.append(engine)
                tpots = [r.tpot for r in runs if r.tpot is not None and not r.disturbed]
                if tpots:
                    fig.samples.append(statistics.fmean(tpots))
                progress(what, batch)
            figures.append(fig)

    # The engine's speed must not move while it is measured: every figure is fitted as if
    # taken at one speed. Time the reference again and compare.
    if first is not None:
        again = await speed_check("drift-end")
        start, end = first.engine_measured, again.engine_measured
        if start is None or end is None:
            start, end = first.measured, again.measured
        stats["drift"] = {"figure": f"cold {ref_tokens}", "start_s": round(start, 6),
                          "end_s": round(end, 6), "ratio": round(end / start, 4)}
    return figures


def default_base(block_size: int | None) -> str:
    """The prior for what the client cannot see: vLLM's CPU backend uses 128-token blocks."""
    return "cpu-tiny" if block_size == 128 else "h100"


def profile_from_fit(base: Profile, result: FitResult, facts: dict[str, Any], *,
                     name: str, overrides: dict[str, Any] | None = None) -> Profile:
    scheduler = {k: facts[k] for k in ("block_size", "num_gpu_blocks", "max_model_len")
                 if k in facts}
    model = facts.get("model", base.model)
    where = facts.get("url", "?")
    return replace(base, name=name, model=model,
                   description=f"fitted by kvtop sim calibrate to {model} at {where} "
                               f"({facts.get('measured_at', '?')})",
                   estimated=False, **{**scheduler, **(overrides or {})}, **result.coefficients)


def write_profile(path, profile: Profile, base: str, measured: dict[str, Any]) -> str:
    text = profile_to_toml(profile, base=base, measured=measured, header=(
        "kvtop engine profile, written by `kvtop sim calibrate`.\n"
        "Use it wherever a profile is taken: kvtop sim --profile FILE, kvtop simulate --profile FILE.\n"
        "[profile] is the whole engine model; [measured] says where, when and against what it\n"
        "was fitted, with every figure (seconds) and its fitted value."))
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return text


def fit_table(result: FitResult) -> dict[str, Any]:
    """The [measured.fit] table: method, residual summary, every figure with its fitted value."""
    return {"method": result.method,
            "rms_relative_residual": round(result.rms_rel, 4),
            "max_relative_residual": round(result.max_rel, 4),
            "rows": [{k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}
                     for r in result.rows]}


async def calibrate(url: str, *, base: str | None = None, plan: Plan | None = None,
                    name: str | None = None, overrides: dict[str, Any] | None = None,
                    progress_factory=None, log: Callable[[str], None] = lambda s: None
                    ) -> tuple[Profile, FitResult, dict[str, Any]]:
    """Measure ``url``, fit, and return (profile, fit result, the [measured] table)."""
    plan = plan or Plan()
    started = time.monotonic()
    measured_at = datetime.now(timezone.utc).replace(microsecond=0).isoformat()
    async with VllmClient(url) as client:
        facts = await server_facts(client)
        facts["url"] = client.base
        facts["measured_at"] = measured_at
        base_name = base or default_base(facts.get("block_size"))
        prior = get_profile(base_name)
        limits = replace(prior, **{**{k: facts[k] for k in ("block_size", "num_gpu_blocks",
                                                             "max_model_len") if k in facts},
                                   **(overrides or {})})
        log(f"{facts['model']} at {client.base}: vLLM {facts.get('vllm_version', '?')}, block "
            f"{limits.block_size}, {limits.num_gpu_blocks} blocks, max_model_len "
            f"{limits.max_model_len}; prior {base_name} (token budget "
            f"{limits.max_num_batched_tokens}, max_num_seqs {limits.max_num_seqs})")
        if await engine_histograms(client) is None:
            log("the server exposes no engine-side request histograms: fitting from client "
                "timings alone (sensitive to a busy host)")
        stats: dict[str, int] = {}
        load_before = _loadavg()
        if progress_factory is None:
            figures = await measure(client, plan, limits.max_model_len, stats=stats)
        else:
            with progress_factory(plan.total_requests()) as advance:
                figures = await measure(client, plan, limits.max_model_len, advance, stats)
        load_after = _loadavg()
    if stats.get("still_disturbed"):
        log(f"note: {stats['still_disturbed']} client samples stayed disturbed after "
            f"{plan.retries} retries (a busy host); medians over repeats absorb a few")
    drift = stats.get("drift")
    if drift and abs(drift["ratio"] - 1) > DRIFT_WARN:
        log(f"warning: the engine's speed moved while it was measured: {drift['figure']} took "
            f"{drift['start_s'] * 1e3:.1f} ms at the start and {drift['end_s'] * 1e3:.1f} ms at the "
            f"end ({(drift['ratio'] - 1) * 100:+.0f}%). The fit averages two speeds; calibrate "
            f"again when the host is quiet")
    elif drift:
        log(f"speed check: {drift['figure']} took {drift['start_s'] * 1e3:.1f} ms at the start and "
            f"{drift['end_s'] * 1e3:.1f} ms at the end ({(drift['ratio'] - 1) * 100:+.0f}%, within "
            f"{DRIFT_WARN:.0%})")
    result = fit(figures, limits)
    profile = profile_from_fit(limits, result, facts,
                               name=name or f"calibrated-{facts['model']}".replace("/", "-"),
                               overrides=overrides)
    measured = {
        "url": client.base, "at": measured_at, "model": facts.get("model"),
        "vllm_version": facts.get("vllm_version", "unknown"), "base": base_name,
        "client_host": socket.gethostname(), "client_cpu": _cpu_model(),
        "client_platform": platform.platform(), "duration_s": round(time.monotonic() - started, 1),
        "client_loadavg_1m": [load_before, load_after],
        "disturbed_samples_retried": stats.get("retried", 0),
        "disturbed_samples_kept": stats.get("still_disturbed", 0),
        **({"drift": drift} if drift else {}),
        "fit": fit_table(result),
        "figures": [f.to_dict() for f in figures],
    }
    return profile, result, measured


def _loadavg() -> float:
    try:
        import os
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return -1.0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
