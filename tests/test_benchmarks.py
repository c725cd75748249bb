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
