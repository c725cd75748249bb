"""An operator's visit to ``kvtop attach``, scripted in tmux, at given terminal sizes and fleets.

For each size (80x24, 140x42) and fleet (4, 64 instances): ``kvtop sim`` + ``kvtop route``
(unified, offload on, a custom knob) + a replay of the bundled trace, and ``kvtop attach`` in a
detached tmux session. Through send-keys it goes through every tab, the help, a receipt, an
instance detail, a cordon / drain / uncordon of the selected instance, a policy switch from the
palette, a shadow add / promote / remove, and a router restart with other settings, and asserts
on every captured screen:

  - the header is one line and the tab bar never moves (header height constant),
  - the fleet's one-line health ("N/N up ... in flight") is on screen,
  - no markup leaks ("[b]", "[/b]", "[dim]"),
  - after the router restarts, no figure of the old router is left: the header and the Policy
    tab show the new policy@version, the old one's nowhere.

  python benchmarks/tmux_attach_session.py [--sizes 80x24 140x42] [--instances 4 64] [--keep DIR]

Every process it starts is stopped by pid; servers listen on 127.0.0.1 only. Exit 1 on the
first failed check, with the screen that failed it. Needs tmux.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PY = sys.executable
LEAKS = ("[b]", "[/b]", "[dim]", "[/dim]", "[/]")


class Failed(Exception):
    pass


class Session:
    def __init__(self, name: str, width: int, height: int, n: int, workdir: Path):
        self.name, self.width, self.height, self.n, self.workdir = name, width, height, n, workdir
        self.procs: dict[str, subprocess.Popen] = {}
        self.checks = 0
        self.tab_row: int | None = None

    # -- processes --------------------------------------------------------------------------
    def start(self, key: str, args: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{key}.log", "ab")
        proc = subprocess.Popen([PY, "-m", "kvtop", *args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs[key] = proc
        return proc

    def stop(self, key: str) -> None:
        proc = self.procs.pop(key, None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def stop_all(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)
        for key in list(reversed(self.procs)):
            self.stop(key)

    # -- the screen -------------------------------------------------------------------------
    def keys(self, *keys: str, pause: float = 0.4) -> None:
        for k in keys:
            done = subprocess.run(["tmux", "send-keys", "-t", self.name,
                                   *([k] if k.startswith(("C-", "Escape", "Enter")) else ["-l", k])],
                                  capture_output=True, text=True)
            if done.returncode:
                raise Failed(f"{self.name}: the dashboard is gone (send-keys {k!r}: {done.stderr.strip()})")
            time.sleep(0.05)
        time.sleep(pause)

    def screen(self) -> list[str]:
        out = subprocess.run(["tmux", "capture-pane", "-p", "-t", self.name], capture_output=True, text=True)
        return out.stdout.splitlines()

    def wait(self, what: str, cond, timeout: float = 20.0) -> list[str]:
        deadline = time.monotonic() + timeout
        lines = self.screen()
        while time.monotonic() < deadline:
            lines = self.screen()
            if cond("\n".join(lines)):
                return lines
            time.sleep(0.2)
        raise Failed(f"{self.name}: waited {timeout:g} s for {what}\n" + "\n".join(lines))

    def check(self, label: str, lines: list[str] | None = None, *, modal: bool = False) -> list[str]:
        """The invariants of every screen."""
        lines = lines if lines is not None else self.screen()
        text = "\n".join(lines)
        self.checks += 1
        for leak in LEAKS:
            if leak in text:
                raise Failed(f"{self.name} {label}: markup leak {leak!r}\n{text}")
        if modal:
            return lines  # a dialog covers the middle; the header and health line stay above it
        row = next((k for k, line in enumerate(lines) if "1 Overview" in line and "5 Policy" in line), None)
        if row is None:
            raise Failed(f"{self.name} {label}: no tab bar\n{text}")
        if self.tab_row is None:
            self.tab_row = row
        if row != self.tab_row:
            raise Failed(f"{self.name} {label}: the tab bar moved from row {self.tab_row} to {row}\n{text}")
        if f"/{self.n} up" not in "\n".join(lines[:row]) or "in flight" not in "\n".join(lines[:row]):
            raise Failed(f"{self.name} {label}: the fleet health line is missing\n{text}")
        return lines


def wait_http(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.2)
    raise Failed(f"{url} did not come up in {timeout:g} s")


def free_base(span: int) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kvtop.procs import free_port_run

    return free_port_run(span)


def run_one(width: int, height: int, n: int, keep: Path | None) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"kvtop-tmux-{width}x{height}-{n}-"))
    s = Session(f"kvtop-attach-{width}x{height}-{n}-{os.getpid()}", width, height, n, workdir)
    base = free_base(n + 1)
    router_port = base + n
    url = f"http://127.0.0.1:{router_port}"
    state_dir = workdir / "state"
    backends = [arg for i in range(n) for arg in ("--backend", f"http://127.0.0.1:{base + i}")]
    route = ["route", "--port", str(router_port), "--db", "none", "--state-dir", str(state_dir), *backends]
    t0 = time.monotonic()
    try:
        s.start("sim", ["sim", "--instances", str(n), "--port-base", str(base), "--speed", "20", "--no-kv-events"])
        wait_http(f"http://127.0.0.1:{base + n - 1}/health")
        s.start("route", [*route, "--policy", "unified", "--knob", "overload_factor=3.5",
                          "--knob", "offload_mode=simple"])
        wait_http(url + "/health")
        from kvtop.traces import sample_trace_path

        s.start("replay", ["replay", str(sample_trace_path()), "--target", url, "--speed", "20",
                           "--duration", "600", "--no-progress", "--out", str(workdir / "replay.jsonl")])
        cfg = workdir / "attach.toml"
        cfg.write_text("")
        subprocess.run(["tmux", "new-session", "-d", "-s", s.name, "-x", str(width), "-y", str(height),
                        f"{PY} -m kvtop attach {url} --state-dir {state_dir} --config {cfg} --hz 4 "
                        "|| sleep 60"],  # an error stays on the pane (Textual draws on stderr)
                       check=True, env={**os.environ, "KVTOP_CONTROL_TOKEN": ""})
        # a crash leaves its traceback on the pane instead of closing it
        subprocess.run(["tmux", "set-option", "-t", s.name, "remain-on-exit", "on"], capture_output=True)
        s.check("first frame", s.wait("the first snapshot", lambda t: f"/{n} up" in t))
        s.wait("traffic", lambda t: "in flight" in t and "routed 0" not in t, timeout=60)
        for tab, word in (("2", "TTFT"), ("3", "sessions"), ("4", "reason"), ("5", "shadow policies"),
                          ("1", "instance")):
            s.keys(tab, pause=1.0)
            s.check(f"tab {tab}", s.wait(f"tab {tab}", lambda t, w=word: w in t))
        s.keys("?", pause=1.0)
        s.check("help", s.wait("the help", lambda t: "kvtop attach: keys" in t), modal=True)
        s.keys("Escape", pause=0.6)
        s.keys("4", pause=1.5)
        s.keys("Enter", pause=1.0)
        s.check("receipt", s.wait("a receipt", lambda t: "▶" in t and "Esc closes" in t), modal=True)
        s.keys("Escape", pause=0.6)
        s.keys("1", pause=1.0)
        s.keys("Enter", pause=1.0)
        s.check("instance detail", s.wait("an instance detail", lambda t: "KV index" in t), modal=True)
        s.keys("Escape", pause=0.6)
        # the fleet keys on the selected row: cordon, drain, uncordon, each confirmed (issue 34)
        for key, verb, shown in (("c", "Cordon", "1 cordoned"), ("d", "Drain", "1 draining"), ("u", "Uncordon", None)):
            s.keys(key, pause=0.8)
            s.check(f"confirm {verb}", s.wait(f"the {verb} dialog", lambda t, v=verb: f"{v} instance" in t
                                              and "Apply (y)" in t), modal=True)
            s.keys("y", pause=0.5)
            if shown:
                s.check(f"{verb}ed", s.wait(f"{shown} in the health line", lambda t, w=shown: w in t, timeout=10))
            else:
                s.check("uncordoned", s.wait("every instance active", lambda t: "cordoned" not in t
                                             and "draining" not in t and "drained" not in t, timeout=10))

        def palette(command: str) -> None:
            s.keys("C-p", pause=0.6)
            s.wait("the command palette", lambda t: "Search for commands" in t or "🔎" in t, timeout=10)
            s.keys(command, pause=1.0)
            s.keys("Enter", pause=0.8)
            s.check(f"confirm {command}", s.wait("the confirmation", lambda t: "Apply (y)" in t), modal=True)
            s.keys("y", pause=0.5)
            s.wait("the confirmation to close", lambda t: "Apply (y)" not in t, timeout=10)

        palette("Switch policy to lmetric")
        s.check("policy switch", s.wait("lmetric@2 in the header", lambda t: "lmetric@2" in t.splitlines()[0]))
        s.keys("5", pause=1.0)
        palette("Add shadow policy leastwork")
        s.check("shadow added", s.wait("the shadow in the panel", lambda t: "leastwork" in t and "agrees" in t))
        palette("Promote shadow leastwork to active")
        s.check("shadow promoted", s.wait("leastwork@3 in the header",
                                          lambda t: "leastwork@3" in t.splitlines()[0] and "agrees" not in t))
        palette("Add shadow policy lmetric")
        s.wait("lmetric as a shadow", lambda t: "agrees" in t)
        palette("Remove shadow policy lmetric")
        s.check("shadow removed", s.wait("no shadow", lambda t: "agrees" not in t and "shadows -lmetric" in t))
        if "kvtop-attach: shadows" not in "\n".join(s.screen()):
            raise Failed(f"{s.name}: the shadow changes are not in the change log")
        # the router restarts with other settings
        s.stop("route")
        s.check("disconnected", s.wait("stale", lambda t: "DISCONNECTED" in t and "stale" in t))
        s.start("route", [*route, "--policy", "round_robin", "--knob", "offload_mode=off"])
        wait_http(url + "/health")
        lines = s.check("after restart", s.wait("round_robin@1 in the header",
                                                lambda t: "round_robin@1" in t.splitlines()[0], timeout=30))
        time.sleep(1.0)  # one refresh
        lines = s.check("policy tab after restart", s.screen())
        if not any("the router restarted" in line for line in lines):
            raise Failed(f"{s.name}: the change log does not mark the restart\n" + "\n".join(lines))
        # the change log above its restart line is history; everything else must be the new run's
        live = lines[:next((k for k, line in enumerate(lines) if "recent changes" in line), len(lines))]
        text = "\n".join(live)
        for old in ("leastwork@3", "lmetric@2", "unified@", "DISCONNECTED", "stale"):
            if old in text:
                raise Failed(f"{s.name}: {old!r} still on screen after the restart\n{text}")
        row = next((line.split() for line in live if line.split()[:1] == ["offload_mode"]), None)
        if row is None or row[1] != "off":  # the knob's value column: the new router's, not "simple"
            raise Failed(f"{s.name}: offload_mode is not the new router's off: {row}\n{text}")
        s.keys("1", pause=1.0)
        s.check("overview after restart")
        s.keys("q", pause=1.0)
        return {"size": f"{width}x{height}", "instances": n, "checks": s.checks, "ok": True,
                "seconds": round(time.monotonic() - t0, 1)}
    finally:
        s.stop_all()
        if keep:
            shutil.copytree(workdir, keep / workdir.name, dirs_exist_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["80x24", "140x42"])
    ap.add_argument("--instances", nargs="+", type=int, default=[4, 64])
    ap.add_argument("--keep", type=Path, default=None, help="copy each run's logs into this folder")
    args = ap.parse_args()
    if shutil.which("tmux") is None:
        print("tmux is not installed", file=sys.stderr)
        return 2
    results = []
    for size in args.sizes:
        w, h = (int(x) for x in size.split("x"))
        for n in args.instances:
            try:
                results.append(run_one(w, h, n, args.keep))
            except Failed as exc:
                print(f"FAILED {size} {n} instances: {exc}", file=sys.stderr)
                return 1
            print(json.dumps(results[-1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
