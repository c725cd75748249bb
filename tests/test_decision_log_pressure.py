"""The decision log under pressure: a bounded queue that drops and counts, and a full disk
that costs rows but never routing, and says so on /health and /metrics."""

from __future__ import annotations

import json
import subprocess

import pytest
import sqlite_utils

from router.app import STATE, Backend, RouterConfig, create_app
from store.writer import Writer


def test_a_full_queue_drops_and_counts_but_keeps_run_rows(tmp_path):
    w = Writer(str(tmp_path / "log.db"), max_queued=10)  # not started: nothing drains the queue
    kept = [w.put("decisions", {"run_id": "r", "request_id": f"q{k}"}) for k in range(15)]
    assert kept == [True] * 10 + [False] * 5
    assert w.put("runs", {"run_id": "r"}) and w.put("config_events", {"run_id": "r", "kind": "run"})
    h = w.health()
    assert h["rows_dropped"] == 5 and h["rows_queued"] == 12 and h["degraded"]
    w.start()
    w.close()
    db = sqlite_utils.Database(str(tmp_path / "log.db"))
    assert db["decisions"].count == 10 and db["runs"].count == 1
    # the drops are in the log too: the span they fell in, for kvtop log summary
    assert [r["kind"] for r in db["config_events"].rows] == ["run", "log_drop"]
    drop = json.loads(list(db["config_events"].rows_where("kind = 'log_drop'"))[0]["after"])
    assert drop["rows_dropped"] == 5 and drop["by_table"] == {"decisions": 5} and drop["from"] <= drop["to"]


@pytest.fixture
def tiny_disk(tmp_path):
    """A 256 KiB tmpfs: SQLite fills it after a few hundred rows."""
    where = tmp_path / "tiny"
    where.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], check=True,
                       capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {exc}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=10)


async def test_a_full_disk_loses_rows_not_routing_and_says_so(router_client, fake_backends, tiny_disk):
    fakes = await fake_backends(1)
    cfg = RouterConfig(backends=[Backend("i0", fakes[0][1])], db=str(tiny_disk / "kvtop.db"),
                       state_dir=str(tiny_disk.parent / "state"), health_interval_s=0)
    client = await router_client(create_app(cfg))
    state = client.server.app[STATE]
    big = list(range(2000))  # decision rows with scores and long session ids fill the disk sooner
    for k in range(600):
        async with client.post("/v1/completions", headers={"X-Session-ID": f"session-{k}-" + "x" * 200},
                               json={"prompt": big[k % 100:], "max_tokens": 1}) as r:
            assert r.status == 200
        if k % 100 == 99:
            state.writer.flush()
        if state.writer.rows_failed:
            break
    state.writer.flush()
    assert state.writer.rows_failed > 0, "the disk never filled"
    async with client.get("/health") as r:
        health = await r.json()
    assert r.status == 200 and health["status"] == "degraded"
    assert health["decision_log"]["rows_failed"] > 0 and "full" in health["decision_log"]["last_error"]
    async with client.get("/metrics") as r:
        metrics = await r.text()
    failed = [line for line in metrics.splitlines() if line.startswith("kvtop_decision_log_rows_failed_total")]
    assert failed and float(failed[0].split()[-1]) > 0
    async with client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1}) as r:
        assert r.status == 200  # still routing


def test_a_drop_is_loud_logged_once_per_interval_and_named_by_log_summary(tmp_path, caplog):
    """The crash run's lost rows were silent: a full queue now warns once when it starts dropping
    and once per interval with the count, and ``kvtop log summary`` names the incomplete span."""
    import logging

    from kvtop.log_cli import format_summary
    from store import summary as store_summary

    path = str(tmp_path / "log.db")
    w = Writer(path, max_queued=10)  # not started: the queue fills
    w.run_id = "r"
    w.put("runs", {"run_id": "r", "started_at": 1.0})
    with caplog.at_level(logging.WARNING, logger="kvtop.store"):
        for k in range(40):
            w.put("decisions", {"run_id": "r", "request_id": f"q{k}", "ts": 100.0 + k, "attempt": 1,
                                "policy": "lmetric", "policy_version": 1})
        started = [r for r in caplog.records if "being dropped" in r.getMessage()]
        assert len(started) == 1  # one line for 31 drops, not 31
        assert w.health()["rows_dropped"] == 31 and w.health()["degraded"]
        w.start()
        w.close()
    counted = [r for r in caplog.records if "rows dropped between" in r.getMessage()]
    assert len(counted) == 1 and "31 rows dropped" in counted[0].getMessage()
    result = store_summary.summary(path, "r")
    gaps = result["incomplete"]
    assert [g["kind"] for g in gaps] == ["dropped", "unclean_end"]
    assert gaps[0]["rows"] == 31 and gaps[0]["by_table"] == {"decisions": 31}
    text = format_summary(result)
    assert "INCOMPLETE: 31 rows dropped between" in text and "has no recorded end" in text
