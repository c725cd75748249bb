"""What-if replay of a recorded run: ``kvtop simulate --from-db kvtop.db [--run R] --policies ...``.

A router's decision log keeps, per request, what is needed to send its traffic again: the
arrival (``t_proxy_recv``), the session and turn, the input tokens, the prompt's block-hash
chain (``blocks``, store/chains.py) and, from the outcome, the output tokens delivered. This
module turns one run of it back into a trace (kvtop/traces/loader.TraceRequest) and runs it
through the offline simulator (kvtop/simulate.py: the router's own pipeline and policies
over the simulated engine) under any policies.

Time. The recorded run happened on real (or ``kvtop sim --speed X``) engines in wall time;
the simulator runs an engine profile in engine time. ``speed`` maps one to the other:
engine seconds = wall seconds x speed, on the way in (arrivals, think times) and back out
(latencies are divided by it, so every figure is in the recorded run's wall time). Given
with ``--speed``, or fitted: for each request that ran alone on its instance from its
arrival to its first token, the profile's own engine (one request, its recorded cached
prefix warm) predicts its TTFT in engine seconds; speed is the median of predicted /
measured. Against ``kvtop sim --speed 10`` with the same profile the fit finds about 10.

Validation. Re-simulating the policy that actually ran must give back the recorded run;
``validate`` compares TTFT p50/p90, E2E p99, APC and each instance's share of requests,
so a reader knows how far to trust the other policies' what-ifs.
"""

from __future__ import annotations

import json
import sqlite3
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtop.traces.loader import TraceRequest
from store.chains import ChainDecoder
from store.errors import CliError
from store.recorded import read_recorded_run
from store.results import RequestResult
from store.stats import percentile

#: Requests the speed fit uses at most (each is one short engine run).
FIT_MAX = 400


@dataclass
class RecordedRun:
    run_id: str
    policies: list[str]  # the policies that routed it, in order of first use
    knobs: dict[str, Any]  # the run's --knob values
    instances: list[str]  # backend names, in the router's order
    block_size: int
    requests: list[TraceRequest]  # wall seconds from the first arrival
    recorded: list[dict[str, Any]]  # one record per replayable request, the replay results format
    shadows: list[str]  # shadow policies recorded in the run
    skipped: dict[str, int] = field(default_factory=dict)  # why requests could not be re-run
    total: int = 0  # first attempts in the run
    #: policy, knob and fleet changes made while it ran (ts, kind, who); the fleet's are replayed
    changes: list[tuple[float, str, str]] = field(default_factory=list)
    #: the fleet's changes as recorded (ts, after): kvtop/fleet_events.from_config_events
    fleet_changes: list[tuple[float, Any]] = field(default_factory=list)
    t0: float = 0.0  # wall time of the first arrival re-run (the requests' time zero)


def load_run(path: str | Path, run_id: str | None = None) -> RecordedRun:
    """One run of a decision log as a trace plus its recorded results. CliError when unusable."""
    got = read_recorded_run(path, run_id)
    rid, rows, outs = got.run_id, got.decisions, got.outcomes
    config, backends = got.config, got.backends
    instances = [b.get("name") for b in backends] or []
    block_size = int(config.get("block_size") or 512)
    if not rows:
        raise CliError(f"--from-db {path}: run {rid} has no decisions")
    dec = ChainDecoder()
    skipped: dict[str, int] = {}
    policies: list[str] = []
    shadows: list[str] = []
    kept: list[tuple[sqlite3.Row, sqlite3.Row, list[int]]] = []
    for row in rows:  # id order: a session's parent row always comes before its child
        chain = dec.decode(row["request_id"], row["blocks_parent"], row["blocks"])
        if row["policy"] not in policies:
            policies.append(row["policy"])
        if row["shadows"]:
            try:
                for s in json.loads(row["shadows"]):
                    if s.get("policy") not in shadows:
                        shadows.append(s["policy"])
            except (ValueError, TypeError, AttributeError):
                pass
        o = outs.get(row["request_id"])
        why = None
        if chain is None:
            why = "no block chain (a lost parent row)"
        elif row["t_proxy_recv"] is None or row["session_id"] is None:
            why = "no arrival time or session"
        elif o is None:
            why = "no outcome recorded"
        elif o["status"] != "ok" or not o["output_tokens"]:
            why = f"not answered ({o['status']})"
        if why:
            skipped[why] = skipped.get(why, 0) + 1
            continue
        kept.append((row, o, chain))
    if not kept:
        raise CliError(f"--from-db {path}: no request of run {rid} can be re-run "
                       f"({', '.join(f'{v} {k}' for k, v in skipped.items())})")
    kept.sort(key=lambda x: x[0]["t_proxy_recv"])
    t0 = kept[0][0]["t_proxy_recv"]
    last_done: dict[str, float] = {}
    requests, recorded = [], []
    fine = FineChains(block_size)
    for row, o, chain in kept:
        sess = row["session_id"]
        t = row["t_proxy_recv"] - t0
        prev = last_done.get(sess)
        think = max(0.0, t - prev) if prev is not None else None
        last_done[sess] = (o["t_done"] or row["t_proxy_recv"]) - t0
        requests.append(TraceRequest(arrival=t, session=sess, turn=row["turn"] or 1,
                                     input_tokens=row["input_tokens"], output_tokens=o["output_tokens"],
                                     hash_ids=fine.chain(sess, row["request_id"], chain, row["input_tokens"]),
                                     block_size=FINE_BLOCK, think_time=think,
                                     source=f"db:{rid}"))
        recorded.append(RequestResult(
            request_id=row["request_id"], session=sess, turn=row["turn"], arrival=t,
            input_tokens=row["input_tokens"], output_tokens=o["output_tokens"], status="ok",
            ttft_ms=o["ttft_ms"], e2e_ms=o["e2e_ms"], tpot_ms=o["tpot_ms"],
            cached_tokens=o["delivered_hit_tokens"], instance=o["instance"], route_class=row["route_class"],
            stream=o["stream"], t_done=last_done[sess], arm="recorded").as_record())
    return RecordedRun(run_id=rid, policies=policies, knobs=dict(config.get("knobs") or {}),
                       instances=instances, block_size=block_size, requests=requests, recorded=recorded,
                       shadows=shadows, skipped=skipped, total=len(rows), changes=list(got.changes),
                       fleet_changes=list(got.fleet_changes), t0=t0)


#: The block size of the chains handed to the simulator (see FineChains).
FINE_BLOCK = 64


class FineChains:
    """Chains at FINE_BLOCK tokens from the router's coarser recorded ones, for the engine.

    The router records a hash per full block of its own size (512 by default), so a prompt's
    last partial block is invisible: simulated engines would prefill up to 511 tokens of every
    cached prompt again, which vLLM (16-token blocks) does not. An agentic turn repeats its
    session's previous prompt whole and appends to it. So: when every full block of the
    session's previous prompt starts this one and this one is no shorter, the whole previous
    prompt counts as shared (its partial tail included); otherwise only the common full blocks.
    A fine block inherits the previous prompt's id inside the shared part, is derived from its
    coarse block's id elsewhere (``hash((coarse_id, k))``: equal content, equal ids, across
    sessions too), and beyond the last full coarse block is this request's own. Kept per session:
    the last coarse chain, input length and fine chain."""

    def __init__(self, coarse_block: int):
        self.coarse = coarse_block
        self.per = max(1, coarse_block // FINE_BLOCK)
        self.last: dict[str, tuple[list[int], int, list[int]]] = {}

    def chain(self, session: str, request_id: str, coarse: list[int], input_tokens: int) -> list[int]:
        prev = self.last.get(session)
        shared = 0
        if prev is not None:
            p_coarse, p_tokens, p_fine = prev
            k = 0
            for a, b in zip(p_coarse, coarse):
                if a != b:
                    break
                k += 1
            shared = p_tokens if k == len(p_coarse) and input_tokens >= p_tokens else k * self.coarse
            fine = p_fine[:min(shared // FINE_BLOCK, len(p_fine))]
        else:
            fine = []
        per = self.per
        for j in range(len(fine), input_tokens // FINE_BLOCK):
            c = j // per
            fine.append(hash((coarse[c], j % per)) if c < len(coarse) else hash((request_id, j)))
        self.last[session] = (coarse, input_tokens, fine)
        return fine


# -- time scale ---------------------------------------------------------------------------------

def isolated_ttft_s(profile: Any, input_tokens: int, cached_tokens: int) -> float:
    """Engine seconds from arrival to first token for one request alone on a fresh engine of
    ``profile`` whose cache holds the request's first ``cached_tokens`` tokens."""
    from kvtop.sim.engine import Engine, EngineRequest

    eng = Engine(profile)
    bs = eng.block_size
    n = min(input_tokens, eng.max_model_len - 1)
    hashes = list(range(1, n // bs + 1))
    warm = min(cached_tokens, n) // bs
    t = 0.0
    if warm:
        eng.add_request(EngineRequest("warm", warm * bs, hashes[:warm], 1, 0.0))
        t = _run_until(eng, "warm", 0.0, finished=True)
    eng.add_request(EngineRequest("r", n, hashes, 2, t))
    return _run_until(eng, "r", t, finished=False) - t


def _run_until(eng: Any, rid: str, t: float, *, finished: bool) -> float:
    for _ in range(100_000):
        res = eng.step(t)
        if res.idle:
            nxt = eng.next_event_time()
            if nxt is None:
                raise RuntimeError("engine idle before the request ended")
            t = max(nxt, t)
            continue
        t = res.end_time
        if finished and any(f.request_id == rid for f in res.finished):
            return t
        if not finished and rid in res.first_token:
            return t
    raise RuntimeError("engine did not finish one request in 100k steps")


@dataclass
class TimeFit:
    """Wall seconds of a request alone on its instance, from arrival to first token:
    ``fixed_s + per_100k_s * input_tokens / 1e5 + engine_s / speed``. The first two terms are
    the wall-clock path (router, HTTP, the engine's frontend); ``fitted_profile`` makes them
    engine frontend time."""

    speed: float
    fixed_s: float
    per_100k_s: float
    used: int
    note: str

    def overhead_s(self, input_tokens: int) -> float:
        """What the wall-clock path adds to a request (router, HTTP, parsing the body)."""
        return self.fixed_s + self.per_100k_s * input_tokens / 1e5


def _lstsq(rows: list[tuple[list[float], float]]) -> list[float] | None:
    """Least squares by the normal equations (k <= 3 columns); None when singular."""
    k = len(rows[0][0])
    m = [[0.0] * (k + 1) for _ in range(k)]
    for x, y in rows:
        for i in range(k):
            m[i][k] += x[i] * y
            for j in range(k):
                m[i][j] += x[i] * x[j]
    for c in range(k):
        p = max(range(c, k), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-15:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(k):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [a - f * b for a, b in zip(m[r], m[c])]
    return [m[i][k] / m[i][i] for i in range(k)]


def fit_time(run: RecordedRun, profile: Any, speed: float | None = None) -> TimeFit | None:
    """Fit the time scale (unless ``speed`` is given) and the wall-clock overhead.

    Uses streamed requests that ran alone on their instance from arrival to first token: for
    each, the profile's engine (one request, its recorded cached prefix warm) predicts the
    TTFT in engine seconds. Least squares of measured on [1, input tokens, predicted] (or on
    the first two with the last fixed at 1/speed), refitted without the points over four
    robust standard deviations until none is left out (a late stream, a scheduling hiccup). The overhead
    grows with the input because the router and the engine's frontend parse the whole body.
    None when fewer than 8 such requests exist."""
    by_inst: dict[str, list[tuple[float, float]]] = {}
    for r in run.recorded:
        by_inst.setdefault(r["instance"], []).append((r["arrival"], r["t_done"]))
    points: list[tuple[float, float, float]] = []  # (input / 1e5, predicted engine s, measured wall s)
    for r in run.recorded:
        if not r["stream"] or not r["ttft_ms"] or r["ttft_ms"] <= 0:
            continue
        start, first = r["arrival"], r["arrival"] + r["ttft_ms"] / 1000
        busy = 0
        for a, done in by_inst[r["instance"]]:
            if a < first and done > start:
                busy += 1
                if busy > 1:  # itself, and another
                    break
        if busy > 1:
            continue
        points.append((r["input_tokens"] / 1e5, isolated_ttft_s(profile, r["input_tokens"], r["cached_tokens"] or 0),
                       r["ttft_ms"] / 1000))
        if len(points) >= FIT_MAX:
            break
    if len(points) < 8:
        return None
    if speed is None:
        rows = [([1.0, x, e], y) for x, e, y in points]
    else:
        rows = [([1.0, x], y - e / speed) for x, e, y in points]
    coef = None
    for _ in range(20):
        coef = _lstsq(rows)
        if coef is None:
            return None
        res = [y - sum(a * b for a, b in zip(coef, x)) for x, y in rows]
        mad = statistics.median(abs(e) for e in res) * 1.4826
        keep = [r for r, e in zip(rows, res) if abs(e) <= 4 * mad] if mad > 0 else rows
        if len(keep) == len(rows) or len(keep) < 8:
            break
        rows = keep
    if speed is None:
        if coef[2] <= 0:
            return None
        speed = 1.0 / coef[2]
        how = f"fitted on {len(rows)} requests alone on their instance"
    else:
        how = "given"
    return TimeFit(speed, coef[0], coef[1], len(rows), how)


def scaled(run: RecordedRun, speed: float) -> list[TraceRequest]:
    """The run's requests in engine seconds."""
    out = []
    for r in run.requests:
        out.append(TraceRequest(arrival=r.arrival * speed, session=r.session, turn=r.turn,
                                input_tokens=r.input_tokens, output_tokens=r.output_tokens,
                                hash_ids=r.hash_ids, block_size=r.block_size,
                                think_time=None if r.think_time is None else r.think_time * speed,
                                source=r.source))
    return out


def unscale(records: list[dict[str, Any]], speed: float, names: Sequence[str]) -> list[dict[str, Any]]:
    """Simulated records back in the recorded run's wall time and instance names."""
    out = []
    for rec in records:
        rec = dict(rec)
        for k in ("ttft_ms", "e2e_ms", "tpot_ms", "admission_wait_ms", "prefill_leg_ms"):
            if rec.get(k) is not None:
                rec[k] = rec[k] / speed
        rec["arrival"] = rec["arrival"] / speed
        inst = rec.get("instance")
        if isinstance(inst, str) and inst.startswith("i") and inst[1:].isdigit() and int(inst[1:]) < len(names):
            rec["instance"] = names[int(inst[1:])]
        out.append(rec)
    return out


def fitted_profile(profile: Any, fit: TimeFit) -> Any:
    """The profile with the fitted wall-clock overhead as engine frontend time: each request
    reaches the simulated scheduler as late as it reached the real one (the router and the
    engine's frontend parse its body first), which changes who is in the batch when."""
    return profile.with_overrides(
        frontend_overhead_s=profile.frontend_overhead_s + max(0.0, fit.fixed_s) * fit.speed,
        frontend_s_per_token=profile.frontend_s_per_token + max(0.0, fit.per_100k_s) / 1e5 * fit.speed)


# -- validation ---------------------------------------------------------------------------------

METRICS = ("ttft_p50", "ttft_p90", "e2e_p99", "apc")


def ordinal_keys(records: Sequence[dict[str, Any]]) -> list[tuple[str, int]]:
    """(session, n): the n-th request of its session by arrival. A key that survives the
    simulator's own request numbering and a replica's shifted arrivals (a session moves whole)."""
    order = sorted(range(len(records)), key=lambda k: (records[k]["arrival"], k))
    seen: dict[str, int] = {}
    keys: list[tuple[str, int]] = [("", 0)] * len(records)
    for k in order:
        s = records[k]["session"]
        seen[s] = seen.get(s, 0) + 1
        keys[k] = (s, seen[s])
    return keys


def figures(records: Sequence[dict[str, Any]], names: Sequence[str],
            only: set[tuple[str, int]] | None = None) -> dict[str, Any]:
    """TTFT p50/p90, E2E p99 (ms), APC and each instance's share of requests, over ok requests
    (TTFT over ``only`` requests when given: those whose TTFT the recording knows)."""
    keys = ordinal_keys(records) if only is not None else None
    ok = [k for k, r in enumerate(records) if r.get("status") == "ok"]
    ttft = [records[k]["ttft_ms"] for k in ok if records[k].get("ttft_ms") is not None
            and (keys is None or keys[k] in only)]
    e2e = [records[k]["e2e_ms"] for k in ok if records[k].get("e2e_ms") is not None]
    inp = sum(records[k]["input_tokens"] for k in ok)
    hit = sum(records[k].get("cached_tokens") or 0 for k in ok)
    n = len(records) or 1
    share = {name: sum(1 for r in records if r.get("instance") == name) / n for name in names}
    return {"requests": len(records), "ok": len(ok), "ttft_p50": percentile(ttft, 50),
            "ttft_p90": percentile(ttft, 90), "e2e_p99": percentile(e2e, 99),
            "apc": hit / inp if inp else None, "share": share}


def combine(figs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Replicas' figures as one row: each metric's mean, with ``<metric>_ci`` (95% half-width)
    and ``<metric>_range`` (min, max) when there is more than one replica."""
    from kvtop.repeats import interval

    out: dict[str, Any] = {"requests": figs[0]["requests"], "ok": round(statistics.mean(f["ok"] for f in figs)),
                           "replicas": len(figs)}
    for m in METRICS:
        vals = [f[m] for f in figs if f[m] is not None]
        if not vals:
            out[m] = None
            continue
        mean, half = interval(vals)
        out[m] = mean
        if len(figs) > 1:
            out[m + "_ci"] = half
            out[m + "_range"] = (min(vals), max(vals))
    names = figs[0]["share"].keys()
    out["share"] = {n: statistics.mean(f["share"][n] for f in figs) for n in names}
    return out


def validate(recorded: dict[str, Any], sim: dict[str, Any]) -> dict[str, Any]:
    """How closely the re-simulation of the policy that ran reproduces the recorded run:
    relative errors of its (mean) figures, APC in points, and with replicas whether each
    recorded figure lies inside the replicas' range."""
    def rel(k):
        a, b = recorded[k], sim[k]
        return None if not a or b is None else (b - a) / a

    share_gap = max((abs(sim["share"].get(k, 0) - v) for k, v in recorded["share"].items()), default=0.0)
    apc_pts = None if recorded["apc"] is None or sim["apc"] is None else (sim["apc"] - recorded["apc"]) * 100
    inside = {m: sim[m + "_range"][0] <= recorded[m] <= sim[m + "_range"][1]
              for m in METRICS if sim.get(m + "_range") and recorded[m] is not None}
    return {"ttft_p50": rel("ttft_p50"), "ttft_p90": rel("ttft_p90"), "e2e_p99": rel("e2e_p99"),
            "apc_points": apc_pts, "max_share_gap": share_gap, "inside": inside}


def _ms(v: float | None) -> str:
    return "-" if v is None else (f"{v / 1000:.3f} s" if v >= 1000 else f"{v:.1f} ms")


def _pct(v: float | None, signed: bool = False) -> str:
    if v is None:
        return "-"
    return f"{v * 100:+.1f}%" if signed else f"{v * 100:.1f}%"


def _cell(f: dict[str, Any], m: str) -> str:
    v, ci = f[m], f.get(m + "_ci")
    if v is None:
        return "-"
    if m == "apc":
        return _pct(v) + ("" if ci is None else f" ± {ci * 100:.1f}")
    if ci is None:
        return _ms(v)
    return f"{v / 1000:.3f} ± {ci / 1000:.3f} s" if v >= 1000 else f"{v:.1f} ± {ci:.1f} ms"


def format_report(run: RecordedRun, speed: float, speed_note: str, rows: list[tuple[str, dict[str, Any]]],
                  check: dict[str, Any] | None, check_policy: str | None, fmt: str = "text",
                  replicas: int = 1, jitter_s: float = 0.0, features: str = "none") -> str:
    if fmt == "csv":
        import csv
        import io

        buf = io.StringIO()
        w = csv.writer(buf)
        cols = ["ttft_p50_ms", "ttft_p90_ms", "e2e_p99_ms", "apc"]
        w.writerow(["arm", "ok", *cols, *(c + "_ci" for c in cols), *(f"share_{n}" for n in run.instances)])
        for label, f in rows:
            w.writerow([label, f["ok"], *(f[m] for m in METRICS), *(f.get(m + "_ci") for m in METRICS),
                        *(f["share"].get(n) for n in run.instances)])
        return buf.getvalue().rstrip("\n")
    lines = []
    skipped = sum(run.skipped.values())
    lines.append(f"what-if replay of run {run.run_id}: {len(run.requests)} of {run.total} requests "
                 f"re-run ({skipped} skipped" + (": " + ", ".join(f"{v} {k}" for k, v in run.skipped.items())
                                                  if skipped else "") + ")")
    lines.append(f"recorded policy: {', '.join(run.policies)}; instances: {len(run.instances)}; "
                 f"time scale: engine = wall x {speed:.4g} ({speed_note}); figures in the run's wall time")
    lines.append(f"router features, as recorded, in every arm: {features}")
    from kvtop.ceiling import of_requests

    ceiling = of_requests(run.requests)
    if ceiling:  # APC against what an infinite cache could have served of these requests
        shares = ", ".join(f"{label} {f['apc'] / ceiling * 100:.1f}%" for label, f in rows
                           if f.get("apc") is not None)
        lines.append(f"prefix ceiling of the re-run requests: {ceiling * 100:.1f}% of input tokens"
                     + (f"; APC as its share: {shares}" if shares else ""))
    fleet = [c for c in run.changes if c[1] == "fleet"]
    if fleet:
        lines.append(f"fleet changes replayed in every arm at their recorded times: {len(fleet)} "
                     f"({', '.join(sorted({w for _, _, w in fleet}))})")
    others = [c for c in run.changes if c[1] != "fleet"]
    if others:
        who = ", ".join(sorted({w for _, _, w in others}))
        lines.append(f"note: the run's policy or knobs changed {len(others)} time(s) while it ran ({who}); "
                     "every arm re-runs its STARTING settings, so figures after the first change "
                     "compare different setups")
    if replicas > 1:
        lines.append(f"simulated: mean ± 95% interval over {replicas} replicas (replica 0 as recorded, the "
                     f"others with each session shifted by up to ±{jitter_s:g} engine seconds)")
    head = ["arm", "ok", "TTFT p50", "TTFT p90", "E2E p99", "APC"] + list(run.instances)
    body = [[label, str(f["ok"]), *(_cell(f, m) for m in METRICS)]
            + [_pct(f["share"].get(n)) for n in run.instances] for label, f in rows]
    lines.append("")
    if fmt == "md":
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|")
        lines += ["| " + " | ".join(r) + " |" for r in body]
    else:
        widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(head)]
        lines.append("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths))))
        for r in body:
            lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    lines.append("")
    if check is None:
        lines.append("validation: the run used several policies (" + ", ".join(run.policies) + "); "
                     "re-simulating one of them cannot reproduce it, so no fidelity check")
        return "\n".join(lines)
    apc = "-" if check["apc_points"] is None else f"{check['apc_points']:+.1f} points"
    lines.append(f"validation (re-simulated {check_policy} on the recorded arrivals, against the recording): "
                 f"TTFT p50 {_pct(check['ttft_p50'], True)}, p90 {_pct(check['ttft_p90'], True)}, "
                 f"E2E p99 {_pct(check['e2e_p99'], True)}, APC {apc}, "
                 f"largest instance-share gap {check['max_share_gap'] * 100:.1f} points")
    if check["inside"]:
        outside = [m for m, ok in check["inside"].items() if not ok]
        lines.append("  the recording lies inside the replicas' range on " +
                     (", ".join(m for m, ok in check["inside"].items() if ok) or "no figure") +
                     ("" if not outside else "; outside on " + ", ".join(outside)))
    errs = [abs(v) for v in (check["ttft_p50"], check["ttft_p90"]) if v is not None]
    close = bool(errs) and max(errs) <= 0.15 and (check["apc_points"] is None or abs(check["apc_points"]) <= 3)
    trust = ("close: the what-ifs are on a simulator that reproduces this run (TTFT within 15%, APC within "
             "3 points)" if close else
             "loose: the simulator does not reproduce this run closely; read the what-ifs as directions, not "
             "figures (a wrong --profile or --speed is the usual cause; --repeats shows the run-to-run spread)")
    lines.append(f"  trust: {trust}")
    return "\n".join(lines)


def run(args: Any, simulate: Any, sim_config: Any) -> int:
    """``kvtop simulate --from-db``: the CLI's whole path. ``simulate``/``sim_config`` come from
    kvtop/simulate.py (passed in, so this module does not import it back)."""
    import sys
    import time

    from kvtop.repeats import perturb
    from kvtop.seedtable import session_table
    from kvtop.sim.profiles import get_profile
    from router.config import KnobError
    from router.features import FEATURE_KNOBS
    from router.policies import policy_class
    from router.settings import Settings, from_recorded

    try:
        prof = get_profile(args.profile)
    except KeyError as exc:
        raise CliError(str(exc.args[0])) from None
    if args.speed is not None and not args.speed > 0:
        raise CliError("--speed must be positive")
    if args.repeats < 1 or not 0 <= args.jitter < float("inf"):
        raise CliError("--repeats must be at least 1, --jitter finite and at least 0")
    policies = [p.strip() for p in (args.policies or "").split(",") if p.strip()]
    for p in policies:
        try:
            policy_class(p)
        except ValueError as exc:
            raise CliError(str(exc)) from None
    rec = load_run(args.from_db, args.run)
    if not policies:
        policies = list(dict.fromkeys(rec.policies + rec.shadows))
        for p in policies:
            try:
                policy_class(p)
            except ValueError as exc:
                raise CliError(f"the run used a policy this kvtop does not have ({exc}); pass --policies") from None
    t0 = time.process_time()
    fit = fit_time(rec, prof, args.speed)
    if fit is None and args.speed is None:
        raise CliError("cannot fit the time scale: fewer than 8 streamed requests ran alone on their "
                       "instance; pass --speed (e.g. the kvtop sim --speed the run used)")
    speed = args.speed if fit is None else fit.speed
    note = "given, no overhead fitted" if fit is None else (
        f"{fit.note}; wall-clock overhead {fit.fixed_s * 1000:.1f} ms + "
        f"{fit.per_100k_s * 1000:.1f} ms per 100k input tokens, simulated as engine frontend time")
    sim_profile = prof if fit is None else fitted_profile(prof, fit)
    print(f"time scale x{speed:.4g} ({note}) in {time.process_time() - t0:.1f} CPU s", file=sys.stderr)
    requests = scaled(rec, speed)
    from kvtop.fleet_events import from_config_events

    start = rec.instances or sorted({r["instance"] for r in rec.recorded})
    # the run's fleet changes at their times in engine seconds, as the simulator's i<k> names;
    # ``names`` is every instance the run had, in the router's order (the starting ones, then added)
    fleet_events, start, names = from_config_events(rec.fleet_changes, rec.t0, speed, list(start)) \
        if rec.instances else ([], list(start), list(start))
    rec.instances = names  # the report's columns: every instance the run had
    rec_keys = ordinal_keys(rec.recorded)
    has_ttft = {k for k, r in zip(rec_keys, rec.recorded) if r["ttft_ms"] is not None}
    recorded_fig = figures(rec.recorded, names)
    rows: list[tuple[str, dict[str, Any]]] = [("recorded " + "+".join(rec.policies), recorded_fig)]
    arms: list[tuple[str, list[dict[str, Any]]]] = [("recorded " + "+".join(rec.policies), rec.recorded)]
    check, check_policy = None, None
    # the run's own router features (offload, admission) run in every arm, as they did live
    recorded_knobs = from_recorded(rec.knobs)
    features = {k: v for k, v in recorded_knobs.items() if k in FEATURE_KNOBS.names()}
    ran_policy = policy_class(rec.policies[0] if rec.policies else policies[0])
    try:
        ran = Settings.parse(ran_policy.name, {k: v for k, v in recorded_knobs.items()
                                               if k in features or k in ran_policy.schema.names()})
    except KnobError as exc:
        raise CliError(f"the run's knob {exc.field} cannot be re-run: {exc.message}") from None
    for pol in policies:
        canon = policy_class(pol).name
        knobs = {k: v for k, v in recorded_knobs.items()
                 if k in set(policy_class(pol).schema.names()) and k not in features}
        cfg = sim_config(instances=len(start), profile=sim_profile, mode=args.mode, fleet_events=tuple(fleet_events),
                         router_block_size=rec.block_size, knobs=knobs, features=features,
                         # the recorded router set vLLM's priority: its engines ran priority scheduling
                         scheduling_policy="priority" if features.get("priority", "off") != "off" else "fcfs")
        t0 = time.process_time()
        figs = []
        for replica in range(args.repeats):
            try:
                records = simulate(perturb(requests, replica, args.jitter), canon, cfg)
            except ValueError as exc:
                raise CliError(str(exc)) from None
            wall = unscale(records, speed, names)
            figs.append(figures(wall, names, only=has_ttft))
            if replica == 0:
                arms.append((f"sim {canon}", wall))
        print(f"simulated {canon}: {len(requests)} requests x {args.repeats} in {time.process_time() - t0:.1f} CPU s",
              file=sys.stderr)
        fig = combine(figs)
        rows.append((f"sim {canon}", fig))
        if len(rec.policies) == 1 and canon == policy_class(rec.policies[0]).name:
            # the reproduction is replica 0 (the recorded arrivals); the others are the spread
            check, check_policy = validate(recorded_fig, {**figs[0], **{k: v for k, v in fig.items()
                                                                      if k.endswith("_range")}}), canon
    print(format_report(rec, speed, note, rows, check, check_policy, args.format, args.repeats, args.jitter,
                        ran.describe_features()))
    table = session_table(arms, args.format)  # agent sessions' completion times, replica 0
    if table and args.format != "csv":
        print()
        print(table)
    return 0
