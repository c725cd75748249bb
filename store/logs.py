"""Opening decision logs read-only, one file or several read as one, and what every read of
them shares: run and time resolution, segment labels, and the fan-out of a grouped query to
each file of a merged log.

Every read in store/ goes through a ``mode=ro`` connection (``open_readonly``), so no query
can change the file. A *policy segment* is the set of a run's decisions made under one
``policy@version``. The router bumps ``policy_version`` on every policy or knob change, so a
segment is one contiguous time range (its edges can overlap by a request's admission wait).
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import time
from datetime import datetime
from pathlib import Path
from typing import Callable, Sequence
from urllib.parse import quote

import sqlite_utils

from store import merge
from store.errors import QueryError
from store.schema import JSON_COLUMNS, TABLES

#: Outcome statuses of requests cut off by their client, not failed (``summary`` counts them apart).
CANCELLED = ("client_gone",)
CANCELLED_SQL = "(" + ", ".join(f"'{c}'" for c in CANCELLED) + ")"
SEP = "\x1f"  # unit separator: cannot appear in a reason, class or status
#: How long a read waits for a writer's exclusive lock before the file is reported locked.
BUSY_TIMEOUT_S = 5.0


# -- opening ------------------------------------------------------------------------
def open_readonly(path: str | Path) -> sqlite_utils.Database:
    """Open a kvtop database read-only: ``file:...?mode=ro`` plus ``query_only``.

    Raises QueryError for a missing file or one that is not a kvtop decision log.
    """
    p = Path(path)
    if not p.exists():
        raise QueryError(f"no database at {path} (pass --db PATH; the router writes kvtop.db by default)")
    if not p.is_file():
        raise QueryError(f"{path} is not a file")
    uri = "file:" + quote(str(p.resolve())) + "?mode=ro"
    try:
        try:
            conn = sqlite3.connect(uri, uri=True, check_same_thread=False, timeout=BUSY_TIMEOUT_S)
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        except sqlite3.OperationalError as exc:
            # A WAL-mode file needs its -shm beside it, even to read; on a read-only mount
            # (an archived log, a CI artefact) SQLite cannot create one. With no -wal content
            # to miss, read the file as immutable: no locks and no -shm, valid while nobody
            # writes the file, which a read-only mount promises.
            if "unable to open" not in str(exc) or not _wal_mode(p) or _has_wal_content(p):
                raise
            uri += "&immutable=1"
            conn = sqlite3.connect(uri, uri=True, check_same_thread=False, timeout=BUSY_TIMEOUT_S)
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as exc:
        if "unable to open" in str(exc):  # e.g. a live WAL file in a directory we cannot write
            hint = (f"; its {p.name}-wal holds rows not yet in the file: copy both somewhere writable"
                    if _has_wal_content(p) else "")
            raise QueryError(f"cannot open {path} read-only: {exc}{hint}") from None
        if "malformed" in str(exc):
            raise QueryError(f"{path} is damaged ({exc})") from None
        if "locked" in str(exc):  # another process holds an exclusive lock past BUSY_TIMEOUT_S
            raise QueryError(f"{path} is locked by another process ({exc}); try again when it lets go") from None
        raise QueryError(f"{path} is not a kvtop database ({exc})") from None
    missing = {"runs", "decisions", "outcomes"} - tables
    if missing:
        conn.close()
        hint = ""
        if _wal_mode(p) and not _has_wal_content(p):  # a WAL-mode file without its -wal
            hint = ("; if it is a copy of a live router's log, its rows may still be in the original's -wal "
                    "file: copy with sqlite3 SRC \".backup DST\", or copy SRC-wal beside it too")
        raise QueryError(f"{path} is not a kvtop database (no {', '.join(sorted(missing))} table){hint}")
    conn.execute("PRAGMA query_only = ON")
    # Reads of a big log are scans: map the file and keep a generous page cache.
    conn.execute("PRAGMA mmap_size = 4294967296")
    conn.execute("PRAGMA cache_size = -262144")
    db = sqlite_utils.Database(conn)
    db.ro_uri = uri  # store.merge attaches the file the same way
    return db


def _wal_mode(p: Path) -> bool:
    """The file's header says WAL (bytes 18 and 19 are 2: SQLite's file format, 1.3)."""
    try:
        with open(p, "rb") as f:
            head = f.read(20)
    except OSError:
        return False
    return head[:16] == b"SQLite format 3\x00" and head[18:20] == b"\x02\x02"


def _has_wal_content(p: Path) -> bool:
    try:
        return os.path.getsize(str(p) + "-wal") > 0
    except OSError:
        return False


def open_logs(paths: str | Path | Sequence[str | Path]) -> sqlite_utils.Database:
    """One log read-only (``open_readonly``), or several read as one (``store.merge``): the
    tables become views over every file, with a ``source`` column naming each row's file.

    The same file given twice is read once (``db.duplicates`` says so); a run id in two
    different files, a missing, foreign, corrupt or locked file raise QueryError.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise QueryError("no database given")
    distinct: list[str | Path] = []
    for p in paths:
        if not any(_same_file(p, q) for q in distinct):
            distinct.append(p)
    if len(distinct) == 1:
        db = open_readonly(distinct[0])
        db.duplicates = [(str(p), str(distinct[0])) for p in paths[1:]]  # type: ignore[attr-defined]
        return db
    return merge.open_merged(paths, open_one=open_readonly, error=QueryError)


def _same_file(a: str | Path, b: str | Path) -> bool:
    try:
        return Path(a).samefile(b)
    except OSError:  # a missing file: open_readonly says so
        return str(a) == str(b)


def is_merged(db: sqlite_utils.Database) -> bool:
    return isinstance(db, merge.MergedLog)


def scope(db: sqlite_utils.Database, run: str | None) -> tuple[sqlite_utils.Database, str]:
    """The run a run-scoped question is about. On several logs, the chosen runs (``run``:
    ids or prefixes joined by commas; None: every log's latest run) become one run."""
    if not is_merged(db):
        return db, resolve_run(db, run)
    wanted = [r.strip() for r in run.split(",") if r.strip()] if run and run != "latest" else None
    if db.runs and (run is None or run == "+".join(r for _, r in db.runs)):
        return db, "+".join(r for _, r in db.runs)
    return db, merge.merge_runs(db, wanted, resolve=resolve_run, error=QueryError)


def as_db(db: sqlite_utils.Database | str | Path) -> sqlite_utils.Database:
    return db if isinstance(db, sqlite_utils.Database) else open_readonly(db)


def db_file(db: sqlite_utils.Database) -> str | None:
    """The file behind a connection, to open a second one on it (None: in memory)."""
    for _seq, name, file in db.conn.execute("PRAGMA database_list"):
        if name == "main" and file:
            return file
    return None


def segment_label(db: sqlite_utils.Database, policy: str | None, version: int | None) -> str:
    """``policy@version``; on several logs, a version the routers ran with different knobs
    is a segment per file, ``policy@version (file)`` (``merge.segment_names``: each router
    numbers its versions on its own)."""
    return getattr(db, "segment_names", {}).get((policy, version)) or f"{policy}@{version}"


def knob_notes(db: sqlite_utils.Database) -> list[str]:
    """One line per segment whose routers' knobs differ (several logs), saying how."""
    return [f"{policy}@{version} ran with different settings on these routers ({text}): "
            "one segment per file"
            for (policy, version), text in getattr(db, "knob_conflicts", {}).items()]


def fetch_dicts(db: sqlite_utils.Database, sql: str, params: Sequence | dict = ()) -> list[dict]:
    cur = db.conn.execute(sql, params)
    cols = [c[0] for c in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]

# -- times and runs -----------------------------------------------------------------
_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)\s*$", re.I)
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_time(value: str | float | int | None, *, now: float | None = None) -> float | None:
    """Unix seconds from ``1700000000``, ``2024-05-01T12:00:00`` (local unless it has an
    offset) or a relative ``30s``/``10m``/``2h``/``1d`` meaning that long before ``now``."""
    if value is None or isinstance(value, (int, float)):
        return None if value is None else float(value)
    text = value.strip()
    m = _RELATIVE.match(text)
    if m:
        return (time.time() if now is None else now) - float(m.group(1)) * _UNIT_S[m.group(2).lower()]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise QueryError(f"cannot read time {value!r}: use unix seconds, ISO 8601, or 30s/10m/2h/1d ago") from None


def resolve_run(db: sqlite_utils.Database, run: str | None) -> str:
    """The run id for ``run``: exact id, unique prefix, or the latest run when None."""
    conn = db.conn
    if run is None or run == "latest":
        row = conn.execute("SELECT run_id FROM runs ORDER BY started_at DESC LIMIT 1").fetchone()
        if row is None:  # decisions without a runs row (a crashed start): latest decision's run
            row = conn.execute("SELECT run_id FROM decisions ORDER BY ts DESC LIMIT 1").fetchone()
        if row is None:
            raise QueryError("the database has no runs yet")
        return row[0]
    if conn.execute("SELECT 1 FROM runs WHERE run_id = ?", (run,)).fetchone() or \
            conn.execute("SELECT 1 FROM decisions WHERE run_id = ? LIMIT 1", (run,)).fetchone():
        return run
    like = run.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    found = [r[0] for r in conn.execute(
        "SELECT run_id FROM runs WHERE run_id LIKE ? ESCAPE '\\' LIMIT 3", (like,))]
    if len(found) == 1:
        return found[0]
    if found:
        raise QueryError(f"run {run!r} is ambiguous: {', '.join(found)}, ...")
    raise QueryError(f"no run {run!r} (kvtop log runs lists them)")


def run_filter(db: sqlite_utils.Database, run_id: str, alias: str = "d") -> str:
    """``run_id = ?`` shaped for the planner: when the run is most of the table a scan in
    rowid order beats 1M look-ups through the (run_id, ts) index, so hide the index."""
    prefix = f"{alias}." if alias else ""
    if is_merged(db):  # the views' run_id is a constant: each file's own filter picks the plan
        return f"{prefix}run_id = ?"
    conn = db.conn
    total = conn.execute("SELECT max(id) FROM decisions").fetchone()[0] or 0
    mine = conn.execute("SELECT count(*) FROM decisions WHERE run_id = ?", (run_id,)).fetchone()[0]
    return f"+{prefix}run_id = ?" if mine * 3 > total else f"{prefix}run_id = ?"

def is_flat(db: sqlite_utils.Database, run_id: str) -> bool:
    """True when every outcome of the run carries its decision's policy (and the other columns
    copied from it), so segment questions can read ``outcomes`` alone. Files written before
    those columns existed, and rows an older router wrote into a newer file, have NULL there:
    then the queries join each outcome to its decision instead. One index seek."""
    if "policy" not in db["outcomes"].columns_dict:
        return False
    return db.conn.execute("SELECT 1 FROM outcomes WHERE run_id = ? AND policy IS NULL LIMIT 1",
                           (run_id,)).fetchone() is None

def each_run(db: sqlite_utils.Database, run_id: str) -> list[tuple[sqlite_utils.Database, str]]:
    """Where the run's rows are: (db, run_id) itself, or on several logs (``merge_runs``)
    each file's own connection with each of its runs that make up the merged one."""
    if not is_merged(db):
        return [(db, run_id)]
    if db.segment_names:  # segments split per file: only the views read them so
        return [(db, run_id)]
    own = {s.label: s.db for s in db.sources}
    return [(own[source], rid) for source, rid in db.runs]


_MIN_COLUMNS, _MAX_COLUMNS, _TEXT_COLUMNS = ("start_ts",), ("end_ts",), ("reasons", "classes")


def gathered(db: sqlite_utils.Database, run_id: str, sql: Callable[[sqlite_utils.Database, str], str],
              group: tuple[str, ...]) -> list[dict]:
    """The rows of a grouped query over the run, ``sql(db, run_id)`` binding the run id as
    its one parameter. On several logs each file answers for its own run(s) through its own
    indexes (a GROUP BY over the union's views would sort every row), and rows of the same
    ``group`` combine: ``start_ts`` min, ``end_ts`` max, separator-joined text joins, every
    other column (counts and sums) adds, None where every part is None."""
    parts = [r for d, rid in each_run(db, run_id) for r in fetch_dicts(d, sql(d, rid), (rid,))]
    if not is_merged(db):
        return parts
    out: dict[tuple, dict] = {}
    for r in parts:
        key = tuple(r[c] for c in group)
        have = out.get(key)
        if have is None:
            out[key] = dict(r)
            continue
        for c, v in r.items():
            if c in group or v is None:
                continue
            old = have[c]
            if old is None:
                have[c] = v
            elif c in _MIN_COLUMNS:
                have[c] = min(old, v)
            elif c in _MAX_COLUMNS:
                have[c] = max(old, v)
            elif c in _TEXT_COLUMNS:
                have[c] = old + SEP + v
            else:
                have[c] = old + v
    return list(out.values())

def decode_json_columns(table: str, row: dict) -> dict:
    """A copy of ``row`` with the table's JSON text columns parsed (bad JSON stays text)."""
    out = dict(row)
    for col in JSON_COLUMNS.get(table, ()):
        v = out.get(col)
        if isinstance(v, str):
            try:
                out[col] = json.loads(v)
            except ValueError:
                pass
    return out

def table_names(db: sqlite_utils.Database) -> list[str]:
    """The kvtop tables present in this file, in schema order."""
    present = set(db.table_names())
    return [t for t in TABLES if t in present]
