"""The control API under ``/kvtop/v1/``: state, events, policies, sessions, decisions.

Reads are open; mutations (``PUT policy``, ``PATCH knobs``) need ``Authorization: Bearer
<token>``. The token comes from ``--control-token-file``, else ``KVTOP_CONTROL_TOKEN``, else
is generated at start and written 0600 to ``<state_dir>/router-<port>.token`` next to a
``router-<port>.json`` that ``kvtop attach`` reads; both are removed at shutdown.
docs/control-api.md is the reference for every body and event.
"""

from __future__ import annotations

import hmac
import json
import heapq
import os
import secrets
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from aiohttp import web

from router import discovery, fleet, fleet_api, kv_wiring, session_metrics, telemetry
from router.backlog import instance_backlog
from router.http import dumps, error_response, read_json
from router.state import STATE, RouterState
from router.config import KnobError
from router.features import FEATURE_KNOBS
from router.events import (DECISIONS_DEFAULT, DECISIONS_MAX, DEFAULT_TYPES, EVENT_TYPES, HZ_DEFAULT,
                           HZ_MAX, HZ_MIN, Broadcaster, Viewer)
from router.policies import POLICIES, policy_class
from router.shadow import ShadowError
from router.request import BadRequest
from router.control_reads import GUARD, BadParam, ReadGuard, bad_params, float_param, guarded_read, int_param

log = logging.getLogger("kvtop.route")

SCHEMA_VERSION = 1
PREFIX = "/kvtop/v1"
TOKEN_ENV = "KVTOP_CONTROL_TOKEN"
USER_HEADER = "X-Kvtop-User"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
SESSION_SORTS = ("last_seen", "turns", "tokens", "moves", "completion")


class Control:
    """Auth, discovery files and the state snapshot of one router."""

    def __init__(self, state: RouterState, tel: telemetry.Telemetry):
        self.state = state
        self.tel = tel
        cfg = state.config
        self.token, self.token_source = self._resolve_token()
        self.state_dir = Path(cfg.state_dir or Path.home() / ".local" / "state" / "kvtop").expanduser()
        self.token_path: Path | None = Path(cfg.control_token_file) if cfg.control_token_file else None
        self.written: list[Path] = []
        self.broadcaster = Broadcaster(self.snapshot)
        self.guard = ReadGuard(state)

    def _resolve_token(self) -> tuple[str, str]:
        cfg = self.state.config
        if cfg.control_token:
            return cfg.control_token, "config"
        if cfg.control_token_file:
            path = Path(cfg.control_token_file).expanduser()
            try:
                mode = path.stat().st_mode
                if mode & 0o077:
                    raise ValueError(f"--control-token-file {cfg.control_token_file} can be read by other "
                                     f"users (mode {mode & 0o777:o}); run chmod 600 on it")
                token = path.read_text().strip()
            except OSError as exc:
                raise ValueError(f"--control-token-file {cfg.control_token_file}: {exc.strerror or exc}") from None
            if not token:
                raise ValueError(f"--control-token-file {cfg.control_token_file} is empty")
            return token, "file"
        env = os.environ.get(TOKEN_ENV, "").strip()
        if env:
            return env, "env"
        return secrets.token_urlsafe(32), "generated"

    # -- discovery files -----------------------------------------------------------------
    @property
    def url(self) -> str:
        cfg = self.state.config
        host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
        return f"{'https' if cfg.tls_cert else 'http'}://{host}:{cfg.port}"

    def write_files(self) -> None:
        port = self.state.config.port
        self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.token_source == "generated":
            self.token_path = self.state_dir / f"router-{port}.token"
            _write_private(self.token_path, self.token + "\n")
            self.written.append(self.token_path)
        info = {"url": self.url, "pid": os.getpid(), "run_id": self.state.run_id,
                "token_file": str(self.token_path.resolve()) if self.token_path else None,
                "token_source": self.token_source, "readonly": self.state.config.control_readonly,
                "started_at": self.state.started_at, "api": PREFIX + "/"}
        info_path = self.state_dir / f"router-{port}.json"
        _write_private(info_path, json.dumps(info, indent=2) + "\n")
        self.written.append(info_path)

    def remove_files(self) -> None:
        for p in self.written:
            try:
                p.unlink()
            except OSError:
                pass
        self.written.clear()

    # -- auth ----------------------------------------------------------------------------
    def check_mutation(self, request: web.Request) -> web.Response | None:
        if self.state.config.control_readonly:
            return error_response(403, "this router was started with --control-readonly; "
                                       "policy and knob changes are refused")
        auth = request.headers.get("Authorization", "")
        scheme, _, given = auth.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return error_response(401, "this call changes the router: send Authorization: Bearer <token> "
                                       "(the token is in the file named by router-<port>.json in the state dir)",
                                  headers={"WWW-Authenticate": 'Bearer realm="kvtop"'})
        # a header byte past ASCII arrives as a surrogate (aiohttp decodes with surrogateescape):
        # encoded back as it came, it compares unequal instead of raising
        if not hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"),
                                   self.token.encode("utf-8", "surrogateescape")):
            return error_response(401, "the bearer token is not valid for this router",
                                  headers={"WWW-Authenticate": 'Bearer realm="kvtop", error="invalid_token"'})
        return None

    # -- the state snapshot --------------------------------------------------------------
    def affinity(self, now: float) -> dict[str, Any]:
        """Sessions held per instance and moves: counts the cluster keeps as sessions come,
        move and go (no walk over them), and how many of them the lookahead may price."""
        cl = self.state.cluster
        return {"sessions": len(cl.sessions), "per_instance": {i.name: i.sessions for i in cl.instances},
                "moves": cl.session_moves, "moved_sessions": cl.moved_sessions,
                "lookahead_sessions": cl.lookahead_held(), "max_sessions": cl.max_sessions,
                "computed_at": now}

    def snapshot(self) -> dict[str, Any]:
        st = self.state
        cfg = st.config
        now = time.time()
        tps = cfg.assumed_prefill_tps
        slot = st.slot
        instances = []
        tot = {"num_requests": 0, "pending_prefill_tokens": 0, "decode_requests": 0, "decode_tokens": 0,
               "routed_total": 0, "input_tokens_total": 0, "est_hit_tokens_total": 0, "errors_total": 0,
               "request_rate": 0.0, "healthy_instances": 0}
        backlog_total = 0.0
        for i, s in enumerate(st.cluster.instances):
            it = self.tel.instances[i]
            rates = self.tel.instance_rates(i, now)
            # backlog seconds at the rate a backlog drains at on it (router/backlog.py: drain,
            # fleet, measured or assumed, as "backlog_source" says), its head's prefill so far off
            backlog = instance_backlog(st.cluster, i, tps, st.cluster.clock())
            backlog_s = backlog["backlog_s"]
            backlog_total += backlog_s or 0.0
            errors = {"requests_total": s.errors_total, "scrape": it.scrape_error,
                      "scrape_total": it.scrape_errors_total, "gpu": it.gpu_error}
            instances.append({
                "name": s.name, "url": s.url, "healthy": s.healthy,
                "num_requests": s.num_requests, "pending_prefill_tokens": s.pending_prefill_tokens,
                **backlog,  # backlog_s, backlog_source, backlog_prefill_tps
                "decode_requests": s.decode_requests, "decode_tokens": s.ongoing_decode_tokens,
                "ongoing_tokens": s.ongoing_tokens, "routed_total": s.routed_total,
                "input_tokens_total": s.input_tokens_total, "est_hit_tokens_total": s.est_hit_tokens_total,
                "est_hit_rate": s.est_hit_tokens_total / s.input_tokens_total if s.input_tokens_total else None,
                "est_hit_rate_recent": rates["est_hit_rate_recent"], "request_rate": rates["request_rate"],
                "engine": it.engine_json(now), "gpu": it.gpu_json(), "errors": errors,
                "health": st.health.instance_json(i) if st.health is not None else None,
                "index_source": st.cluster.index_source(i),
                "kv_events": kv_wiring.instance_json(st.cluster, st.kv_subscribers, i),
                # measured prefill rate (router/calibration.py): tokens/s or None, and its sample count
                **st.cluster.calibration.snapshot(i),
                **fleet.instance_json(st.router.fleet, st.cluster, i),  # fleet_state, drain (router/fleet.py)
            })
            for k in ("num_requests", "pending_prefill_tokens", "decode_requests", "routed_total",
                      "input_tokens_total", "est_hit_tokens_total", "errors_total"):
                tot[k] += getattr(s, k)
            tot["decode_tokens"] += s.ongoing_decode_tokens
            tot["request_rate"] += rates["request_rate"] or 0.0
            tot["healthy_instances"] += s.healthy
        tot["est_hit_rate"] = tot["est_hit_tokens_total"] / tot["input_tokens_total"] if tot["input_tokens_total"] else None
        tot["backlog_s"] = backlog_total  # the instances' own backlog seconds, added up
        tot["in_flight"] = st.cluster.in_flight
        m = self.tel.metrics
        return {
            "schema_version": SCHEMA_VERSION, "ts": now,
            "router": {"url": self.url, "uptime_s": now - st.started_at, "started_at": st.started_at,
                       "run_id": st.run_id, "policy": slot.label, "policy_name": slot.policy.name,
                       "policy_version": slot.version, "knobs": dict(slot.policy.knobs),
                       "features": dict(st.features.knobs), "db": cfg.db,
                       "readonly": cfg.control_readonly, "draining": st.draining,
                       "assumed_prefill_tps": tps, "block_size": cfg.block_size,
                       "viewers": len(self.broadcaster.viewers),
                       "decision_log": st.writer.health() if st.writer is not None else None,
                       "tokenizer": cfg.tokenizer, "token_warning": token_warning(st)},
            # background work down or dead lately (router/supervise.py) and a decision log
            # losing rows: empty when all is well; the dashboard's header shows it
            "degraded": st.degraded(), "tasks": st.supervisor.snapshot(),
            "instances": instances, "totals": tot, "affinity": self.affinity(now),
            "discovery": discovery.snapshot(st),  # the watched file and DNS names (router/discovery.py)
            "requests": dict(st.counts), "decisions_by_reason": dict(m.reasons),
            # exact hits need KV events and the engine's tokens: how many decisions had both
            "decisions_by_index_source": _by_first(m.sources),
            "decisions_by_token_source": _by_second(m.sources),
            "outcomes_by_status": dict(st.outcome_counts),
            "shadows": st.shadows.summary(),
            "replicas": st.replicas.snapshot() if st.replicas is not None else None,  # router/replicas.py
            "hit_tokens": {"input": m.input_tokens, "estimated": m.est_hit_tokens, "best": m.best_hit_tokens,
                           "delivered": m.delivered_hit_tokens},
        }


def token_warning(st: RouterState) -> str | None:
    """Why KV events that flow cannot make text prompts exact, or None when they can."""
    followed = [b.name for b in st.config.backends if getattr(b, "kv_events", None)]
    if not followed or st.tokenizer is not None:
        return None
    return (f"KV events are followed ({', '.join(followed)}) but there is no --tokenizer: text and chat "
            f"prompts are counted from a 4-characters-a-token approximation that cannot match the "
            f"engines' token ids, so their hits come from the estimate (index_source=estimate, "
            f"token_source=text_approx); pass --tokenizer with the model's tokenizer to make them exact")


def _by_first(pairs: dict[tuple[str, str], int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for (a, _), n in pairs.items():
        out[a] = out.get(a, 0) + n
    return out


def _by_second(pairs: dict[tuple[str, str], int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for (_, b), n in pairs.items():
        out[b] = out.get(b, 0) + n
    return out


def _write_private(path: Path, text: str) -> None:
    """Write a file that only the owner can read, created with 0600 (never world-readable)."""
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


CONTROL = web.AppKey("control", Control)


# -- handlers ---------------------------------------------------------------------------------

@guarded_read
async def get_state(request: web.Request) -> web.Response:
    return web.json_response(request.app[CONTROL].snapshot(), dumps=_dumps)


_dumps = dumps


@bad_params
async def get_events(request: web.Request) -> web.StreamResponse:
    ctl = request.app[CONTROL]
    hz = float_param(request, "hz", HZ_DEFAULT, HZ_MIN, HZ_MAX)
    rate = float_param(request, "decisions", DECISIONS_DEFAULT, 0.0, DECISIONS_MAX)
    types = DEFAULT_TYPES
    raw = request.query.get("types")
    if raw:
        asked = frozenset(t.strip() for t in raw.split(",") if t.strip())
        unknown = sorted(asked - set(EVENT_TYPES))
        if unknown:
            raise BadParam("types", f"unknown event type(s) {', '.join(unknown)}; "
                                     f"allowed: {', '.join(EVENT_TYPES)}")
        types = asked
    if ctl.broadcaster.closing:
        return error_response(503, "the router is shutting down")
    limit = request.app[STATE].config.max_viewers
    if limit and len(ctl.broadcaster.viewers) >= limit:
        return error_response(503, f"the router already serves {limit} event-stream viewers (--max-viewers); "
                                   "retry later", headers={"Retry-After": "5"})
    viewer = Viewer(types, hz, rate, ctl.broadcaster.buffer)
    return await ctl.broadcaster.stream(request, viewer)


@guarded_read
async def get_policies(request: web.Request) -> web.Response:
    slot = request.app[STATE].slot
    out = []
    for name in sorted(POLICIES):
        d = POLICIES[name].describe()
        d["current"] = name == slot.policy.name
        out.append(d)
    features = request.app[STATE].features
    return web.json_response({"current": {"name": slot.policy.name, "version": slot.version,
                                          "policy": slot.label, "knobs": slot.policy.knobs,
                                          "features": features.knobs},
                              "policies": out,
                              # router-level knobs (offload, admission): valid with every policy
                              "features": FEATURE_KNOBS.to_json()}, dumps=_dumps)


async def _json_body(request: web.Request) -> Any:
    try:
        return (await read_json(request, request.app[STATE].config.client_timeout_s))[1]
    except BadRequest as exc:
        raise BadParam("body", exc.message, status=exc.status) from None


def _json_knob_types(name: str | None, knobs: Any, current: str) -> None:
    """The control API takes knobs as JSON values: a number or a boolean given as a string
    (``"1.5"``) is a 400, though the CLI's ``key=value`` parses the same text (router/config.py
    ``Knob.coerce`` accepts both). Unknown names are left to the full validation."""
    if not isinstance(knobs, dict):
        return
    try:
        schema = policy_class(name or current).schema
    except KnobError:
        return  # an unknown policy: the full validation names it
    for k, v in knobs.items():
        knob = schema.get(k) or FEATURE_KNOBS.get(k)
        if knob is not None and knob.type is not str and isinstance(v, str):
            want = "true or false" if knob.type is bool else f"a JSON number ({knob.describe_range()})"
            raise KnobError(k, f"expected {want}, got the string {v!r}")


def _who(request: web.Request) -> str:
    who = request.headers.get(USER_HEADER, "").strip()
    return "".join(ch for ch in who if ch.isprintable())[:64] or "api"


def _swap_response(slot, features) -> web.Response:
    return web.json_response({"policy": slot.label, "name": slot.policy.name, "version": slot.version,
                              "knobs": slot.policy.knobs, "features": features.knobs}, dumps=_dumps)


@bad_params
async def put_policy(request: web.Request) -> web.Response:
    ctl = request.app[CONTROL]
    denied = ctl.check_mutation(request)
    if denied is not None:
        return denied
    body = await _json_body(request)
    if not isinstance(body, dict):
        raise BadParam("body", 'expected a JSON object {"name": POLICY, "knobs": {...}}')
    extra = sorted(set(body) - {"name", "knobs"})
    if extra:
        raise BadParam(extra[0], f"unknown field {extra[0]!r}; allowed fields: name, knobs")
    name = body.get("name")
    if not isinstance(name, str) or not name:
        raise BadParam("name", "name must be a policy name; known: " + ", ".join(sorted(POLICIES)))
    knobs = body.get("knobs", {})
    if knobs is None:
        knobs = {}
    try:
        policy_class(name)
        _json_knob_types(name, knobs, request.app[STATE].slot.policy.name)
        slot = request.app[STATE].set_policy(name, knobs, _who(request))
    except KnobError as exc:
        param = "name" if exc.field == "policy" else exc.field
        prefix = "" if param in ("name", "knobs") else "knobs."
        return error_response(400, f"{prefix}{param}: {exc.message}", param=param)
    request.app[CONTROL].guard.cache.clear()  # a change is visible at once
    return _swap_response(slot, request.app[STATE].features)


@bad_params
async def patch_knobs(request: web.Request) -> web.Response:
    ctl = request.app[CONTROL]
    denied = ctl.check_mutation(request)
    if denied is not None:
        return denied
    body = await _json_body(request)
    if not isinstance(body, dict):
        raise BadParam("body", "expected a JSON object of knob names to values")
    try:
        _json_knob_types(None, body, request.app[STATE].slot.policy.name)
        slot = request.app[STATE].set_policy(None, body, _who(request), merge=True)
    except KnobError as exc:
        return error_response(400, f"{exc.field}: {exc.message}", param=exc.field)
    request.app[CONTROL].guard.cache.clear()  # a change is visible at once
    return _swap_response(slot, request.app[STATE].features)


@guarded_read
async def get_shadows(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].shadows.summary(), dumps=_dumps)


@bad_params
async def put_shadows(request: web.Request) -> web.Response:
    """Replace the shadow policies: {"policies": ["leastwork", {"policy": P, "knobs": {...}}]}
    ([] turns shadowing off). A shadow kept with the same knobs keeps its counts."""
    ctl = request.app[CONTROL]
    denied = ctl.check_mutation(request)
    if denied is not None:
        return denied
    body = await _json_body(request)
    if not isinstance(body, dict) or set(body) != {"policies"}:
        raise BadParam("body", 'expected a JSON object {"policies": [NAME or {"policy": NAME, "knobs": {...}}]}')
    specs = body["policies"]
    if not isinstance(specs, list):  # the CLI's "a,b" form is for --shadow, not this API
        raise BadParam("policies", 'policies must be a list of policy names or {"policy": NAME, '
                                    f'"knobs": {{...}}}} objects ([] for none), got {type(specs).__name__}')
    try:
        for s in specs:
            if isinstance(s, dict) and isinstance(s.get("policy"), str):
                _json_knob_types(s["policy"], s.get("knobs"), s["policy"])
    except KnobError as exc:
        return error_response(400, f"policies: {exc.field}: {exc.message}", param="policies")
    try:
        summary = request.app[STATE].set_shadows(specs, _who(request))
    except ShadowError as exc:
        return error_response(400, str(exc), param="policies")
    ctl.guard.cache.clear()
    return web.json_response(summary, dumps=_dumps)


async def get_auth(request: web.Request) -> web.Response:
    """Check a token without changing anything: 200 if this caller may mutate, else 401/403."""
    denied = request.app[CONTROL].check_mutation(request)
    if denied is not None:
        return denied
    return web.json_response({"ok": True, "readonly": False})


@guarded_read
@bad_params
async def get_sessions(request: web.Request) -> web.Response:
    st = request.app[STATE]
    limit = int_param(request, "limit", 50, 1, 10_000)
    sort = request.query.get("sort", "last_seen")
    if sort not in SESSION_SORTS:
        raise BadParam("sort", f"sort must be one of {', '.join(SESSION_SORTS)}, got {sort!r}")
    names = [s.name for s in st.cluster.instances]
    only = request.query.get("instance")
    if only is not None and only not in names:
        raise BadParam("instance", f"unknown instance {only!r}; known: {', '.join(names)}")
    now = st.cluster.clock()
    key = {"last_seen": lambda s: s.last_seen, "turns": lambda s: s.turns,
           "tokens": lambda s: s.total_input_tokens, "moves": lambda s: s.moves,
           "completion": lambda s: (now if s.in_flight > 0 else max(s.last_done, s.last_seen)) - s.first_seen}[sort]
    sessions = st.cluster.sessions.values()
    if only is not None:
        idx = names.index(only)
        sessions = [s for s in sessions if s.instance == idx]
    top = heapq.nlargest(limit, sessions, key=key)
    rows = [{"session": s.session_id, "instance": names[s.instance], "turns": s.turns,
             "tokens": s.total_input_tokens, "last_input_tokens": s.last_input_tokens,
             "last_est_hit_tokens": s.last_est_hit_tokens,
             "est_hit_rate": s.last_est_hit_tokens / s.last_input_tokens if s.last_input_tokens else None,
             "first_seen": s.first_seen, "last_seen": s.last_seen, "idle_s": now - s.last_seen,
             "bound_since": s.bound_since, "bound_for_s": now - s.bound_since, "moves": s.moves,
             **session_metrics.row(s, now)}
            for s in top]
    return web.json_response({"total": len(st.cluster.sessions), "sort": sort, "sessions": rows,
                              "summary": session_metrics.summary(st.cluster.sessions.values(), now)},
                             dumps=_dumps)


@guarded_read
@bad_params
async def get_decisions(request: web.Request) -> web.Response:
    st = request.app[STATE]
    limit = int_param(request, "limit", 100, 1, max(1, st.ring.maxlen or 1))
    filters = {k: request.query[k] for k in ("reason", "instance", "session") if k in request.query}
    out = []
    for ev in reversed(st.ring):
        if all(ev.get(k) == v for k, v in filters.items()):
            out.append(ev)
            if len(out) >= limit:
                break
    return web.json_response({"decisions": out, "ring_size": len(st.ring)}, dumps=_dumps)


# -- assembly ---------------------------------------------------------------------------------

def setup(app: web.Application) -> None:
    """Called by create_app: telemetry, /metrics, the control routes and their lifecycle."""
    state = app[STATE]
    tel = telemetry.setup(app, state)
    ctl = Control(state, tel)  # raises ValueError for a missing or empty token file
    app[CONTROL] = ctl
    app[GUARD] = ctl.guard
    state.listeners.append(ctl.broadcaster)
    r = app.router
    r.add_get(PREFIX + "/state", get_state)
    r.add_get(PREFIX + "/events", get_events)
    r.add_get(PREFIX + "/policies", get_policies)
    r.add_put(PREFIX + "/policy", put_policy)
    r.add_patch(PREFIX + "/knobs", patch_knobs)
    r.add_get(PREFIX + "/auth", get_auth)
    r.add_get(PREFIX + "/shadows", get_shadows)
    r.add_put(PREFIX + "/shadows", put_shadows)
    r.add_get(PREFIX + "/sessions", get_sessions)
    r.add_get(PREFIX + "/decisions", get_decisions)
    fleet_api.setup(app, ctl, _who)
    app.cleanup_ctx.append(_lifecycle)
    app.on_shutdown.append(_close_streams)


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    ctl = app[CONTROL]
    cfg = ctl.state.config
    try:
        ctl.write_files()
    except OSError as exc:  # attach discovery is a convenience; the router still serves
        log.warning("cannot write to state dir %s: %s", ctl.state_dir, exc)
    where = {"generated": f"written to {ctl.token_path}", "file": f"from {ctl.token_path}",
             "env": f"from ${TOKEN_ENV}", "config": "from the config"}[ctl.token_source]
    mode = "read-only (every mutation refused)" if cfg.control_readonly else f"control token {where}"
    log.info("control API %s/ %s", PREFIX, mode)
    if cfg.host not in LOOPBACK:
        log.warning(f"the control API is reachable beyond loopback on {cfg.host}: "
              "reads (state, events, sessions, decisions) need no token; mutations need the bearer token, "
                    "sent in clear over plain HTTP unless --tls-cert is set")
    try:
        yield
    finally:
        ctl.remove_files()


async def _close_streams(app: web.Application) -> None:
    await app[CONTROL].broadcaster.close()
