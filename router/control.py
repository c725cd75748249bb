"""The control API under ``/kvtop/v1/``: state, events, policies, sessions, decisions.

Reads are open; mutations (``PUT policy``, ``PATCH knobs``) need ``Authorization: Bearer
<token>``. The token comes from ``--control-token-file``, else ``KVTOP_CONTROL_TOKEN``, else
is generated at start and written 0600 to ``<state_dir>/router-<port>.token`` next to a
``router-<port>.json`` that ``kvtop attach`` reads; both are removed at shutdown.
docs/control-api.md is the reference for every body and event.
"""

from __future__ import annotations

import asyncio
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

from router import fleet, fleet_api, kv_events, telemetry
from router.http import dumps, error_response, read_json
from router.state import STATE, RouterState
from router.config import KnobError
from router.features import FEATURE_KNOBS
from router.events import (DECISIONS_DEFAULT, DECISIONS_MAX, DEFAULT_TYPES, EVENT_TYPES, HZ_DEFAULT,
                           HZ_MAX, HZ_MIN, Broadcaster, Viewer)
from router.policies import POLICIES, policy_class
from router.shadow import ShadowError
from router.request import BadRequest

log = logging.getLogger("kvtop.route")

SCHEMA_VERSION = 1
PREFIX = "/kvtop/v1"
TOKEN_ENV = "KVTOP_CONTROL_TOKEN"
USER_HEADER = "X-Kvtop-User"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
SESSION_SORTS = ("last_seen", "turns", "tokens", "moves")


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
        cal = st.cluster.calibration
        backlog_total = 0.0
        for i, s in enumerate(st.cluster.instances):
            it = self.tel.instances[i]
            rates = self.tel.instance_rates(i, now)
            # backlog seconds at the prefill rate the router measures (router/calibration.py:
            # the instance's own first tokens, shrunk toward the fleet's while it has few),
            # the assumed rate only before any instance has a sample; "backlog_source" says which
            if cal.measured:
                rate, source = cal.tps(i), ("measured" if cal.samples(i) else "fleet")
            else:
                rate, source = tps, "assumed"
            backlog_s = s.pending_prefill_tokens / rate if rate > 0 else None
            backlog_total += backlog_s or 0.0
            errors = {"requests_total": s.errors_total, "scrape": it.scrape_error,
                      "scrape_total": it.scrape_errors_total, "gpu": it.gpu_error}
            instances.append({
                "name": s.name, "url": s.url, "healthy": s.healthy,
                "num_requests": s.num_requests, "pending_prefill_tokens": s.pending_prefill_tokens,
                "backlog_s": backlog_s, "backlog_source": source,
                "backlog_prefill_tps": round(rate, 1) if rate > 0 else None,
                "decode_requests": s.decode_requests, "decode_tokens": s.ongoing_decode_tokens,
                "ongoing_tokens": s.ongoing_tokens, "routed_total": s.routed_total,
                "input_tokens_total": s.input_tokens_total, "est_hit_tokens_total": s.est_hit_tokens_total,
                "est_hit_rate": s.est_hit_tokens_total / s.input_tokens_total if s.input_tokens_total else None,
                "est_hit_rate_recent": rates["est_hit_rate_recent"], "request_rate": rates["request_rate"],
                "engine": it.engine_json(now), "gpu": it.gpu_json(), "errors": errors,
                "health": st.health.instance_json(i) if st.health is not None else None,
                "index_source": st.cluster.index_source(i),
                "kv_events": kv_events.instance_json(st.cluster, st.kv_subscribers, i),
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


def token_warning(st) -> str | None:
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

def _int_param(request: web.Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise _BadParam(name, f"{name} must be an integer in [{lo}, {hi}], got {raw!r}") from None
    if not lo <= value <= hi:
        raise _BadParam(name, f"{name} must be an integer in [{lo}, {hi}], got {value}")
    return value


def _float_param(request: web.Request, name: str, default: float, lo: float, hi: float) -> float:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not lo <= value <= hi:  # NaN fails too
        raise _BadParam(name, f"{name} must be a number in [{lo:g}, {hi:g}], got {raw!r}")
    return value


class _BadParam(Exception):
    def __init__(self, param: str, message: str, status: int = 400):
        super().__init__(message)
        self.param = param
        self.message = message
        self.status = status


def _bad_params(handler):
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except _BadParam as exc:
            msg = exc.message if exc.message.startswith(exc.param) else f"{exc.param}: {exc.message}"
            resp = error_response(exc.status, msg, param=exc.param)
            if exc.status in (408, 413):  # the body is unread: close behind the answer
                resp.force_close()
            return resp
    wrapped.__name__ = handler.__name__
    return wrapped


#: Control reads while requests are in flight come from a snapshot at most this old, shared
#: by every client asking the same question (a read never costs the data plane twice).
READ_SNAPSHOT_S = 0.25
#: Per client address: control reads per second, the burst allowed above it, and how long a
#: read over the rate may wait for its turn before it is refused (a client reading in a loop
#: is slowed to the rate instead of spinning on fast 429s).
READ_RATE, READ_BURST, READ_MAX_WAIT_S = 50.0, 100.0, 2.0
_MAX_CLIENTS = 4096  # rate-limit buckets kept (oldest forgotten first)
#: While requests are in flight, control reads from every client together take at most this
#: share of the event loop (their handler time, plus their answer's bytes at WRITE_S_PER_BYTE
#: and READ_OVERHEAD_S each), with READ_WORK_BURST_S of work allowed above it: four clients
#: reading ``decisions?limit=2000`` in a loop cost the data plane 27% of its throughput before
#: (issue 36). A read over the share waits its turn (READ_MAX_WAIT_S at most, then 429).
READ_LOOP_SHARE = 0.05
READ_WORK_BURST_S = 0.05
READ_OVERHEAD_S = 0.0003
WRITE_S_PER_BYTE = 2e-9


class ReadGuard:
    """Fairness between planes: a token bucket per client address, and shared snapshots of
    read answers while the data plane is busy."""

    def __init__(self, state: RouterState):
        self.state = state
        self.buckets: dict[str, tuple[float, float]] = {}  # address -> (tokens, last refill)
        self.cache: dict[str, tuple[float, bytes]] = {}  # path?query -> (made at, body)
        self.refused = 0
        self.served_from_snapshot = 0
        self.work = READ_WORK_BURST_S  # seconds of loop work control reads may still take now
        self.work_at: float | None = None
        self.cost: dict[str, float] = {}  # path?query -> what its last read cost (an estimate)
        self.paced_s = 0.0  # total time reads waited for the loop share

    def work_turn(self, key: str, now: float) -> float | None:
        """Reserve this read's estimated cost against READ_LOOP_SHARE: seconds it waits for
        its turn (0: at once), or None: refuse it (the wait would pass READ_MAX_WAIT_S)."""
        last = self.work_at if self.work_at is not None else now
        self.work_at = now
        self.work = min(READ_WORK_BURST_S, self.work + (now - last) * READ_LOOP_SHARE)
        guess = self.cost.get(key, READ_OVERHEAD_S)
        wait = max(0.0, guess - self.work) / READ_LOOP_SHARE
        if wait > READ_MAX_WAIT_S:
            self.refused += 1
            return None
        self.work -= guess
        self.paced_s += wait
        return wait

    def spent(self, key: str, guess: float, cost: float) -> None:
        """The read's measured cost replaces the guess made at its turn."""
        self.work -= cost - guess
        if len(self.cost) > 256:
            self.cost.clear()
        self.cost[key] = cost

    def turn(self, who: str, now: float) -> float | None:
        """Seconds this read waits for its turn (0: at once), or None: refuse it. Tokens may go
        negative: each waiting read holds its place in the client's line."""
        tokens, last = self.buckets.pop(who, (READ_BURST, now))
        tokens = min(READ_BURST, tokens + (now - last) * READ_RATE) - 1.0
        wait = -tokens / READ_RATE if tokens < 0 else 0.0
        if wait > READ_MAX_WAIT_S:
            tokens += 1.0  # refused: it takes no place
            self.refused += 1
            self.buckets[who] = (tokens, now)
            return None
        self.buckets[who] = (tokens, now)  # re-inserted: newest last
        if len(self.buckets) > _MAX_CLIENTS:
            del self.buckets[next(iter(self.buckets))]
        return wait

    def cached(self, key: str, now: float) -> bytes | None:
        hit = self.cache.get(key)
        if hit is not None and now - hit[0] < READ_SNAPSHOT_S and self.state.cluster.in_flight:
            self.served_from_snapshot += 1
            return hit[1]
        return None

    def keep(self, key: str, now: float, body: bytes) -> None:
        if len(self.cache) > 256:  # distinct queries are few; a client inventing them gets no cache
            self.cache.clear()
        self.cache[key] = (now, body)


def _guarded_read(handler):
    """A control read: rate-limited per client, answered from a shared snapshot when busy."""
    async def wrapped(request: web.Request) -> web.StreamResponse:
        guard: ReadGuard = request.app[CONTROL].guard
        now = time.monotonic()
        wait = guard.turn(request.remote or "?", now)
        if wait is None:
            return error_response(429, f"more than {READ_RATE:g} control reads per second from this client; "
                                       "use GET /kvtop/v1/events for a live view", headers={"Retry-After": "1"})
        if wait:
            await asyncio.sleep(wait)
            now = time.monotonic()
        key = request.path_qs
        busy = request.app[STATE].cluster.in_flight > 0  # an idle router answers reads at once
        guess = guard.cost.get(key, READ_OVERHEAD_S)
        if busy:
            pace = guard.work_turn(key, now)
            if pace is None:
                return error_response(429, "control reads are taking more than their share of the router "
                                           "while it serves requests; use GET /kvtop/v1/events for a live view",
                                      headers={"Retry-After": "1"})
            if pace:
                await asyncio.sleep(pace)
                now = time.monotonic()
        t0 = time.perf_counter()
        body = guard.cached(key, now)
        if body is not None:
            resp = web.Response(body=body, content_type="application/json")
        else:
            resp = await handler(request)
            if resp.status == 200 and isinstance(resp.body, bytes):
                guard.keep(key, now, resp.body)
        if busy:
            size = len(resp.body) if isinstance(resp.body, bytes) else 0
            guard.spent(key, guess, time.perf_counter() - t0 + READ_OVERHEAD_S + size * WRITE_S_PER_BYTE)
        return resp
    wrapped.__name__ = handler.__name__
    return wrapped


@_guarded_read
async def get_state(request: web.Request) -> web.Response:
    return web.json_response(request.app[CONTROL].snapshot(), dumps=_dumps)


_dumps = dumps


@_bad_params
async def get_events(request: web.Request) -> web.StreamResponse:
    ctl = request.app[CONTROL]
    hz = _float_param(request, "hz", HZ_DEFAULT, HZ_MIN, HZ_MAX)
    rate = _float_param(request, "decisions", DECISIONS_DEFAULT, 0.0, DECISIONS_MAX)
    types = DEFAULT_TYPES
    raw = request.query.get("types")
    if raw:
        asked = frozenset(t.strip() for t in raw.split(",") if t.strip())
        unknown = sorted(asked - set(EVENT_TYPES))
        if unknown:
            raise _BadParam("types", f"unknown event type(s) {', '.join(unknown)}; "
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


@_guarded_read
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
        raise _BadParam("body", exc.message, status=exc.status) from None


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


@_bad_params
async def put_policy(request: web.Request) -> web.Response:
    ctl = request.app[CONTROL]
    denied = ctl.check_mutation(request)
    if denied is not None:
        return denied
    body = await _json_body(request)
    if not isinstance(body, dict):
        raise _BadParam("body", 'expected a JSON object {"name": POLICY, "knobs": {...}}')
    extra = sorted(set(body) - {"name", "knobs"})
    if extra:
        raise _BadParam(extra[0], f"unknown field {extra[0]!r}; allowed fields: name, knobs")
    name = body.get("name")
    if not isinstance(name, str) or not name:
        raise _BadParam("name", "name must be a policy name; known: " + ", ".join(sorted(POLICIES)))
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


@_bad_params
async def patch_knobs(request: web.Request) -> web.Response:
    ctl = request.app[CONTROL]
    denied = ctl.check_mutation(request)
    if denied is not None:
        return denied
    body = await _json_body(request)
    if not isinstance(body, dict):
        raise _BadParam("body", "expected a JSON object of knob names to values")
    try:
        _json_knob_types(None, body, request.app[STATE].slot.policy.name)
        slot = request.app[STATE].set_policy(None, body, _who(request), merge=True)
    except KnobError as exc:
        return error_response(400, f"{exc.field}: {exc.message}", param=exc.field)
    request.app[CONTROL].guard.cache.clear()  # a change is visible at once
    return _swap_response(slot, request.app[STATE].features)


@_guarded_read
async def get_shadows(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].shadows.summary(), dumps=_dumps)


@_bad_params
async def put_shadows(request: web.Request) -> web.Response:
    """Replace the shadow policies: {"policies": ["leastwork", {"policy": P, "knobs": {...}}]}
    ([] turns shadowing off). A shadow kept with the same knobs keeps its counts."""
    ctl = request.app[CONTROL]
    denied = ctl.check_mutation(request)
    if denied is not None:
        return denied
    body = await _json_body(request)
    if not isinstance(body, dict) or set(body) != {"policies"}:
        raise _BadParam("body", 'expected a JSON object {"policies": [NAME or {"policy": NAME, "knobs": {...}}]}')
    specs = body["policies"]
    if not isinstance(specs, list):  # the CLI's "a,b" form is for --shadow, not this API
        raise _BadParam("policies", 'policies must be a list of policy names or {"policy": NAME, '
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


@_guarded_read
@_bad_params
async def get_sessions(request: web.Request) -> web.Response:
    st = request.app[STATE]
    limit = _int_param(request, "limit", 50, 1, 10_000)
    sort = request.query.get("sort", "last_seen")
    if sort not in SESSION_SORTS:
        raise _BadParam("sort", f"sort must be one of {', '.join(SESSION_SORTS)}, got {sort!r}")
    names = [s.name for s in st.cluster.instances]
    only = request.query.get("instance")
    if only is not None and only not in names:
        raise _BadParam("instance", f"unknown instance {only!r}; known: {', '.join(names)}")
    key = {"last_seen": lambda s: s.last_seen, "turns": lambda s: s.turns,
           "tokens": lambda s: s.total_input_tokens, "moves": lambda s: s.moves}[sort]
    sessions = st.cluster.sessions.values()
    if only is not None:
        idx = names.index(only)
        sessions = [s for s in sessions if s.instance == idx]
    top = heapq.nlargest(limit, sessions, key=key)
    now = st.cluster.clock()
    rows = [{"session": s.session_id, "instance": names[s.instance], "turns": s.turns,
             "tokens": s.total_input_tokens, "last_input_tokens": s.last_input_tokens,
             "last_est_hit_tokens": s.last_est_hit_tokens,
             "est_hit_rate": s.last_est_hit_tokens / s.last_input_tokens if s.last_input_tokens else None,
             "first_seen": s.first_seen, "last_seen": s.last_seen, "idle_s": now - s.last_seen,
             "bound_since": s.bound_since, "bound_for_s": now - s.bound_since, "moves": s.moves}
            for s in top]
    return web.json_response({"total": len(st.cluster.sessions), "sort": sort, "sessions": rows},
                             dumps=_dumps)


@_guarded_read
@_bad_params
async def get_decisions(request: web.Request) -> web.Response:
    st = request.app[STATE]
    limit = _int_param(request, "limit", 100, 1, max(1, st.ring.maxlen or 1))
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
