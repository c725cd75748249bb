"""Does `kvtop simulate` agree with live runs of the same trace? (issue 18's agreement study)

Live: `benchmarks/peers/run.py --peers "" --policies P --seed S` run several times (fresh
engines and router each time), each a directory with one `kvtop-<policy>.jsonl` of client-side
records per arm and the built trace (meta.json names it). Simulated: the same trace through
`kvtop simulate`'s own function, closed loop, the same instances and profile, in N replicas
(replica 0 as traced, the others with each session shifted by up to --jitter engine seconds,
kvtop/repeats.py `perturb`). Per policy and metric (TTFT p50, TTFT p90, E2E p99 over ok
requests, the same linear percentile on both sides) it prints the live runs, their mean and
spread, the simulator's mean with its 95% interval and the replicas' 95% prediction interval
(where one more run would fall), the difference of the means with its Welch interval, and
whether each live run lies inside the prediction interval; then whether the two rank the
policies the same way.

Live figures are wall seconds of engines running --speed times faster than the profile;
they are multiplied by --speed to compare with the simulator's engine seconds. What the
live path adds that does not scale with the engines (the router, HTTP, the client, the
simulated server's parsing) is then multiplied too: `--fit-overhead` measures it on the live
runs' isolated requests and gives it to the simulated engines as frontend time.

    python benchmarks/bench_agreement.py --live /tmp/agree/s7-r1 /tmp/agree/s7-r2 /tmp/agree/s7-r3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvtop.repeats import interval, perturb, t95
from kvtop.simulate import SimConfig, simulate
from kvtop.traces.loader import load_trace
from store.stats import percentile

METRICS = (("ttft", 50, "TTFT p50 s"), ("ttft", 90, "TTFT p90 s"), ("e2e", 99, "E2E p99 s"))

_STATE: dict[str, Any] = {}


def figures(records: list[dict[str, Any]], scale: float = 1.0) -> dict[str, float]:
    """TTFT p50/p90 and E2E p99 in seconds over ok requests; ``scale`` turns wall into engine
    seconds."""
    ok = [r for r in records if r.get("status", "ok") == "ok" and not r.get("error")]
    out = {}
    for key, q, label in METRICS:
        vals = [r[f"{key}_ms"] * scale / 1000 for r in ok
                if r.get(f"{key}_ms") is not None]
        out[label] = percentile(vals, q) if vals else float("nan")
    return out


def welch_halfwidth(a: list[float], b: list[float]) -> float:
    """Half-width of the 95% interval of mean(b) - mean(a) without assuming equal variances
    (Welch-Satterthwaite degrees of freedom); one live run counts with the simulator's
    variance alone."""
    va = statistics.variance(a) / len(a) if len(a) > 1 else 0.0
    vb = statistics.variance(b) / len(b) if len(b) > 1 else 0.0
    if va + vb == 0:
        return 0.0
    terms = (va * va / (len(a) - 1) if len(a) > 1 else 0.0) + (vb * vb / (len(b) - 1) if len(b) > 1 else 0.0)
    df = max(1, round((va + vb) ** 2 / terms)) if terms else 1
    return t95(df) * (va + vb) ** 0.5


def read_live(run_dir: Path, policy: str) -> list[dict[str, Any]]:
    path = run_dir / f"kvtop-{policy}.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path}: no such live arm (run peers/run.py with --policies {policy})")
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines[1:] if line.strip()]


def pooled_overhead(runs: list[Path], policies: list[str], profile: str, speed: float) -> tuple[Any, str]:
    """The profile with the live path's overhead (fixed + per input token, wall, times
    ``speed``) added as frontend time: one least-squares fit per recorded arm, weighted by the
    requests each fit used."""
    from kvtop.sim.profiles import get_profile
    from kvtop.whatif import TimeFit, fit_time, fitted_profile, load_run

    base = get_profile(profile)
    fits = []
    for d in runs:
        for pol in policies:
            fit = fit_time(load_run(d / f"kvtop-{pol}.db"), base, speed)
            if fit is not None:
                fits.append(fit)
    if not fits:
        raise SystemExit("no live arm had 8 requests alone on their instance to fit the overhead on")
    n = sum(f.used for f in fits)
    fixed = sum(f.fixed_s * f.used for f in fits) / n
    per = sum(f.per_100k_s * f.used for f in fits) / n
    pooled = TimeFit(speed, fixed, per, n, "pooled")
    note = (f"live path overhead, fitted on {n} isolated requests of {len(fits)} arms: "
            f"{fixed * 1000:.1f} ms + {per * 1000:.1f} ms per 100k input tokens (wall), "
            f"given to the simulated engines as frontend time x{speed:g}")
    return fitted_profile(base, pooled), note


def turn_delay(runs: list[Path], policies: list[str], requests: list[Any], speed: float) -> float:
    """The live client's own turn-around in engine seconds: the median over every later turn of
    (its send - the previous turn's end - its think time). The simulated closed loop sends the
    next turn exactly its think time after the answer; live, the answer's last bytes, the
    client's timer and the next send take a few milliseconds more each turn, which moves the
    order of near-simultaneous arrivals (and from there, placements) as a session goes on."""
    think = {(r.session, r.turn): r.think_time or 0.0 for r in requests}
    gaps = []
    for d in runs:
        for pol in policies:
            recs = {(r["session"], r["turn"]): r for r in read_live(d, pol)}
            for (s, t), r in recs.items():
                prev = recs.get((s, t - 1))
                if prev is None or r.get("status") != "ok" or prev.get("status") != "ok" or prev.get("e2e_ms") is None:
                    continue
                gaps.append((r["sent_at"] - prev["sent_at"] - prev["e2e_ms"] / 1000) * speed - think.get((s, t), 0.0))
    return max(0.0, statistics.median(gaps)) if gaps else 0.0


def measured_noise(runs: list[Path], policies: list[str], profile: str, speed: float) -> dict[str, float]:
    """What separates one live run of a trace from another, in engine seconds: the standard
    deviation of the sessions' first sends across the runs (pooled over sessions, each around
    its own mean), and the robust standard deviation (1.4826 x median absolute deviation) of
    the path time of requests that ran alone on their instance, around each arm's fitted
    overhead (kvtop/whatif.py fit_time). With the uniform widths of the same standard
    deviations they give --jitter (half-width, sqrt(3) sd) and --path-jitter (full width,
    sqrt(12) sd)."""
    from kvtop.sim.profiles import get_profile
    from kvtop.whatif import fit_time, isolated_ttft_s, load_run

    devs: list[float] = []
    groups = 0
    for pol in policies:
        sends: dict[str, list[float]] = {}
        for d in runs:
            for r in read_live(d, pol):
                if r.get("turn") == 1:
                    sends.setdefault(r["session"], []).append(r["sent_at"] * speed)
        for v in sends.values():
            if len(v) > 1:
                m = sum(v) / len(v)
                devs += [x - m for x in v]
                groups += 1
    base = get_profile(profile)
    res: list[float] = []
    for d in runs:
        for pol in policies:
            run = load_run(d / f"kvtop-{pol}.db")
            fit = fit_time(run, base, speed)
            if fit is None:
                continue
            spans: dict[str, list[tuple[float, float]]] = {}
            for r in run.recorded:
                spans.setdefault(r["instance"], []).append((r["arrival"], r["t_done"]))
            for r in run.recorded:
                if not r["stream"] or not r["ttft_ms"] or r["ttft_ms"] <= 0:
                    continue
                start, first = r["arrival"], r["arrival"] + r["ttft_ms"] / 1000
                if sum(1 for a, done in spans[r["instance"]] if a < first and done > start) > 1:
                    continue   # not alone on its instance
                predicted = (fit.fixed_s + fit.per_100k_s * r["input_tokens"] / 1e5
                             + isolated_ttft_s(base, r["input_tokens"], r["cached_tokens"] or 0) / speed)
                res.append((r["ttft_ms"] / 1000 - predicted) * speed)
    # pooled within-session variance: one degree of freedom per session's mean (Bessel)
    first_sd = (sum(x * x for x in devs) / (len(devs) - groups)) ** 0.5 if len(devs) > groups else float("nan")
    path_sd = statistics.median(abs(e) for e in res) * 1.4826 if res else float("nan")
    return {"first_send_sd": first_sd, "path_sd": path_sd, "first_sends": len(devs), "isolated": len(res),
            "jitter": 3 ** 0.5 * first_sd, "path_jitter": 12 ** 0.5 * path_sd}


def _sim(task: tuple[str, int]) -> tuple[str, int, dict[str, float]]:
    policy, replica = task
    reqs = perturb(_STATE["requests"], replica, _STATE["jitter"])
    cfg = _STATE["cfg"]
    if cfg.path_jitter_s:
        cfg = replace(cfg, path_seed=replica)   # replica 0 keeps the noise-free path
    recs = simulate(reqs, policy, cfg)
    return policy, replica, figures(recs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--live", type=Path, nargs="+", required=True, help="peers/run.py output dirs of one trace")
    p.add_argument("--trace", type=Path, default=None, help="the built trace (default: the first run's meta.json)")
    p.add_argument("--policies", default="round_robin,lmetric,unified,leastwork,expected_cost")
    p.add_argument("--repeats", type=int, default=16)
    p.add_argument("--jitter", type=float, default=2.0,
                   help="largest shift of a session's arrivals in a replica, engine seconds (default 2)")
    p.add_argument("--path-jitter", type=float, default=0.0, metavar="S",
                   help="each request's path time varies by up to +-S/2 engine seconds in a replica "
                        "(SimConfig.path_jitter_s), the live path's own run-to-run noise (default 0)")
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--fit-overhead", action="store_true",
                   help="give the simulated engines the live path's wall-clock overhead as frontend "
                        "time, fitted on each live run's requests that ran alone (kvtop/whatif.py "
                        "fit_time; pooled over every run and arm)")
    p.add_argument("--measure-noise", action="store_true",
                   help="print what separates the live runs from each other (the sessions' first "
                        "sends, the path time of isolated requests) and the --jitter and --path-jitter "
                        "of the same spread, then exit")
    p.add_argument("--fit-turn-delay", action="store_true",
                   help="add the live client's median turn-around (next send - previous end - think "
                        "time, engine seconds) to every later turn's think time")
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = p.parse_args(argv)
    if not 0 <= args.path_jitter < float("inf") or not 0 <= args.jitter < float("inf"):
        raise SystemExit("--jitter and --path-jitter must be finite and at least 0")
    if not (args.live[0] / "meta.json").is_file():
        raise SystemExit(f"{args.live[0]}: not a benchmarks/peers/run.py output directory (no meta.json)")
    meta = json.loads((args.live[0] / "meta.json").read_text())
    trace = args.trace or Path(meta["trace"])
    speed, instances, profile = meta["speed"], meta["instances_per_arm"], meta["profile"]
    policies = [x for x in args.policies.split(",") if x]
    live = {pol: [figures(read_live(d, pol), speed) for d in args.live] for pol in policies}
    if args.measure_noise:
        n = measured_noise(args.live, policies, profile, speed)
        print(f"live run-to-run noise over {len(args.live)} runs, engine seconds: first sends sd "
              f"{n['first_send_sd']:.3f} ({n['first_sends']} sends) -> --jitter {n['jitter']:.2f}; "
              f"path time of isolated requests, robust sd {n['path_sd']:.3f} ({n['isolated']} requests) "
              f"-> --path-jitter {n['path_jitter']:.2f}")
        return 0

    sim_profile: Any = profile
    fit_note = None
    if args.fit_overhead:
        sim_profile, fit_note = pooled_overhead(args.live, policies, profile, speed)
        print(fit_note, file=sys.stderr)
    requests = load_trace(str(trace))
    if args.fit_turn_delay:
        delay = turn_delay(args.live, policies, requests, speed)
        requests = [replace(r, think_time=(r.think_time or 0.0) + delay) if r.turn > 1 else r for r in requests]
        fit_note = (fit_note + "; " if fit_note else "") + f"client turn-around {delay:.3f} engine s added to think times"
        print(f"live client turn-around (median): {delay:.3f} engine s, added to every later turn's think time",
              file=sys.stderr)
    _STATE.update(requests=requests, jitter=args.jitter,
                  cfg=SimConfig(instances=instances, profile=sim_profile, mode="closed",
                                path_jitter_s=args.path_jitter))
    tasks = [(pol, r) for pol in policies for r in range(args.repeats)]
    t0 = time.time()
    with multiprocessing.get_context("fork").Pool(args.workers) as pool:
        done = pool.map(_sim, tasks)
    sim: dict[str, list[dict[str, float]]] = {pol: [] for pol in policies}
    for pol, _, fig in sorted(done, key=lambda x: (x[0], x[1])):
        sim[pol].append(fig)
    print(f"trace {trace}: {len(_STATE['requests'])} requests, {instances} instances, profile {profile}, "
          f"live at speed {speed} x{len(args.live)} runs, simulated x{args.repeats} "
          f"({time.time() - t0:.1f} s wall); engine seconds", file=sys.stderr)

    out: dict[str, Any] = {"trace": str(trace), "speed": speed, "instances": instances,
                           "fit": fit_note, "policies": {}}
    print(f"{'policy':<14} {'metric':<11} {'live runs':<22} {'live mean ± 95%':>16} {'sim mean ± 95%':>16} "
          f"{'sim 95% PI':>15}  {'live - sim ± 95%':>18}")
    agree = total = in_range = runs_total = 0
    for pol in policies:
        out["policies"][pol] = {}
        for _, _, label in METRICS:
            lv = [f[label] for f in live[pol]]
            sv = [f[label] for f in sim[pol]]
            m, h = interval(sv)
            lm, lh = interval(lv) if len(lv) > 1 else (lv[0], float("nan"))
            dh = welch_halfwidth(sv, lv)
            diff = lm - m
            ok = abs(diff) <= dh
            # where one more run would fall: the replicas' 95% prediction interval
            pi = t95(len(sv) - 1) * statistics.stdev(sv) * (1 + 1 / len(sv)) ** 0.5
            rng = (m - pi, m + pi)
            k = sum(rng[0] <= v <= rng[1] for v in lv)
            agree += ok
            total += 1
            in_range += k
            runs_total += len(lv)
            out["policies"][pol][label] = {"live": lv, "sim": sv, "sim_mean": m, "sim_ci": h, "live_mean": lm,
                                           "live_ci": lh, "diff": diff, "diff_ci": dh, "agree": ok,
                                           "sim_pi": pi, "runs_in_sim_pi": k}
            runs = " ".join(f"{v:.2f}" for v in lv)
            print(f"{pol:<14} {label:<11} {runs:<22} {lm:>8.2f} ± {lh:<5.2f} {m:>8.2f} ± {h:<5.2f} "
                  f"{rng[0]:>7.2f}-{rng[1]:<7.2f}  {diff:>+8.2f} ± {dh:<6.2f}{'' if ok else ' *'}")
    print(f"\nmeans that agree (live - sim interval holds 0): {agree}/{total}; live runs inside the "
          f"simulator's 95% prediction interval: {in_range}/{runs_total}  (* = the means differ)")
    for _, _, label in METRICS:
        lr = sorted(policies, key=lambda pol: statistics.mean(f[label] for f in live[pol]))
        sr = sorted(policies, key=lambda pol: statistics.mean(f[label] for f in sim[pol]))
        print(f"rank by {label}: live {' < '.join(lr)}; sim {' < '.join(sr)}"
              f"{'  (same)' if lr == sr else ''}")
        out.setdefault("ranks", {})[label] = {"live": lr, "sim": sr}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
