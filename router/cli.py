"""Start the routing proxy in front of vLLM instances.

Example:
  kvtop route --backend http://127.0.0.1:8100 --backend http://127.0.0.1:8101 \\
      --policy unified --knob overload_factor=1.5

A backend is URL, name=URL, and may end in @gpu=N to map it to a local GPU for
telemetry (e.g. --backend a=http://127.0.0.1:8100@gpu=0), and in @kv=tcp://HOST:PORT
(@kv-replay=tcp://HOST:PORT) to follow its vLLM KV events (docs/kv-events.md). Policies and their knobs:
see docs/policies.md, or GET /kvtop/v1/policies on a running router.

Sessions come from --session-header, else the body's session_id, else user, else the
hash of the prompt's first block. Text prompts are tokenized with --tokenizer when given,
else approximated as 4 characters per token (each decision records which).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import asyncio
import logging
import signal
import socket
import sqlite3
import sys

from router import limits, replicas
from router.app import STATE, create_app, start_server, tls_context
from router.config import KnobError, parse_knob_args
from router.policies import ALIASES, DEFAULT_POLICY, POLICIES
from router.shadow import ShadowError, parse_specs
from router.backends import parse_backend  # noqa: F401  (kvtop route --backend; tests import it here)
from router.state import DEFAULT_CAPACITY_TOKENS, Backend, RouterConfig
from router.upstream import Pool, UpstreamError
from store.errors import CliError

log = logging.getLogger("kvtop.route")


def add_arguments(p: argparse.ArgumentParser) -> None:
    names = ", ".join(sorted(POLICIES) + sorted(ALIASES))
    p.add_argument("--backend", action="append", default=[], metavar="URL",
                   help="a vLLM instance: URL, name=URL, optionally @gpu=N, @kv=tcp://HOST:5557 (its KV "
                        "events: exact cache state, docs/kv-events.md) and @kv-replay=tcp://HOST:5558 "
                        "(its replay endpoint, to fill gaps) (repeat for each; at least one, or a "
                        "discovery source below)")
    p.add_argument("--backends-file", default=None, metavar="PATH",
                   help="discover instances from a file, one --backend spec a line (# comments; without "
                        "NAME= an entry is named HOST:PORT), watched while the router runs: a new line is "
                        "added, a line gone is drained and then removed, a bad file changes nothing "
                        "(docs/fleet.md)")
    p.add_argument("--backend-dns", action="append", default=[], metavar="NAME:PORT",
                   help="discover instances from NAME's A and AAAA records, each address an instance on "
                        "PORT, looked up again every --dns-interval (repeatable; docs/fleet.md); "
                        "NAME:PORT@kv=auto: each follows the KV events it announces")
    p.add_argument("--backend-srv", action="append", default=[], metavar="NAME",
                   help="discover instances from NAME's SRV records (e.g. _http._tcp.vllm.ns.svc.cluster.local): "
                        "each target's addresses on its port (repeatable; NAME@kv=auto as for --backend-dns)")
    p.add_argument("--dns-server", default=None, metavar="IP[:PORT]",
                   help="ask this DNS server for --backend-dns/--backend-srv (default: the system's resolvers)")
    p.add_argument("--dns-interval", type=float, default=1.0, metavar="S",
                   help="seconds between DNS lookups of each discovered name (default 1)")
    p.add_argument("--discovery-drain-timeout", type=float, default=300.0, metavar="S",
                   help="an instance its discovery source dropped is drained, then removed once idle, or "
                        "removed with its requests failing over after S seconds of draining (default 300)")
    p.add_argument("--policy", default=DEFAULT_POLICY,
                   help=f"routing policy ({names}); default {DEFAULT_POLICY} (docs/policies.md)")
    p.add_argument("--shadow", default=None, metavar="P1,P2",
                   help="shadow policies: each is asked for its pick on every request (same view, off "
                        "the client's path, never applied); recorded per decision and summarised in "
                        "GET /kvtop/v1/shadows (docs/policies.md, Shadow policies)")
    p.add_argument("--shadow-budget-ms", type=float, default=5.0, metavar="MS",
                   help="a shadow whose pick takes longer twice in a row (or 5x this once) is dropped "
                        "from shadowing with an event (default 5)")
    p.add_argument("--knob", action="append", default=[], metavar="KEY=VALUE",
                   help="set a knob (repeatable): a policy knob, or a router-level offload/admission knob "
                        "(docs/policies.md); validated before the router starts")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--db", default="kvtop.db", help="SQLite decision log (default kvtop.db; 'none' to disable)")
    p.add_argument("--block-size", type=int, default=512,
                   help="tokens per block of the router's prefix index (default 512)")
    p.add_argument("--capacity-tokens", type=int, default=DEFAULT_CAPACITY_TOKENS,
                   help="KV capacity per instance in tokens for the estimated cache "
                        f"(default {DEFAULT_CAPACITY_TOKENS:,}: one H20 with Qwen3-30B-A3B)")
    p.add_argument("--kv-speculative-ttl", type=float, default=2.0, metavar="S",
                   help="with KV events, blocks just routed count as cached on their instance for this "
                        "long unless its events confirm them sooner (default 2; 0 = off)")
    p.add_argument("--session-header", default="X-Session-ID",
                   help="request header carrying the session id (default X-Session-ID)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="the model's tokenizer directory (tokenizer.json + tokenizer_config.json with its "
                        "chat template) or a tokenizer.json: text and chat prompts are rendered and "
                        "tokenized as vLLM does, off the event loop (docs/apis.md); 'auto': find the "
                        "tokenizer of the model the backends serve (the directory the engine loaded, "
                        "else the Hugging Face cache); a directory without tokenizer.json: search it "
                        "the same way; the one used is printed at start; 'kvtop-sim': the simulated "
                        "vLLM's own tokenizer (kvtop sim's route line gives it). Default: the "
                        "4-characters-a-token approximation")
    p.add_argument("--max-input-tokens", type=int, default=1_000_000,
                   help="reject prompts longer than this with a 400 (default 1,000,000)")
    p.add_argument("--connect-timeout", type=float, default=5.0, help="upstream connect timeout, s")
    p.add_argument("--read-timeout", type=float, default=600.0,
                   help="upstream read timeout between bytes, s (default 600)")
    p.add_argument("--control-token-file", default=None,
                   help="file holding the control API token, mode 0600 (default: generate one)")
    p.add_argument("--control-readonly", action="store_true", help="refuse every control API mutation")
    p.add_argument("--state-dir", default=None,
                   help="where the token file is written for `kvtop attach` (default ~/.local/state/kvtop)")
    p.add_argument("--assumed-prefill-tps", type=float, default=5000.0,
                   help="prefill tokens/s assumed per instance to show pending prefill as seconds "
                        "of backlog in the control API (default 5000)")
    p.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="serve HTTPS with this certificate chain (with --tls-key)")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="the private key for --tls-cert")
    p.add_argument("--backend-ca-file", default=None, metavar="PEM",
                   help="trust this CA bundle (besides the system's) for https:// backends")
    p.add_argument("--allow-unreachable", action="store_true",
                   help="start even if no backend answers yet")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let in-flight requests finish (default 30)")
    limits.add_arguments(p)
    replicas.add_arguments(p)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    backends = [parse_backend(s, i) for i, s in enumerate(args.backend)]
    discovered: dict[str, list[Backend]] = {}
    if not (backends or args.backends_file or args.backend_dns or args.backend_srv):
        raise CliError("give at least one --backend, or a discovery source (--backends-file, --backend-dns, "
                       "--backend-srv)")
    if args.backends_file:
        from router.discovery import DiscoveryError, read_backends_file

        try:
            found = read_backends_file(args.backends_file)
        except DiscoveryError as exc:
            raise CliError(f"--backends-file {args.backends_file}: {exc}") from None
        backends += found
        # as the file says them (@kv=auto stays auto there; the router's copies get the endpoints)
        discovered["file"] = [dataclasses.replace(b) for b in found]
    if args.backend_dns or args.backend_srv or args.dns_server:
        from router.discovery_dns import make_resolver, parse_dns_target, split_kv

        for spec in args.backend_dns:
            parse_dns_target(split_kv(spec)[0])
        for spec in args.backend_srv:
            split_kv(spec)
        if args.dns_server and not (args.backend_dns or args.backend_srv):
            raise CliError("--dns-server goes with --backend-dns or --backend-srv")
        make_resolver(args.dns_server)
    if not 0 < args.dns_interval < float("inf") or not 0 <= args.discovery_drain_timeout < float("inf"):
        raise CliError("--dns-interval must be positive and --discovery-drain-timeout at least 0")
    names = [b.name for b in backends]
    if len(set(names)) != len(names):
        raise CliError("backend names must be unique" + (" (--backend and --backends-file together)"
                                                         if args.backends_file else ""))
    if not 1 <= args.port <= 65535:
        raise CliError(f"--port {args.port}: expected 1-65535")
    for flag, value in (("--block-size", args.block_size), ("--capacity-tokens", args.capacity_tokens),
                        ("--max-input-tokens", args.max_input_tokens)):
        if value <= 0:
            raise CliError(f"{flag} must be positive")
    if args.kv_speculative_ttl < 0:
        raise CliError("--kv-speculative-ttl must be >= 0")
    if args.assumed_prefill_tps <= 0:
        raise CliError("--assumed-prefill-tps must be positive")
    if args.capacity_tokens < args.block_size:
        raise CliError("--capacity-tokens must hold at least one block")
    try:
        knobs = parse_knob_args(args.knob)
    except KnobError as exc:
        raise CliError(f"--knob {exc.field}: {exc.message}") from None
    try:
        shadows = [name for name, _ in parse_specs(args.shadow)]
    except ShadowError as exc:
        raise CliError(f"--shadow: {exc}") from None
    if not args.shadow_budget_ms > 0:
        raise CliError("--shadow-budget-ms must be positive")
    try:
        replica_kwargs = replicas.config_kwargs(args)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    return RouterConfig(
        backends=backends, policy=args.policy, knobs=knobs, host=args.host, port=args.port,
        db=None if args.db.lower() == "none" else args.db, block_size=args.block_size,
        capacity_tokens=args.capacity_tokens, session_header=args.session_header,
        tokenizer=args.tokenizer, max_input_tokens=args.max_input_tokens,
        connect_timeout_s=args.connect_timeout, read_timeout_s=args.read_timeout,
        control_token_file=args.control_token_file, control_readonly=args.control_readonly,
        state_dir=args.state_dir, argv=" ".join(sys.argv),
        assumed_prefill_tps=args.assumed_prefill_tps, tls_cert=args.tls_cert, tls_key=args.tls_key,
        backend_ca_file=args.backend_ca_file, kv_speculative_ttl_s=args.kv_speculative_ttl,
        shadows=shadows, shadow_budget_ms=args.shadow_budget_ms,
        backends_file=args.backends_file, backend_dns=args.backend_dns, backend_srv=args.backend_srv,
        dns_server=args.dns_server, dns_interval_s=args.dns_interval,
        discovery_drain_timeout_s=args.discovery_drain_timeout, discovered=discovered,
        **limits.config_kwargs(args), **replica_kwargs,
    )


async def probe_backends(backends: list[Backend], timeout: float = 3.0,
                         ca_file: str | None = None) -> list[bool]:
    pool = Pool(connect_timeout=timeout, read_timeout=timeout, ssl_ca_file=ca_file)

    async def one(b: Backend) -> bool:
        try:
            async with asyncio.timeout(timeout):
                r = await pool.request(b.url, "GET", "/health", (), b"")
                async with r:
                    await r.read(limit=64 * 1024)
            return r.status < 500
        except (UpstreamError, TimeoutError, OSError):
            return False
    try:
        return list(await asyncio.gather(*(one(b) for b in backends)))
    finally:
        pool.close()


class _Format(logging.Formatter):
    """``kvtop route: message``, with ``warning:`` before warnings, as the CLI always printed."""

    def format(self, record: logging.LogRecord) -> str:
        msg = super().format(record)
        level = "" if record.levelno < logging.WARNING else record.levelname.lower() + ": "
        return f"kvtop route: {level}{msg}"


def setup_logging() -> None:
    logger = logging.getLogger("kvtop")
    if not any(getattr(h, "_kvtop", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_Format("%(message)s"))
        handler._kvtop = True
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


async def backend_models(backends: list[Backend], timeout: float = 3.0,
                         ca_file: str | None = None) -> list[dict]:
    """The ``data`` of the first backend's ``GET /v1/models`` that answers ([] when none does)."""
    pool = Pool(connect_timeout=timeout, read_timeout=timeout, ssl_ca_file=ca_file)
    try:
        for b in backends:
            try:
                async with asyncio.timeout(timeout):
                    r = await pool.request(b.url, "GET", "/v1/models", (), b"")
                    async with r:
                        body = await r.read(limit=4 * 1024 * 1024)
                if r.status == 200:
                    data = json.loads(body).get("data")
                    if isinstance(data, list):
                        return [m for m in data if isinstance(m, dict)]
            except (UpstreamError, TimeoutError, OSError, ValueError, AttributeError):
                continue
        return []
    finally:
        pool.close()


async def resolve_kv_sources(config: RouterConfig, timeout: float = 3.0) -> None:
    """``@kv=auto``: each such backend's announced KV-event endpoints (router/kv_sources.py);
    one that announces none is followed by the estimate, with a warning."""
    from router import kv_sources

    auto = [b for b in config.backends if b.kv_events == kv_sources.AUTO]
    if not auto:
        return
    pool = Pool(connect_timeout=timeout, read_timeout=timeout, ssl_ca_file=config.backend_ca_file)
    try:
        found = await asyncio.gather(*(kv_sources.announced(pool, b.url, timeout) for b in auto))
    finally:
        pool.close()
    for b, got in zip(auto, found):
        b.kv_events, b.kv_replay = got if got is not None else (None, None)
        if got is None:
            log.warning("%s %s announces no KV events (GET %s); its hits come from the estimate",
                        b.name, b.url, kv_sources.PATH)
        else:
            print(f"kvtop route: {b.name} announces KV events at {b.kv_events}"
                  + (f" (replay {b.kv_replay})" if b.kv_replay else ""), flush=True)


async def resolve_tokenizer(config: RouterConfig) -> None:
    """``--tokenizer auto`` or a directory to search: the tokenizer found, printed; none found
    is a warning and the approximation (router/tokenizer_find.py)."""
    from router.sim_tokenizer import NAME as SIM_TOKENIZER
    from router.tokenizer_find import find_tokenizer

    spec = config.tokenizer
    if spec is None or spec == SIM_TOKENIZER:
        return
    if not (spec == "auto" or (os.path.isdir(spec) and not os.path.isfile(os.path.join(spec, "tokenizer.json")))):
        return
    models = await backend_models(config.backends, ca_file=config.backend_ca_file)
    found = find_tokenizer(models, None if spec == "auto" else spec)
    names = ", ".join(str(m.get("id")) for m in models) or "none answered /v1/models"
    if found is None:
        log.warning("--tokenizer %s: no tokenizer found for the backends' model(s) (%s); text prompts are "
                    "counted with the 4-characters-a-token approximation", spec, names)
        config.tokenizer = None
        return
    config.tokenizer = found[0]
    print(f"kvtop route: tokenizer {found[0]} (found in {found[1]})", flush=True)


async def serve(config: RouterConfig, *, allow_unreachable: bool = False, drain_timeout: float = 30.0,
                ready: asyncio.Event | None = None) -> int:
    if config.backend_dns or config.backend_srv:  # the names' instances at start (router/discovery_dns.py)
        from router.discovery_dns import resolve_at_start

        taken = {b.name for b in config.backends}
        for (kind, spec), found in (await resolve_at_start(config)).items():
            new = [b for b in found if b.name not in taken]
            taken |= {b.name for b in new}
            config.backends += new
            config.discovered[f"{'dns' if kind == 'a' else 'srv'}:{spec}"] = [dataclasses.replace(b) for b in new]
    await resolve_kv_sources(config)
    await resolve_tokenizer(config)
    try:
        app = create_app(config)
        ssl_context = tls_context(config.tls_cert, config.tls_key)
    except KnobError as exc:
        raise CliError(f"{exc.field}: {exc.message}") from None
    except ValueError as exc:
        raise CliError(str(exc)) from None
    up = await probe_backends(config.backends, ca_file=config.backend_ca_file)
    if not any(up) and not allow_unreachable:
        raise CliError("no backend answered /health: " + ", ".join(b.url for b in config.backends)
                       + " (use --allow-unreachable to start anyway)")
    state = app[STATE]
    for i, ok in enumerate(up):
        if not ok:
            state.cluster.set_healthy(i, False)
            log.warning("%s did not answer; marked unhealthy", config.backends[i].url)
    limits.raise_open_file_limit()
    # After the drain deadline, requests still running get 1 s before they are cancelled
    # (their outcomes are still recorded, as client_gone, before the log is flushed).
    # Bind before start-up writes anything: a second router on a taken port must not replace,
    # then delete, the running one's router-<port>.json and token file in the shared state dir.
    try:
        sock = socket.create_server((config.host, config.port),
                                    family=socket.AF_INET6 if ":" in config.host else socket.AF_INET)
    except OSError as exc:
        raise CliError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}") from None
    try:
        runner = await start_server(app, sock, ssl_context)
    except sqlite3.Error as exc:  # the writer opens --db at start-up
        sock.close()
        raise CliError(f"cannot open the decision log --db {config.db}: {exc}") from None
    if config.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s, beyond loopback%s", config.host,
                    "" if ssl_context else " without TLS (--tls-cert/--tls-key)")
    scheme = "https" if ssl_context else "http"
    print(f"kvtop route: {scheme}://{config.host}:{config.port}  policy {state.slot.label}  "
          f"{len(config.backends)} backends  db {config.db or 'off'}  run {state.run_id}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    if ready is not None:
        ready.set()
    await stop.wait()
    # Drain: stop taking new requests, let in-flight ones finish, then flush the log.
    state.draining = True
    deadline = loop.time() + drain_timeout
    while state.cluster.in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    await runner.cleanup()
    log.info("stopped; %d requests routed", state.counts["requests"])
    return 0


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    setup_logging()
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; without it asyncio's loop serves
        uvloop = None
    if uvloop is not None:
        return uvloop.run(serve(config, allow_unreachable=args.allow_unreachable,
                                drain_timeout=args.drain_timeout))
    return asyncio.run(serve(config, allow_unreachable=args.allow_unreachable,
                             drain_timeout=args.drain_timeout))
