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


def test_bench_decision_agentic_state_is_a_run_left_by_the_policy():
    """--agentic (issue 38): sessions routed by the policy turn by turn with think times, so
    the fleet has a mean gap, sessions bound where the policy put them, a third in flight."""
    bench = _load("bench_decision")
    import random

    core, chains = bench.agentic_cluster("expected_cost", 4, 12, 8192, random.Random(1))
    cl = core.cluster
    assert len(chains) == 12 and len(cl.sessions) == 12
    assert cl.gaps > 0 and all(s.turns >= 4 for s in cl.sessions.values())
    assert cl.in_flight == 12 // 3
    p50, p99 = bench.bench_pick("expected_cost", 4, 8192, 20, sessions=12, clock=bench.time.thread_time_ns)
    assert 0 < p50 <= p99


@pytest.mark.parametrize("argv", [["--instances", "0"], ["--prompts", "100"], ["--policies", "nope"],
                                  ["--instances", "x"]])
def test_bench_decision_refuses_bad_input(argv):
    got = subprocess.run([sys.executable, str(BENCHMARKS / "bench_decision.py"), *argv, "--iterations", "1"],
                         capture_output=True, text=True, timeout=60)
    assert got.returncode == 2 and "error:" in got.stderr and "Traceback" not in got.stderr


def test_peers_offline_runs_the_peer_models_in_virtual_time(tmp_path):
    """run.py --offline (issue 38): kvtop's arms and the peers' models in one kvtop simulate,
    no venv, engines or routers; the report sets APC against the trace's ceiling."""
    from kvtop.traces.loader import TraceRequest, write_trace

    reqs = [TraceRequest(arrival=s * 1.0 + t * 3.0, session=f"s{s}", turn=t + 1, input_tokens=4096 + 512 * t,
                         output_tokens=8, hash_ids=[s * 1000 + k for k in range((4096 + 512 * t) // 64)],
                         block_size=64, think_time=1.0) for s in range(3) for t in range(3)]
    trace = tmp_path / "t.jsonl"
    write_trace(trace, sorted(reqs, key=lambda r: r.arrival))
    run = _load_peers_run()
    assert run.main(["--offline", "--trace", str(trace), "--policies", "leastwork", "--instances", "2",
                     "--out", str(tmp_path / "out")]) == 0
    report = (tmp_path / "out" / "report.md").read_text()
    for arm in ("leastwork", "cache_aware", "round_robin"):  # sglang and vllm cache_aware: one model
        assert f"| {arm} |" in report
    assert "% of " in report  # APC as a share of the ceiling
    # and where the gap to it went, placement from the decision rows (issue 38)
    assert "## Where the gap went, placement from the decision rows" in report
    assert "capacity ceiling" in report
    with pytest.raises(SystemExit) as exc:
        run.main(["--offline", "--trace", str(trace), "--peers", "sglang:power_of_two", "--out",
                  str(tmp_path / "o2")])
    assert exc.value.code == 2


def _load_peers_run():
    spec = importlib.util.spec_from_file_location("_peers_run", BENCHMARKS / "peers" / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["_peers_run"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
