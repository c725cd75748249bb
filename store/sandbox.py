"""Arbitrary read-only SQL against the decision log (``kvtop log sql``, and the queries
``kvtop log export`` streams): three locks, each enough alone. A keyword check gives the
clear message, an authorizer denies writes hidden inside a WITH, and the ``mode=ro``
connection (store.logs.open_readonly) is the guarantee behind both.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Sequence

import sqlite_utils

from store.errors import QueryError
from store.logs import as_db

_READ_KEYWORDS = ("select", "with", "explain", "pragma", "values")
# PRAGMAs that take an argument yet only read.
_READ_PRAGMAS_WITH_ARG = {"table_info", "table_xinfo", "index_list", "index_info", "index_xinfo",
                          "foreign_key_list", "table_list", "pragma_list", "function_list"}
_LEADING_COMMENTS = re.compile(r"^(\s+|--[^\n]*\n?|/\*.*?\*/)*", re.S)


def _authorizer(action: int, arg1, arg2, db_name, trigger) -> int:
    if action in (sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
                  getattr(sqlite3, "SQLITE_RECURSIVE", 33)):
        return sqlite3.SQLITE_OK
    if action == sqlite3.SQLITE_PRAGMA and (arg2 is None or (arg1 or "").lower() in _READ_PRAGMAS_WITH_ARG):
        return sqlite3.SQLITE_OK
    return sqlite3.SQLITE_DENY


def _check_read_only(sql: str) -> None:
    body = _LEADING_COMMENTS.sub("", sql, count=1)
    first = re.match(r"[A-Za-z]+", body)
    keyword = first.group(0).lower() if first else ""
    if keyword not in _READ_KEYWORDS:
        raise QueryError("only read-only statements are allowed (SELECT, WITH, EXPLAIN, PRAGMA reads); "
                         f"got {keyword.upper() or repr(sql[:20])}")
    if keyword == "pragma" and "=" in body:
        raise QueryError("PRAGMA assignments are not allowed: the log is opened read-only")


def execute(db: sqlite_utils.Database, sql: str, params: Sequence | dict) -> sqlite3.Cursor:
    """A cursor over one read-only statement's rows; QueryError for anything else."""
    _check_read_only(sql)
    conn = db.conn
    conn.set_authorizer(_authorizer)
    try:
        return conn.execute(sql, params)
    except sqlite3.DatabaseError as exc:
        msg = str(exc)
        if "not authorized" in msg:
            msg = "statement is not read-only (not authorized)"
        raise QueryError(f"SQL error: {msg}") from None
    except (sqlite3.ProgrammingError, sqlite3.Warning) as exc:  # e.g. two statements
        raise QueryError(f"SQL error: {exc}") from None
    finally:
        conn.set_authorizer(None)


def run_sql(db: sqlite_utils.Database | str | Path, sql: str,
            params: Sequence | dict = ()) -> tuple[list[str], list[tuple]]:
    """Run one read-only statement; returns (column names, rows).

    Refuses anything but a single SELECT / WITH / EXPLAIN / PRAGMA read with a QueryError.
    The keyword check gives the clear message, an authorizer denies writes hidden inside a
    WITH, and the ``mode=ro`` connection is the guarantee behind both.
    """
    db = as_db(db)
    cur = execute(db, sql, params)
    try:
        rows = cur.fetchall()
    except sqlite3.DatabaseError as exc:
        raise QueryError(f"SQL error: {exc}") from None
    return [c[0] for c in cur.description or ()], rows
