"""The fleet's control endpoints and state fields: the shell around router/fleet.py (its
metrics are in router/telemetry.py).

``GET /kvtop/v1/fleet`` lists each instance's fleet state; ``POST /kvtop/v1/fleet`` adds one and
``POST /kvtop/v1/fleet/{instance}/{cordon|drain|uncordon|remove}`` changes one (bearer token),
each audited in ``config_events`` with kind ``fleet``. docs/control-api.md ("Fleet") is the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import asyncio
import logging

from aiohttp import web
from router import discovery
from router import fleet as fl
from router import kv_events, kv_sources
from router.fleet import FleetError
from router.http import dumps, error_response, read_json
from router.backends import parse_backend
from router.request import BadRequest
from router.engine_metrics import InstanceTelemetry
from store.errors import CliError

if TYPE_CHECKING:  # pragma: no cover
    from router.state import RouterState
    from router.telemetry import Telemetry

PREFIX = "/kvtop/v1"
log = logging.getLogger("kvtop.route")


def instance_json(st: RouterState, i: int) -> dict[str, Any]:
    return fl.instance_json(st.router.fleet, st.cluster, i)


async def change(st: RouterState, tel: Telemetry, name: str, action: str, who: str, *, force: bool = False,
                 note: dict[str, Any] | None = None) -> dict[str, Any]:
    """Apply a fleet action to the instance named ``name``; audited when it changes the state
    (``note``, e.g. a discovery source, joins the row's ``after``). Raises FleetError (changing
    nothing). A remove also stops its health probes and KV-event subscriber and forgets what it
    cached."""
    i = fl.index_of([s.name for s in st.cluster.instances], name)
    c = st.router.change_fleet(name, action, force=force)  # the rule, and a remove's forgetting
    if c.changed:
        st.record_config("fleet", who, {"instance": name, "state": c.before},
                         {"instance": name, "state": c.after, "action": action, "force": force, **(note or {})})
    if c.changed and c.after == fl.REMOVED:
        # closed to routing from here; with requests still in flight (a forced remove) their
        # connections are cut: each fails as when a backend drops it, and the retry rules apply
        if st.upstream is not None:
            st.upstream.cut_off(st.cluster.instances[i].url)
        if st.health is not None:
            st.health.stop(i)
        if i < len(tel.instances):
            tel.instances[i].removed = True
        subs = st.kv_subscribers
        if i < len(subs) and subs[i] is not None:
            sub, subs[i] = subs[i], None
            await sub.stop()
    return {"instance": name, "action": action, "before": c.before, "after": c.after, "changed": c.changed,
            **instance_json(st, i)}


async def add(st: RouterState, tel: Telemetry, spec: str, who: str, *, note: dict[str, Any] | None = None) -> dict[str, Any]:
    """Add the instance ``spec`` names, in ``kvtop route --backend`` syntax (``[NAME=]URL[@kv=..]
    [@kv-replay=..][@gpu=N]``), active at once: every per-instance structure grows by one (or a
    removed instance of that name is revived in its place), its health probes, telemetry and
    KV-event subscriber start. Raises FleetError (changing nothing) for a bad spec or a name or
    URL already in the fleet."""
    cl, f = st.cluster, st.router.fleet
    try:
        b = parse_backend(spec, len(cl.instances))
    except CliError as exc:
        raise FleetError(str(exc).replace("--backend ", "backend ", 1), 400) from None
    for s in cl.instances:
        if f.states[s.index] != fl.REMOVED and (s.name == b.name or s.url == b.url):
            raise FleetError(f"{s.name} ({s.url}) is in the fleet already; remove it first to replace it")
    if b.kv_events == kv_sources.AUTO:  # the engine's own announcement (GET /kv_event_sources)
        found = None
        if cl.exact is None:  # nothing to follow them with: served from the estimate, as announced-none
            log.warning("%s %s: @kv=auto on a router that follows no KV events (no --backend had @kv=); "
                        "its hits come from the estimate", b.name, b.url)
        elif st.upstream is not None:
            found = await kv_sources.announced(st.upstream, b.url)
        b.kv_events, b.kv_replay = found if found is not None else (None, None)
        if found is None and cl.exact is not None:
            log.warning("%s %s announces no KV events (GET %s); its hits come from the estimate",
                        b.name, b.url, kv_sources.PATH)
        # the name or URL may have been taken while we asked
        for s in cl.instances:
            if f.states[s.index] != fl.REMOVED and (s.name == b.name or s.url == b.url):
                raise FleetError(f"{s.name} ({s.url}) is in the fleet already; remove it first to replace it")
    if b.kv_events and cl.exact is None:
        raise FleetError("this router follows no KV events (no --backend had @kv=), so it has no exact index "
                         "to add this instance's to; add it without @kv=", 400)
    i = st.router.add_instance(b.name, b.url, capacity_blocks=st.config.capacity_blocks,
                               kv_events=bool(b.kv_events))
    if st.upstream is not None:
        st.upstream.allow(b.url)  # a URL removed before may come back
    _put(st.config.backends, i, b)
    _put(tel.instances, i, InstanceTelemetry(b.name, b.url, b.gpu))
    if st.health is not None:
        st.health.add(i)
    if b.kv_events:
        sub = kv_events.Subscriber(cl.exact, i, b.kv_events, replay_endpoint=b.kv_replay,
                                   resync_tokens=st.config.capacity_tokens)
        await sub.start()
        _put(st.kv_subscribers, i, sub)
    after = {"instance": b.name, "state": fl.ACTIVE, "action": "add", "url": b.url, "gpu": b.gpu,
             "kv_events": b.kv_events, "kv_replay": b.kv_replay, **(note or {})}
    st.record_config("fleet", who, None, after)
    return {"instance": b.name, "action": "add", "before": None, "after": fl.ACTIVE, "changed": True,
            "index": i, **instance_json(st, i)}


def _put(items: list, i: int, value: Any) -> None:
    """items[i] = value, growing the list (with None) when i is past its end."""
    while len(items) <= i:
        items.append(None)
    items[i] = value


def listing(st: RouterState) -> dict[str, Any]:
    out = []
    for s in st.cluster.instances:
        out.append({"name": s.name, "url": s.url, "healthy": s.healthy, "num_requests": s.num_requests,
                    "sessions_homed": fl.sessions_homed(st.cluster, s.index), **instance_json(st, s.index)})
    return {"instances": out, "counts": st.router.fleet.counts()}


# -- handlers ---------------------------------------------------------------------------------------

def setup(app: web.Application, ctl: Any, who: Callable[[web.Request], str]) -> None:
    """Called by router/control.setup with its ``Control`` (auth, read cache) and its ``who``."""
    st = ctl.state

    async def get_fleet(request: web.Request) -> web.Response:
        return web.json_response(listing(st), dumps=dumps)

    async def post_action(request: web.Request) -> web.Response:
        denied = ctl.check_mutation(request)
        if denied is not None:
            return denied
        force = False
        if request.body_exists:
            try:
                body = (await read_json(request, st.config.client_timeout_s))[1]
            except BadRequest as exc:
                return error_response(exc.status, exc.message, param="body")
            if not isinstance(body, dict) or set(body) - {"force"} or not isinstance(body.get("force", False), bool):
                return error_response(400, 'expected no body or a JSON object {"force": true|false}', param="body")
            force = body.get("force", False)
        name, action = request.match_info["instance"], request.match_info["action"]
        try:
            out = await change(st, ctl.tel, name, action, who(request), force=force)
        except fl.FleetError as exc:
            return error_response(exc.status, exc.message, param="action" if exc.status == 400 else "instance")
        ctl.guard.cache.clear()  # a change is visible at once
        return web.json_response(out, dumps=dumps)

    async def post_add(request: web.Request) -> web.Response:
        denied = ctl.check_mutation(request)
        if denied is not None:
            return denied
        try:
            body = (await read_json(request, st.config.client_timeout_s))[1]
        except BadRequest as exc:
            return error_response(exc.status, exc.message, param="body")
        if not isinstance(body, dict) or set(body) != {"backend"} or not isinstance(body["backend"], str):
            return error_response(400, 'expected a JSON object {"backend": "[NAME=]URL[@kv=tcp://HOST:PORT]'
                                       '[@kv-replay=...][@gpu=N]"}, as kvtop route --backend takes', param="body")
        try:
            out = await add(st, ctl.tel, body["backend"], who(request))
        except fl.FleetError as exc:
            return error_response(exc.status, exc.message, param="backend")
        ctl.guard.cache.clear()
        return web.json_response(out, dumps=dumps)

    app.router.add_get(PREFIX + "/fleet", get_fleet)
    app.router.add_post(PREFIX + "/fleet", post_add)
    app.router.add_post(PREFIX + "/fleet/{instance}/{action}", post_action)
    setup_discovery(app, ctl)


# -- discovery: the watched file and DNS names, through the same operations (docs/fleet.md) ------

class Actions:
    """What a discovery source's reconciler (router/discovery.py) may do: this module's add and
    change, on this router."""

    def __init__(self, st: RouterState, tel: Telemetry):
        self.st, self.tel = st, tel

    @property
    def fleet(self) -> fl.Fleet:
        return self.st.router.fleet

    @property
    def instances(self) -> list[Any]:
        return self.st.cluster.instances

    async def add(self, spec: str, who: str, *, note: dict[str, Any] | None = None) -> dict[str, Any]:
        return await add(self.st, self.tel, spec, who, note=note)

    async def change(self, name: str, action: str, who: str, *, force: bool = False,
                     note: dict[str, Any] | None = None) -> dict[str, Any]:
        return await change(self.st, self.tel, name, action, who, force=force, note=note)


def setup_discovery(app: web.Application, ctl: Any) -> None:
    """The configured discovery sources, each a supervised task started and stopped with the app."""
    st = ctl.state
    cfg = st.config
    disc = discovery.Discovery()
    st.discovery = disc
    acts = Actions(st, ctl.tel)
    owned = cfg.discovered or {}
    if cfg.backends_file:
        fsrc = discovery.FileSource(cfg.backends_file)
        rec = discovery.Reconciler(discovery.Status("file", cfg.backends_file), owned.get("file", []),
                                   drain_timeout_s=cfg.discovery_drain_timeout_s)
        disc.sources.append((rec, lambda: fsrc.run(rec, acts)))
    if cfg.backend_dns or cfg.backend_srv:
        from router import discovery_dns

        disc.sources += discovery_dns.sources(cfg, acts, owned)
    if not disc.sources:
        return

    async def lifecycle(_app: web.Application):
        tasks = [st.supervisor.spawn(f"discovery-{rec.status.source}-{k}", run, kind="discovery",
                                     fallback="restarted; the fleet stays as it is meanwhile")
                 for k, (rec, run) in enumerate(disc.sources)]
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    app.cleanup_ctx.append(lifecycle)
