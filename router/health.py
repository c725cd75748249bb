"""Backend health: an active prober, passive marking from the proxy, and outlier detection.

Each backend has its own watcher task that GETs ``/health`` every ``health_interval_s``
with a ``health_timeout_s`` limit. A refused connection marks the instance down at once;
a timeout or a 5xx needs ``FAIL_THRESHOLD`` in a row, so one slow answer from a busy engine
does not take it out, and a soft failure does not count at all while the instance is still
completing requests (its /health is slow because it is busy, not dead), nor while most of the
fleet fails alike (``HealthChecker.correlated``: the router's host or network, not the instances). The proxy marks
an instance down the moment a connect fails (``passive_down``). A down instance is excluded from picking (``Cluster.set_healthy``) and
probed with exponential backoff (interval x 2^(failures-1), capped at
``health_backoff_max_s``); its first good answer re-admits it. Every transition is a
``health`` event and a ``config_events`` row of kind ``health``. docs/reliability.md has the
timing figures.

Outlier detection, in the style of Envoy's: a backend whose /health answers 200 while its
completions fail is caught by real traffic. ``outlier_consecutive`` failed attempts in a row
(5xx, gateway errors, timeouts; a client that leaves and a 4xx do not count) eject it for
``outlier_ejection_s`` x (times ejected), capped at ``OUTLIER_MAX_EJECTION_S``, as long as at
most ``OUTLIER_MAX_SHARE`` of the fleet is ejected and one instance stays in. When the time is
up it returns on trial once its probe answers (at once when active checks are off): its next
real failure ejects it again, for longer; a success clears the streak.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from router.upstream import ConnectFailed, UpstreamError

if TYPE_CHECKING:  # typing only: router/state.py imports this module
    from router.state import RouterState

log = logging.getLogger("kvtop.route")

#: Consecutive soft failures (timeout, 5xx) before a healthy instance is marked down.
FAIL_THRESHOLD = 2
#: Soft failures shared by most of the fleet at once (see ``correlated``) are held up to this
#: many in a row before they count: past it, the instance goes down whatever the others do.
CORRELATED_MAX_FAILURES = 8
#: Outlier detection: the longest ejection, and the largest share of the fleet ejected at once.
OUTLIER_MAX_EJECTION_S = 300.0
OUTLIER_MAX_SHARE = 0.7
#: Outcome statuses that count against an instance (router/pipeline.py).
FAILED = frozenset(("upstream_error", "timeout"))


@dataclass(slots=True)
class ProbeState:
    """What the checker knows about one instance beyond its ``healthy`` flag."""

    failures: int = 0  # consecutive failed probes (or passive failures) since the last success
    last_error: str | None = None
    changed_at: float = 0.0  # wall time of the last transition
    probes: int = 0
    served_seen: int = 0  # requests this instance had completed without error at the last probe
    forgiven: int = 0  # soft failures ignored because the instance was completing requests
    held: int = 0  # soft failures ignored because most of the fleet failed alike (``correlated``)
    wake: asyncio.Event | None = None
    consecutive_errors: int = 0  # failed real-traffic attempts in a row
    ejected_until: float = 0.0  # monotonic deadline of the current ejection (0: not ejected)
    ejected_timer: asyncio.TimerHandle | None = None


def backoff_s(failures: int, interval_s: float, cap_s: float) -> float:
    """Delay before the next probe of a down instance: doubles per failure, capped."""
    if failures <= 0:
        return interval_s
    return min(cap_s, interval_s * 2 ** min(failures - 1, 30))


class HealthChecker:
    def __init__(self, state: RouterState):
        self.state = state
        cfg = state.config
        self.interval_s = cfg.health_interval_s
        self.timeout_s = cfg.health_timeout_s
        self.backoff_max_s = max(cfg.health_backoff_max_s, cfg.health_interval_s)
        self.outlier_consecutive = cfg.outlier_consecutive
        self.outlier_ejection_s = cfg.outlier_ejection_s
        self.probes = [ProbeState(changed_at=time.time()) for _ in state.cluster.instances]
        self.tasks: dict[int, asyncio.Task] | None = None  # index -> its watcher, while running
        self.transitions = 0

    # -- transitions -------------------------------------------------------------------
    def _set(self, index: int, healthy: bool, source: str, why: str | None) -> bool:
        st = self.state
        if not st.cluster.set_healthy(index, healthy):
            return False
        inst = st.cluster.instances[index]
        p = self.probes[index]
        now = time.time()
        was_for = now - p.changed_at
        p.changed_at = now
        self.transitions += 1
        payload = {"instance": inst.name, "url": inst.url, "healthy": healthy, "source": source,
                   "reason": why, "failures": p.failures, "previous_state_s": round(was_for, 3)}
        word = "healthy again" if healthy else f"unhealthy ({source}: {why})"
        log.warning("%s %s %s", inst.name, inst.url, word)
        st.emit("health", payload)
        st.record_config("health", source, {"instance": inst.name, "healthy": not healthy},
                         {"instance": inst.name, "healthy": healthy, "reason": why})
        return True

    # -- outlier detection on real traffic ---------------------------------------------
    def observe(self, index: int, status: str) -> None:
        """One attempt on ``index`` ended with ``status`` (the pipeline's outcome)."""
        if not self.outlier_consecutive:
            return
        p = self.probes[index]
        if status == "ok":
            p.consecutive_errors = 0
            return
        if status not in FAILED:
            return
        p.consecutive_errors += 1
        inst = self.state.cluster.instances[index]
        if p.consecutive_errors >= self.outlier_consecutive and inst.healthy and self._may_eject():
            self._eject(index)

    def _may_eject(self) -> bool:
        insts = self.state.cluster.instances
        ejected = sum(s.ejected for s in insts)
        cap = min(len(insts) - 1, math.ceil(len(insts) * OUTLIER_MAX_SHARE))
        return ejected < cap

    def _eject(self, index: int) -> None:
        inst = self.state.cluster.instances[index]
        p = self.probes[index]
        inst.ejected = True
        inst.ejections_total += 1
        duration = min(OUTLIER_MAX_EJECTION_S, self.outlier_ejection_s * inst.ejections_total)
        loop = asyncio.get_running_loop()
        p.ejected_until = loop.time() + duration
        p.last_error = f"{p.consecutive_errors} failed requests in a row"
        self._set(index, False, "outlier", f"{p.last_error}; ejected for {duration:g} s")
        if p.ejected_timer is not None:
            p.ejected_timer.cancel()
        p.ejected_timer = loop.call_later(duration, self._ejection_over, index)

    def _ejection_over(self, index: int) -> None:
        p = self.probes[index]
        p.ejected_timer = None
        p.ejected_until = 0.0
        if self.interval_s > 0 and p.wake is not None:
            p.wake.set()  # the watcher probes now and re-admits on a good answer
        else:
            self._readmit_on_trial(index)

    def _readmit_on_trial(self, index: int) -> None:
        inst = self.state.cluster.instances[index]
        p = self.probes[index]
        inst.ejected = False
        # on trial: one more failure ejects it again (for longer); a success clears the streak
        p.consecutive_errors = max(0, self.outlier_consecutive - 1)
        self._set(index, True, "outlier", "ejection over; back on trial")

    def passive_down(self, index: int, exc: BaseException) -> None:
        """The proxy could not connect to ``index``: exclude it now; probes re-admit it."""
        p = self.probes[index]
        p.failures = max(p.failures, 1)
        p.last_error = f"{type(exc).__name__}: {exc}"[:300]
        self._set(index, False, "proxy", p.last_error)

    # -- probing -----------------------------------------------------------------------
    async def probe(self, index: int) -> tuple[bool, bool, str | None]:
        """GET /health; a timeout is confirmed by a second try at once. Returns (ok, hard_failure, why).

        The confirmation is for a host that is slow for a moment: during a fleet_live.sh run at
        load ~10, an outside client measured kvtop sim's /health at up to 1.7 s and the router's
        own at up to 1.4 s (over the 1 s timeout), and an idle, freshly added instance (nothing
        completing, so nothing forgiven) was taken out by such timeouts. A hung instance is
        still found, one timeout later."""
        why = None
        for _ in range(2):
            ok, hard, why = await self._probe_once(index)
            if ok or hard or why is None or "timed out" not in why:
                return ok, hard, why
        return False, False, why

    async def _probe_once(self, index: int) -> tuple[bool, bool, str | None]:
        inst = self.state.cluster.instances[index]
        try:
            async with asyncio.timeout(self.timeout_s):
                r = await self.state.upstream.request(inst.url, "GET", "/health", (), b"")
                async with r:
                    await r.read(limit=64 * 1024)
            if r.status < 500:
                return True, False, None
            return False, False, f"/health answered HTTP {r.status}"
        except ConnectFailed as exc:
            return False, True, f"connect failed: {exc}"
        except TimeoutError:
            return False, False, f"/health timed out after {self.timeout_s:g} s"
        except (UpstreamError, OSError) as exc:
            return False, False, f"{type(exc).__name__}: {exc}"[:300]

    def after_probe(self, index: int, ok: bool, hard: bool, why: str | None) -> float:
        """Apply one probe's result; return the delay before the next probe."""
        p = self.probes[index]
        p.probes += 1
        inst = self.state.cluster.instances[index]
        healthy = inst.healthy
        # An engine that keeps finishing requests is alive even if its /health is slow under
        # load: a soft failure then does not count (a refused connect always does).
        served = inst.routed_total - inst.num_requests - inst.errors_total
        progressing = served > p.served_seen
        p.served_seen = served
        if not ok and not hard and healthy and progressing:
            p.forgiven += 1
            p.last_error = why
            return self.interval_s
        if ok:
            p.failures = 0
            p.held = 0
            if inst.ejected:  # an outlier returns on trial once its time is up and it answers
                if p.ejected_until == 0.0:
                    self._readmit_on_trial(index)
                return self.interval_s
            p.last_error = None
            if not healthy:
                self._set(index, True, "probe", None)
            return self.interval_s
        p.failures += 1
        p.last_error = why
        if (healthy and not hard and p.failures >= FAIL_THRESHOLD and p.failures < CORRELATED_MAX_FAILURES
                and self.correlated()):
            if not p.held:
                log.warning("%s: /health failing (%s) with most of the fleet at once: held as the router's host "
                            "or network, not the instance (up to %d in a row)", inst.name, why,
                            CORRELATED_MAX_FAILURES)
            p.held += 1
            return self.interval_s
        if healthy and (hard or p.failures >= FAIL_THRESHOLD):
            self._set(index, False, "probe", why)
            healthy = False
        return self.interval_s if healthy else backoff_s(p.failures, self.interval_s, self.backoff_max_s)

    def correlated(self) -> bool:
        """Whether most healthy instances are failing their probes softly at the same time.

        Every /health timing out together says more about the router's host (an overloaded
        machine, a stalled event loop) or the network than about the instances; taking them all
        out turns a slow moment into 503s for every request (fleet_live.sh saw 14 of them when
        every probe timed out at once during a fleet change, on a host at load ~10 where
        /health answers took up to 1.7 s). As Envoy's panic threshold, then: with two
        or more healthy instances and more than half of them in a soft-failure streak, a soft
        failure is held, up to CORRELATED_MAX_FAILURES in a row. A refused connection counts at
        once as always, and one instance failing alone goes down after FAIL_THRESHOLD."""
        insts = self.state.cluster.instances
        healthy = [k for k, s in enumerate(insts) if s.healthy and k < len(self.probes)]
        failing = sum(1 for k in healthy if self.probes[k].failures >= 1)
        return len(healthy) >= 2 and failing * 2 > len(healthy)

    async def _watch(self, index: int) -> None:
        p = self.probes[index]
        p.wake = asyncio.Event()
        # The first probe waits one interval: at start the CLI has just probed every backend.
        delay = self.interval_s
        while True:
            try:
                await asyncio.wait_for(p.wake.wait(), delay)
            except asyncio.TimeoutError:
                pass
            p.wake.clear()
            ok, hard, why = await self.probe(index)
            delay = self.after_probe(index, ok, hard, why)

    def snapshot(self) -> list[dict[str, Any]]:
        return [self.instance_json(i) for i in range(len(self.probes))]

    def instance_json(self, index: int) -> dict[str, Any]:
        """What the state snapshot says about one instance's health (why it is out, if it is)."""
        s = self.state.cluster.instances[index]
        p = self.probes[index]
        left = None
        if p.ejected_until:
            left = max(0.0, p.ejected_until - asyncio.get_running_loop().time())
        return {"instance": s.name, "healthy": s.healthy, "failures": p.failures,
                "last_error": p.last_error, "since": p.changed_at, "probes": p.probes,
                "forgiven": p.forgiven, "held": p.held, "ejected": s.ejected, "ejected_for_s": left,
                "ejections": s.ejections_total, "consecutive_errors": p.consecutive_errors}

    # -- lifecycle ---------------------------------------------------------------------
    def add(self, index: int) -> None:
        """Watch an instance added while the router runs (router/fleet_api.py), or one re-added."""
        if index < len(self.probes):
            self.probes[index] = ProbeState(changed_at=time.time())  # re-added: a fresh record
        else:
            self.probes.append(ProbeState(changed_at=time.time()))
        if self.tasks is not None and self.interval_s > 0 and index not in self.tasks:
            self.tasks[index] = self._start(index)

    def _start(self, index: int) -> asyncio.Task:
        """One instance's probe loop; supervised where the router has a supervisor (a loop that
        dies is logged, shown and started again)."""
        sup = getattr(self.state, "supervisor", None)
        if sup is not None:
            return sup.spawn(f"health-probe-{index}", lambda: self._watch(index), kind="health-probe",
                             fallback="restarted; the instance keeps its last health meanwhile")
        return asyncio.create_task(self._watch(index), name=f"kvtop-health-{index}")

    def stop(self, index: int) -> None:
        """Stop probing a removed instance."""
        t = self.tasks.pop(index, None) if self.tasks is not None else None
        if t is not None:
            t.cancel()
        p = self.probes[index]
        if p.ejected_timer is not None:
            p.ejected_timer.cancel()
            p.ejected_timer = None

    async def run(self) -> AsyncIterator[None]:
        self.tasks = {i: self._start(i) for i in range(len(self.probes))}
        tasks = self.tasks
        try:
            yield
        finally:
            self.tasks = None
            for t in tasks.values():
                t.cancel()
            for p in self.probes:
                if p.ejected_timer is not None:
                    p.ejected_timer.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)


def setup(app, state: RouterState) -> HealthChecker:
    """Called by create_app: the checker, started and stopped with the app."""
    checker = HealthChecker(state)
    state.health = checker
    if checker.interval_s > 0:
        app.cleanup_ctx.append(lambda _app: checker.run())
    return checker
