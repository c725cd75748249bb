"""Discovery: instances that join and leave the fleet because a source says so.

A source (a watched backends file here, DNS names in router/discovery_dns.py) yields the set
of backends it wants in the fleet; a ``Reconciler`` per source turns each new set into the
same fleet operations the control API performs (router/fleet_api.py), audited as
``config_events`` of kind ``fleet`` with ``who`` the source (``file``, ``dns``) and
``"source"`` in ``after``. docs/fleet.md is the reference.

The reconciler acts on edits, not on every look: an entry that appears is added; one that
disappears is drained and removed once nothing is in flight there (forced after
``drain_timeout_s``); an entry whose URL or options change is the old one leaving and the new
one joining, under the same name once the old is removed. What an operator does through the
control API to a discovered instance is not undone on the next look (a cordon stays; an
instance they uncordon while its entry is gone is left to them).

A bad set (a file that does not parse, a duplicate name or URL, a bad URL, a name already
taken by an instance the source does not own, or one that would leave no active instance)
changes nothing: it is logged once, counted, and shown in ``GET state`` (``discovery``) and
``/metrics`` (``kvtop_discovery_ok``, ``kvtop_discovery_errors_total``) until a good one comes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from router import fleet as fl
from router.backends import parse_backend
from router.state import Backend
from store.errors import CliError

if TYPE_CHECKING:  # pragma: no cover
    from router.state import RouterState

log = logging.getLogger("kvtop.route")

#: How often the backends file is looked at (a stat; read and parsed only when it changed).
FILE_POLL_S = 0.25
#: A file larger than this is refused (a backends file is a few lines per instance).
MAX_FILE_BYTES = 1024 * 1024


class DiscoveryError(ValueError):
    """A source's answer that cannot be applied; the message says why (one line)."""


# -- the backends file --------------------------------------------------------------------------

def parse_backends_file(text: str, where: str = "") -> list[Backend]:
    """One backend per line in ``kvtop route --backend`` syntax
    (``[NAME=]URL[@gpu=N][@kv=tcp://HOST:PORT][@kv-replay=tcp://HOST:PORT]``); ``#`` starts a
    comment, blank lines are skipped. An entry without ``NAME=`` is named by its URL's
    ``host:port``, so its name does not depend on its line. DiscoveryError (naming the line)
    for a bad line, and for a name or URL given twice."""
    out: list[Backend] = []
    names: dict[str, int] = {}
    urls: dict[str, int] = {}
    where = f"{where} " if where else ""
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if any(c.isspace() for c in line):
            raise DiscoveryError(f"{where}line {n}: one backend a line, without spaces: {line!r}")
        try:
            b = parse_backend(line, 0)
        except CliError as exc:
            raise DiscoveryError(f"{where}line {n}: {str(exc).replace('--backend ', '', 1)}") from None
        if not _named(line):
            b.name = host_port(b.url)
        if b.name in names:
            raise DiscoveryError(f"{where}line {n}: the name {b.name} is on line {names[b.name]} already")
        if b.url in urls:
            raise DiscoveryError(f"{where}line {n}: {b.url} is on line {urls[b.url]} already")
        names[b.name], urls[b.url] = n, n
        out.append(b)
    return out


def _named(spec: str) -> bool:
    head, sep, _ = spec.partition("=")
    return bool(sep) and "://" not in head


def host_port(url: str) -> str:
    """``http://10.0.0.4:8000`` -> ``10.0.0.4:8000``: a discovered instance's default name."""
    return url.split("://", 1)[-1].split("/", 1)[0]


def read_backends_file(path: str) -> list[Backend]:
    """The file's backends; DiscoveryError when it cannot be read or parsed."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise DiscoveryError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise DiscoveryError(f"{path} is over {MAX_FILE_BYTES // 1024} KiB; a backends file is a line per instance")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DiscoveryError(f"{path} is not UTF-8 text (byte {exc.start})") from None
    return parse_backends_file(text)


# -- the reconciler ------------------------------------------------------------------------------

@dataclass
class Status:
    """One source as ``GET state`` shows it (``discovery``)."""

    source: str  # file | dns | srv
    target: str  # the file's path, or the DNS name
    ok: bool = True
    error: str | None = None
    checked_at: float | None = None
    changed_at: float | None = None
    owned: list[str] = field(default_factory=list)
    leaving: list[str] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)
    errors_total: int = 0
    changes_total: int = 0

    def json(self) -> dict[str, Any]:
        return {"source": self.source, "target": self.target, "ok": self.ok, "error": self.error,
                "checked_at": self.checked_at, "changed_at": self.changed_at, "instances": sorted(self.owned),
                "leaving": sorted(self.leaving), "waiting": sorted(self.waiting),
                "errors_total": self.errors_total, "changes_total": self.changes_total}


@dataclass(frozen=True)
class Op:
    kind: str  # add | drain | uncordon | wait (add once the name or URL is free) | adopt (no change)
    name: str
    backend: Backend | None = None


class Reconciler:
    """Applies a source's successive backend sets to the fleet. ``owned`` is what the source
    put there (its last good set); ``leaving`` the instances it is draining away (name -> when
    the drain began); ``waiting`` entries to add once the instance holding their name or URL
    has left."""

    def __init__(self, status: Status, owned: list[Backend] | None = None, *, drain_timeout_s: float = 300.0):
        self.status = status
        self.owned: dict[str, Backend] = {b.name: b for b in owned or ()}
        self.leaving: dict[str, float] = {}
        self.waiting: dict[str, Backend] = {}
        self.drain_timeout_s = drain_timeout_s
        self._sync()

    @property
    def who(self) -> str:
        return self.status.source

    def _note(self) -> dict[str, Any]:
        return {"source": self.status.source, "target": self.status.target}

    def _sync(self) -> None:
        self.status.owned = list(self.owned)
        self.status.leaving = list(self.leaving)
        self.status.waiting = list(self.waiting)

    def plan(self, desired: list[Backend], fleet: fl.Fleet, instances: list[Any]) -> list[Op]:
        """The operations that take the fleet from the last set to ``desired``, validated as a
        whole first: DiscoveryError (nothing planned) when it cannot be applied."""
        want = {b.name: b for b in desired}
        live = {s.name: s for s in instances if fleet.states[s.index] != fl.REMOVED}
        by_url = {s.url: s for s in live.values()}
        ops: list[Op] = []
        going = [n for n, b in self.owned.items() if want.get(n) != b]  # gone, or changed
        for name, b in want.items():
            if self.owned.get(name) == b:
                continue
            holder = live.get(name) or by_url.get(b.url)
            if holder is None:
                ops.append(Op("add", name, b))
            elif holder.name in self.owned or holder.name in self.leaving:
                if holder.name == name and holder.name in self.leaving and holder.url == b.url:
                    ops.append(Op("uncordon", name))  # it came back before it left
                else:
                    ops.append(Op("wait", name, b))  # added once the one it replaces has left
            elif holder.name == name and holder.url == b.url:
                ops.append(Op("adopt", name, b))  # already there (given by --backend, or added by hand)
            else:
                raise DiscoveryError(f"{name} ({b.url}): {holder.name} ({holder.url}) is in the fleet already, "
                                     f"not from this {self.status.source}; remove it first")
        for name in going:
            if name in live and fleet.states[live[name].index] in (fl.ACTIVE, fl.CORDONED):
                ops.append(Op("drain", name))
        # the fleet's own rule, for the set as a whole: someone must be left to take new sessions
        active = {n for n, s in live.items() if fleet.states[s.index] == fl.ACTIVE}
        active -= {op.name for op in ops if op.kind == "drain"}
        active |= {op.name for op in ops if op.kind in ("add", "uncordon")}
        if not active:
            raise DiscoveryError("this change would leave no active instance for new sessions; nothing changed")
        return ops

    async def apply(self, desired: list[Backend], acts: Any) -> int:
        """Plan and perform; returns how many fleet changes were made. DiscoveryError when the
        set is refused (nothing changed), or when the fleet refused one of its operations (an
        add the control API would refuse too: the rest is applied, that entry is not owned and
        is tried again with the next answer that names it). ``acts`` performs the fleet's
        operations (router/fleet_api.Actions: the control API's own add and change)."""
        ops = self.plan(desired, acts.fleet, acts.instances)
        now = time.time()
        made = 0
        want = {b.name: b for b in desired}
        refused: list[str] = []
        # adds first: a drain must never find the fleet without an active instance
        for op in sorted(ops, key=lambda o: o.kind != "add"):
            try:
                if op.kind == "add":
                    await acts.add(_spec(op.backend), self.who, note=self._note())
                    made += 1
                elif op.kind == "uncordon":
                    await acts.change(op.name, "uncordon", self.who, note=self._note())
                    self.leaving.pop(op.name, None)
                    made += 1
                elif op.kind == "drain":
                    await acts.change(op.name, "drain", self.who, note=self._note())
                    self.leaving[op.name] = now
                    made += 1
                elif op.kind == "wait":
                    self.waiting[op.name] = op.backend
            except fl.FleetError as exc:  # the fleet's own refusal (or it changed between plan and act)
                log.warning("%s %s: %s %s refused: %s", self.who, self.status.target, op.kind, op.name, exc.message)
                refused.append(f"{op.kind} {op.name}: {exc.message}")
                if op.kind == "add":
                    want.pop(op.name, None)  # not there: tried again when an answer names it again
        for name in list(self.waiting):  # a name that left the set is not waited for any more
            if name not in want:
                del self.waiting[name]
        self.owned = want
        made += await self.tick(acts)
        self.status.changes_total += made
        if made:
            self.status.changed_at = time.time()
        self._sync()
        if refused:  # applied but for these: shown until an answer applies whole
            raise DiscoveryError("refused by the fleet: " + "; ".join(refused))
        return made

    async def tick(self, acts: Any) -> int:
        """Follow through: remove what finished draining (or drained too long), add what waited."""
        made = 0
        fleet, insts = acts.fleet, acts.instances
        now = time.time()
        for name, since in list(self.leaving.items()):
            s = next((x for x in insts if x.name == name), None)
            state = fleet.states[s.index] if s is not None else fl.REMOVED
            if state != fl.DRAINING:  # removed by hand, or uncordoned by hand: theirs now
                if state != fl.REMOVED:
                    log.warning("%s %s: %s is %s, not draining; left as it is", self.who, self.status.target,
                                name, state)
                del self.leaving[name]
                continue
            force = now - since >= self.drain_timeout_s
            if s.num_requests and not force:
                continue
            try:
                await acts.change(name, "remove", self.who, force=force, note=self._note())
                made += 1
            except fl.FleetError as exc:
                log.warning("%s %s: remove %s refused: %s", self.who, self.status.target, name, exc.message)
                continue
            del self.leaving[name]
        for name, b in list(self.waiting.items()):
            live = [x for x in insts if fleet.states[x.index] != fl.REMOVED and (x.name == name or x.url == b.url)]
            if live:
                continue
            try:
                await acts.add(_spec(b), self.who, note=self._note())
                made += 1
            except fl.FleetError as exc:
                log.warning("%s %s: add %s refused: %s", self.who, self.status.target, name, exc.message)
            del self.waiting[name]
        if made:
            self.status.changes_total += made
            self.status.changed_at = time.time()
        self._sync()
        return made

    def failed(self, why: str) -> None:
        """A refused set: logged once per distinct reason, shown until a good one comes."""
        s = self.status
        s.checked_at = time.time()
        s.errors_total += 1
        if s.ok or s.error != why:
            log.warning("%s %s: %s; the fleet is unchanged", s.source, s.target, why)
        s.ok, s.error = False, why

    def succeeded(self) -> None:
        s = self.status
        if not s.ok:
            log.info("%s %s: good again", s.source, s.target)
        s.ok, s.error, s.checked_at = True, None, time.time()


def _spec(b: Backend) -> str:
    """A Backend back in ``--backend`` syntax (what fleet_api.add takes)."""
    spec = f"{b.name}={b.url}"
    if b.gpu is not None:
        spec += f"@gpu={b.gpu}"
    if b.kv_events:
        spec += f"@kv={b.kv_events}"
    if b.kv_replay:
        spec += f"@kv-replay={b.kv_replay}"
    return spec


# -- running the sources -----------------------------------------------------------------------

class FileSource:
    """``--backends-file PATH``: looked at every FILE_POLL_S (a stat), read when it changed."""

    def __init__(self, path: str):
        self.path = path
        self._seen: tuple | None = None

    def changed(self) -> bool:
        try:
            st = os.stat(self.path)
            key: tuple = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError as exc:
            key = ("missing", exc.errno)
        if key == self._seen:
            return False
        self._seen = key
        return True

    async def run(self, rec: Reconciler, acts: Any) -> None:
        # the first look reads the file again: an edit made since the router read it at start
        # is applied (the same entries are no change)
        while True:
            await asyncio.sleep(FILE_POLL_S)
            if self.changed():
                try:
                    desired = read_backends_file(self.path)
                    await rec.apply(desired, acts)
                except DiscoveryError as exc:
                    rec.failed(str(exc))
                else:
                    rec.succeeded()
            else:
                await rec.tick(acts)


@dataclass
class Discovery:
    """The router's sources: each with its reconciler and the coroutine that runs it."""

    sources: list[tuple[Reconciler, Callable[[], Awaitable[None]]]] = field(default_factory=list)

    def snapshot(self) -> list[dict[str, Any]]:
        return [rec.status.json() for rec, _ in self.sources]


def snapshot(st: RouterState) -> list[dict[str, Any]]:
    """``GET state``'s ``discovery``: one entry per source ([] when there is none)."""
    disc = getattr(st, "discovery", None)
    return disc.snapshot() if disc is not None else []


def metric_families(st: RouterState) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    disc = getattr(st, "discovery", None)
    if disc is None or not disc.sources:
        return
    ok = GaugeMetricFamily("kvtop_discovery_ok", "1 while the discovery source's last answer was applied, "
                           "0 while it is refused (the fleet unchanged; GET state's discovery says why)",
                           labels=["source", "target"])
    errors = CounterMetricFamily("kvtop_discovery_errors_total", "answers of the discovery source refused "
                                 "(unreadable, unparsable, conflicting, or would empty the fleet)",
                                 labels=["source", "target"])
    changes = CounterMetricFamily("kvtop_discovery_changes_total", "fleet changes the discovery source made "
                                  "(adds, drains, removes)", labels=["source", "target"])
    for rec, _ in disc.sources:
        s = rec.status
        ok.add_metric([s.source, s.target], int(s.ok))
        errors.add_metric([s.source, s.target], s.errors_total)
        changes.add_metric([s.source, s.target], s.changes_total)
    yield ok
    yield errors
    yield changes
