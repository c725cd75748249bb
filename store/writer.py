"""A background writer: the event loop enqueues rows, one thread writes them in batches.

The router must never wait on disk. ``Writer.put`` only appends to a queue; a daemon
thread that owns its own SQLite connection drains the queue every ``flush_interval``
seconds (or sooner when a batch fills) and inserts each table's rows with one
``executemany`` inside one transaction. ``close()`` writes everything still queued
before it returns, so a clean shutdown loses nothing; WAL keeps the file readable after a
crash.

The queue is bounded (``max_queued`` rows): when the disk or the thread cannot keep up, new
decision and outcome rows are dropped and counted instead of growing the router's memory and
the window a crash can lose. What a SIGKILL loses is therefore at most the rows queued plus
the batch being written: ``max_queued`` rows, about ``max_queued / rows per second`` of
traffic (docs/reliability.md has the measured figures). ``runs`` and ``config_events`` rows
are never dropped. ``health()`` says how the writer is doing (written, queued, dropped,
failed, the last error, and its lag in seconds).

A drop is loud: the first one of each ``DROP_LOG_INTERVAL_S`` logs a warning with the count
since the last, and each such span is written to the log itself as a ``config_events`` row
(kind ``log_drop``: from, to, rows) so that ``kvtop log summary`` says which span of the run
is incomplete.
"""

from __future__ import annotations

import json
import queue
import logging
import sqlite3
import threading
import time
from typing import Any

import sqlite_utils

from store.schema import JSON_COLUMNS, TABLES, ensure_schema

log = logging.getLogger("kvtop.store")

_STOP = object()
#: Bound variables per statement (SQLite's limit is 32,766 since 3.32, 999 before).
_MAX_VARIABLES = 32_000 if sqlite3.sqlite_version_info >= (3, 32) else 999


#: Tables whose rows are never dropped: rare, and what a run's story hangs on.
_KEEP = frozenset(("runs", "config_events"))
#: A writer that dropped or failed rows this recently, or lags this much, is "degraded".
DEGRADED_WINDOW_S = 60.0
DEGRADED_LAG_S = 5.0
#: While rows are being dropped, one warning (and one ``log_drop`` row) per this many seconds.
DROP_LOG_INTERVAL_S = 10.0


class Writer:
    def __init__(self, path: str, *, flush_interval: float = 0.2, max_batch: int = 2000,
                 max_queued: int = 6000):
        self.path = path
        self.flush_interval = flush_interval
        self.max_batch = max_batch
        self.max_queued = max_queued
        self.rows_written = 0
        self.rows_failed = 0
        self.rows_dropped = 0
        self.batches = 0
        self.thread_deaths = 0  # write windows that failed outside SQLite (the thread went on)
        self._in_hand: tuple[list, list] | None = None
        self._stop_seen = False
        #: the run whose ``log_drop`` rows this writer adds (router/app.py sets it)
        self.run_id: str | None = None
        #: drops not yet reported: [first (wall), last (wall), rows, rows by table, first (monotonic)]
        self._drop_span: list | None = None
        self._drop_lock = threading.Lock()
        self._drop_logged_at = float("-inf")  # monotonic time of the last drop warning
        self.last_error: str | None = None
        self.last_problem_at = 0.0  # monotonic time of the last drop or failed write
        self._written_enqueued_at: float | None = None  # enqueue time of the newest row written
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._urgent = threading.Event()  # a flush or close is waiting: end the window now
        self._open_error: BaseException | None = None
        self._cols = {t: [c for c in cols if c != "id"] for t, cols in TABLES.items()}

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> "Writer":
        """Open the database (creating the schema) and start the thread.

        Raises the open error in the caller, so a bad ``--db`` path fails at start-up.
        """
        self._thread = threading.Thread(target=self._run, name="kvtop-writer", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._open_error is not None:
            raise self._open_error
        return self

    def close(self, timeout: float = 30.0) -> None:
        """Write everything queued so far, then stop the thread."""
        if self._thread is None:
            return
        self._report_drops(force=True)  # drops since the last report: logged and recorded too
        self._queue.put(_STOP)
        self._urgent.set()
        self._thread.join(timeout)
        self._thread = None

    def put(self, table: str, row: dict[str, Any]) -> bool:
        """Queue one row; never blocks. JSON columns may hold Python objects. Returns False
        (and counts it) when the queue is full and the row was dropped."""
        now = time.monotonic()
        if self._queue.qsize() >= self.max_queued and table not in _KEEP:
            self.rows_dropped += 1
            self.last_problem_at = now
            self._dropped(table, now)
            return False
        self._queue.put((table, row, now))
        return True

    def _dropped(self, table: str, now: float) -> None:
        with self._drop_lock:
            span = self._drop_span
            if span is None:
                wall = time.time()
                span = self._drop_span = [wall, wall, 0, {}, now]
                if now - self._drop_logged_at >= DROP_LOG_INTERVAL_S:
                    self._drop_logged_at = now
                    log.warning("decision log: the queue is full (%d rows, the writer %.1f s behind): new decision "
                                "and outcome rows are being dropped; a count follows every %.0f s",
                                self.max_queued, self._lag(now), DROP_LOG_INTERVAL_S)
            span[1] = time.time()
            span[2] += 1
            span[3][table] = span[3].get(table, 0) + 1

    def _report_drops(self, force: bool = False) -> None:
        """From the writer's thread, once per interval (and at close): the span's drops as a
        warning and a ``log_drop`` row, which the same thread then writes."""
        with self._drop_lock:
            span = self._drop_span
            if span is None or not (force or time.monotonic() - span[4] >= DROP_LOG_INTERVAL_S):
                return
            self._drop_span = None
        t0, t1, n, by_table, _ = span
        log.warning("decision log: %d rows dropped between %s and %s (%s): the log misses them "
                    "(see /health; kvtop log summary names the span)", n,
                    time.strftime("%H:%M:%S", time.localtime(t0)), time.strftime("%H:%M:%S", time.localtime(t1)),
                    ", ".join(f"{t} {k}" for t, k in by_table.items()))
        self._queue.put(("config_events", {
            "run_id": self.run_id, "ts": t1, "kind": "log_drop", "who": "writer", "policy_version": None,
            "before": None, "after": {"from": t0, "to": t1, "rows_dropped": n, "by_table": by_table}},
            time.monotonic()))

    def _lag(self, now: float) -> float:
        w = self._written_enqueued_at
        return max(0.0, now - w) if w is not None and self._queue.qsize() else 0.0

    def health(self) -> dict[str, Any]:
        """The writer's state for /health, /metrics and the control API."""
        now = time.monotonic()
        queued = self._queue.qsize()
        lag = 0.0
        if queued and self._written_enqueued_at is not None:
            lag = max(0.0, now - self._written_enqueued_at)
        recent = self.last_problem_at and now - self.last_problem_at < DEGRADED_WINDOW_S
        return {"rows_written": self.rows_written, "rows_queued": queued, "rows_dropped": self.rows_dropped,
                "rows_failed": self.rows_failed, "max_queued": self.max_queued, "batches": self.batches,
                "thread_deaths": self.thread_deaths,
                "last_error": self.last_error, "lag_s": round(lag, 3),
                "degraded": bool(recent) or lag > DEGRADED_LAG_S}

    def flush(self, timeout: float = 10.0) -> bool:
        """Block until every row queued before this call is written (for tests and shutdown)."""
        done = threading.Event()
        self._queue.put(done)
        self._urgent.set()
        return done.wait(timeout)

    @property
    def backlog(self) -> int:
        return self._queue.qsize()

    # -- the thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            db = sqlite_utils.Database(conn)
            ensure_schema(db)
            conn.execute("PRAGMA synchronous=NORMAL")
        except BaseException as exc:  # reported to start()
            self._open_error = exc
            self._ready.set()
            return
        self._ready.set()
        stopping = False
        while not stopping:
            try:
                stopping = self._step(conn)
            except Exception as exc:  # noqa: BLE001 - the thread must outlive any one batch
                self._step_died(exc, conn)
                stopping = self._stop_seen
        conn.close()

    def _step(self, conn: sqlite3.Connection) -> bool:
        """One window: take what is queued, write it, wake the flush waiters. True: stop."""
        stopping = False
        if self._drop_span is not None:
            self._report_drops()
        batch: list = []
        markers: list[threading.Event] = []
        self._in_hand = (batch, markers)
        try:
            item = self._queue.get(timeout=self.flush_interval)
        except queue.Empty:
            return False
        deadline = time.monotonic() + self.flush_interval
        # One wake per window, not one per row: rows queued meanwhile are drained below
        # without blocking. (A blocking get per row woke this thread on every put, and each
        # wake took the GIL from the event loop in the middle of a request.)
        if self._queue.qsize() < self.max_batch and not self._urgent.is_set():
            self._urgent.wait(max(0.0, deadline - time.monotonic()))
        self._urgent.clear()
        while True:
            if item is _STOP:
                stopping = self._stop_seen = True
            elif isinstance(item, threading.Event):
                markers.append(item)
                break  # write what came before the marker, then wake the waiter
            else:
                batch.append(item)
            if stopping or len(batch) >= self.max_batch:
                break
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
        if stopping:
            # Drain whatever is still queued behind the stop request.
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, threading.Event):
                    markers.append(item)
                elif item is not _STOP:
                    batch.append(item)
        if batch:
            self._write(conn, batch)
        for m in markers:
            m.set()
        self._in_hand = None
        return stopping

    def _step_died(self, exc: BaseException, conn: sqlite3.Connection) -> None:
        """A window failed outside SQLite (a bug, a row that cannot be encoded): its rows are
        counted as failed, logged, its flush waiters woken, and the thread goes on."""
        if conn.in_transaction:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
        batch, markers = self._in_hand or ([], [])
        self._in_hand = None
        self.thread_deaths += 1
        self.rows_failed += len(batch)
        self.last_problem_at = time.monotonic()
        self.last_error = f"writer loop failed: {exc.__class__.__name__}: {exc}"[:300]
        log.error("decision log: a write window failed (%s); %d rows lost, the writer goes on",
                  self.last_error, len(batch), exc_info=True)
        for m in markers:
            m.set()

    def _insert(self, conn: sqlite3.Connection, table: str, rows: list[tuple]) -> None:
        """Many rows per statement. executemany steps SQLite once per row and gives the GIL
        back each time; with the event loop busy, each return waits up to the interpreter's
        switch interval (5 ms), which capped the writer at a few hundred rows a second under
        load. One statement of up to ~1,000 rows hands the GIL over once."""
        cols = self._cols[table]
        verb = "INSERT OR REPLACE" if table == "runs" else "INSERT"
        per = max(1, _MAX_VARIABLES // len(cols))
        one = "(" + ", ".join("?" for _ in cols) + ")"
        head = f"{verb} INTO [{table}] ({', '.join(f'[{c}]' for c in cols)}) VALUES "
        for start in range(0, len(rows), per):
            chunk = rows[start:start + per]
            conn.execute(head + ", ".join([one] * len(chunk)), [v for r in chunk for v in r])

    def _write(self, conn: sqlite3.Connection, batch: list) -> None:
        by_table: dict[str, list[tuple]] = {}
        for table, row, _ in batch:
            cols = self._cols.get(table)
            if cols is None:
                self.rows_failed += 1
                self.last_error = f"unknown table {table!r}"
                continue
            json_cols = JSON_COLUMNS.get(table, ())
            values = []
            for c in cols:
                v = row.get(c)
                if c in json_cols and v is not None and not isinstance(v, str):
                    v = json.dumps(v, separators=(",", ":"), default=str)
                values.append(v)
            by_table.setdefault(table, []).append(tuple(values))
        try:
            conn.execute("BEGIN")
            for table, rows in by_table.items():
                self._insert(conn, table, rows)
            conn.execute("COMMIT")
            self.rows_written += sum(len(r) for r in by_table.values())
            self.batches += 1
        except sqlite3.Error as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            self.rows_failed += len(batch)
            self.last_problem_at = time.monotonic()
            if str(exc) != self.last_error:  # once per kind of failure, not once per batch
                log.error("decision log write failed (%s); rows are being lost (see /health)", exc)
            self.last_error = str(exc)
        if batch:
            self._written_enqueued_at = batch[-1][2]
