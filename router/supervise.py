"""Background work that cannot die silently: every death is logged, counted, shown, and the work
restarted (or, where it cannot be, replaced by what stands in for it).

The router runs long-lived work beside its requests: a KV-event subscriber per instance, a
health probe per instance, the telemetry poller, the decision log's writer thread and the
body parser's worker process. An asyncio task that raises ends quietly (its exception waits
for a garbage collector to print it), so a subscriber that died on one bad batch left its
instance "exact" on a frozen index. ``Supervisor.spawn`` runs such a task in a loop that
catches the death, logs it with its traceback, counts it, tells the owner (``on_death``: the
subscriber drops its instance to the estimate) and starts the task again after a backoff.
Deaths seen elsewhere (a thread, a worker process) are reported with ``died``.

``degraded()`` lists what died within the last ``window_s`` seconds or is down now: the state
snapshot (``degraded``), ``/health`` and ``/metrics`` (``kvtop_background_task_*``) show it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kvtop.supervise")

#: A death is shown as degraded for this long after it (the work was restarted meanwhile).
DEGRADED_WINDOW_S = 60.0
#: The first restart waits this long, each further death in a row twice as long, up to the max.
BACKOFF_S = 0.1
BACKOFF_MAX_S = 5.0
#: A task that ran this long before dying starts again from the first backoff.
STABLE_S = 30.0


@dataclass(slots=True)
class TaskHealth:
    name: str  # e.g. "kv-events-0", "health-probe-1", "telemetry", "writer", "parser-worker"
    kind: str  # kv-subscriber | health-probe | telemetry | writer | parser-worker
    fallback: str  # what stands in while it is down, in a few words
    deaths: int = 0
    restarts: int = 0
    running: bool = True
    last_error: str | None = None
    last_death: float | None = None  # wall clock

    def json(self) -> dict[str, Any]:
        return {"task": self.name, "kind": self.kind, "deaths": self.deaths, "restarts": self.restarts,
                "running": self.running, "last_error": self.last_error, "since": self.last_death,
                "fallback": self.fallback}


class Supervisor:
    def __init__(self, *, window_s: float = DEGRADED_WINDOW_S, backoff_s: float = BACKOFF_S,
                 backoff_max_s: float = BACKOFF_MAX_S, clock: Callable[[], float] = time.time):
        self.window_s = window_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.clock = clock
        self.tasks: dict[str, TaskHealth] = {}

    def health(self, name: str, kind: str, fallback: str) -> TaskHealth:
        h = self.tasks.get(name)
        if h is None:
            h = self.tasks[name] = TaskHealth(name, kind, fallback)
        return h

    def spawn(self, name: str, factory: Callable[[], Awaitable[Any]], *, kind: str,
              fallback: str = "restarted", on_death: Callable[[BaseException], None] | None = None,
              on_restart: Callable[[], None] | None = None) -> asyncio.Task:
        """Run ``factory()`` as a task that is started again whenever it raises or returns.

        ``on_death(exc)`` runs at once (before the backoff); ``on_restart()`` just before the
        next ``factory()``. Cancelling the returned task stops it for good."""
        h = self.health(name, kind, fallback)
        h.running = True
        return asyncio.get_running_loop().create_task(self._keep(h, factory, on_death, on_restart), name=name)

    async def _keep(self, h: TaskHealth, factory, on_death, on_restart) -> None:
        loop = asyncio.get_running_loop()
        delay = self.backoff_s
        while True:
            started = loop.time()
            try:
                await factory()
                exc: BaseException = RuntimeError("the task returned; it should run until stopped")
            except asyncio.CancelledError:
                h.running = False
                raise
            except Exception as e:  # noqa: BLE001 - the point: any death is caught and shown
                exc = e
            self.died(h.name, exc, kind=h.kind, fallback=h.fallback, restarting_in=delay)
            if on_death is not None:
                try:
                    on_death(exc)
                except Exception:  # noqa: BLE001
                    log.exception("%s: the death handler failed too", h.name)
            if loop.time() - started >= STABLE_S:
                delay = self.backoff_s
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.backoff_max_s)
            h.restarts += 1
            h.running = True
            if on_restart is not None:
                try:
                    on_restart()
                except Exception:  # noqa: BLE001
                    log.exception("%s: preparing the restart failed", h.name)

    def died(self, name: str, exc: BaseException, *, kind: str, fallback: str = "restarted",
             restarting_in: float | None = None, running: bool = False) -> None:
        """Record one death (from a task, a thread or a worker process) and log it once."""
        h = self.health(name, kind, fallback)
        h.deaths += 1
        h.running = running
        h.last_error = f"{exc.__class__.__name__}: {exc}"[:300]
        h.last_death = self.clock()
        when = f"restarting in {restarting_in:.1f} s" if restarting_in is not None else fallback
        log.error("background task %s died (%s, death %d); %s", name, h.last_error, h.deaths, when,
                  exc_info=(type(exc), exc, exc.__traceback__) if exc.__traceback__ else None)

    def degraded(self, now: float | None = None) -> list[dict[str, Any]]:
        """What is down now or died within the window, newest death first."""
        now = self.clock() if now is None else now
        out = [h for h in self.tasks.values()
               if h.deaths and (not h.running or (h.last_death is not None and now - h.last_death < self.window_s))]
        out.sort(key=lambda h: -(h.last_death or 0.0))
        return [h.json() for h in out]

    def snapshot(self) -> list[dict[str, Any]]:
        return [h.json() for h in self.tasks.values()]
