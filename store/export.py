"""A table or a read-only query of the decision log written out as CSV or JSON lines
(``kvtop log export``), streamed row by row."""

from __future__ import annotations

import csv
import json
import re
import sqlite3
import sys
from pathlib import Path
from typing import IO, Any, Sequence

import sqlite_utils

from store.errors import QueryError
from store.logs import as_db
from store.sandbox import execute


def export(db: sqlite_utils.Database | str | Path, table_or_query: str, fmt: str = "csv",
           out: str | Path | IO[str] | None = None, params: Sequence | dict = ()) -> int:
    """Write a table (by name) or a read-only query's rows as CSV or JSON lines to ``out``
    (a path, an open text file, or stdout when None). Streams rows; returns how many."""
    db = as_db(db)
    if fmt not in ("csv", "jsonl"):
        raise QueryError(f"unknown export format {fmt!r} (csv or jsonl)")
    name = table_or_query.strip()
    if re.fullmatch(r"\w+", name):
        if not db[name].exists():
            raise QueryError(f"no table {name!r} (tables: {', '.join(db.table_names())})")
        sql = f"SELECT * FROM [{name}]"
    else:
        sql = table_or_query
    cur = execute(db, sql, params)
    cols = [c[0] for c in cur.description or ()]
    close = False
    if out is None:
        fh: IO[str] = sys.stdout
    elif isinstance(out, (str, Path)):
        fh = open(out, "w", newline="", encoding="utf-8")
        close = True
    else:
        fh = out
    n = 0
    try:
        if fmt == "csv":
            w = csv.writer(fh)
            w.writerow(cols)
            for n, row in enumerate(cur, 1):
                w.writerow(row)
        else:
            for n, row in enumerate(cur, 1):
                fh.write(json.dumps(dict(zip(cols, row)), default=_json_default) + "\n")
    except sqlite3.DatabaseError as exc:
        raise QueryError(f"SQL error: {exc}") from None
    finally:
        if close:
            fh.close()
    return n


def _json_default(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.hex()
    return str(v)
