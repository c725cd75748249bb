"""The one composition root: settings + instances + a clock + a sink -> a ready router.

``kvtop route`` (router/state.py), ``kvtop simulate`` (kvtop/simulate.py), what-if and the
sweep all build their router here, so a piece added to the router (a shadow set, a feature,
a deferral rule) reaches every driver at once instead of being wired twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from router.calibration import DEFAULT_PRIOR, PrefillPrior
from router.cluster import Cluster
from router.core import PolicySlot, RoutingCore
from router.fleet import REMOVED, Change, Fleet, index_of
from router.lifecycle import Lifecycle
from router.pipeline import Flow, Pipeline, Sink
from router.request import RouteRequest
from router.settings import Settings


class Router:
    """The pure router: its settings, the cluster's books, the policy slot and the request
    pipeline. No sockets and no event loop; the drivers perform what it decides."""

    def __init__(self, settings: Settings, cluster: Cluster, sink: Sink, *,
                 clock: Callable[[], float] = time.time,
                 on_admit: Callable[[Flow], None] | None = None, shadows: Any = None,
                 defer: Callable[[Callable[[], None]], Any] | None = None,
                 background: Callable[[Callable[[], bool]], Any] | None = None,
                 full: Callable[[], tuple[int, ...]] = tuple):
        self.settings = settings
        self.core = RoutingCore(cluster, settings.build_policy(), clock=clock)
        self.pipeline = Pipeline(self.core, lambda: self.settings.features, sink, clock=clock,
                                 on_admit=on_admit, shadows=shadows, defer=defer, background=background)
        #: which instances take new sessions and requests (router/fleet.py); the control API changes it
        self.fleet = Fleet(len(cluster.instances))
        #: the one order of a request's steps; the drivers only perform its actions
        self.lifecycle = Lifecycle(self.pipeline, full=full, closed=self.closed_to)

    @property
    def cluster(self) -> Cluster:
        return self.core.cluster

    @property
    def slot(self) -> PolicySlot:
        return self.core.slot

    def closed_to(self, req: RouteRequest) -> tuple[int, ...]:
        """The instances the fleet closes to ``req`` (router/fleet.py): draining ones, and
        cordoned ones unless its session is bound there."""
        sess = self.cluster.sessions.get(req.session_id) if req.session_id is not None else None
        return self.fleet.closed_to(sess.instance if sess is not None else None)

    def add_instance(self, name: str, url: str = "", *, capacity_blocks: int, kv_events: bool = False) -> int:
        """Grow every per-instance structure by one new, empty, active instance (or revive the
        removed one of that name in its place); returns its index."""
        cl = self.cluster
        now = self.pipeline.clock()
        for s in cl.instances:
            if s.name == name:
                self.fleet.revive(s.index, now)  # FleetError unless it was removed
                s.url, s.healthy, s.ejected = url, True, False
                if cl.exact is not None and kv_events:
                    cl.exact.published_mask |= 1 << s.index
                return s.index
        i = cl.add_instance(name, url, capacity_blocks=capacity_blocks, kv_events=kv_events)
        self.pipeline.queue.add_instance()
        self.fleet.add(now)
        return i

    def change_fleet(self, name: str, action: str, *, force: bool = False) -> Change:
        """Cordon, drain, uncordon or remove the instance named ``name`` (router/fleet.py's rules;
        FleetError changing nothing); a remove also forgets what it held. The control API
        (router/fleet_api.py) and the simulator (kvtop/simulate.py) both change the fleet here."""
        i = index_of([s.name for s in self.cluster.instances], name)
        plan = self.fleet.plan(i, action, force=force, in_flight=self.cluster.instances[i].num_requests)
        c = self.fleet.apply(plan, self.pipeline.clock())
        if c.changed and c.after == REMOVED:
            self.remove_instance(i)
        return c

    def remove_instance(self, i: int) -> None:
        """Forget what instance ``i`` held; it keeps its index, marked removed, out of every pick.
        Requests still in flight there (a forced remove) release their tickets as usual."""
        cl = self.cluster
        cl.index.forget_instance(i)
        cl.calibration.forget(i)
        if cl.exact is not None:
            cl.exact.clear(i)
            cl.exact.set_live(i, False)
            cl.exact.published_mask &= ~(1 << i)
        cl.instances[i].healthy = False

    def apply(self, settings: Settings) -> PolicySlot:
        """Swap in validated settings: a new policy version and the features, in one step;
        in-flight requests keep the policy that routed them. Waiters at an admission gate
        are re-examined at once (a larger budget or ``admission=off`` lets them through)."""
        policy = settings.build_policy()  # before anything changes: a failure changes nothing
        self.settings = settings
        slot = self.core.swap(policy)
        self.pipeline.pump_all()
        return slot


def build_router(settings: Settings, names: Sequence[str], sink: Sink, *,
                 urls: Sequence[str] | None = None, block_size: int = 512,
                 capacity_blocks: int | Sequence[int] = 518,
                 prefill_prior: PrefillPrior = DEFAULT_PRIOR,
                 clock: Callable[[], float] = time.time,
                 on_admit: Callable[[Flow], None] | None = None, shadows: Any = None,
                 defer: Callable[[Callable[[], None]], Any] | None = None,
                 background: Callable[[Callable[[], bool]], Any] | None = None,
                 full: Callable[[], tuple[int, ...]] = tuple) -> Router:
    """A router over instances ``names``: the live server passes wall time, its shadow set,
    its loop's deferral and which instances are at their in-flight bound (``full``); the
    simulator passes virtual time and nothing else."""
    cluster = Cluster(list(names), urls=urls, block_size=block_size, capacity_blocks=capacity_blocks,
                      clock=clock, prefill_prior=prefill_prior)
    return Router(settings, cluster, sink, clock=clock, on_admit=on_admit, shadows=shadows,
                  defer=defer, background=background, full=full)
