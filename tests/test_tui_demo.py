"""kvtop demo's dashboard side (issue 35): --port-base, --state-dir, a first frame that says
"connecting" while the cluster starts behind it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from test_demo import small_trace


@pytest.mark.parametrize("flags, message", [
    (["--port-base", "80"], "--port-base must leave"),
    (["--port-base", "65530"], "--port-base must leave"),
])
def test_bad_demo_ports_are_one_line_errors(flags, message, capsys):
    from kvtop.cli import main

    assert main(["demo", "--headless", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_port_plan_follows_port_base():
    import argparse

    from kvtop.demo import port_plan

    args = argparse.Namespace(instances=4, port_base=20000, no_kv_events=False)
    assert port_plan(args) == (20000, 20004, 20012)  # 4 HTTP, 8 KV-event ports, then the router
    args.no_kv_events = True
    assert port_plan(args) == (20000, 20004, 20004)


def test_demo_headless_uses_port_base_and_state_dir(tmp_path):
    from kvtop.procs import free_port_run

    base = free_port_run(2 * 3 + 1)
    state = tmp_path / "state"
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    proc = subprocess.run([sys.executable, "-m", "kvtop", "demo", "--headless", "--duration", "4", "--instances", "2",
                           "--trace", str(small_trace(tmp_path / "t.jsonl")), "--port-base", str(base),
                           "--state-dir", str(state)], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"router http://127.0.0.1:{base + 6}" in proc.stderr
    kept = list((state / "demo").glob("kvtop-demo-*.db"))  # the log goes to --state-dir, not HOME
    assert len(kept) == 1 and not (tmp_path / "home" / ".local").exists()


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_demo_dashboard_says_connecting_before_the_cluster_is_up(tmp_path):
    """The first frame is the dashboard saying "connecting", not a blank terminal for the
    seconds the cluster takes to start. Measured from the process start, in tmux."""
    from kvtop.procs import free_port_run

    base = free_port_run(2 * 3 + 1)
    name = f"kvtop-demo-test-{os.getpid()}"
    cmd = (f"{sys.executable} -m kvtop demo --instances 2 --port-base {base} --state-dir {tmp_path / 'state'} "
           f"--trace {small_trace(tmp_path / 't.jsonl')} --duration 20")
    env = {**os.environ, "HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    t0 = time.monotonic()
    subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "100", "-y", "30", cmd], check=True, env=env)
    try:
        first = live = None
        before_textual = False
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and live is None:
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", name], capture_output=True, text=True).stdout
            if first is None and "connecting" in screen:
                first = time.monotonic() - t0
            # the frame drawn before Textual is imported (kvtop/tui/splash.py): "connecting"
            # and the router's URL, before Textual's own frame with the tab bar
            before_textual |= "⋯ connecting" in screen and f":{base + 6}" in screen and "1 Overview" not in screen
            if "2/2 up" in screen:
                live = time.monotonic() - t0
            time.sleep(0.05)
        assert first is not None, screen
        assert live is not None and first < live  # "connecting" came first, then the live view
        assert before_textual
        print(f"connecting frame after {first:.2f} s, live after {live:.2f} s")
    finally:
        subprocess.run(["tmux", "send-keys", "-t", name, "q"], capture_output=True)
        time.sleep(5)
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)
