"""Fleet changes as timed events for the offline simulator: ``kvtop simulate --fleet-events FILE``.

The file is JSON Lines (or one JSON array) of events, in any order:

    {"t": 30, "action": "add"}                          # a new instance, named i<index>
    {"t": 30, "action": "add", "instance": "i5"}        # ... or named; a removed name comes back
    {"t": 60, "action": "drain", "instance": "i0"}      # also cordon, uncordon
    {"t": 90, "action": "remove", "instance": "i0"}     # once nothing is in flight there
    {"t": 90, "action": "remove", "instance": "i1", "force": true}  # in flight: fails over
    {"t": 45, "action": "fail", "instance": "i2"}       # dies: in flight fails over, then unhealthy

``t`` is seconds on the trace's clock (its arrivals). Blank lines and lines starting with ``#``
are skipped. The simulator applies each through the router's own fleet rules
(router/build.Router.change_fleet, router/fleet.py), as the control API does live; a remove
without ``force`` waits until the instance has nothing in flight, as ``kvtop fleet drain
--wait && kvtop fleet remove`` does. ``load`` checks the whole sequence against those rules
before anything runs (an unknown instance, a change to a removed one, the last active
instance cordoned or drained), so a bad file is a one-line error, not a failed simulation.

What-if (kvtop/whatif.py) builds the same events from a recorded run's ``config_events``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from router.fleet import REMOVED, Fleet, FleetError
from store.errors import CliError

ACTIONS = ("add", "cordon", "drain", "uncordon", "remove", "fail")
KEYS = {"t", "action", "instance", "force"}
#: A file holds at most this many events (a fleet's changes, not a trace).
MAX_EVENTS = 100_000


@dataclass(frozen=True)
class FleetEvent:
    t: float
    action: str
    instance: str | None = None  # None only for an unnamed add
    force: bool = False


def parse(text: str, where: str = "--fleet-events") -> list[FleetEvent]:
    """Events from JSON Lines or a JSON array; CliError naming the line (or item) when bad."""
    stripped = text.lstrip()
    items: list[tuple[str, Any]] = []
    if stripped.startswith("["):
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise CliError(f"{where}: not valid JSON: {exc}") from None
        items = [(f"item {k + 1}", x) for k, x in enumerate(data)]
    else:
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                items.append((f"line {n}", json.loads(line)))
            except ValueError as exc:
                raise CliError(f"{where} line {n}: not valid JSON: {exc}") from None
    if len(items) > MAX_EVENTS:
        raise CliError(f"{where}: {len(items)} events; at most {MAX_EVENTS:,}")
    out = []
    for at, x in items:
        out.append(_event(x, f"{where} {at}"))
    return sorted(out, key=lambda e: e.t)  # stable: same-time events keep the file's order


def _event(x: Any, at: str) -> FleetEvent:
    if not isinstance(x, dict):
        raise CliError(f'{at}: expected an object like {{"t": 60, "action": "drain", "instance": "i0"}}')
    extra = set(x) - KEYS
    if extra:
        raise CliError(f"{at}: unknown key(s) {', '.join(sorted(extra))}; known: t, action, instance, force")
    t = x.get("t")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise CliError(f"{at}: t must be a number of seconds, at least 0")
    action = x.get("action")
    if action not in ACTIONS:
        raise CliError(f"{at}: action must be one of {', '.join(ACTIONS)}, not {action!r}")
    inst = x.get("instance")
    if inst is not None and (not isinstance(inst, str) or not inst or len(inst) > 256):
        raise CliError(f"{at}: instance must be a name (a string)")
    if inst is None and action != "add":
        raise CliError(f"{at}: {action} needs an instance")
    force = x.get("force", False)
    if not isinstance(force, bool):
        raise CliError(f"{at}: force must be true or false")
    if force and action != "remove":
        raise CliError(f"{at}: force goes with remove")
    return FleetEvent(float(t), action, inst, force)


def check(events: list[FleetEvent], names: list[str], where: str = "--fleet-events") -> list[str]:
    """Replay ``events`` over a fleet of ``names`` with the router's rules; returns every name
    the run will know (the starting ones, then those added). CliError for the first event the
    router would refuse."""
    names = list(names)
    fleet = Fleet(len(names))
    for e in events:
        at = f"{where}: at t={e.t:g} {e.action} {e.instance or ''}".rstrip()
        if e.action == "add":
            name = e.instance or f"i{len(names)}"
            if name in names:
                i = names.index(name)
                if fleet.states[i] != REMOVED:
                    raise CliError(f"{at}: {name} is in the fleet already; remove it first")
                fleet.revive(i, e.t)
            else:
                names.append(name)
                fleet.add(e.t)
            continue
        if e.instance not in names:
            raise CliError(f"{at}: unknown instance {e.instance!r}; known then: {', '.join(names)}")
        i = names.index(e.instance)
        if e.action == "fail":
            if fleet.states[i] == REMOVED:
                raise CliError(f"{at}: the instance was removed")
            continue
        try:  # in flight is unknown before the run: a remove without force waits for its drain
            fleet.apply(fleet.plan(i, e.action, force=e.force), e.t)
        except FleetError as exc:
            raise CliError(f"{at}: {exc.message}") from None
    return names


def instance_names(n: int, events: Any = ()) -> list[str]:
    """Every instance a simulation of ``n`` instances with ``events`` has: i0..i<n-1>, then each
    added one, in the router's order (for per-instance figures such as the balance)."""
    names = [f"i{i}" for i in range(n)]
    for e in events:
        if e.action == "add":
            name = e.instance or f"i{len(names)}"
            if name not in names:
                names.append(name)
    return names


def load(path: str, names: list[str]) -> tuple[list[FleetEvent], list[str]]:
    """``--fleet-events PATH`` read, parsed and checked against a fleet of ``names``."""
    try:
        with open(path, "rb") as f:
            data = f.read(16 * 1024 * 1024 + 1)
    except OSError as exc:
        raise CliError(f"--fleet-events {path}: {exc.strerror or exc}") from None
    if len(data) > 16 * 1024 * 1024:
        raise CliError(f"--fleet-events {path}: over 16 MiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise CliError(f"--fleet-events {path}: not UTF-8 text") from None
    events = parse(text, f"--fleet-events {path}")
    return events, check(events, names, f"--fleet-events {path}")


def from_config_events(rows: list[tuple[float, Any]], t0: float, scale: float,
                       names: list[str]) -> tuple[list[FleetEvent], list[str], list[str]]:
    """A recorded run's fleet changes (``config_events`` of kind ``fleet``: (ts, after)) as
    events on the simulator's clock (``(ts - t0) x scale``), with the run's instance names
    mapped to the simulator's (``i<index>`` in the router's order: the starting backends, then
    each added name). ``names`` are the run's backends as recorded, which may already hold the
    instances added while it ran (the runs row is rewritten at the end): a name whose first
    change is an add was not there at the start (an add of a name in the fleet is refused).
    Returns the events, the starting names and every name, in the router's order."""
    first: dict[str, str] = {}
    for _, after in rows:
        if isinstance(after, dict) and isinstance(after.get("instance"), str):
            first.setdefault(after["instance"], after.get("action"))
    start = [n for n in names if first.get(n) != "add"]
    known = list(start)
    events = []
    for ts, after in rows:
        if not isinstance(after, dict) or after.get("action") not in ACTIONS or not after.get("instance"):
            continue
        name = after["instance"]
        if after["action"] == "add" and name not in known:
            known.append(name)
        if name not in known:
            continue  # a change to an instance the run did not have (a garbled row): skipped
        sim_name = f"i{known.index(name)}"
        events.append(FleetEvent(max(0.0, (ts - t0) * scale), after["action"], sim_name,
                                 bool(after.get("force", False)) and after["action"] == "remove"))
    return events, start, known
