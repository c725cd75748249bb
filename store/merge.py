"""Several routers' decision logs read as one (``kvtop log --db A --db B``, ``kvtop report``).

Each file is ATTACHed read-only to one in-memory connection, and TEMP views named like the
tables (``decisions``, ``outcomes``, ``runs``, ``config_events``, ``samples``) are the UNION
ALL of every file's rows plus a ``source`` column naming the file. So every read in store/
(logs, reads, summary, arms) runs unchanged on the union, and SQLite still answers through
each file's own indexes: a WHERE on a view is pushed into every file's arm, and an ORDER BY over the
union is a merge of the files' index orders, so a percentile of the merged rows is a walk of
the merged order, never an average of per-file figures.

Why views and not per-file queries merged in Python: the rows, not the answers, are what
merge correctly (a p90 of two files is not a function of their p90s). Why not a copy: a copy
of two million-row logs costs seconds and memory before the first answer.

Run ids are unique across routers (start time plus a random suffix), so ``run_id`` keeps
joins between decisions and outcomes inside one router's rows; ``id`` columns collide across
files and are only used for order. A run id found in two files means one file is a copy of
the other and is refused; the same file given twice is read once. Files of different schema
versions merge: a column one file lacks reads NULL there.

``merge_runs`` narrows the views to chosen runs (by default each file's latest) and renames
their ``run_id`` to one label, so the run-scoped questions (``summary``, ``shadow``, the
report's arms) see the routers' runs as one run of the fleet.
"""

from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence
from urllib.parse import quote

import sqlite_utils

from store.schema import TABLES

#: Tables every kvtop log has (``open_readonly`` checks them); the rest may be missing.
MERGED_TABLES = tuple(TABLES)


@dataclass
class Source:
    """One router's log: the path as the user gave it (its label in ``source``), its schema
    alias on the merged connection, and a read-only connection of its own."""

    label: str
    alias: str
    path: str
    db: sqlite_utils.Database = field(repr=False)


class MergedLog(sqlite_utils.Database):
    """An in-memory connection whose TEMP views read several logs as one.

    sqlite-utils only lists the main schema's tables; the views here are TEMP (a view in one
    schema may not read another), so ``table_names`` lists them too and ``db["decisions"]``
    (``exists``, ``columns_dict``) works as on a file.
    """

    sources: list[Source]
    #: after ``merge_runs``: [(source label, run id)] in the merged run, in start order
    runs: list[tuple[str, str]]
    #: files given more than once, read once: [(path given again, path kept)]
    duplicates: list[tuple[str, str]]
    #: after ``merge_runs``: {(policy, version): text} for the segments whose routers ran
    #: them with different knobs or features (each router numbers its versions on its own)
    knob_conflicts: dict[tuple[str, int], str]
    #: after ``merge_runs``: {(policy, version as the views read it): label} for those
    #: segments, split per file: the views read such a file's ``policy_version`` as
    #: ``version + 1,000,000 x (its index + 1)``, labelled ``unified@3 (r2.db)``
    segment_names: dict[tuple[str, int], str]

    def table_names(self, fts4: bool = False, fts5: bool = False) -> list[str]:
        if fts4 or fts5:
            return super().table_names(fts4, fts5)
        temp = [r[0] for r in self.execute("SELECT name FROM sqlite_temp_master WHERE type = 'view'")]
        return super().table_names() + temp

    def view_names(self) -> list[str]:  # our views are "tables" to sqlite-utils (see table_names)
        return []

    def lacking(self, table: str, column: str) -> list[str]:
        """The sources (of the merged run, after ``merge_runs``) whose ``table`` has no ``column``."""
        chosen = {source for source, _ in self.runs} if self.runs else {s.label for s in self.sources}
        return [s.label for s in self.sources if s.label in chosen
                and column not in (_columns(self.conn, s.alias, table) or [])]

    def damaged(self) -> list[str]:
        """The sources whose file fails SQLite's quick check (asked only after an error)."""
        bad = []
        for s in self.sources:
            try:
                ok = s.db.conn.execute("PRAGMA quick_check(1)").fetchone()[0] == "ok"
            except sqlite3.DatabaseError:
                ok = False
            if not ok:
                bad.append(s.label)
        return bad


def _lit(text: str) -> str:
    return "'" + str(text).replace("'", "''") + "'"


def _columns(conn: sqlite3.Connection, alias: str, table: str) -> list[str] | None:
    rows = conn.execute(f"PRAGMA [{alias}].table_info([{table}])").fetchall()
    return [r[1] for r in rows] or None


def open_merged(paths: Sequence[str | Path], *, open_one, error: type[Exception]) -> MergedLog:
    """Attach every log in ``paths`` read-only and build the views over all their runs.

    ``open_one`` opens and checks one file (``store.logs.open_readonly``: missing, corrupt,
    locked and foreign files raise ``error`` naming the file). The same file twice (by
    device and inode) is read once and listed in ``duplicates``; a run id in two different
    files raises ``error``.
    """
    sources: list[Source] = []
    seen: dict[tuple[int, int], str] = {}
    duplicates: list[tuple[str, str]] = []
    conn = None
    try:
        for path in paths:
            one = open_one(path)  # raises for a missing, foreign, corrupt or locked file
            st = os.stat(path)
            key = (st.st_dev, st.st_ino)
            if key in seen:
                duplicates.append((str(path), seen[key]))
                one.conn.close()
                continue
            seen[key] = str(path)
            sources.append(Source(str(path), f"log{len(sources)}", str(Path(path).resolve()), one))
        conn = sqlite3.connect("file::memory:", uri=True, check_same_thread=False)
        limit = conn.getlimit(sqlite3.SQLITE_LIMIT_ATTACHED) if hasattr(conn, "getlimit") else 10
        if len(sources) > limit:
            raise error(f"at most {limit} logs can be read at once (SQLite's attach limit); got {len(sources)}")
        for s in sources:
            uri = getattr(s.db, "ro_uri", None) or "file:" + quote(s.path) + "?mode=ro"
            conn.execute("ATTACH DATABASE ? AS " + s.alias, (uri,))
        _check_run_ids(sources, error)
        db = MergedLog(conn)
        db.sources, db.duplicates, db.runs, db.knob_conflicts, db.segment_names = sources, duplicates, [], {}, {}
        _create_views(db, None)
        conn.execute("PRAGMA query_only = ON")
        return db
    except BaseException:
        for s in sources:
            s.db.conn.close()
        if conn is not None:
            conn.close()
        raise


def _check_run_ids(sources: list[Source], error: type[Exception]) -> None:
    owner: dict[str, str] = {}
    for s in sources:
        ids = {r[0] for r in s.db.conn.execute("SELECT run_id FROM runs")}
        ids |= {r[0] for r in s.db.conn.execute("SELECT DISTINCT run_id FROM decisions")}
        for run_id in ids:
            if run_id in owner:
                raise error(f"run {run_id} is in both {owner[run_id]} and {s.label}: is one a copy of the "
                            "other? give each router's log once")
            owner[run_id] = s.label


#: tables whose rows carry a decision's segment (``remap`` applies to them)
_SEGMENT_TABLES = ("decisions", "outcomes")


def _create_views(db: MergedLog, chosen: dict[str, list[str]] | None, label: str | None = None,
                  remap: dict[str, dict[tuple[str, int], int]] | None = None) -> None:
    """TEMP views over every source; with ``chosen`` ({source label: run ids}) only those
    runs' rows, their run_id read as ``label``; ``remap`` ({source label: {(policy,
    version): version read instead}}) splits segments the routers ran with different knobs."""
    conn = db.conn
    for table in MERGED_TABLES:
        per_source = [(s, _columns(conn, s.alias, table)) for s in db.sources]
        per_source = [(s, cols) for s, cols in per_source if cols]
        if chosen is not None:
            per_source = [(s, cols) for s, cols in per_source if chosen.get(s.label)]
        if not per_source:
            continue
        # The schema's columns first, in its order; then any a newer file has that we do not know.
        union = [c for c in TABLES[table] if any(c in cols for _, cols in per_source)]
        for _, cols in per_source:
            union += [c for c in cols if c not in union and c != "source"]
        arms = []
        for s, cols in per_source:
            have = set(cols)
            picked = []
            for c in union:
                if c == "run_id" and chosen is not None:
                    picked.append(f"{_lit(label)} AS run_id")
                elif c == "policy_version" and table in _SEGMENT_TABLES and remap and remap.get(s.label) \
                        and "policy" in have:
                    cases = " ".join(f"WHEN policy = {_lit(pol)} AND policy_version = {int(ver)} THEN {int(new)}"
                                     for (pol, ver), new in remap[s.label].items())
                    picked.append(f"CASE {cases} ELSE policy_version END AS policy_version")
                elif c in have:
                    picked.append(f"[{c}]")
                else:
                    picked.append(f"NULL AS [{c}]")
            arm = f"SELECT {', '.join(picked)}, {_lit(s.label)} AS source FROM {s.alias}.[{table}]"
            if chosen is not None:
                arm += f" WHERE run_id IN ({', '.join(_lit(r) for r in chosen[s.label])})"
            arms.append(arm)
        conn.execute(f"DROP VIEW IF EXISTS temp.[{table}]")
        conn.execute(f"CREATE TEMP VIEW [{table}] AS " + "\nUNION ALL\n".join(arms))


def merge_runs(db: MergedLog, runs: Sequence[str] | None, *, resolve, error: type[Exception]) -> str:
    """Narrow ``db``'s views to ``runs`` (ids or unique prefixes, each in whichever file holds
    it; None: every file's latest run) read as one run; returns its id, the chosen ids joined
    with ``+`` in start order. ``resolve(db, run)`` is ``store.logs.resolve_run``."""
    conn = db.conn
    if db.runs:  # narrowed before: look again over every run
        _with_writes(db, lambda: _create_views(db, None))
        db.runs = []
    chosen: dict[str, list[str]] = {}
    picked: list[tuple[float, str, str]] = []

    def add(source: str, run_id: str) -> None:
        if run_id in chosen.get(source, []):
            return
        chosen.setdefault(source, []).append(run_id)
        own = next(s.db.conn for s in db.sources if s.label == source)
        row = own.execute("SELECT min(t) FROM (SELECT started_at AS t FROM runs WHERE run_id = ? "
                          "UNION ALL SELECT min(ts) FROM decisions WHERE run_id = ?)", (run_id, run_id)).fetchone()
        picked.append((row[0] or 0.0, source, run_id))

    if runs:
        for run in runs:
            run_id = resolve(db, run)  # over every file's runs: prefixes and ambiguity as one log
            row = conn.execute("SELECT source FROM runs WHERE run_id = ? UNION ALL "
                               "SELECT source FROM (SELECT source FROM decisions WHERE run_id = ? LIMIT 1)",
                               (run_id, run_id)).fetchone()
            add(row[0], run_id)
    else:
        for s in db.sources:
            try:
                add(s.label, resolve(s.db, None))
            except error:  # a log with no runs yet adds nothing
                continue
        if not chosen:
            raise error("none of these logs has a run yet")
    picked.sort()
    label = "+".join(run_id for _, _, run_id in picked)
    db.runs = [(source, run_id) for _, source, run_id in picked]
    db.knob_conflicts = knob_conflicts(db)
    # A version the routers ran with different settings is one segment per file: its
    # figures are not pooled. Each file keeps its own number, shifted out of the way.
    remap: dict[str, dict[tuple[str, int], int]] = {}
    db.segment_names = {}
    index = {s.label: i for i, s in enumerate(db.sources)}
    for (policy, version) in db.knob_conflicts:
        for source in chosen:
            new = version + 1_000_000 * (index[source] + 1)
            remap.setdefault(source, {})[(policy, version)] = new
            db.segment_names[(policy, new)] = f"{policy}@{version} ({source})"
    _with_writes(db, lambda: _create_views(db, chosen, label, remap))
    return label


def _settings(db: MergedLog) -> dict[tuple[str, int], dict[str, dict]]:
    """{(policy, version): {source label: settings}} of the merged run, from each file's
    ``config_events`` (the run's start and every policy or knob change record the new
    policy, version, knobs and features in ``after``)."""
    out: dict[tuple[str, int], dict[str, dict]] = {}
    own = {s.label: s.db for s in db.sources}
    for source, run_id in db.runs:
        conn = own[source].conn
        if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'config_events'").fetchone():
            continue
        for (after,) in conn.execute("SELECT after FROM config_events WHERE run_id = ? AND kind IN "
                                     "('run', 'policy', 'knobs') ORDER BY ts, id", (run_id,)):
            try:
                a = json.loads(after)
                key = (a["policy"], int(a["version"]))
            except (TypeError, ValueError, KeyError):
                continue
            out.setdefault(key, {})[source] = {"knobs": a.get("knobs") or {}, "features": a.get("features") or {}}
    return out


def knob_conflicts(db: MergedLog) -> dict[tuple[str, int], str]:
    """The segments of the merged run that routers ran with different settings: a version
    is a counter each router keeps, so ``unified@3`` on one router and ``unified@3`` on
    another may differ. Value: the differing knobs, e.g. ``overload_factor 1.5 (r1.db), 3.0
    (r2.db)``; a router whose setting is unset shows ``-``."""
    out = {}
    for key, by_source in _settings(db).items():
        if len(by_source) < 2:
            continue
        diffs = []
        for part in ("knobs", "features"):
            names = sorted({k for v in by_source.values() for k in v[part]})
            for name in names:
                values = {src: v[part].get(name) for src, v in by_source.items()}
                if len({json.dumps(x, sort_keys=True) for x in values.values()}) > 1:
                    diffs.append(f"{name} " + ", ".join(f"{'-' if x is None else x} ({src})"
                                                         for src, x in values.items()))
        if diffs:
            out[key] = "; ".join(diffs)
    return out


def _with_writes(db: MergedLog, build) -> None:
    """Run ``build`` (TEMP views only, in memory: the files stay ``mode=ro``) with writes on."""
    db.conn.execute("PRAGMA query_only = OFF")
    try:
        build()
    finally:
        db.conn.execute("PRAGMA query_only = ON")


def close(db: sqlite_utils.Database) -> None:
    for s in getattr(db, "sources", ()):
        s.db.conn.close()
    db.conn.close()
