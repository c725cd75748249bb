"""A whole kvtop setup on this machine, one command: simulated vLLM instances, the router,
a replay of the bundled sample trace, and the dashboard attached to it.

  kvtop demo                          # 4 instances, policy expected_cost, the TUI
  kvtop demo --instances 8 --policy lmetric --speed 20
  kvtop demo --headless --duration 10 # no TUI: run for 10 s, print the report seed table

The instances publish vLLM's KV events and the router follows them, so its hits are what each
engine holds and the dashboard's drift column shows how far its own estimate would have been
(--no-kv-events: the estimate alone). Everything listens on 127.0.0.1, on free ports or from
--port-base. Quitting (q or ctrl+c) stops every process the demo started, by pid, and nothing
else. The decision log is kept (in the state dir, ~/.local/state/kvtop/demo/ or --state-dir,
unless --db names a file) and its path printed on the way out; the router's locator goes to
the state dir too, so `kvtop attach` (with the same --state-dir) in a second terminal finds the
demo. The dashboard opens at once and says "connecting" while the cluster starts. Latencies are
wall-clock time at --speed: the engines run that much faster.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from kvtop.procs import free_port_run, stop_processes
from router.policies import DEFAULT_POLICY


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instances", type=int, default=4, metavar="N", help="simulated vLLM instances (default 4)")
    p.add_argument("--policy", default=DEFAULT_POLICY, help=f"routing policy (default {DEFAULT_POLICY})")
    p.add_argument("--shadow", default=None, metavar="P1,P2",
                   help="shadow policies the router asks on every request without applying them "
                        "(kvtop route --shadow; the Policy tab shows them)")
    p.add_argument("--knob", action="append", default=[], metavar="KEY=VALUE",
                   help="a policy or router-level knob for the router (kvtop route --knob; e.g. "
                        "offload_mode=simple, admission=fifo; repeatable)")
    p.add_argument("--speed", type=float, default=10.0, metavar="X",
                   help="engine time and trace arrivals run X times faster than wall time (default 10)")
    p.add_argument("--db", default=None, metavar="FILE", help="decision log (default: a temporary file)")
    p.add_argument("--duration", type=float, default=None, metavar="S",
                   help="stop after S seconds (default: until you quit; headless: until the trace ends)")
    p.add_argument("--headless", action="store_true",
                   help="no dashboard: run, then print the report seed table for the run")
    p.add_argument("--trace", default=None, metavar="FILE", help="trace to replay (default: the bundled sample)")
    p.add_argument("--loops", type=int, default=3, metavar="K",
                   help="with the dashboard, replay the trace up to K times (default 3)")
    p.add_argument("--loop", action="store_true",
                   help="with the dashboard, replay the trace again and again until you quit")
    p.add_argument("--port-base", type=int, default=None, metavar="PORT",
                   help="instances listen on PORT..PORT+N-1, their KV events on the 2N ports after them "
                        "(none with --no-kv-events), the router on the next one (default: a free run of ports)")
    p.add_argument("--state-dir", default=None, metavar="DIR",
                   help="where the router's locator and the kept decision logs go "
                        "(default ~/.local/state/kvtop; kvtop attach --state-dir DIR finds it)")
    p.add_argument("--no-kv-events", action="store_true",
                   help="the simulated instances publish no KV events, so the router routes on its "
                        "own estimate of their caches (default: it follows their events, exact)")


class Stack:
    """The processes one demo started; ``stop`` ends exactly those."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.lock = threading.Lock()
        self.closed = False  # after stop, nothing more starts (the cluster starts behind the dashboard)

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        from kvtop.cli import CliError

        with self.lock:
            if self.closed:
                raise CliError("the demo is stopping")
            log = open(self.workdir / f"{name}.log", "ab")
            proc = subprocess.Popen([sys.executable, "-m", "kvtop", *args], stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            self.procs.append((name, proc))
        return proc

    def log_tail(self, name: str, lines: int = 5) -> str:
        try:
            text = (self.workdir / f"{name}.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:])

    def stop(self, grace_s: float = 5.0) -> None:
        with self.lock:
            self.closed = True
            procs = list(reversed(self.procs))
            self.procs.clear()
        # Each verb shuts down cleanly on SIGINT. One at a time, newest first: the replay, then
        # the router (its requests in flight are answered by instances still up, and it writes
        # the last of its decision log: on a busy machine a shared 5 s cut it off mid-write),
        # then the instances.
        for name, proc in procs:
            stop_processes([proc], grace_s=max(grace_s, 15.0) if name == "route" else grace_s,
                           sig=signal.SIGINT)


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float, ok=(200, 503)) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status in ok:
                    return True
        except urllib.error.HTTPError as exc:
            if exc.code in ok:
                return True
        except OSError:
            pass
        time.sleep(0.1)
    return False


def port_plan(args: argparse.Namespace) -> tuple[int, int, int]:
    """(instance base, KV-event base, router port): HTTP on base..base+n-1; with events,
    instance i publishes on kv + 2i and replays on kv + 2i + 1; the router on the port after."""
    n = args.instances
    events = not getattr(args, "no_kv_events", False)
    span = 3 * n if events else n
    base = args.port_base if getattr(args, "port_base", None) is not None else free_port_run(span + 1)
    return base, base + n, base + span


def state_dir_of(args: argparse.Namespace) -> Path:
    from kvtop.tui.feed import default_state_dir

    return Path(args.state_dir).expanduser() if getattr(args, "state_dir", None) else default_state_dir()


def start_cluster(args: argparse.Namespace, stack: Stack, db: str,
                  plan: tuple[int, int, int] | None = None) -> tuple[str, str | None, list[str]]:
    """Start sim and router; returns (router URL, token, instance URLs)."""
    from kvtop.cli import CliError

    n = args.instances
    events = not getattr(args, "no_kv_events", False)
    base, kv, port = plan or port_plan(args)
    sim = stack.start("sim", ["sim", "--instances", str(n), "--port-base", str(base), "--speed", f"{args.speed:g}",
                              *(["--kv-events-port-base", str(kv)] if events else ["--no-kv-events"])])
    urls = [f"http://127.0.0.1:{base + i}" for i in range(n)]
    for u in urls:
        if not wait_http(u + "/health", sim, 30):
            raise CliError(f"kvtop sim did not come up: {stack.log_tail('sim') or 'no output'}")
    state_dir = state_dir_of(args)  # where `kvtop attach` looks: a second terminal finds the demo
    # the simulator's own tokenizer: text prompts are counted into the token ids the engines hash
    route_args = ["route", "--port", str(port), "--policy", args.policy, "--db", db, "--state-dir", str(state_dir),
                  "--tokenizer", "kvtop-sim"]
    for i, u in enumerate(urls):
        # the router's hits then come from what each engine reports it holds (docs/kv-events.md)
        route_args += ["--backend", f"{u}@kv=tcp://127.0.0.1:{kv + 2 * i}@kv-replay=tcp://127.0.0.1:{kv + 2 * i + 1}"
                       if events else u]
    if args.shadow:
        route_args += ["--shadow", args.shadow]
    for knob in args.knob:
        route_args += ["--knob", knob]
    router = stack.start("route", route_args)
    url = f"http://127.0.0.1:{port}"
    if not wait_http(url + "/health", router, 30):
        raise CliError(f"kvtop route did not come up: {stack.log_tail('route') or 'no output'}")
    token = None
    try:
        info = json.loads((state_dir / f"router-{port}.json").read_text())
        token = Path(info["token_file"]).read_text().strip() if info.get("token_file") else None
    except (OSError, ValueError, KeyError):
        pass
    return url, token, urls


def trace_path(args: argparse.Namespace) -> str:
    from kvtop.cli import CliError

    if args.trace:
        if not Path(args.trace).is_file():
            raise CliError(f"no trace file at {args.trace}")
        return args.trace
    try:
        from kvtop.traces import sample_trace_path

        path = sample_trace_path()
    except (ImportError, FileNotFoundError, ModuleNotFoundError):
        path = None
    if path is None or not Path(path).is_file():
        raise CliError("the bundled sample trace is missing from this install; pass --trace FILE")
    return str(path)


def replay_args(trace: str, url: str, speed: float, out: Path, duration: float | None = None) -> list[str]:
    args = ["replay", trace, "--target", url, "--speed", f"{speed:g}", "--out", str(out), "--arm", "demo",
            "--no-progress"]
    return args + ["--duration", f"{duration:g}"] if duration else args


#: How long a bounded run waits, after it stops sending, for answers still on their way.
ANSWER_GRACE_S = 60.0


def run(args: argparse.Namespace) -> int:
    from kvtop.cli import CliError

    if args.instances < 1:
        raise CliError("--instances must be at least 1")
    if args.speed <= 0:
        raise CliError("--speed must be positive")
    if args.shadow:
        from router.shadow import ShadowError, parse_specs

        try:
            parse_specs(args.shadow)
        except ShadowError as exc:
            raise CliError(f"--shadow: {exc}") from None
    if args.knob:  # refused here, in one line, not as the router's failure to start
        from router.config import KnobError, parse_knob_args
        from router.settings import Settings

        try:
            Settings.parse(args.policy, parse_knob_args(args.knob))
        except KnobError as exc:
            raise CliError(f"--knob {exc.field}: {exc.message}") from None
    if args.duration is not None and args.duration <= 0:
        raise CliError("--duration must be positive")
    if args.loops < 1:
        raise CliError("--loops must be at least 1")
    if args.port_base is not None:
        span = (3 * args.instances if not args.no_kv_events else args.instances) + 1
        if not 1024 <= args.port_base <= 65535 - span:
            raise CliError(f"--port-base must leave {span} ports below 65536 and be at least 1024, "
                           f"got {args.port_base}")
    if args.state_dir is not None:
        try:
            state_dir_of(args).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CliError(f"--state-dir {args.state_dir}: {exc.strerror or exc}") from None
    trace = trace_path(args)
    if not args.headless and not (sys.stdout.isatty() and sys.stdin.isatty()):
        # No terminal to draw on (a pipe, a CI log): give the numbers instead of escape codes.
        args.headless = True
        if args.duration is None:
            args.duration = 60.0
        print(f"kvtop demo: no terminal, so no dashboard; running headless for {args.duration:g} s "
              "and printing the report (choose with --headless --duration S)", file=sys.stderr)
    # A terminal closing (SIGHUP) or a kill (SIGTERM) stops the demo like Ctrl-C does, so the
    # processes it started are stopped too instead of outliving it.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    db = args.db or str(demo_db_path(state_dir_of(args)))
    with tempfile.TemporaryDirectory(prefix="kvtop-demo-") as tmp:
        workdir = Path(tmp)
        stack = Stack(workdir)
        print(f"kvtop demo: starting {args.instances} simulated instances and the router ...", file=sys.stderr)
        try:
            if args.headless:
                url, token, _ = start_cluster(args, stack, db)
                return _headless(args, stack, trace, url, workdir, db)
            return _with_tui(args, stack, trace, workdir, db)
        finally:
            stack.stop()
            if Path(db).is_file():
                print(f"kvtop demo: decision log kept at {db}\n  kvtop log --db {db} summary\n"
                      f"  kvtop log --db {db} why REQUEST_ID", file=sys.stderr)


def demo_db_path(state_dir: Path | None = None) -> Path:
    """A new decision-log file for this demo in the state dir: kept after the demo ends."""
    from kvtop.tui.feed import default_state_dir

    folder = (state_dir or default_state_dir()) / "demo"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"kvtop-demo-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.db"


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _headless(args: argparse.Namespace, stack: Stack, trace: str, url: str, workdir: Path, db: str) -> int:
    from kvtop.report import load_db_arms, load_results, render

    out = workdir / "results.jsonl"
    # replay stops sending at --duration and waits for what it asked, so no answer is cut off
    replay = stack.start("replay", replay_args(trace, url, args.speed, out, args.duration))
    print(f"kvtop demo: {args.instances} simulated instances, router {url} (policy {args.policy}), "
          f"replaying {Path(trace).name} at {args.speed:g}x", file=sys.stderr)
    try:
        replay.wait(timeout=None if args.duration is None else args.duration + ANSWER_GRACE_S)
    except subprocess.TimeoutExpired:
        replay.send_signal(signal.SIGINT)  # replay writes the results it has, then exits
        try:
            replay.wait(timeout=15)
        except subprocess.TimeoutExpired:
            replay.kill()
    stack.stop()  # the router flushes its decision log on the way out
    arms = []
    if out.is_file() and out.stat().st_size:
        try:
            arms = [load_results(str(out))]
        except Exception as exc:  # fall back to the router's own log
            print(f"kvtop demo: cannot read replay results ({exc}); using the decision log", file=sys.stderr)
    if not arms and Path(db).is_file():
        arms = load_db_arms(db, None)
    if not arms:
        from kvtop.cli import CliError

        raise CliError(f"the run produced no results: {stack.log_tail('replay') or stack.log_tail('route')}")
    table = render(arms, "text")
    sys.stdout.write(table if table.endswith("\n") else table + "\n")
    if args.speed != 1:
        print(f"(latencies are wall-clock time with the engines at {args.speed:g}x speed: the simulated "
              f"engine's own times are {args.speed:g}x these; kvtop simulate reports engine time)")
    return 0


def _with_tui(args: argparse.Namespace, stack: Stack, trace: str, workdir: Path, db: str) -> int:
    """The dashboard first (its first frame says "connecting"), the cluster behind it."""
    from kvtop.cli import CliError
    from kvtop.tui import splash

    plan = port_plan(args)
    url = f"http://127.0.0.1:{plan[2]}"
    # the first frame before Textual is imported (seconds on a loaded host); Textual draws over it
    shown = splash.connecting_frame(url, f"kvtop demo: starting {args.instances} instances and the router")
    try:
        from kvtop.tui.app import KvtopApp, theme_names
        from kvtop.tui.config import ConfigError, config_path, load_config
        from kvtop.tui.feed import RouterFeed
    except BaseException:
        if shown:
            splash.leave()
        raise
    locator = state_dir_of(args) / f"router-{plan[2]}.json"

    def token_loader() -> str | None:
        # the router writes its token once it is up: read when a change first needs it
        info = json.loads(locator.read_text())
        return Path(info["token_file"]).read_text().strip() if info.get("token_file") else None

    config_file = config_path()
    try:
        config = load_config(config_file, themes=theme_names())
    except ConfigError:
        config = {}  # kvtop attach reports a bad file; the demo runs on the defaults
    stop = threading.Event()
    failed: list[str] = []
    app = KvtopApp(RouterFeed(url, None, token_loader=token_loader), url=url, can_control=True, speed=args.speed,
                   theme=config.get("theme"), hidden_columns=config.get("hidden_columns"),
                   config_file=config_file, connect_grace_s=120.0)

    def tell(note: str, message: str | None = None) -> None:
        def show() -> None:
            app.note = note
            if message:
                app.notify(message, title="kvtop demo", timeout=20)
        try:
            app.call_from_thread(show)
        except RuntimeError:  # the app is not running (yet, or any more)
            pass

    def loop_replay() -> None:
        try:
            start_cluster(args, stack, db, plan)
        except CliError as exc:
            if stop.is_set():
                return  # quit while starting: not a failure
            failed.append(exc.args[0] if exc.args else str(exc))
            try:
                app.call_from_thread(app.exit, 2)
            except RuntimeError:
                pass
            return
        tell("replay 1" + ("" if args.loop else f"/{args.loops}"))
        k = 0
        while args.loop or k < args.loops:
            if stop.is_set():
                return
            if k:
                tell(f"replay {k + 1}" + ("" if args.loop else f"/{args.loops}"))
            proc = stack.start(f"replay-{k}", replay_args(trace, url, args.speed, workdir / f"results-{k}.jsonl"))
            while proc.poll() is None:
                if stop.wait(0.5):
                    return
            k += 1
        # Without a word the dashboard just went quiet once the trace ran out.
        tell(f"trace done ({args.loops}×): idle",
             f"The trace has been replayed {args.loops} times and nothing more is sent. Quit with q; "
             "kvtop demo --loop replays until you quit.")

    app.note = f"starting {args.instances} instances and the router"
    threading.Thread(target=loop_replay, name="kvtop-demo-replay", daemon=True).start()
    if args.duration:
        app.call_later(lambda: app.set_timer(args.duration, app.exit))
    try:
        app.run()
    finally:
        stop.set()
    if failed:
        raise CliError(failed[0])
    return 0


if __name__ == "__main__":
    from kvtop.cli import main

    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(["demo", *sys.argv[1:]]))
