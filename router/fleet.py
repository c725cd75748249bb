"""Which instances take new work: each instance's fleet state and the rules that follow from it.

An operator takes an instance out of rotation without stopping the router (docs/control-api.md,
"Fleet"). Pure: no I/O, no clock of its own; the control API changes it, routing reads it.

    state      new sessions   new requests of sessions bound there   in-flight requests
    active     yes            yes                                    run
    cordoned   no             yes                                    run
    draining   no             no: each moves at its next turn        run to their end
    removed    no             no                                     none (removed once drained)

A removed instance keeps its index (decision rows, masks and metrics name instances by it);
adding it again under its name revives that place.

The one routing rule is ``Fleet.closed_to(bound)``: the instances a request must not go to,
given the instance its session is bound to. Routing gets it through the lifecycle's exclusion
(router/lifecycle.py), so the policy's pick, a retry and the offload's prefill instance all
obey it, and a ``previous_response_id`` pinned to a draining instance is answered as for an
unhealthy one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ACTIVE, CORDONED, DRAINING, REMOVED = "active", "cordoned", "draining", "removed"
STATES = (ACTIVE, CORDONED, DRAINING, REMOVED)

#: Control verbs -> the state they lead to (adding an instance is ``Fleet.add``).
ACTIONS = {"cordon": CORDONED, "drain": DRAINING, "uncordon": ACTIVE, "remove": REMOVED}


class FleetError(ValueError):
    """A fleet change that cannot be made; ``status`` is the HTTP status that says why."""

    def __init__(self, message: str, status: int = 409):
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(frozen=True, slots=True)
class Change:
    instance: int
    action: str
    before: str
    after: str

    @property
    def changed(self) -> bool:
        return self.before != self.after


class Fleet:
    """Each instance's state, by index (the cluster's instance order)."""

    def __init__(self, n: int):
        self.states: list[str] = [ACTIVE] * n
        self.since: list[float | None] = [None] * n  # when the state last changed (None: at start)
        self._closed: tuple[int, ...] = ()  # draining or removed: no request of any kind
        self._cordoned: tuple[int, ...] = ()

    def state(self, i: int) -> str:
        return self.states[i]

    def closed_to(self, bound: int | None) -> tuple[int, ...]:
        """Instances a request must not go to, for a request whose session is bound to
        ``bound`` (None: a new session): every draining or removed instance, and every
        cordoned one but its own. O(1) while every instance is active."""
        if not self._cordoned:
            return self._closed
        return self._closed + tuple(i for i in self._cordoned if i != bound)

    def plan(self, i: int, action: str, *, force: bool = False, in_flight: int = 0) -> Change:
        """The change ``action`` makes to instance ``i``, validated, without applying it.

        Refuses (FleetError) an unknown action, any change to a removed instance but removing
        it again (no change), a remove while ``in_flight`` requests run there unless ``force``
        (they then fail over: drain it first to avoid that), and a change that would leave no active instance for new sessions unless ``force``:
        the router would then refuse every new session, which is an outage, not a drain."""
        if action not in ACTIONS:
            raise FleetError(f"unknown fleet action {action!r}; known: {', '.join(ACTIONS)}", 400)
        if not 0 <= i < len(self.states):
            raise FleetError(f"no instance with index {i}", 404)
        before, after = self.states[i], ACTIONS[action]
        if before == REMOVED:
            if after == REMOVED:
                return Change(i, action, before, after)
            raise FleetError("the instance was removed; add it again instead")
        if after == REMOVED and in_flight and not force:
            raise FleetError(f"{in_flight} requests are in flight there; drain it and wait until it is "
                             "drained (kvtop fleet drain --wait), then remove it, or send force to "
                             "cut them off (each is retried elsewhere if nothing reached its client yet)")
        if (after != ACTIVE and before == ACTIVE and not force
                and not any(s == ACTIVE for k, s in enumerate(self.states) if k != i)):
            raise FleetError(f"{action} would leave no active instance for new sessions; "
                             "send force to do it anyway")
        return Change(i, action, before, after)

    def apply(self, change: Change, now: float) -> Change:
        if change.changed:
            self.states[change.instance] = change.after
            self.since[change.instance] = now
            self._reindex()
        return change

    def add(self, now: float) -> int:
        """A new instance, active; returns its index."""
        self.states.append(ACTIVE)
        self.since.append(now)
        return len(self.states) - 1

    def revive(self, i: int, now: float) -> None:
        """A removed instance added again under its name: active, in its old place."""
        if self.states[i] != REMOVED:
            raise FleetError("the instance is in the fleet already; remove it first to replace it")
        self.states[i] = ACTIVE
        self.since[i] = now
        self._reindex()

    def _reindex(self) -> None:
        self._closed = tuple(i for i, s in enumerate(self.states) if s in (DRAINING, REMOVED))
        self._cordoned = tuple(i for i, s in enumerate(self.states) if s == CORDONED)

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(STATES, 0)
        for s in self.states:
            out[s] += 1
        return out


def sessions_homed(cluster: Any, i: int) -> int:
    """Sessions whose home is instance ``i`` now: what a drain still waits to move (each moves
    at its next turn; one that never returns stays counted). The count the cluster keeps."""
    return cluster.instances[i].sessions


def progress(fleet: Fleet, cluster: Any, i: int) -> dict[str, Any] | None:
    """A drain's progress on instance ``i`` (None unless it is draining): sessions still homed
    there, requests in flight there (admission queue and prefill legs included), and whether
    it is drained (nothing in flight: it can be stopped or removed)."""
    if fleet.states[i] != DRAINING:
        return None
    in_flight = cluster.instances[i].num_requests
    return {"sessions_homed": sessions_homed(cluster, i), "in_flight": in_flight, "drained": in_flight == 0}


def instance_json(fleet: Fleet, cluster: Any, i: int) -> dict[str, Any]:
    """Instance ``i``'s fleet fields in the control API's state and fleet listing."""
    return {"fleet_state": fleet.states[i], "fleet_since": fleet.since[i], "drain": progress(fleet, cluster, i)}


def index_of(names: Sequence[str], name: str) -> int:
    """An instance's index by name; FleetError 404 naming the known ones when there is none."""
    try:
        return list(names).index(name)
    except ValueError:
        raise FleetError(f"unknown instance {name!r}; known: {', '.join(names)}", 404) from None
