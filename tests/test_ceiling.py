"""APC against the prefix ceiling in every report (issue 38): ``kvtop simulate`` (one run and
``--repeats``), ``kvtop report`` on results files (the trace in their header) and on a decision
log (its block chains)."""

from __future__ import annotations

import asyncio
import csv
import io
import json

import pytest

from kvtop import ceiling, seedtable
from kvtop.cli import main
from kvtop.traces.loader import TraceRequest, write_trace
from router.app import STATE
from test_control import complete, router  # noqa: F401  (the router fixture)


def two_sessions() -> list[TraceRequest]:
    """Session a: 4 blocks, then the same 4 and 4 more (4 of 8 cached at best); session b: 8
    blocks once. Ceiling: 4 x 64 tokens of 4 x 64 + 8 x 64 + 8 x 64 = 256 / 1280 = 0.2."""
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    return [TraceRequest(arrival=0.0, session="a", turn=1, input_tokens=256, output_tokens=5,
                         hash_ids=a[:4], block_size=64),
            TraceRequest(arrival=1.0, session="b", turn=1, input_tokens=512, output_tokens=5,
                         hash_ids=[11, 12, 13, 14, 15, 16, 17, 18], block_size=64),
            TraceRequest(arrival=2.0, session="a", turn=2, input_tokens=512, output_tokens=5,
                         hash_ids=a, block_size=64)]


def test_ceiling_of_requests_is_trace_stats_token_share():
    assert ceiling.of_requests(two_sessions()) == pytest.approx(0.2)
    assert ceiling.of_requests([]) is None


@pytest.mark.parametrize("apc, ceil, text", [
    (0.15, 0.2, "15.0% (usage) = 75.0% of 20.0%"),  # the share reached, then the ceiling
    (0.15, None, "15.0% (usage)"),  # not known: as before
])
def test_apc_cell_shows_the_share_of_the_ceiling(apc, ceil, text):
    rec = {"status": "ok", "ttft_ms": 1, "e2e_ms": 2, "tpot_ms": 1, "cached_tokens": int(apc * 1000),
           "input_tokens": 1000, "instance": "i0", "output_tokens": 2}
    row = seedtable.seed_row([rec], ceiling=ceil)
    assert text in seedtable.format_seed_table([("x", row)])
    got = list(csv.DictReader(io.StringIO(seedtable.format_seed_table([("x", row)], "csv"))))[0]
    assert got["apc_ceiling"] == ("" if ceil is None else str(ceil))


def test_simulate_shows_apc_against_the_trace_ceiling(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    write_trace(path, two_sessions())
    assert main(["simulate", str(path), "--policies", "sticky", "--instances", "1",
                 "--out", str(tmp_path / "res")]) == 0
    out = capsys.readouterr().out
    assert "of 20.0%" in out
    assert main(["simulate", str(path), "--policies", "sticky,round_robin", "--instances", "1",
                 "--repeats", "2", "--workers", "1", "--terminal-plot", "never"]) == 0
    assert "APC / ceiling 20.0%" in capsys.readouterr().out
    # the results file names the trace: kvtop report finds the ceiling there
    assert main(["report", str(tmp_path / "res" / "sticky.jsonl")]) == 0
    assert "of 20.0%" in capsys.readouterr().out


def test_report_without_the_trace_shows_no_ceiling(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    write_trace(path, two_sessions())
    assert main(["simulate", str(path), "--policies", "sticky", "--instances", "1",
                 "--out", str(tmp_path / "res")]) == 0
    capsys.readouterr()
    path.unlink()
    assert main(["report", str(tmp_path / "res" / "sticky.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "(usage)" in out and " of " not in out


async def test_report_db_shows_the_ceiling_from_the_block_chains(router, capsys):  # noqa: F811
    """Three sessions of four turns, each turn its previous prompt and more: the ceiling from
    the log's chains is each returning turn's previous blocks over all input."""
    c = await router(2, db=True)
    for t in range(4):
        for s in range(3):
            prompt = " ".join(f"s{s}w{k}" for k in range(1000 + 600 * t))
            assert (await complete(c, f"sess-{s}", prompt=prompt))["status"] == 200
    await asyncio.sleep(0.05)
    st = c.server.app[STATE]
    st.writer.flush()
    got = ceiling.of_log(st.config.db)
    assert set(got) == {"unified"} and 0.3 < got["unified"] < 0.9
    assert main(["report", "--db", st.config.db, "--format", "csv"]) == 0
    seed = list(csv.DictReader(io.StringIO(capsys.readouterr().out.split("\n\n")[0])))
    assert float(seed[0]["apc_ceiling"]) == pytest.approx(got["unified"])
    assert json.dumps(got)  # plain floats
    # the what-if report (kvtop simulate --from-db) sets each arm's APC against it too
    assert main(["simulate", "--from-db", st.config.db, "--speed", "1000", "--policies", "leastwork"]) == 0
    out = capsys.readouterr().out
    assert "prefix ceiling of the re-run requests:" in out and "sim leastwork" in out.split("APC as its share:")[1]
