"""The simulated engine against the engine it models, under an agentic load: ``kvtop sim fidelity``.

The same requests (token ids, arrival pattern, output lengths) go to a real vLLM and to a
``kvtop sim`` instance running a profile of it, one side after the other; the figures that
matter for routing are compared: TTFT and E2E percentiles, per-request TTFT correlation, time
per output token at fixed batch sizes, and the cached tokens each request was served with.

The load (``agentic_plan``): 6 sessions x 6 turns, each turn the previous prompt plus
256-1,792 new tokens (a tool result; 1k -> about 6k tokens), 32 output tokens, a random think
time before each turn and staggered session starts, closed loop (a session's next turn waits
for its answer), so 2-4 requests overlap. Then ``tpot_probe``: 1, 4 and 8 simultaneous streams of 128 tokens on cached
4,096-token prompts.
"""

from __future__ import annotations

import asyncio
import math
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

from kvtop.sim.calibrate import ENGINE_TPOT, EngineClock, VllmClient, random_ids

__all__ = ["Turn", "agentic_plan", "run_load", "tpot_probe", "measure_side", "compare",
           "run_comparison", "format_report", "TARGETS"]

#: The issue's targets: |sim/real - 1| for TTFT p50/p90 and for TPOT p50 per batch; a floor
#: for the per-request TTFT correlation; cached tokens must match exactly.
TARGETS = {"ttft": 0.10, "tpot": 0.15, "ttft_correlation": 0.95}


@dataclass(frozen=True)
class Turn:
    session: int
    turn: int
    ids: tuple[int, ...]
    max_tokens: int
    think_s: float          # wait before sending (after the previous answer, or session start)


def agentic_plan(seed: int = 0, sessions: int = 6, turns: int = 6, first_tokens: int = 1024,
                 growth_tokens: tuple[int, int] = (256, 1792), max_tokens: int = 32,
                 think_s: tuple[float, float] = (0.2, 0.8),
                 stagger_s: float = 0.1, salt: str = "") -> list[list[Turn]]:
    """One list of turns per session; turn k's prompt is turn k-1's plus a uniform draw from
    ``growth_tokens`` new tokens. ``seed`` fixes the shape (lengths, think times); ``salt``
    only the token ids, so a fresh salt gives the same load with nothing cached."""
    rng = random.Random(seed)
    plan = []
    for s in range(sessions):
        ids: list[int] = []
        session = []
        for t in range(turns):
            new = first_tokens if t == 0 else rng.randint(*growth_tokens)
            ids = ids + random_ids(new, f"fidelity-{seed}-{salt}-{s}-{t}")
            think = s * stagger_s if t == 0 else rng.uniform(*think_s)
            session.append(Turn(s, t, tuple(ids), max_tokens, think))
        plan.append(session)
    return plan


async def run_load(client: VllmClient, plan: list[list[Turn]]) -> list[dict[str, Any]]:
    """Drive every session closed-loop; one record per request (times in seconds)."""
    t0 = time.perf_counter()
    inflight = 0
    records: list[dict[str, Any]] = []

    async def session(turns: list[Turn]) -> None:
        nonlocal inflight
        for turn in turns:
            await asyncio.sleep(turn.think_s)
            inflight += 1
            overlap = inflight
            start = time.perf_counter() - t0
            try:
                r = await client.complete(turn.ids, turn.max_tokens)
            finally:
                inflight -= 1
            records.append({"session": turn.session, "turn": turn.turn, "start_s": start,
                            "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                            "output_tokens": r.output_tokens, "ttft_s": r.ttft, "e2e_s": r.e2e,
                            "tpot_s": r.tpot, "in_flight_at_start": overlap,
                            "disturbed": r.disturbed})

    await asyncio.gather(*(session(s) for s in plan))
    records.sort(key=lambda r: (r["session"], r["turn"]))
    return records


async def tpot_probe(client: VllmClient, batches=(1, 4, 8), context: int = 4096,
                     max_tokens: int = 128, repeats: int = 6, salt: str = ""
                     ) -> dict[str, dict[int, float]]:
    """Time per output token of ``b`` simultaneous streams on cached prompts: ``engine`` (the
    server's own per-request TPOT histogram, median over the runs) and ``client`` (median of the
    streams' client-side TPOT). Six runs per batch: on a shared 2-core host one run's mean step
    at batch 1 and 4k context moved 1.7-3.7 ms within a minute, so a mean of two was a draw."""
    prompts = [random_ids(context, f"tpot-probe-{salt}-{i}") for i in range(max(batches))]
    for p in prompts:
        await client.complete(p, 1)
    clock = EngineClock(client)
    engine: dict[int, float] = {}
    client_side: dict[int, float] = {}
    for b in batches:
        tpots, means = [], []
        for _ in range(repeats):
            await clock.start()
            runs = await asyncio.gather(*(client.complete(p, max_tokens) for p in prompts[:b]))
            mean = await clock.delta(ENGINE_TPOT, b)
            if mean is not None:
                means.append(mean)
            tpots += [r.tpot for r in runs if r.tpot is not None and not r.disturbed]
        if means:
            engine[b] = statistics.median(means)
        if tpots:
            client_side[b] = statistics.median(tpots)
    return {"engine": engine, "client": client_side}


async def measure_side(url: str, seed: int = 0, salt: str = "") -> dict[str, Any]:
    async with VllmClient(url) as client:
        for k in range(3):
            await client.complete(random_ids(64, f"fidelity-warm-{salt}-{k}"), 2)
        records = await run_load(client, agentic_plan(seed, salt=salt))
        tpot = await tpot_probe(client, salt=salt)
    return {"url": url, "requests": records, "tpot_by_batch_s": tpot}


def _pct(values: list[float], q: float) -> float:
    """numpy's default (linear) percentile, the convention of every kvtop figure."""
    data = sorted(values)
    if len(data) == 1:
        return data[0]
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def _pearson(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else float("nan")


def compare(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, Any]:
    """Figures of both sides, sim/real ratios, and which targets hold."""
    key = lambda r: (r["session"], r["turn"])  # noqa: E731
    rs = {key(r): r for r in real["requests"]}
    ss = {key(r): r for r in sim["requests"]}
    keys = sorted(rs.keys() & ss.keys())
    rows: dict[str, dict[str, float]] = {}

    def row(name: str, a: float, b: float) -> None:
        rows[name] = {"real": a, "sim": b, "ratio": b / a if a else float("nan")}

    for metric in ("ttft_s", "e2e_s"):
        a = [rs[k][metric] for k in keys]
        b = [ss[k][metric] for k in keys]
        for q in (50, 90):
            row(f"{metric[:-2]} p{q}", _pct(a, q), _pct(b, q))
    a = [rs[k]["tpot_s"] for k in keys if rs[k]["tpot_s"] and ss[k]["tpot_s"]]
    b = [ss[k]["tpot_s"] for k in keys if rs[k]["tpot_s"] and ss[k]["tpot_s"]]
    row("tpot p50 (load)", _pct(a, 50), _pct(b, 50))
    for side in ("engine", "client"):
        a, b = real["tpot_by_batch_s"].get(side, {}), sim["tpot_by_batch_s"].get(side, {})
        for batch in sorted(set(a) & set(b), key=int):
            row(f"tpot batch {batch} {side}", a[batch], b[batch])
    corr = _pearson([rs[k]["ttft_s"] for k in keys], [ss[k]["ttft_s"] for k in keys])
    cached_equal = sum(1 for k in keys if rs[k]["cached_tokens"] == ss[k]["cached_tokens"])
    overlap = {side: max(r["in_flight_at_start"] for r in d["requests"])
               for side, d in (("real", real), ("sim", sim))}
    checks = {
        "ttft p50": abs(rows["ttft p50"]["ratio"] - 1) <= TARGETS["ttft"],
        "ttft p90": abs(rows["ttft p90"]["ratio"] - 1) <= TARGETS["ttft"],
        "ttft correlation": corr >= TARGETS["ttft_correlation"],
        "cached tokens": cached_equal == len(keys) == len(rs) == len(ss),
    }
    # TPOT per batch is judged on the engine's own clock where both sides expose it (a busy
    # host delays the client's reads, not the engine's steps); else on the client's.
    judged = "engine" if any(n.endswith(" engine") for n in rows) else "client"
    for name in rows:
        if name.startswith("tpot batch") and name.endswith(judged):
            checks[name] = abs(rows[name]["ratio"] - 1) <= TARGETS["tpot"]
    disturbed = {side: sum(1 for r in d["requests"] if r.get("disturbed"))
                 for side, d in (("real", real), ("sim", sim))}
    return {"rows": rows, "ttft_correlation": corr, "requests": len(keys),
            "cached_tokens_equal": cached_equal, "max_in_flight": overlap, "checks": checks,
            "disturbed_requests": disturbed, "passed": all(checks.values())}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_sim(profile: str, port: int | None = None, timeout_s: float = 30.0
              ) -> tuple[subprocess.Popen, str]:
    """``kvtop sim --profile PROFILE`` on a loopback port, in its own process (as deployed)."""
    port = port or _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvtop", "sim", "--instances", "1",
                             "--port-base", str(port), "--profile", str(profile)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise RuntimeError(f"kvtop sim exited with {proc.returncode}: {err.strip()[-300:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return proc, url
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"kvtop sim not healthy at {url} after {timeout_s} s")
            time.sleep(0.2)


def _disturbed_share(side: dict[str, Any]) -> float:
    reqs = side["requests"]
    return sum(1 for r in reqs if r.get("disturbed")) / max(1, len(reqs))


def run_comparison(real_url: str, profile: str, sim_url: str | None = None,
                   seed: int = 0, attempts: int = 3, max_disturbed: float = 0.1,
                   log=lambda s: None) -> dict[str, Any]:
    """Measure the real side, then the simulated one (started here unless ``sim_url``).

    A real run with more than ``max_disturbed`` of its requests delivered in bunches (the host
    was busy: its timings are the neighbours', not the engine's) is measured again, up to
    ``attempts`` runs; the least disturbed one is compared. Each run uses fresh token ids (the
    simulated side gets the kept run's), so nothing is cached from an earlier run."""
    runs = []
    for attempt in range(attempts):
        salt = f"{random.randrange(1 << 30)}"   # the same ids on both sides, cached on neither
        run = asyncio.run(measure_side(real_url, seed, salt))
        runs.append((_disturbed_share(run), attempt, salt, run))
        if runs[-1][0] <= max_disturbed:
            break
        log(f"real run {attempt + 1}: {runs[-1][0]:.0%} of requests bunched (busy host)"
            + ("; measuring again" if attempt + 1 < attempts else ""))
    share, _, salt, real = min(runs)
    real["attempts"] = len(runs)
    proc = None
    if sim_url is None:
        proc, sim_url = start_sim(profile)
    try:
        sim = asyncio.run(measure_side(sim_url, seed, salt))
    finally:
        if proc is not None:
            from kvtop.procs import stop_process
            stop_process(proc, grace_s=10)
    return {"profile": str(profile), "seed": seed, "real": real, "sim": sim,
            "comparison": compare(real, sim)}


def format_report(report: dict[str, Any]) -> str:
    c = report["comparison"]
    lines = [f"{'figure':<24} {'real':>10} {'sim':>10} {'sim/real':>9}"]
    for name, r in c["rows"].items():
        lines.append(f"{name:<24} {r['real'] * 1e3:>8.1f}ms {r['sim'] * 1e3:>8.1f}ms "
                     f"{r['ratio']:>9.3f}")
    lines.append(f"per-request TTFT correlation {c['ttft_correlation']:.3f} over {c['requests']} "
                 f"requests; cached tokens equal on {c['cached_tokens_equal']}; most in flight "
                 f"real {c['max_in_flight']['real']}, sim {c['max_in_flight']['sim']}; requests "
                 f"with bunched tokens (a busy host) real {c['disturbed_requests']['real']}, "
                 f"sim {c['disturbed_requests']['sim']}")
    missed = [k for k, ok in c["checks"].items() if not ok]
    lines.append("targets (TTFT p50/p90 10%, TPOT per batch 15%, correlation 0.95, cached exact): "
                 + ("all hold" if not missed else "MISSED " + ", ".join(missed)))
    return "\n".join(lines)
