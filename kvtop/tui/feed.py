"""Where the dashboard's data comes from: finding the router, its token, and its event stream.

The app never talks HTTP itself. It reads ``(kind, payload)`` pairs from a feed's
``events()`` and calls the feed's few request methods; ``RouterFeed`` does that over the
control API (docs/control-api.md), ``FakeFeed`` from a queue for tests and benchmarks.
Nothing here imports Textual, so ``attach --once`` stays light.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PREFIX = "/kvtop/v1"
TOKEN_ENV = "KVTOP_CONTROL_TOKEN"
DEFAULT_URL = "http://127.0.0.1:8000"
EVENT_TYPES = "state,decision,config,health,outcome"


def default_state_dir() -> Path:
    return Path.home() / ".local" / "state" / "kvtop"


class ControlError(Exception):
    """The router refused a request (its own message) or could not be reached."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass
class Target:
    url: str
    token: str | None = None
    token_source: str | None = None  # "--token-file", "env", "locator", or None
    locator: str | None = None


def _pid_alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, TypeError, ValueError) as exc:
        return isinstance(exc, PermissionError)
    return True


def read_locators(state_dir: Path) -> list[dict[str, Any]]:
    """Locator files of live routers, newest first."""
    out = []
    for p in sorted(state_dir.glob("router-*.json")):
        try:
            info = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(info, dict) or "url" not in info:
            continue
        if "pid" in info and not _pid_alive(info["pid"]):
            continue
        info["_path"] = str(p)
        out.append(info)
    out.sort(key=lambda i: i.get("started_at") or 0, reverse=True)
    return out


def resolve_target(url: str | None, *, token_file: str | None = None,
                   state_dir: str | Path | None = None) -> Target:
    """The router URL and bearer token: flags first, then env, then the locator files.

    Raises ``ControlError`` for a token file that cannot be read.
    """
    sd = Path(state_dir).expanduser() if state_dir else default_state_dir()
    locators = read_locators(sd) if sd.is_dir() else []
    chosen: dict[str, Any] | None = None
    if url:
        url = url.rstrip("/")
        if "://" not in url:
            url = "http://" + url
        chosen = next((i for i in locators if str(i["url"]).rstrip("/") == url), None)
    elif locators:
        chosen = locators[0]
        url = str(chosen["url"]).rstrip("/")
    else:
        url = DEFAULT_URL
    target = Target(url=url, locator=chosen["_path"] if chosen else None)
    if token_file:
        target.token, target.token_source = _read_token(token_file), "--token-file"
    elif os.environ.get(TOKEN_ENV, "").strip():
        target.token, target.token_source = os.environ[TOKEN_ENV].strip(), "env"
    elif chosen and chosen.get("token_file"):
        try:
            target.token, target.token_source = _read_token(chosen["token_file"]), "locator"
        except ControlError:
            pass  # read-only attach still works; the header says why control is off
    return target


def _read_token(path: str) -> str:
    try:
        token = Path(path).expanduser().read_text().strip()
    except OSError as exc:
        raise ControlError(f"cannot read token file {path}: {exc.strerror or exc}") from None
    if not token:
        raise ControlError(f"token file {path} is empty")
    return token


# -- blocking calls, for --once and the pre-flight check (no event loop, no aiohttp) ---------

def _router_message(body: bytes, status: int) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except Exception:
        text = body.decode(errors="replace").strip().splitlines()
        return f"HTTP {status}" + (f": {text[0][:200]}" if text else "")


def fetch_json(url: str, path: str, *, method: str = "GET", body: Any = None, token: str | None = None,
               timeout: float = 5.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + PREFIX + path, data=data, method=method)
    req.add_header("Accept", "application/json")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise ControlError(_router_message(exc.read(), exc.code), exc.code) from None
    except urllib.error.URLError as exc:
        reason = getattr(exc.reason, "strerror", None) or str(exc.reason)
        raise ControlError(f"cannot reach the router at {url}: {reason}") from None
    except (OSError, ValueError) as exc:
        raise ControlError(f"cannot reach the router at {url}: {exc}") from None


def check_token(url: str, token: str, timeout: float = 5.0) -> str | None:
    """None if the router accepts ``token`` for changes; else the router's reason.

    ``GET /kvtop/v1/auth`` checks the token and changes nothing.
    """
    try:
        fetch_json(url, "/auth", token=token, timeout=timeout)
    except ControlError as exc:
        if exc.status in (401, 403):
            return exc.message
        raise
    return None


def describe_error(exc: BaseException, url: str) -> str:
    """A lost or refused connection in words an operator reads, not aiohttp's repr."""
    import aiohttp

    where = url.split("://", 1)[-1]
    if isinstance(exc, aiohttp.ClientConnectorError):
        os_err = getattr(exc, "os_error", None)
        if isinstance(os_err, ConnectionRefusedError) or "refused" in str(exc).lower():
            return f"connection refused: nothing listens at {where} (the router is stopped or restarting)"
        return f"cannot connect to {where}: {getattr(os_err, 'strerror', None) or os_err or exc}"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the router closed the connection"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "the event stream broke off in the middle of an event"
    if isinstance(exc, asyncio.TimeoutError):
        return f"no answer from {where} in time"
    if isinstance(exc, RuntimeError) and "closed" in str(exc).lower():
        return "the connection to the router was lost"
    if isinstance(exc, aiohttp.ClientConnectionError):
        return f"the connection to the router was lost ({exc or type(exc).__name__})"
    return str(exc) or type(exc).__name__


# -- the event stream's framing ----------------------------------------------------------------

MAX_EVENT_BYTES = 8 * 2**20  # a state event at 256 instances is ~0.5 MiB; more is a broken router


class SseParser:
    """Server-sent events from raw byte chunks, with memory bounded by ``max_event_bytes``.

    ``feed(chunk)`` returns ``(events, errors)``: ``(kind, decoded JSON)`` pairs and one-line
    descriptions of what was dropped (a line or an event over the bound, data that is not
    JSON). A line that passes the bound is skipped up to its end; an event whose data lines
    never meet a blank line is dropped once it passes the bound, so neither can grow memory.
    """

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES):
        self.max = max_event_bytes
        self._line = bytearray()
        self._skipping_line = False
        self._kind = "message"
        self._data: list[bytes] = []
        self._data_bytes = 0
        self._overflow = False
        self._skipped = 0  # bytes of data lines skipped since an event passed the bound
        self._broken: str | None = None

    @property
    def buffered_bytes(self) -> int:
        return len(self._line) + self._data_bytes

    def feed(self, chunk: bytes) -> tuple[list[tuple[str, Any]], list[str]]:
        events: list[tuple[str, Any]] = []
        errors: list[str] = []
        *lines, rest = chunk.split(b"\n")
        for part in lines:
            if self._skipping_line:
                self._skipping_line = False  # the overlong line ends here
                continue
            if self._line:
                self._line += part
                part, self._line = bytes(self._line), bytearray()
            self._handle(part.rstrip(b"\r"), events, errors)
        if not self._skipping_line:
            self._line += rest
            if len(self._line) > self.max:
                errors.append(f"dropped a line over {self.max // 2**20} MiB")
                self._line = bytearray()
                self._skipping_line = True
                self._reset_event()
                self._overflow = True  # what follows belongs to a broken event
        return events, errors

    @property
    def broken(self) -> str | None:
        """Why the stream cannot be read as events any more (an event over the bound), else None."""
        return self._broken

    def _reset_event(self) -> None:
        self._kind, self._data, self._data_bytes, self._overflow = "message", [], 0, False
        self._skipped = 0

    def _handle(self, line: bytes, events: list, errors: list[str]) -> None:
        if not line:
            if self._data and not self._overflow:
                raw = b"\n".join(self._data)
                try:
                    events.append((self._kind, json.loads(raw)))
                except ValueError:
                    errors.append(f"a {self._kind!r} event whose data is not JSON ({raw[:40]!r}...)")
            self._reset_event()
        elif line.startswith(b"event:"):
            self._kind = line[6:].strip().decode(errors="replace")
        elif line.startswith(b"data:"):
            if self._overflow:
                # Still no blank line: a stream that never ends its event is broken, not late.
                self._skipped += len(line)
                if self._skipped > 2 * self.max and self._broken is None:
                    self._broken = (f"a {self._kind!r} event ran past {3 * self.max // 2**20} MiB of data lines "
                                    "without the blank line that ends it")
                return
            piece = line[5:].lstrip()
            self._data_bytes += len(piece)
            if self._data_bytes > self.max:
                errors.append(f"dropped a {self._kind!r} event over {self.max // 2**20} MiB "
                              "(data lines without the blank line that ends an event?)")
                self._data, self._data_bytes, self._overflow = [], 0, True
            else:
                self._data.append(piece)


# -- feeds ----------------------------------------------------------------------------------

class RouterFeed:
    """The control API of one router: the SSE event stream plus the few request calls.

    ``events()`` never ends on its own: on a lost connection it yields a ``_status`` event
    and reconnects with exponential backoff (0.5 s doubling to 8 s).
    """

    def __init__(self, url: str, token: str | None = None, hz: float = 4.0,
                 token_loader: Callable[[], str | None] | None = None):
        self.url = url.rstrip("/")
        self.token = token
        self.hz = hz
        # A restarted router has a new token (a generated one is rewritten to the file its
        # locator names): re-read on every reconnect and once on a refusal.
        self.token_loader = token_loader
        self.control_problem: str | None = None  # why changes would be refused, for the header
        self._connected_once = False
        self._session: Any = None
        self._reconnect = asyncio.Event()
        self.next_retry_at: float | None = None
        self._backfilled = False

    async def _http(self):
        if "aiohttp" not in sys.modules:
            # imported off the event loop: on a loaded host the import took long enough to hold
            # back the dashboard's first frame ("connecting")
            await asyncio.to_thread(importlib.import_module, "aiohttp")
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        return self._session

    def set_hz(self, hz: float) -> None:
        if hz != self.hz:
            self.hz = hz
            self._reconnect.set()

    async def events(self) -> AsyncIterator[tuple[str, Any]]:
        delay = 0.5
        while True:
            self._reconnect.clear()
            http = await self._http()
            import aiohttp

            try:
                async with http.get(f"{self.url}{PREFIX}/events",
                                    params={"hz": f"{self.hz:g}", "types": EVENT_TYPES}) as resp:
                    if resp.status != 200:
                        raise ControlError(_router_message(await resp.read(), resp.status), resp.status)
                    delay = 0.5
                    self.next_retry_at = None
                    if self._connected_once:
                        await self.recheck_control()
                    self._connected_once = True
                    yield "_status", {"connected": True, "error": None}
                    for ev in await self._recent_decisions():
                        yield "decision", ev
                    parser = SseParser()
                    err = "the router closed the event stream"
                    # Raw chunks, not aiohttp's line iterator: that one raises on a long line.
                    async for chunk in resp.content.iter_any():
                        if self._reconnect.is_set():
                            break
                        events, errors = parser.feed(chunk)
                        for error in errors:
                            yield "_malformed", {"error": error}
                        for ev in events:
                            yield ev
                        if parser.broken:
                            # An event that never ends (endless data lines): nothing more on this
                            # connection can be read as events. Drop it and connect again.
                            err = f"the event stream is broken: {parser.broken}"
                            break
                    if self._reconnect.is_set():
                        continue
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ControlError) as exc:
                err = exc.message if isinstance(exc, ControlError) else describe_error(exc, self.url)
            except RuntimeError as exc:
                # aiohttp raises RuntimeError("Connection closed.") when a connection that was
                # paused under a flood of data is lost: a lost stream like any other.
                err = describe_error(exc, self.url)
            self.next_retry_at = time.time() + delay
            yield "_status", {"connected": False, "error": err, "retry_in_s": delay}
            try:
                await asyncio.wait_for(self._reconnect.wait(), delay)
            except asyncio.TimeoutError:
                pass
            delay = min(8.0, delay * 2)

    async def _recent_decisions(self) -> list[dict[str, Any]]:
        """The router's last decisions, oldest first, so the stream does not start empty."""
        if self._backfilled:
            return []
        self._backfilled = True
        try:
            body = await self.request("GET", "/decisions?limit=200")
        except ControlError:
            return []
        rows = body.get("decisions") if isinstance(body, dict) else None
        return list(reversed(rows)) if isinstance(rows, list) else []

    def _reload_token(self) -> bool:
        """Read the token again; True when it changed."""
        if self.token_loader is None:
            return False
        try:
            token = self.token_loader()
        except Exception:  # noqa: BLE001 - a vanished or unreadable file keeps the old token
            return False
        if token and token != self.token:
            self.token = token
            return True
        return False

    async def recheck_control(self) -> None:
        """After a reconnect: the current token, checked with ``GET auth`` (which changes nothing)."""
        self._reload_token()
        if not self.token:
            return
        try:
            await self._send("GET", "/auth", None, auth=True)
        except ControlError as exc:
            if exc.status in (401, 403):
                self.control_problem = exc.message
            return
        self.control_problem = None

    async def request(self, method: str, path: str, body: Any = None, *, auth: bool = False) -> Any:
        try:
            result = await self._send(method, path, body, auth=auth)
        except ControlError as exc:
            if not (auth and exc.status == 401 and self._reload_token()):
                if auth and exc.status in (401, 403):
                    self.control_problem = exc.message
                raise
            result = await self._send(method, path, body, auth=auth)  # the router restarted: new token
        if auth:
            self.control_problem = None
        return result

    async def _send(self, method: str, path: str, body: Any = None, *, auth: bool = False) -> Any:
        http = await self._http()
        import aiohttp
        headers = {"X-Kvtop-User": "kvtop-attach"}
        if auth and self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        try:
            async with http.request(method, self.url + PREFIX + path, json=body, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=10)) as resp:
                raw = await resp.read()
                if resp.status >= 400:
                    raise ControlError(_router_message(raw, resp.status), resp.status)
                return json.loads(raw)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, RuntimeError) as exc:
            raise ControlError(f"cannot reach the router at {self.url}: {describe_error(exc, self.url)}") from None
        except ValueError:
            raise ControlError(f"{self.url}{PREFIX}{path} answered with something that is not JSON") from None

    async def policies(self) -> dict[str, Any]:
        return await self.request("GET", "/policies")

    async def sessions(self, limit: int = 200) -> dict[str, Any]:
        return await self.request("GET", f"/sessions?sort=tokens&limit={limit}")

    async def put_policy(self, name: str, knobs: dict[str, Any]) -> dict[str, Any]:
        return await self.request("PUT", "/policy", {"name": name, "knobs": knobs}, auth=True)

    async def patch_knobs(self, knobs: dict[str, Any]) -> dict[str, Any]:
        return await self.request("PATCH", "/knobs", knobs, auth=True)

    async def put_shadows(self, specs: list[Any]) -> dict[str, Any]:
        """Replace the shadow set: ``[NAME or {"policy": NAME, "knobs": {...}}]`` (audited by the router)."""
        return await self.request("PUT", "/shadows", {"policies": specs}, auth=True)

    async def fleet_action(self, instance: str, action: str, force: bool = False) -> dict[str, Any]:
        """Cordon, drain, uncordon or remove an instance (``POST fleet/{instance}/{action}``,
        audited by the router as a ``fleet`` change); ``force`` cuts off its in-flight requests."""
        from urllib.parse import quote

        return await self.request("POST", f"/fleet/{quote(instance, safe='')}/{action}",
                                  {"force": True} if force else None, auth=True)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class FakeFeed:
    """A scripted feed: tests push events; policies and sessions come from fixtures.

    Mutations succeed unless ``fail_with`` is set, and bump the policy version like a router.
    """

    def __init__(self, policies: dict[str, Any] | None = None, sessions: dict[str, Any] | None = None):
        self.queue: asyncio.Queue[tuple[str, Any]] | None = None
        self._pending: list[tuple[str, Any]] = []
        self.policies_body = policies or {"current": {}, "policies": []}
        self.sessions_body = sessions or {"total": 0, "sessions": []}
        self.fail_with: ControlError | None = None
        self.calls: list[tuple[str, Any]] = []
        self.hz = 4.0
        self.url = "fake://router"
        self.token = "fake"

    def push(self, kind: str, payload: Any) -> None:
        if self.queue is None:
            self._pending.append((kind, payload))
        else:
            self.queue.put_nowait((kind, payload))

    def set_hz(self, hz: float) -> None:
        self.hz = hz

    async def events(self) -> AsyncIterator[tuple[str, Any]]:
        self.queue = asyncio.Queue()
        for item in self._pending:
            self.queue.put_nowait(item)
        self._pending.clear()
        yield "_status", {"connected": True, "error": None}
        while True:
            yield await self.queue.get()

    async def policies(self) -> dict[str, Any]:
        return self.policies_body

    async def sessions(self, limit: int = 200) -> dict[str, Any]:
        return self.sessions_body

    async def _mutate(self, call: str, body: Any) -> dict[str, Any]:
        self.calls.append((call, body))
        if self.fail_with is not None:
            raise self.fail_with
        cur = self.policies_body.setdefault("current", {})
        cur["version"] = int(cur.get("version", 1)) + 1
        if call == "put_policy":
            cur["name"], cur["knobs"] = body["name"], dict(body["knobs"])
        else:
            cur["knobs"] = {**cur.get("knobs", {}), **body}
        cur["policy"] = f"{cur.get('name')}@{cur['version']}"
        return {"policy": cur["policy"], "name": cur.get("name"), "version": cur["version"],
                "knobs": cur["knobs"]}

    async def put_policy(self, name: str, knobs: dict[str, Any]) -> dict[str, Any]:
        return await self._mutate("put_policy", {"name": name, "knobs": knobs})

    async def patch_knobs(self, knobs: dict[str, Any]) -> dict[str, Any]:
        return await self._mutate("patch_knobs", knobs)

    async def put_shadows(self, specs: list[Any]) -> dict[str, Any]:
        self.calls.append(("put_shadows", specs))
        if self.fail_with is not None:
            raise self.fail_with
        rows = [{"policy": s if isinstance(s, str) else s["policy"],
                 "knobs": {} if isinstance(s, str) else dict(s.get("knobs") or {}), "picks": 0, "agree": 0,
                 "agreement": None} for s in specs]
        return {"shadows": rows, "dropped": []}

    async def fleet_action(self, instance: str, action: str, force: bool = False) -> dict[str, Any]:
        self.calls.append(("fleet_action", (instance, action, force)))
        if self.fail_with is not None:
            raise self.fail_with
        after = {"cordon": "cordoned", "drain": "draining", "uncordon": "active", "remove": "removed"}[action]
        return {"instance": instance, "action": action, "after": after, "changed": True}

    async def close(self) -> None:
        pass


@dataclass
class RouterLink:
    """One of several routers the dashboard watches: its feed and what the header says of it."""

    label: str
    feed: Any
    can_control: bool = True
    snapshot: dict[str, Any] | None = None
    connected: bool = False
    error: str | None = None
    names: dict[str, str] | None = None  # this router's instance name -> the table's name


class MultiFeed:
    """Several routers in front of the same instances, read as one feed (``attach URL URL ...``).

    ``events()`` merges the routers' streams: every state becomes one merged snapshot
    (``merge_router_snapshots``: instances matched by backend URL, each router's in-flight
    share), decisions and config events carry their router's label, and the connection is
    up while every router's is. Policy, knob and shadow calls go to the *selected* router
    (``select``); sessions come from all of them.
    """

    def __init__(self, feeds: list[Any], can_control: list[bool] | None = None, labels: list[str] | None = None):
        labels = labels or [f"r{k + 1}" for k in range(len(feeds))]
        flags = can_control or [bool(getattr(f, "token", None)) for f in feeds]
        self.routers = [RouterLink(lb, f, c) for lb, f, c in zip(labels, feeds, flags)]
        self.selected = 0
        self._queue: asyncio.Queue | None = None

    @property
    def current(self) -> RouterLink:
        return self.routers[self.selected]

    @property
    def url(self) -> str:
        return self.current.feed.url

    @property
    def token(self) -> str | None:
        return getattr(self.current.feed, "token", None)

    @property
    def control_problem(self) -> str | None:
        return getattr(self.current.feed, "control_problem", None)

    def select(self, index: int) -> None:
        """Make router ``index`` the one control acts on (and whose policy the header shows)."""
        self.selected = index % len(self.routers)
        if self._queue is not None:
            self._queue.put_nowait((-1, "_remerge", None))

    def set_hz(self, hz: float) -> None:
        for r in self.routers:
            r.feed.set_hz(hz)

    def merged(self) -> dict[str, Any]:
        from kvtop.tui.model import merge_router_snapshots

        return merge_router_snapshots([(r.label, r.snapshot) for r in self.routers], self.selected)

    async def events(self) -> AsyncIterator[tuple[str, Any]]:
        from kvtop.tui.model import clean_snapshot

        self._queue = queue = asyncio.Queue(maxsize=1000)

        async def pump(k: int) -> None:
            async for kind, payload in self.routers[k].feed.events():
                await queue.put((k, kind, payload))

        tasks = [asyncio.create_task(pump(k)) for k in range(len(self.routers))]
        try:
            while True:
                k, kind, payload = await queue.get()
                link = self.routers[k] if k >= 0 else self.current
                if kind == "_remerge":
                    if any(r.snapshot for r in self.routers):
                        yield "state", self.merged()
                    continue
                if kind == "state":
                    snap, problems = clean_snapshot(payload)
                    if problems:
                        yield "_malformed", {"error": f"{link.label}: state: " + "; ".join(problems[:3])}
                    if snap is None:
                        continue
                    link.snapshot = snap
                    link.names = {str(i["name"]): str(i.get("url") or i["name"]) for i in snap["instances"]}
                    yield "state", self.merged()
                elif kind in ("decision", "config") and isinstance(payload, dict):
                    yield kind, {**payload, "router": link.label}
                elif kind == "outcome" and isinstance(payload, dict):
                    yield kind, {**payload, "instance": self._table_name(link, payload.get("instance")),
                                 "router": link.label}
                elif kind == "_status":
                    link.connected = bool(payload.get("connected"))
                    link.error = payload.get("error")
                    down = [r for r in self.routers if not r.connected]
                    first = down[0] if down else None
                    yield "_status", {"connected": not down,
                                      "error": f"{first.label} ({first.feed.url}): {first.error or 'connecting'}"
                                      if first else None,
                                      "retry_in_s": payload.get("retry_in_s") if not link.connected else None}
                elif kind == "_malformed" and isinstance(payload, dict):
                    yield kind, {"error": f"{link.label}: {payload.get('error')}"}
                else:
                    yield kind, payload
        finally:
            for t in tasks:
                t.cancel()

    def _table_name(self, link: RouterLink, name: Any) -> Any:
        """An instance as this router names it -> as the merged table names it (by URL)."""
        url = (link.names or {}).get(str(name))
        if url is None:
            return name
        for r in self.routers:
            for n, u in (r.names or {}).items():
                if u == url:
                    return n
        return name

    async def policies(self) -> dict[str, Any]:
        return await self.current.feed.policies()

    async def sessions(self, limit: int = 200) -> dict[str, Any]:
        """Every router's sessions; a session two routers both know is shown where it has more tokens."""
        rows: dict[str, dict[str, Any]] = {}
        total, errors = 0, []
        for r in self.routers:
            try:
                body = await r.feed.sessions(limit)
            except ControlError as exc:
                errors.append(exc)
                continue
            if not isinstance(body, dict) or not isinstance(body.get("sessions"), list):
                continue
            total += body.get("total") if isinstance(body.get("total"), int) else 0
            for s in body["sessions"]:
                if not isinstance(s, dict) or "session" not in s:
                    continue
                s = {**s, "router": r.label, "instance": f"{s.get('instance')} ({r.label})"}
                old = rows.get(str(s["session"]))
                if old is None or (s.get("tokens") or 0) > (old.get("tokens") or 0):
                    rows[str(s["session"])] = s
        if errors and len(errors) == len(self.routers):
            raise errors[0]
        return {"total": total, "sessions": list(rows.values())}

    async def put_policy(self, name: str, knobs: dict[str, Any]) -> dict[str, Any]:
        return await self.current.feed.put_policy(name, knobs)

    async def patch_knobs(self, knobs: dict[str, Any]) -> dict[str, Any]:
        return await self.current.feed.patch_knobs(knobs)

    async def put_shadows(self, specs: list[Any]) -> dict[str, Any]:
        return await self.current.feed.put_shadows(specs)

    async def fleet_action(self, instance: str, action: str, force: bool = False) -> dict[str, Any]:
        """On the selected router, under its own name for the instance (matched by URL)."""
        url = next((u for r in self.routers for n, u in (r.names or {}).items() if n == instance), None)
        own = next((n for n, u in (self.current.names or {}).items() if u == url), instance)
        return await self.current.feed.fleet_action(own, action, force)

    async def close(self) -> None:
        for r in self.routers:
            await r.feed.close()
