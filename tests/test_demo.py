"""kvtop demo --headless: sim + router + replay for a few seconds, then the report table."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def small_trace(path: Path) -> Path:
    """Three sessions of growing prompts that share their prefix, like an agent's turns."""
    lines = [json.dumps({"kvtop_trace": 1})]
    for s in range(3):
        ids: list[int] = []
        for turn in range(1, 7):
            ids = ids + [s * 1_000_000 + turn * 1000 + k for k in range(40)]  # +40 blocks of 64 each turn
            lines.append(json.dumps({"arrival": s * 0.5 + turn * 2.0, "session": f"s{s}", "turn": turn,
                                     "input_tokens": len(ids) * 64, "output_tokens": 16, "hash_ids": ids,
                                     "block_size": 64, "think_time": 0.0, "parent": None, "source": "test"}))
    path.write_text("\n".join(lines) + "\n")
    return path


def sample_trace() -> Path | None:
    try:
        from kvtop.traces import sample_trace_path

        p = Path(sample_trace_path())
    except Exception:
        return None
    return p if p.is_file() else None


@pytest.mark.parametrize("which", ["sample", "small"])
def test_demo_headless_prints_seed_table(tmp_path, which):
    if which == "sample":
        assert sample_trace() is not None, "the sample trace ships inside the package (kvtop/data)"
        extra: list[str] = []
    else:
        extra = ["--trace", str(small_trace(tmp_path / "t.jsonl")), "--instances", "2"]
    env = {**os.environ, "HOME": str(tmp_path)}  # the router's state files stay in the test's dir
    proc = subprocess.run([sys.executable, "-m", "kvtop", "demo", "--headless", "--duration", "10", *extra],
                          capture_output=True, text=True, timeout=90, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "TTFT" in proc.stdout and "demo" in proc.stdout
    assert "Traceback" not in proc.stderr
    # Issue 20: the decision log was deleted on quit, and nothing said the latencies are wall
    # time at 10x speed (0.238 s against kvtop simulate's 2.669 s for the same trace).
    kept = list((tmp_path / ".local" / "state" / "kvtop" / "demo").glob("kvtop-demo-*.db"))
    assert len(kept) == 1 and f"decision log kept at {kept[0]}" in proc.stderr
    assert "wall-clock time with the engines at 10x speed" in proc.stdout


def _processes_mentioning(text: str) -> list[int]:
    """Live processes whose environment mentions ``text`` (every child inherits TMPDIR)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                env = (entry / "environ").read_bytes().decode(errors="replace")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if text in env and state != "Z":
                pids.append(int(entry.name))
    return pids


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to find the demo's children")
def test_demo_sigterm_stops_everything_it_started(tmp_path):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {**os.environ, "HOME": str(tmp_path), "TMPDIR": str(tmpdir)}
    trace = small_trace(tmp_path / "t.jsonl")
    proc = subprocess.Popen([sys.executable, "-m", "kvtop", "demo", "--headless", "--duration", "60",
                             "--trace", str(trace), "--instances", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 30
        while len(_processes_mentioning(str(tmpdir))) < 4:  # demo, sim, router, replay
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the demo's processes did not start"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 15
    while _processes_mentioning(str(tmpdir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = _processes_mentioning(str(tmpdir))
    for pid in survivors:  # they carry this test's TMPDIR: started by this test, so ours to end
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert survivors == [], "processes started by the demo outlived it"


def test_demo_without_a_terminal_prints_the_report_instead(tmp_path):
    """No TTY (a pipe, a CI log): no escape codes, a note on stderr and the report on stdout."""
    env = {**os.environ, "HOME": str(tmp_path)}
    trace = small_trace(tmp_path / "t.jsonl")
    proc = subprocess.run([sys.executable, "-m", "kvtop", "demo", "--duration", "6", "--trace", str(trace),
                           "--instances", "2"], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no terminal" in proc.stderr and "TTFT" in proc.stdout
    assert "\x1b[" not in proc.stdout


@pytest.mark.parametrize("flags, message", [
    (["--loops", "0"], "--loops must be at least 1"),  # was silently one loop
    (["--instances", "0"], "--instances must be at least 1"),
    (["--speed", "0"], "--speed must be positive"),
    (["--duration", "-3"], "--duration must be positive"),
])
def test_bad_demo_flags_are_one_line_errors_before_starting_anything(capsys, flags, message):
    from kvtop.cli import main

    rc = main(["demo", "--headless", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and err == f"kvtop demo: {message}\n"
