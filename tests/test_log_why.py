"""kvtop log from an operator's terminal: `log why REQUEST_ID`, and `| head` as normal use."""

from __future__ import annotations

import subprocess
import sys

import pytest
import sqlite_utils


@pytest.fixture
def big_log(tmp_path):
    """A decision log with more rows than a pipe buffer holds, so the writer meets a closed pipe."""
    path = tmp_path / "kvtop.db"
    db = sqlite_utils.Database(path)
    db["runs"].insert({"run_id": "r1", "started_at": 0.0})
    db["decisions"].insert_all({"ts": float(k), "request_id": f"req-{k:06d}", "session_id": "s" * 40,
                                "reason": "argmin"} for k in range(20_000))
    db["outcomes"].insert({"request_id": "req-000000", "status": "ok"})
    db.close()
    return path


@pytest.mark.parametrize("argv", [
    ["export", "--table", "decisions"],                     # caught as OSError: "cannot write None"
    ["export", "--table", "decisions", "--format", "jsonl"],
    ["sql", "SELECT * FROM decisions", "--format", "csv"],  # the shared BrokenPipe path
])
def test_log_into_head_exits_0_quietly(big_log, argv):
    cmd = [sys.executable, "-m", "kvtop.cli", "log", "--db", str(big_log), *argv]
    shell = " ".join(f"'{a}'" for a in cmd) + " | head -1; exit ${PIPESTATUS[0]}"
    r = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert r.stdout.count("\n") == 1
