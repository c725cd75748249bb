"""Benchmark scripts' command lines: the same option means the same spelling in every one."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["bench_log", "bench_attach", "bench_viewers"])
def test_rounds_option_is_spelled_repeat(name):
    # bench_viewers alone said --repeats, so a command copied between benchmarks failed.
    out = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), "--help"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "--repeat " in out
    assert "--repeats" not in out


@pytest.mark.parametrize("argv,expected", [
    ([], 2),  # the default: two rounds per configuration
    (["--repeat", "3"], 3),
    (["--repeats", "4"], 4),  # the old spelling still works for commands written down in notes
])
def test_bench_viewers_repeat(argv, expected):
    assert _load("bench_viewers").parse_args(argv).repeat == expected


@pytest.mark.parametrize("argv", [["--window", "0"], ["--window", "3000"], ["--step", "500"],
                                  ["--sessions", "1000"], ["--concurrency", "0"], ["--chunk", "0"]])
def test_bench_sessions_refuses_bad_sizes(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        _load("bench_sessions").parse_args(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_bench_sessions_in_process_grows_one_session_per_request():
    grown = _load("bench_sessions").InProcess("expected_cost")
    times = grown.grow(300)
    assert len(times) == 300 and all(t >= 0 for t in times)
    assert len(grown.cluster.sessions) == 300 and grown.cluster.counters_zero()
