"""kvtop against sglang-router and vllm-router on simulated vLLM, one command, one report.

    python benchmarks/peers/run.py --out peers-out          # about 5 minutes on 2 cores

What it does, in order:
1. Makes (once) a venv under ``--venv`` with ``sglang-router`` and ``vllm-router`` from PyPI.
2. Builds the agentic trace from the Claude Code sessions in ``--weka`` (``kvtop trace
   convert`` with the input capped at ``--max-input``, cached; ``kvtop trace build``;
   ``kvtop trace cap``).
3. Starts ONE ``kvtop sim`` process holding ``instances x arms`` engines on 127.0.0.1; each
   arm gets its own, never-used set of ports, so every arm starts with cold engine caches
   and no arm sees another's traffic.
4. Per arm: starts the router on loopback, replays the trace through it (closed loop, text
   prompts: ``kvtop replay --prompt-format text``, since sglang-router rejects token ids)
   scraping that arm's engines, stops the router by pid.
5. Writes ``report.md`` (``kvtop report --format md``) over all arms to ``--out``.
   It ends with where each arm's gap to the prefix ceiling went (docs/ceiling.md), against
   the capacity ceiling of the arm's engines (--profile's KV x --instances), and for kvtop's
   arms again with placement from their decision logs.

Everything binds 127.0.0.1 (peers get ``--host`` and ``--prometheus-host`` 127.0.0.1 and
distinct Prometheus ports).

``--offline`` (issue 38) runs the same comparison in virtual time instead, for fleets the
machine cannot drive live: ``kvtop simulate`` over the same built trace, kvtop's arms as they
are and the peers through their models (``cache_aware`` for sglang-router's and
vllm-router's cache_aware, kvtop's own ``round_robin`` for sglang's round_robin: the same
rule), no venv, engines or routers; ``--repeats N`` adds replicas with error bars.

    python benchmarks/peers/run.py --offline --instances 32 --sessions 96 --stagger 1.25 \
        --max-turns 12 --seed 23 --policies expected_cost --out peers32
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_CACHE = Path(os.environ.get("KVTOP_PEERS_CACHE", Path.home() / ".cache" / "kvtop-peers"))
KVTOP_POLICIES = "round_robin,lmetric,unified,leastwork"
PEER_ARMS = "sglang:cache_aware,sglang:round_robin,vllm:cache_aware"


@dataclass
class Arm:
    label: str
    kind: str  # kvtop | sglang | vllm
    policy: str
    backends: list[str] = field(default_factory=list)


def log(msg: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ensure_venv(venv: Path) -> Path:
    """The peers' venv (created and filled once); returns its bin directory."""
    bin_dir = venv / "bin"
    py = bin_dir / "python"
    ok = py.exists() and subprocess.run(
        [str(py), "-c", "import sglang_router, vllm_router"], capture_output=True).returncode == 0
    if not ok:
        log(f"creating {venv} and installing sglang-router, vllm-router")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "sglang-router", "vllm-router"],
                       check=True)
    return bin_dir


def build_trace(args: argparse.Namespace, out: Path) -> Path:
    kvtop = [sys.executable, "-m", "kvtop"]
    converted = args.cache / f"weka-cap{args.max_input}.jsonl.gz"
    if not converted.exists():
        log(f"converting {args.weka} (once; cached at {converted})")
        tmp = converted.with_suffix(".tmp.gz")
        subprocess.run([*kvtop, "trace", "convert", str(args.weka), "--format", "weka",
                        "--max-input", str(args.max_input), "--out", str(tmp)], check=True)
        tmp.rename(converted)
    built, capped = out / "built.jsonl", out / "trace.jsonl"
    subprocess.run([*kvtop, "trace", "build", str(converted), "--sessions", str(args.sessions),
                    "--stagger", str(args.stagger), "--max-gap", str(args.max_gap),
                    "--seed", str(args.seed), "--out", str(built)], check=True)
    subprocess.run([*kvtop, "trace", "cap", str(built), "--max-turns", str(args.max_turns),
                    "--out", str(capped)], check=True)
    stats = subprocess.run([*kvtop, "trace", "stats", str(capped)], check=True,
                           capture_output=True, text=True).stdout
    (out / "trace-stats.txt").write_text(stats)
    log("trace:\n" + stats)
    return capped


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None,
              want: str | None = None) -> None:
    """Poll ``url`` until it answers 200 (and its body contains ``want``)."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                body = r.read().decode(errors="replace")
                if r.status == 200 and (want is None or want in body):
                    return
                last = body[:200]
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.3)
    raise RuntimeError(f"{url} not ready after {timeout} s: {last}")


def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM by pid, then SIGKILL after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def router_cmd(arm: Arm, port: int, prom_port: int, peers_bin: Path, out: Path,
               args: argparse.Namespace) -> list[str]:
    if arm.kind == "kvtop":
        cmd = [sys.executable, "-m", "kvtop", "route", "--host", "127.0.0.1", "--port", str(port),
               "--policy", arm.policy, "--db", str(out / f"{arm.label}.db"),
               "--state-dir", str(out / "state"), "--capacity-tokens", str(args.capacity_tokens)]
        for b in arm.backends:
            cmd += ["--backend", b]
        return cmd
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *arm.backends,
              "--policy", arm.policy, "--prometheus-host", "127.0.0.1",
              "--prometheus-port", str(prom_port)]
    if arm.kind == "sglang":
        return [str(peers_bin / "python"), "-m", "sglang_router.launch_router", *common,
                "--log-level", "warn"]
    return [str(peers_bin / "vllm-router"), *common, "--log-level", "warning"]


def parse_arms(args: argparse.Namespace) -> list[Arm]:
    arms = [Arm(f"kvtop-{p}", "kvtop", p) for p in args.policies.split(",") if p]
    for spec in (s for s in args.peers.split(",") if s):
        kind, _, policy = spec.partition(":")
        if kind not in ("sglang", "vllm") or not policy:
            raise SystemExit(f"bad --peers entry {spec!r} (want sglang:POLICY or vllm:POLICY)")
        arms.append(Arm(f"{kind}-{policy}", kind, policy))
    return arms


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("peers-out"), help="output directory")
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                   help="cache dir for the converted trace (default ~/.cache/kvtop-peers)")
    p.add_argument("--venv", type=Path, default=None, help="peers' venv (default CACHE/venv)")
    p.add_argument("--weka", default="/work/shared/traces/weka_claude_code",
                   help="Claude Code trace directory (or glob)")
    p.add_argument("--trace", type=Path, default=None, help="use this built trace instead")
    p.add_argument("--max-input", type=int, default=200_000,
                   help="cap input tokens at this max_model_len (default 200,000)")
    p.add_argument("--sessions", type=int, default=10)
    p.add_argument("--stagger", type=float, default=10.0, help="trace seconds between session starts")
    p.add_argument("--max-gap", type=float, default=20.0, help="clamp idle gaps and think times (trace s; `trace build --max-gap`)")
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--instances", type=int, default=4, help="engines per arm")
    p.add_argument("--profile", default="h20")
    p.add_argument("--speed", type=float, default=10.0,
                   help="engine and trace time run this many times faster than wall time")
    p.add_argument("--capacity-tokens", type=int, default=265_000,
                   help="kvtop's estimated cache per instance (the h20 profile's KV)")
    p.add_argument("--port-base", type=int, default=18400, help="first engine port")
    p.add_argument("--router-port", type=int, default=18380, help="router port (arms reuse it)")
    p.add_argument("--prometheus-port", type=int, default=18390, help="first peer Prometheus port")
    p.add_argument("--policies", default=KVTOP_POLICIES, help="kvtop arms")
    p.add_argument("--peers", default=PEER_ARMS, help="peer arms, kind:policy,...")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request replay timeout (s)")
    p.add_argument("--prompt-format", choices=("text", "tokens"), default="text",
                   help="how prompts are sent (default text: sglang-router rejects token ids; "
                        "tokens: kvtop arms only, no tokenizing anywhere on the path)")
    p.add_argument("--offline", action="store_true",
                   help="kvtop simulate instead of live engines and routers; the peers through their "
                        "models (see above)")
    p.add_argument("--repeats", type=int, default=1,
                   help="--offline: replicas per arm (kvtop simulate --repeats; default 1)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.offline:
        return offline(args, p)
    if args.prompt_format == "tokens" and any(a.kind != "kvtop" for a in parse_arms(args)):
        raise SystemExit("--prompt-format tokens is for kvtop arms only (give --peers \"\"): "
                         "sglang-router rejects token ids")
    args.cache.mkdir(parents=True, exist_ok=True)
    out = args.out
    if out.exists():
        shutil.rmtree(out)
    (out / "logs").mkdir(parents=True)
    arms = parse_arms(args)
    peers_bin = ensure_venv(args.venv or args.cache / "venv") if any(
        a.kind != "kvtop" for a in arms) else Path()
    trace = args.trace or build_trace(args, out)

    n = args.instances
    for k, arm in enumerate(arms):
        arm.backends = [f"http://127.0.0.1:{args.port_base + k * n + i}" for i in range(n)]
    sim_log = open(out / "logs" / "sim.log", "w")
    sim = subprocess.Popen(
        [sys.executable, "-m", "kvtop", "sim", "--instances", str(n * len(arms)),
         "--port-base", str(args.port_base), "--profile", args.profile, "--speed", str(args.speed),
         "--no-kv-events"],  # no router here follows them: they would only cost the sim CPU
        stdout=sim_log, stderr=subprocess.STDOUT)
    meta = {"profile": args.profile, "speed": args.speed, "instances_per_arm": n,
            "cold_caches": "one kvtop sim process, a fresh never-used set of engines per arm",
            "trace": str(trace), "arms": []}
    results: list[str] = []
    try:
        for arm in arms:
            for b in arm.backends:
                wait_http(b + "/health", 60, sim)
        log(f"sim up: {n * len(arms)} engines ({args.profile}, speed {args.speed})")
        model = json.loads(urllib.request.urlopen(arms[0].backends[0] + "/v1/models", timeout=5)
                           .read())["data"][0]["id"]
        for k, arm in enumerate(arms):
            port = args.router_port
            rlog = open(out / "logs" / f"{arm.label}.router.log", "w")
            cmd = router_cmd(arm, port, args.prometheus_port + k, peers_bin, out, args)
            router = subprocess.Popen(cmd, stdout=rlog, stderr=subprocess.STDOUT)
            try:
                wait_http(f"http://127.0.0.1:{port}/v1/models", 90, router, want=model)
                res = out / f"{arm.label}.jsonl"
                t0 = time.monotonic()
                log(f"arm {arm.label}: replaying through {' '.join(cmd[:4])} ...")
                rc = subprocess.run(
                    [sys.executable, "-m", "kvtop", "replay", str(trace), "--prompt-format",
                     args.prompt_format, "--target", f"http://127.0.0.1:{port}", "--mode", "closed",
                     "--speed", str(args.speed), "--model", model,
                     "--arm", arm.label, "--out", str(res), "--timeout", str(args.timeout),
                     "--no-progress", *sum((["--scrape", b] for b in arm.backends), [])]).returncode
                meta["arms"].append({"label": arm.label, "cmd": cmd, "rc": rc,
                                     "wall_s": round(time.monotonic() - t0, 1)})
                if rc == 0:
                    results.append(str(res))
            finally:
                stop(router)
                rlog.close()
    finally:
        stop(sim)
        sim_log.close()
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    if not results:
        log("no arm produced results")
        return 1
    subprocess.run([sys.executable, "-m", "kvtop", "report", *results, "--format", "md",
                    "--kv-tokens", str(fleet_kv(args)), "--out", str(out / "report.md")], check=True)
    logged = [(str(out / f"{a.label}.jsonl"), str(out / f"{a.label}.db")) for a in arms
              if a.kind == "kvtop" and str(out / f"{a.label}.jsonl") in results and (out / f"{a.label}.db").exists()]
    if logged:  # kvtop's arms again, placement from their decision logs (docs/ceiling.md)
        from kvtop.report import logged_gaps

        table = logged_gaps(logged, fleet_kv(args), "md")
        if table:
            with open(out / "report.md", "a", encoding="utf-8") as f:
                f.write(f"\n## Where the gap went, placement from the decision logs\n\n{table}\n")
    print((out / "report.md").read_text())
    return 0


def fleet_kv(args: argparse.Namespace) -> int:
    """The engines' KV in tokens, all of an arm's instances together (the capacity ceiling)."""
    from kvtop.sim.profiles import get_profile

    return args.instances * get_profile(args.profile).kv_capacity_tokens


#: What each peer arm is offline: the kvtop policy (or peer model) that follows its rule.
PEER_MODELS = {"sglang:cache_aware": "cache_aware", "vllm:cache_aware": "cache_aware",
               "sglang:round_robin": "round_robin", "vllm:round_robin": "round_robin"}


def offline(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    """The comparison in virtual time: one ``kvtop simulate`` over every arm, then the report."""
    policies = [x for x in args.policies.split(",") if x]
    for spec in (x for x in args.peers.split(",") if x):
        model = PEER_MODELS.get(spec)
        if model is None:
            p.error(f"--offline has no model of peer arm {spec!r} (known: {', '.join(PEER_MODELS)})")
        if model not in policies:
            policies.append(model)
    if not policies:
        p.error("no arm to run")
    args.cache.mkdir(parents=True, exist_ok=True)
    out = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    trace = args.trace or build_trace(args, out)
    cmd = [sys.executable, "-m", "kvtop", "simulate", str(trace), "--policies", ",".join(policies),
           "--instances", str(args.instances), "--profile", args.profile, "--mode", "closed",
           "--format", "md"]
    if args.repeats > 1:
        cmd += ["--repeats", str(args.repeats), "--terminal-plot", "never"]
    else:
        cmd += ["--out", str(out / "sim")]
    log(f"offline: {' '.join(cmd[2:])}")
    got = subprocess.run(cmd, capture_output=True, text=True)
    if got.returncode != 0:
        sys.stderr.write(got.stderr)
        return got.returncode
    if args.repeats > 1:
        report = got.stdout
    else:  # one results file per arm: kvtop report (the ceiling from the trace they name)
        subprocess.run([sys.executable, "-m", "kvtop", "report",
                        *sorted(str(x) for x in (out / "sim").glob("*.jsonl")),
                        "--format", "md", "--out", str(out / "report.md")], check=True)
        report = (out / "report.md").read_text()
    if args.repeats == 1:  # the gap to the ceiling again, placement from the decision rows
        from kvtop.cachegap import simulated_gaps

        report += ("\n## Where the gap went, placement from the decision rows\n\n"
                   + simulated_gaps(str(trace), policies, args.instances, args.profile, fmt="md") + "\n")
    header = (f"# Offline: {args.instances} instances, {args.profile}, engine seconds\n\n"
              f"`{' '.join(cmd[2:])}`; peers as models: "
              f"{', '.join(f'{k} = {v}' for k, v in PEER_MODELS.items() if k in args.peers.split(','))}\n\n")
    (out / "report.md").write_text(header + report)
    print(header + report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
