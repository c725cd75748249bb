"""kvtop sweep: a spec of policies x knob grids x traces x loads, train/validate ranks, SQLite,
plots; the same rows locally, in worker processes and on Ray."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sqlite_utils

from kvtop.cli import CliError, main
from kvtop.sweep import format_report, load_spec, plan, rank

EXAMPLE = Path(__file__).resolve().parent.parent / "docs" / "sweep-example.toml"


def small_spec(tmp_path, **over) -> Path:
    """The docs example, made smaller for a test (fewer loads and settings)."""
    text = EXAMPLE.read_text()
    text = text.replace("instances = [2, 4]", "instances = [2]").replace("rate_scale = [1.0, 2.0]", "rate_scale = [1.0, 2.0]")
    text = text.replace("repeats = 3 ", "repeats = 2 ").replace("limit = 100 ", "limit = 40 ")
    text = text.replace("cache_ratio_gate = [0.3, 0.6]", "cache_ratio_gate = [0.6]")
    text = text.replace('"../kvtop/data/', f'"{EXAMPLE.parent.parent}/kvtop/data/')
    for k, v in over.items():
        text = text.replace(k, v)
    p = tmp_path / "spec.toml"
    p.write_text(text)
    return p


def rows_of(db: Path) -> list[dict]:
    d = sqlite_utils.Database(db)
    return [{k: v for k, v in r.items() if k != "sweep_id"} for r in d["sweep_results"].rows]


def test_the_docs_example_runs_and_writes_ranks_db_and_plots(tmp_path, capsys):
    spec = load_spec(EXAMPLE)
    assert len(spec.settings) == 7 and spec.train[0].part == (1, 2) and spec.validate[0].part == (2, 2)
    db, svg = tmp_path / "s.db", tmp_path / "s.svg"
    assert main(["sweep", str(EXAMPLE), "--db", str(db), "--plot", str(svg), "--terminal-plot", "always"]) == 0
    out = capsys.readouterr().out
    # one table per load, the best-on-train line with its validate rank, and the terminal charts
    assert out.count("best on train: ") == 4 and "rank changes between train and validate" in out
    assert "train" in out and "TTFT p90 s, 4 instances, rate x2" in out
    d = sqlite_utils.Database(db)
    n_tasks = 7 * 4 * 2 * 3
    assert d["sweep_results"].count == n_tasks and d["sweep_ranks"].count == 7 * 4
    # the sweep tables sit in a kvtop database, so kvtop log sql reads them
    assert main(["log", "sql", "--db", str(db), "--format", "jsonl",
                 "SELECT count(*) AS n FROM sweep_ranks WHERE best_on_train = 1"]) == 0
    assert json.loads(capsys.readouterr().out.strip()) == {"n": 4}
    text = svg.read_text()
    assert text.startswith("<svg") and text.count("<rect") > 7 * 4 * 2


def test_ranks_pick_the_best_on_train_and_flag_rank_changes(tmp_path):
    spec = load_spec(small_spec(tmp_path))
    tasks = plan(spec)
    # invented rows: setting 0 wins train, setting 1 wins validate, the others keep their rank
    rows = []
    for t in tasks:
        si, split, _, _ = t.tag
        v = {0: (1.0, 3.0), 1: (2.0, 1.0)}.get(si, (10.0 + si, 10.0 + si))[split == "validate"]
        rows.append({"ttft_p90_ms": v * 1000 + t.replica})
    ranks = [r for r in rank(spec, tasks, rows) if r["rate_scale"] == 1.0]
    by = {r["setting"]: r for r in ranks}
    assert by["leastwork"]["best_on_train"] == 1 and by["leastwork"]["validate_rank"] == 2
    assert by["lmetric"]["train_rank"] == 2 and by["lmetric"]["validate_rank"] == 1
    assert by["leastwork"]["rank_changed"] == by["lmetric"]["rank_changed"] == 1
    assert sum(r["rank_changed"] for r in ranks) == 2   # the rest keep their places
    assert by["leastwork"]["train_mean"] == pytest.approx(1000.5)   # mean over replicas 0 and 1


def test_path_jitter_reaches_the_replicas(tmp_path):
    # replicas 1.. of a sweep carry the path noise (seeded by replica, as kvtop simulate
    # --repeats); replica 0 stays as traced
    spec = load_spec(small_spec(tmp_path, **{"path_jitter = 0.0 ": "path_jitter = 0.6 "}))
    assert spec.path_jitter == 0.6
    tasks = plan(spec)
    assert tasks and all(t.config.path_jitter_s == 0.6 for t in tasks)
    plain = load_spec(small_spec(tmp_path))
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    assert main(["sweep", str(small_spec(tmp_path, **{"path_jitter = 0.0 ": "path_jitter = 0.6 "})), "--db", str(a),
                 "--workers", "1", "--terminal-plot", "never"]) == 0
    assert main(["sweep", str(small_spec(tmp_path)), "--db", str(b), "--workers", "1", "--terminal-plot", "never"]) == 0
    ra, rb = rows_of(a), rows_of(b)
    assert len(ra) == len(rb) == len(plan(plain))
    same = [x == y for x, y in zip(ra, rb)]
    assert all(s for s, t in zip(same, plan(plain)) if t.replica == 0)   # replica 0: no noise
    assert not all(same)
    one = small_spec(tmp_path, **{"path_jitter = 0.0 ": "path_jitter = 0.6 ", "repeats = 2 ": "repeats = 1 "})
    with pytest.raises(CliError, match="path_jitter varies replicas 1 and on: give repeats 2 or more"):
        load_spec(one)


@pytest.mark.parametrize("edit,message", [
    (("metric = \"ttft_p90_ms\"", "metric = \"speed\""), "metric must be one of"),
    (("name = \"lmetric\"", "name = \"nope\""), "unknown policy 'nope'"),
    (("overload_factor = [1.5, 2.0]", "overload_fator = [1.5]"), "unified has no knob 'overload_fator'"),
    (("overload_factor = [1.5, 2.0]", "overload_factor = [-1]"), "overload_factor"),
    (("validate = [", "tests = ["), "[traces] needs train"),
    (("part = \"2/2\"", "part = \"3/2\""), "part must be"),
    (("repeats = 2 ", "repeats = 0 "), "repeats must be"),
    (("instances = [2]", "instances = []"), "loads.instances"),
    (("name = \"example\"", "nme = \"x\""), "unknown key 'nme'"),
    (("jitter = 2.0 ", "jitter = nan "), "jitter must be a finite number"),
    (("path_jitter = 0.0 ", "path_jitter = -0.5 "), "path_jitter must be a finite number"),
    (("path_jitter = 0.0 ", "path_jitter = inf "), "path_jitter must be a finite number"),
])
def test_a_bad_spec_is_one_line_naming_the_key(tmp_path, edit, message):
    p = small_spec(tmp_path, **{edit[0]: edit[1]})
    with pytest.raises(CliError, match=message.replace("[", r"\[")):
        load_spec(p)


def test_same_rows_in_one_process_and_in_workers(tmp_path):
    spec = small_spec(tmp_path)
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    assert main(["sweep", str(spec), "--db", str(a), "--workers", "1", "--terminal-plot", "never"]) == 0
    assert main(["sweep", str(spec), "--db", str(b), "--workers", "2", "--terminal-plot", "never"]) == 0
    assert rows_of(a) == rows_of(b) and len(rows_of(a)) == 5 * 2 * 2 * 2


#: A Ray head on loopback, owned by this process: SIGTERM shuts it down with everything it
#: started (so the test ends only the processes it started). Token auth off: the sweep is a
#: second driver on the same machine.
_HEAD = """
import signal, sys, time
import ray
ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
         configure_logging=False, _temp_dir=sys.argv[1])
print(ray.get_runtime_context().gcs_address, flush=True)
signal.signal(signal.SIGTERM, lambda *a: (ray.shutdown(), sys.exit(0)))
while True:
    time.sleep(1)
"""


def test_same_rows_on_a_local_ray_cluster(tmp_path):
    pytest.importorskip("ray", reason="Ray is optional (pip install 'kvtop[ray]'); CI runs without it")
    if os.environ.get("KVTOP_TEST_NETNS") == "1":
        return _same_rows_on_ray(tmp_path)
    # Ray's GCS, raylet and workers listen on every interface even with the node's address set
    # to 127.0.0.1 (Ray 2.60: `ss -ltnp` shows them on *:port). So the test runs again in a
    # network namespace of its own, whose only interface is loopback: nothing it starts can be
    # reached from outside the machine.
    unshare, ip = shutil.which("unshare"), shutil.which("ip")
    if not unshare or not ip:
        pytest.skip("no unshare/ip here to confine Ray to loopback, and Ray listens on every interface")
    probe = subprocess.run([unshare, "-rn", ip, "link", "set", "lo", "up"], capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"no private network namespace here ({probe.stderr.strip()[-200:]}), "
                    "and Ray listens on every interface")
    inner = subprocess.run(
        [unshare, "-rn", "sh", "-c", '"$0" link set lo up && exec "$1" -m pytest -q -p no:cacheprovider "$2"',
         ip, sys.executable, f"{__file__}::test_same_rows_on_a_local_ray_cluster"],
        capture_output=True, text=True, timeout=600, cwd=Path(__file__).parent.parent,
        env={**os.environ, "KVTOP_TEST_NETNS": "1"})
    assert inner.returncode == 0, inner.stdout[-4000:] + inner.stderr[-2000:]
    assert re.search(r"^1 passed\b", inner.stdout, re.M), inner.stdout[-2000:]   # not skipped in there


def _same_rows_on_ray(tmp_path):
    import tempfile

    temp = tempfile.mkdtemp(prefix="kvray", dir="/tmp")   # Ray's socket paths must stay short
    head = subprocess.Popen([sys.executable, "-c", _HEAD, temp], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    try:
        address = head.stdout.readline().strip()
        assert address, "the Ray head did not start"
        spec = small_spec(tmp_path, **{"rate_scale = [1.0, 2.0]": "rate_scale = [2.0]"})
        local, remote = tmp_path / "local.db", tmp_path / "ray.db"
        assert main(["sweep", str(spec), "--db", str(local), "--workers", "1", "--terminal-plot", "never"]) == 0
        assert main(["sweep", str(spec), "--db", str(remote), "--ray", address, "--terminal-plot", "never"]) == 0
        assert rows_of(local) == rows_of(remote) and len(rows_of(local)) == 5 * 2 * 2
        assert sqlite_utils.Database(remote)["sweeps"].get(1)["ran_on"] == address
        # kvtop simulate --repeats takes the same --ray
        trace = str(EXAMPLE.parent.parent / "kvtop" / "data" / "sample_trace.jsonl.gz")
        assert main(["simulate", trace, "--limit", "40", "--instances", "2", "--policies", "leastwork,lmetric",
                     "--repeats", "2", "--ray", address]) == 0
    finally:
        head.terminate()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_flag_without_ray_installed_is_one_line(monkeypatch, tmp_path, capsys):
    import builtins

    real_import = builtins.__import__

    def no_ray(name, *a, **kw):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(name)
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    assert main(["sweep", str(small_spec(tmp_path)), "--ray", "auto", "--db", "none", "--terminal-plot", "never"]) == 2
    assert capsys.readouterr().err.strip().endswith("--ray needs Ray: pip install 'kvtop[ray]'")


def test_a_rank_change_within_the_noise_is_not_flagged_and_ties_are_named(tmp_path):
    """The issue's case: settings whose replicas overlap swap places between the splits. Only a
    swap whose paired difference is significant on both splits is a rank change; the rest are
    named as indistinguishable, and an interval wider than its mean is marked."""
    spec = load_spec(small_spec(tmp_path))
    tasks = plan(spec)
    noise = {0: 3.0, 1: -3.0}  # replica 0 and 1 disagree by far more than the settings differ
    rows = []
    for t in tasks:
        si, split, _, _ = t.tag
        base = {0: (4.29, 4.33), 1: (4.33, 4.29)}.get(si, (20.0 + si, 20.0 + si))[split == "validate"]
        rows.append({"ttft_p90_ms": (base + noise[t.replica] * (1 + 0.1 * si)) * 1000})
    ranks = [r for r in rank(spec, tasks, rows) if r["rate_scale"] == 1.0]
    by = {r["setting"]: r for r in ranks}
    assert by["leastwork"]["rank_moved"] == by["lmetric"]["rank_moved"] == 1
    assert by["leastwork"]["rank_changed"] == by["lmetric"]["rank_changed"] == 0  # within the noise
    assert "lmetric" in json.loads(by["leastwork"]["train_ties"])
    text = format_report(spec, rank(spec, tasks, rows))
    assert "0 of" in text and "within the noise" in text and "indistinguishable from it on train: lmetric" in text
    wide = [{"ttft_p90_ms": 1000.0 + (50_000.0 if t.replica else 0.0)} for t in tasks]
    assert all(r["wide"] for r in rank(spec, tasks, wide))
    assert "(wide)" in format_report(spec, rank(spec, tasks, wide))
