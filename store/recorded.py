"""One recorded run's traffic, as what-if replay reads it back (``kvtop simulate --from-db``):
the run's settings, its first attempts with their block chains, and each request's final
outcome. kvtop/whatif.py turns these rows into a trace; the SQL lives here with the log's
other reads.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from store.errors import CliError


@dataclass
class RecordedRows:
    """The rows of one run that what-if replay needs (``sqlite3.Row``, read by column name)."""

    run_id: str
    config: dict[str, Any]  # runs.config: the router's settings (knobs, block_size, ...)
    backends: list[dict[str, Any]]  # runs.backends, in the router's order
    #: first attempts, in id order (a session's parent row before its child): request_id,
    #: session_id, turn, policy, instance, input_tokens, route_class, t_proxy_recv, blocks,
    #: blocks_parent, shadows
    decisions: list[sqlite3.Row]
    #: per request, its last attempt's outcome: request_id, attempt, instance, status, stream,
    #: ttft_ms, e2e_ms, tpot_ms, output_tokens, delivered_hit_tokens, t_recv, t_done
    outcomes: dict[str, sqlite3.Row]
    #: the run's policy, knob and fleet changes made while it ran (config_events): (ts, kind, who);
    #: what-if replays the starting settings and says these were not replayed
    changes: list[tuple[float, str, str]] = field(default_factory=list)
    #: the fleet's changes (config_events of kind fleet): (ts, after), which what-if replays
    fleet_changes: list[tuple[float, Any]] = field(default_factory=list)


def _connect(path: str | Path) -> sqlite3.Connection:
    p = Path(path)
    if not p.is_file():
        raise CliError(f"--from-db {p}: no such file")
    try:
        conn = sqlite3.connect(f"file:{p}?mode=ro", uri=True)
        conn.row_factory = sqlite3.Row
        conn.execute("SELECT 1 FROM decisions LIMIT 1")
    except sqlite3.DatabaseError as exc:
        raise CliError(f"--from-db {p}: not a kvtop decision log ({exc})") from None
    cols = {r[1] for r in conn.execute("PRAGMA table_info(decisions)")}
    if "blocks" not in cols:
        raise CliError(f"--from-db {p}: written by a kvtop before what-if replay (no block chains "
                       "in its decisions; schema version 1); record the run again with this kvtop")
    return conn


def read_recorded_run(path: str | Path, run_id: str | None = None) -> RecordedRows:
    """The rows of run ``run_id`` (None: the latest started) of the log at ``path``, read-only.

    Raises CliError (one line, in ``--from-db``'s words) for a missing file, one that is not a
    decision log, one written before block chains were recorded, no runs or an unknown run.
    """
    conn = _connect(path)
    try:
        runs = conn.execute("SELECT run_id, started_at, policy, backends, config FROM runs "
                            "ORDER BY started_at").fetchall()
        if not runs:
            raise CliError(f"--from-db {path}: no runs recorded")
        if run_id is None:
            run = runs[-1]
        else:
            match = [r for r in runs if r["run_id"] == run_id]
            if not match:
                known = ", ".join(r["run_id"] for r in runs[-5:])
                raise CliError(f"--run {run_id}: not in {path} (latest runs: {known})")
            run = match[0]
        rid = run["run_id"]
        config = json.loads(run["config"] or "{}")
        backends = json.loads(run["backends"] or "[]")
        rows = conn.execute(
            "SELECT request_id, session_id, turn, policy, instance, input_tokens, route_class, "
            "t_proxy_recv, blocks, blocks_parent, shadows FROM decisions "
            "WHERE run_id = ? AND attempt = 1 ORDER BY id", (rid,)).fetchall()
        outs: dict[str, sqlite3.Row] = {}
        for o in conn.execute(
                "SELECT request_id, attempt, instance, status, stream, ttft_ms, e2e_ms, tpot_ms, "
                "output_tokens, delivered_hit_tokens, t_recv, t_done FROM outcomes "
                "WHERE run_id = ? ORDER BY attempt", (rid,)):
            outs[o["request_id"]] = o  # the last attempt's outcome is the request's
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        changes = [] if "config_events" not in tables else [
            (r["ts"], r["kind"], r["who"]) for r in conn.execute(
                "SELECT ts, kind, who FROM config_events WHERE run_id = ? AND kind IN ('policy', 'knobs', 'fleet') "
                "ORDER BY ts", (rid,))]
        fleet_changes = [] if "config_events" not in tables else [
            (r["ts"], _json(r["after"])) for r in conn.execute(
                "SELECT ts, after FROM config_events WHERE run_id = ? AND kind = 'fleet' ORDER BY ts", (rid,))]
    finally:
        conn.close()
    return RecordedRows(run_id=rid, config=config, backends=backends, decisions=rows, outcomes=outs,
                        changes=changes, fleet_changes=fleet_changes)


def _json(text: Any) -> Any:
    try:
        return json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return None
