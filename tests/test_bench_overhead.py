"""benchmarks/bench_overhead.py: ``kvtop@DIR`` runs another checkout's router beside this one's."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("_bench_overhead", ROOT / "benchmarks" / "bench_overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_another_checkouts_router_runs_from_that_checkout(tmp_path):
    bench = _bench()
    cmd = bench.target_cmd(f"kvtop@{ROOT}", 1234, "http://127.0.0.1:9", str(tmp_path))
    mine = bench.target_cmd("kvtop", 1234, "http://127.0.0.1:9", str(tmp_path))
    assert cmd[:2] == ["env", f"PYTHONPATH={ROOT}"]
    assert cmd[4:] == mine[1:]  # the same flags as this checkout's kvtop target


def test_another_checkouts_code_is_what_runs(tmp_path):
    """Run from this checkout (as the benchmark is), the other checkout's modules are imported,
    not this one's: ``python -m`` alone puts the working directory first."""
    other = tmp_path / "other"
    (other / "router").mkdir(parents=True)
    (other / "router" / "__init__.py").write_text("")
    cmd = _bench().target_cmd(f"kvtop@{other}", 1234, "http://127.0.0.1:9", str(tmp_path))
    interp = cmd[:cmd.index("-m")]  # env PYTHONPATH=... python -P
    out = subprocess.run([*interp, "-c", "import router; print(router.__file__)"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == str(other / "router" / "__init__.py")


def test_a_path_without_a_checkout_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no kvtop checkout"):
        _bench().target_cmd(f"kvtop@{tmp_path}", 1234, "http://127.0.0.1:9", str(tmp_path))


def test_router_cpu_is_read_in_nanoseconds_over_every_thread():
    """The CPU column: a busy 50 ms in another thread of this process shows up (the 10 ms ticks
    of /proc/PID/stat could not resolve a router's few hundred µs a request); no process, None."""
    import os
    import threading
    import time

    bench = _bench()
    before = bench.cpu_seconds(os.getpid())
    spun, done = threading.Event(), threading.Event()

    def spin():
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
        spun.set()
        done.wait(10)  # alive while read: an ended thread leaves /proc/PID/task
    t = threading.Thread(target=spin)
    t.start()
    spun.wait(10)
    after = bench.cpu_seconds(os.getpid())
    done.set()
    t.join()
    assert after - before >= 0.045
    assert bench.cpu_seconds(None) is None
    assert bench.cpu_seconds(2 ** 22 + 12345) is None  # above any pid_max: no such process
