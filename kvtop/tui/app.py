"""``KvtopApp``: the live dashboard of one router.

Data enters one way: ``_read_feed`` (an async worker) puts every event into ``Collected``;
``apply`` (a timer at the refresh rate) draws the latest of it inside ``batch_update()``,
through the visible tab's widget (kvtop/tui/tabs.py: one ``TabPane`` per tab draws its own widgets).
Pause stops ``apply`` only, so nothing is lost while the view is frozen. Tables are updated
cell by cell by row key and sorted only when the sort column changed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.command import DiscoveryHit, Hit, Hits, Provider
from textual.theme import Theme
from textual.widgets import Button, DataTable, Footer, Input, Static, TabbedContent

from kvtop.tui.feed import ControlError
from kvtop.tui.model import (COLUMN_HELP, COMPACT_MIN, DEFAULT_SORT, FLEET_AFTER, FLEET_VERBS, INSTANCE_COLUMNS,
                             MEASURED_TPS_COLUMN,
                             OPTIONAL_COLUMNS, SORT_KEYS, Collected, column_legend, degraded_tasks, doc_summary,
                             fit_segments, fleet_state, fmt_duration, fmt_pct, health_line, health_state, is_number)
from kvtop.tui.screens import ConfirmScreen, HelpScreen, KnobForm, PolicyPicker
from kvtop.tui.tabs import ChartsTab, DecisionsTab, OverviewTab, PolicyTab, SessionsTab

HZ_STEPS = [0.5, 1.0, 2.0, 4.0, 8.0, 10.0]
WINDOWS_S = [30, 60, 120, 300, 600]
TABLE_HZ = 2.0  # tables redraw at most this often; the header follows the refresh rate
TABS = ["overview", "charts", "sessions", "decisions", "policy"]

THEMES = [
    Theme(name="kvtop-dark", primary="#5fafd7", secondary="#87afaf", accent="#d7af5f", warning="#d7af00",
          error="#ff5f5f", success="#5fd75f", background="#121417", surface="#1a1d21", panel="#23272d",
          foreground="#dfe3e8", dark=True),
    Theme(name="kvtop-light", primary="#005f87", secondary="#5f8787", accent="#875f00", warning="#af5f00",
          error="#d70000", success="#008700", background="#fafafa", surface="#f0f0f0", panel="#e4e4e4",
          foreground="#1c1c1c", dark=False),
    # Okabe-Ito palette: blue / orange / vermillion stay apart under deuteranopia and protanopia.
    Theme(name="kvtop-cb", primary="#56B4E9", secondary="#009E73", accent="#F0E442", warning="#E69F00",
          error="#D55E00", success="#0072B2", background="#101418", surface="#182028", panel="#202a34",
          foreground="#f0f0f0", dark=True),
]


def theme_names() -> list[str]:
    """Every name ``--theme`` accepts: kvtop's own themes, then Textual's built-in ones."""
    from textual.theme import BUILTIN_THEMES

    return [t.name for t in THEMES] + sorted(set(BUILTIN_THEMES) - {t.name for t in THEMES})


class PolicyCommands(Provider):
    """Command palette: switch policy, edit knobs, pause. Nothing when read-only."""

    def _commands(self) -> list[tuple[str, Callable[[], Any], str]]:
        app = self.app
        if not isinstance(app, KvtopApp):
            return []
        out: list[tuple[str, Callable[[], Any], str]] = [
            ("Pause / resume the view", app.action_pause, "freeze the screen; data keeps arriving")]
        if app.control_enabled:
            current = app.current_policy().get("name")
            for p in app.policies_body.get("policies", []):
                if p["name"] != current:
                    out.append((f"Switch policy to {p['name']}",
                                lambda n=p["name"]: app.switch_policy_to(n), escape(doc_summary(p.get("doc"))[:80])))
            out.append(("Edit knobs of the current policy", app.action_edit_knobs,
                        "validated form; confirm shows the diff"))
            shadowed = {r["policy"]: r for r in app.shadow_rows()}
            for name, row in shadowed.items():
                out.append((f"Promote shadow {name} to active", lambda n=name: app.promote_shadow(n),
                            escape(app.shadow_effect(row))))
                out.append((f"Remove shadow policy {name}", lambda n=name: app.remove_shadow(n),
                            "stop asking it on every request"))
            for p in app.policies_body.get("policies", []):
                if p["name"] != current and p["name"] not in shadowed:
                    out.append((f"Add shadow policy {p['name']}", lambda n=p["name"]: app.add_shadow(n),
                                "asked on every request, never applied; the Policy tab shows its agreement"))
        return out

    async def discover(self) -> Hits:
        for name, fn, help_text in self._commands():
            yield DiscoveryHit(name, fn, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for name, fn, help_text in self._commands():
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), fn, help=help_text)


class KvtopApp(App):
    CSS_PATH = Path(__file__).with_name("kvtop.tcss")
    TITLE = "kvtop"
    COMMANDS = App.COMMANDS | {PolicyCommands}
    BINDINGS = [
        Binding("q", "quit", "quit", id="kvtop.quit"),
        # A terminal user's reflex, and what `kvtop demo --help` promises; priority so that the
        # filter box's copy binding does not swallow it.
        Binding("ctrl+c", "quit", "quit", show=False, priority=True, id="kvtop.quit_ctrl_c"),
        Binding("question_mark", "help", "help", id="kvtop.help"),
        Binding("p", "pause", "pause", id="kvtop.pause"),
        Binding("s", "sort", "sort", id="kvtop.sort"),
        Binding("r", "reverse", "reverse", show=False, id="kvtop.reverse"),
        Binding("slash", "filter", "filter", id="kvtop.filter"),
        Binding("escape", "clear_filter", "clear", show=False, id="kvtop.clear_filter"),
        Binding("plus,equals_sign", "faster", "+Hz", show=False, id="kvtop.faster"),
        Binding("minus", "slower", "-Hz", show=False, id="kvtop.slower"),
        Binding("left_square_bracket", "window(-1)", "window-", show=False, id="kvtop.window_shorter"),
        Binding("right_square_bracket", "window(1)", "window+", show=False, id="kvtop.window_longer"),
        Binding("P", "switch_policy", "policy", id="kvtop.switch_policy"),
        Binding("k", "edit_knobs", "knobs", id="kvtop.edit_knobs"),
        # shadow policies: add, remove, promote (the id predates add/remove: remaps keep working)
        Binding("S", "shadows", "shadows", show=False, id="kvtop.promote_shadow"),
        # attach URL URL ...: which router the policy and knob actions act on
        Binding("R", "next_router", "next router", show=False, id="kvtop.next_router"),
        # the selected instance (an overview row, or its detail): out of rotation and back
        Binding("c", "fleet('cordon')", "cordon", show=False, id="kvtop.fleet.cordon"),
        Binding("d", "fleet('drain')", "drain", show=False, id="kvtop.fleet.drain"),
        Binding("u", "fleet('uncordon')", "uncordon", show=False, id="kvtop.fleet.uncordon"),
        Binding("x", "fleet('remove')", "remove", show=False, id="kvtop.fleet.remove"),
        Binding("z", "compact", "condense", show=False, id="kvtop.compact"),
        Binding("C", "columns", "columns", show=False, id="kvtop.columns"),
        Binding("1", "tab('overview')", "overview", show=False, id="kvtop.tab.overview"),
        Binding("2", "tab('charts')", "charts", show=False, id="kvtop.tab.charts"),
        Binding("3", "tab('sessions')", "sessions", show=False, id="kvtop.tab.sessions"),
        Binding("4", "tab('decisions')", "decisions", show=False, id="kvtop.tab.decisions"),
        Binding("5", "tab('policy')", "policy", show=False, id="kvtop.tab.policy"),
    ]

    def __init__(self, feed: Any, *, url: str = "", readonly: bool = False, can_control: bool = True,
                 hz: float = 4.0, theme: str | None = None, max_decisions: int = 500,
                 clock: Callable[[], float] = time.time, apply_timer: bool = True,
                 poll_sessions_s: float = 2.0, connect_grace_s: float = 3.0, speed: float | None = None,
                 keymap: dict[str, str] | None = None, config_file: Any = None,
                 hidden_columns: list[str] | None = None):
        super().__init__()
        #: instance-table columns the chooser hid (``C``), saved to the config file
        self.hidden_columns: set[str] = set(hidden_columns or ())
        #: attach.toml (kvtop/tui/config.py): a theme switched from the palette is saved there
        self.config_file = config_file
        self._config_write_failed = False
        self._theme_saved: str | None = None  # None until the starting theme is set
        self.feed = feed
        self.url = url or getattr(feed, "url", "")
        self.readonly_flag = readonly
        self._can_control = can_control
        self.hz = hz
        self.clock = clock
        self.apply_timer = apply_timer
        self.poll_sessions_s = poll_sessions_s
        # A router that is still starting (kvtop demo) refuses the first connection: that is
        # "connecting", not a red DISCONNECTED frame, until the grace is over.
        self.connect_grace_s = connect_grace_s
        self._started = time.monotonic()
        #: kvtop demo: the simulated engines run this many times faster than wall time
        self.speed = speed
        #: a line from whoever runs the app (kvtop demo: the replay's progress), in the header
        self.note: str | None = None
        self.max_decisions = max_decisions
        self.collected = Collected(max_decisions=max(max_decisions, 100))
        self.paused = False
        #: condensed overview from COMPACT_MIN instances (only the rows that fit); z toggles
        self.compact: bool | None = None  # None: automatic
        self.sort_key = DEFAULT_SORT
        self.sort_reverse = True  # busiest first
        self.window_s = 120
        self.filters: dict[str, str] = {"overview": "", "sessions": "", "decisions": ""}
        self.policies_body: dict[str, Any] = {"current": {}, "policies": []}
        self.sessions_body: dict[str, Any] = {"total": 0, "sessions": []}
        self.last_error: str | None = None
        self._policies_label: str | None = None  # the policy@version the policies answer is for
        self._policies_asked: str | None = None  # ... and the one last asked for
        self._run_id: Any = None
        self._applied_stale: Any = None
        self._health_key: Any = None
        # what the screen shows now, so only changes are drawn
        self._applied_snapshot = 0
        self._applied_decision = 0
        self._applied_sessions: int = -1
        self._applied_affinity = 0
        self._static_cache: dict[str, tuple] = {}
        self._sessions_seq = 0
        self._charts_at = 0.0
        self._tables_at = 0.0
        self._colors: dict[str, str] = {}
        self._theme_seq = 0  # counts theme changes: cells drawn under an older theme are restyled
        for t in THEMES:
            self.register_theme(t)
        self.theme = theme or "kvtop-dark"
        self._theme_saved = self.theme  # as started (flag or file): not written back unchanged
        if keymap:
            self.set_keymap(dict(keymap))

    # -- layout ------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Static(id="topbar")
        yield Static(id="routers")  # attach URL URL ...: one line per router
        yield Static(id="banner")
        yield Static(id="health")  # the fleet's health in one line, on every tab and at any size
        with TabbedContent(initial="overview", id="tabs"):
            yield OverviewTab("1 Overview", id="overview")
            yield ChartsTab("2 Charts", id="charts")
            yield SessionsTab("3 Sessions", id="sessions")
            yield DecisionsTab("4 Decisions", id="decisions")
            yield PolicyTab("5 Policy", id="policy")
        yield Input(placeholder="filter: words, or reason:X instance:Y session:Z (Esc clears)", id="filter")
        yield Footer()

    def on_mount(self) -> None:
        t = self.query_one("#instances", DataTable)
        self.query_one(OverviewTab).build_columns()
        d = self.query_one("#decision-table", DataTable)
        router = [("router", "router")] if self.multi else []  # attach URL URL ...
        for key, label in [("time", "time"), *router, ("session", "session"), ("class", "class"), ("instance", "inst"),
                           ("reason", "reason"), ("hit", "hit"), ("terms", "chosen terms")]:
            d.add_column(label, key=key)
        s = self.query_one("#session-table", DataTable)
        for key, label in [("session", "session"), ("instance", "instance"), ("turns", "turns"),
                           ("tokens", "tokens"), ("hit", "last hit%"), ("bound", "stayed"), ("idle", "idle"),
                           ("moves", "moves"), ("completion", "completion"), ("fleet", "fleet"), ("client", "client")]:
            s.add_column(label, key=key)
        k = self.query_one("#knob-table", DataTable)
        for key, label in [("knob", "knob"), ("value", "value"), ("default", "default"), ("range", "range"),
                           ("doc", "doc")]:
            k.add_column(label, key=key)
        self.query_one("#filter", Input).display = False
        self.query_one("#fleet", Static).display = False
        self.query_one("#routers", Static).display = self.multi
        t.focus()
        self._refresh_controls()
        self._read_feed()
        self._load_policies()
        if self.poll_sessions_s > 0:
            self.set_interval(self.poll_sessions_s, self._poll_sessions)
        if self.apply_timer:
            self._timer = self.set_interval(1 / self.hz, self._tick)
        self.apply(force=True)

    async def on_unmount(self) -> None:
        await self.feed.close()

    # -- data in ------------------------------------------------------------------------------
    @work(exclusive=True, group="stream")
    async def _read_feed(self) -> None:
        """The one way data comes in. A feed that fails is a lost connection, shown and retried:
        never the end of the dashboard."""
        while True:
            try:
                async for kind, payload in self.feed.events():
                    self._take(kind, payload)
                error = "the event stream ended"
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - see the docstring
                error = f"the event reader failed: {type(exc).__name__}: {exc}"
            self._take("_status", {"connected": False, "error": error, "retry_in_s": 1.0})
            await asyncio.sleep(1.0)

    def _take(self, kind: str, payload: Any) -> None:
        was = self.collected.connects
        self.collected.ingest(kind, payload)
        if kind == "config":
            self._load_policies()
        elif kind == "_status" and self.collected.connects > was > 0:
            self._forget_router("reconnected")

    def _forget_router(self, why: str) -> None:
        """A reconnect (or a new run id): the router may have restarted with other settings, so
        nothing it answered before is kept: policies, knobs and sessions are fetched again."""
        self.policies_body = {"current": {}, "policies": []}
        self._policies_label = None
        self._policies_asked = None
        self.sessions_body = {"total": 0, "sessions": []}
        self._sessions_seq += 1
        self.last_error = None
        self._load_policies()
        if self.query_one(TabbedContent).active == "sessions":
            self._fetch_sessions()

    def _check_truth(self) -> None:
        """The one refresh rule's other half: when the latest snapshot names another policy
        version or run than the policies answer on hand, fetch it again (once per change)."""
        r = (self.collected.snapshot or {}).get("router") or {}
        run = r.get("run_id")
        if self.multi:
            # several routers: the snapshot's router section is the selected one's (R moves it);
            # a run is that router's, named by its URL
            run = (r.get("url"), run) if run is not None else None
        if run is not None and self._run_id is not None and run != self._run_id and (
                not self.multi or run[0] == self._run_id[0]):
            self._run_id = run
            # the change log is history: say where the old run's changes end
            self.collected.config_events.append({"kind": "restart", "ts": time.time(), "who": "attach",
                                                 "after": {"run_id": r.get("run_id"), "policy": r.get("policy")}})
            self._forget_router("new run")
            return
        self._run_id = run if run is not None else self._run_id
        label = r.get("policy") if isinstance(r.get("policy"), str) else None
        if label and label != self._policies_label and label != self._policies_asked:
            self._policies_asked = label
            self._load_policies()

    def current_policy(self) -> dict[str, Any]:
        """The active policy as the latest snapshot says it (name, label, version, knobs,
        router features); the policies answer fills in only what the snapshot lacks."""
        cur = dict(self.policies_body.get("current") or {})
        r = (self.collected.snapshot or {}).get("router") or {}
        if isinstance(r.get("policy"), str):
            cur["policy"] = r["policy"]
            cur["name"] = r.get("policy_name") if isinstance(r.get("policy_name"), str) else r["policy"].split("@")[0]
            if is_number(r.get("policy_version")):
                cur["version"] = r["policy_version"]
            if isinstance(r.get("knobs"), dict):
                cur["knobs"] = r["knobs"]
            if isinstance(r.get("features"), dict):
                cur["features"] = r["features"]
        return cur

    @property
    def stale_s(self) -> float | None:
        """Seconds the view has been stale (the connection lost, the last snapshot on screen), else None."""
        c = self.collected
        if c.connected or self.connecting or c.snapshot is None:
            return None
        return max(0.0, time.time() - (c.disconnected_at or time.time()))

    def stale_label(self) -> str | None:
        s = self.stale_s
        return None if s is None else f"stale {fmt_duration(s)}"

    @work(exclusive=True, group="policies")
    async def _load_policies(self) -> None:
        try:
            body = await self.feed.policies()
        except ControlError as exc:
            self.last_error = f"GET policies: {exc.message}"
            self._policies_asked = None  # asked again on the next snapshot
        else:
            if isinstance(body, dict) and isinstance(body.get("policies", []), list):
                body = dict(body)
                body["policies"] = [p for p in body.get("policies", [])
                                    if isinstance(p, dict) and isinstance(p.get("name"), str)]
                if not isinstance(body.get("current"), dict):
                    body["current"] = {}
                self.policies_body = body
                label = body["current"].get("policy")
                self._policies_label = label if isinstance(label, str) else None
            else:
                self.last_error = "GET policies: the answer is not shaped like a kvtop router's"
        self._draw_policy()

    def _poll_sessions(self) -> None:
        if self.query_one(TabbedContent).active == "sessions":
            self._fetch_sessions()

    @work(exclusive=True, group="sessions")
    async def _fetch_sessions(self) -> None:
        try:
            body = await self.feed.sessions(200)
        except ControlError:
            return
        rows = body.get("sessions") if isinstance(body, dict) else None
        if isinstance(rows, list):
            self.sessions_body = {**body, "sessions": [s for s in rows if isinstance(s, dict) and "session" in s]}
            self._sessions_seq += 1

    # -- data out -------------------------------------------------------------------------------
    @property
    def readonly(self) -> bool:
        snap = self.collected.snapshot or {}
        return self.readonly_flag or bool(snap.get("router", {}).get("readonly"))

    @property
    def multi(self) -> bool:
        """Several routers in front of the same instances (``kvtop attach URL URL ...``)."""
        return len(getattr(self.feed, "routers", ())) > 1

    @property
    def can_control(self) -> bool:
        """A token was found (for the selected router, with several)."""
        if self.multi:
            return self.feed.current.can_control
        return self._can_control

    @can_control.setter
    def can_control(self, value: bool) -> None:
        self._can_control = value

    @property
    def control_enabled(self) -> bool:
        return not self.readonly and self.can_control

    def on_router(self) -> str:
        """`` on r2 (http://...)`` with several routers, so every control action says where it goes."""
        if not self.multi:
            return ""
        link = self.feed.current
        return f" on {link.label} ({link.feed.url})"

    def _tick(self) -> None:
        """The refresh timer. It can fire once more while the app shuts down its widgets."""
        if self.is_running:
            self.apply()

    def apply(self, force: bool = False) -> None:
        """Draw what was collected since the last call, on the visible tab only.

        Does nothing but the header while paused. The header follows every frame; tables
        redraw at most ``TABLE_HZ`` (each redraw re-renders every changed visible cell) and
        plots at most 1 Hz. ``force`` draws everything now.
        """
        if self.paused:
            self._draw_topbar()  # the PAUSED marker and the connection state stay live
            self._draw_banner()
            return
        c = self.collected
        self._check_truth()
        active = self.query_one(TabbedContent).active
        tick = time.monotonic()
        tables_due = force or tick - self._tables_at >= 1 / TABLE_HZ - 0.02  # timer jitter
        if tables_due:
            self._tables_at = tick
        stale = self.stale_label()
        if stale != self._applied_stale:
            # stale (greyed, with its age) or live again: every figure on screen is redrawn
            if (stale is None) != (self._applied_stale is None):
                self.screen.set_class(stale is not None, "-stale")  # the CSS greys the session table
                self._charts_at = 0.0
            self._applied_stale = stale
            self._applied_snapshot = -1
            self._applied_affinity = -1
            tables_due = True
        with self.batch_update():
            self._draw_topbar()
            self._draw_banner()
            self._draw_health()
            if active == "overview" and c.snapshot_seq != self._applied_snapshot and tables_due:
                self._applied_snapshot = c.snapshot_seq
                self.query_one(OverviewTab).draw()
            if active == "policy" and tables_due:
                self._draw_policy()  # current policy, knobs and shadows: from the latest snapshot
            screen = self.screen
            if tables_due and hasattr(screen, "refresh_live"):
                screen.refresh_live()  # a modal on top redraws from the latest snapshot too
            if active == "sessions":
                if c.snapshot_seq != self._applied_affinity:
                    self._applied_affinity = c.snapshot_seq
                    self.query_one(SessionsTab).draw_affinity()
                if self._sessions_seq != self._applied_sessions:
                    self._applied_sessions = self._sessions_seq
                    self.query_one(SessionsTab).draw_sessions()
            if active == "decisions" and c.decision_seq != self._applied_decision and tables_due:
                self.query_one(DecisionsTab).draw_decisions()
            now = self.clock()
            # Plots are the expensive part of a frame: at most 1 Hz, and only when on screen.
            if active in ("charts", "overview") and (force or now - self._charts_at >= 1.0):
                self._charts_at = now
                if active == "overview":
                    self.query_one(OverviewTab).draw_backlog()
                else:
                    self.query_one(ChartsTab).draw()

    def _update_static(self, selector: str, content: Text) -> None:
        """Update a Static only when its text changed: every update costs a layout pass."""
        key = (content.plain, tuple((sp.start, sp.end, str(sp.style)) for sp in content.spans))
        if self._static_cache.get(selector) != key:
            self._static_cache[selector] = key
            self.query_one(selector, Static).update(content)

    # header and banner
    def topbar_fields(self) -> list[tuple[str, str, int]]:
        """The header's fields as (text, style, priority): what ``fit_segments`` trims from,
        the least important first (the log path, the refresh rate, the URL, the uptime)."""
        snap = self.collected.snapshot or {}
        r = snap.get("router", {})
        tot = snap.get("totals", {})
        stale = self.stale_label()
        live = "dim" if stale else ""
        out: list[tuple[str, str, int]] = []

        def mark(text: str, style: str, prio: int) -> None:
            out.append((f" {text} ", style, prio))
            out.append((" ", "", prio))

        if self.paused:
            mark("⏸ PAUSED", "reverse bold", 100)
        if self.connecting:
            mark("⋯ connecting", "bold", 100)
        elif not self.collected.connected:
            mark("✖ DISCONNECTED" + (f" · {stale}" if stale else ""), "reverse bold", 100)
        if self.speed and self.speed != 1:
            mark(f"SIM ×{self.speed:g}", "bold", 40)
        if self.note:
            mark(self.note, "bold", 35)
        if self.readonly:
            mark("READ-ONLY", "bold", 60)
        elif not self.can_control:
            mark("READ-ONLY (no token)", "bold", 60)
        elif getattr(self.feed, "control_problem", None):
            # e.g. the router restarted with a token this dashboard cannot find
            mark(f"CONTROL UNAVAILABLE: {self.feed.control_problem}"[:60], "bold reverse", 70)
        log = r.get("decision_log") if isinstance(r.get("decision_log"), dict) else {}
        if r.get("db") and log.get("degraded"):
            # The writer is losing or failing rows (GET /health says degraded): say how.
            lost = ", ".join(f"{log[k]} {word}" for k, word in (("rows_dropped", "dropped"), ("rows_failed", "failed"))
                             if is_number(log.get(k)) and log[k])
            lag = f", {float(log['lag_s']):.0f} s behind" if is_number(log.get("lag_s")) and log["lag_s"] >= 1 else ""
            mark(f"⚠ rec DEGRADED{': ' + lost if lost else ''}{lag}", f"bold reverse {self._color('error')}", 80)
        elif r.get("db"):
            mark("● rec", "bold" if not stale else live, 30)
        dead = degraded_tasks(snap)
        if dead:
            mark(f"⚠ {len(dead)} task{'s' if len(dead) > 1 else ''} down: {', '.join(dead)}"[:48],
                 f"bold reverse {self._color('error')}", 85)
        down = [health_state(i)[0] for i in snap.get("instances", [])
                if not i.get("healthy") and fleet_state(i) != "removed"]
        if down.count("ejected"):
            mark(f"⏏ {down.count('ejected')} ejected", f"bold reverse {self._color('error')}" if not stale else live, 75)
        if down.count("down"):
            mark(f"✖ {down.count('down')} down", f"bold reverse {self._color('error')}" if not stale else live, 75)
        if r.get("draining"):
            mark("DRAINING", "bold" if not stale else live, 75)
        out.append((f"{r.get('policy', '?')}", "bold" if not stale else "bold dim", 90))
        # rates are frozen at the last snapshot while stale, and drawn dim
        out.append((f"  {float(tot.get('request_rate') or 0):.1f} req/s", live, 50))
        out.append((f"  up {fmt_duration(r.get('uptime_s'))}", live, 20))
        out.append((f"  {r.get('url') or self.url}", "", 15))
        out.append((f"  {self.hz:g} Hz", "dim", 10))
        if r.get("db"):  # last: the whole path where the width allows (it is printed on quit too)
            out.append((f"  log {r['db']}", "dim", 5))
        return out

    def _draw_topbar(self) -> None:
        """One line, never wrapped: the fields that fit, the least important trimmed first;
        the whole header is the tooltip (and the help lists every field)."""
        fields = self.topbar_fields()
        width = max(10, self.size.width - 2)  # the bar's padding
        t = Text(no_wrap=True, overflow="ellipsis")
        for text, style in fit_segments(fields, width):
            t.append(text, style=style)
        self._update_static("#topbar", t)
        full = "".join(text for text, _, _ in fields).strip()
        bar = self.query_one("#topbar", Static)
        if bar.tooltip != full:
            bar.tooltip = full
        if self.multi:
            self._draw_routers()

    def _draw_health(self) -> None:
        """The fleet's one-line health under the header: greyed with its age when stale."""
        snap = self.collected.snapshot
        if snap is None:
            self._update_static("#health", Text("fleet: waiting for the router's first snapshot", style="dim"))
            return
        stale = self.stale_label()
        key = (self.collected.snapshot_seq, stale, self._theme_seq)
        if key == self._health_key:
            return  # nothing new: the line is drawn once a snapshot (256 instances: once, not per frame)
        self._health_key = key
        line = health_line(snap)
        bad = any(not i.get("healthy") for i in snap.get("instances", []))
        t = Text(no_wrap=True, overflow="ellipsis")
        if stale:
            t.append(f"{stale}: ", style="bold")
            t.append(line, style="dim")
        else:
            t.append(line, style=f"bold {self._color('error')}" if bad else "bold")
        self._update_static("#health", t)

    def _draw_routers(self) -> None:
        """One line per router: policy, request rate, instances up, in flight, control, link."""
        snap = self.collected.snapshot or {}
        summary = {r.get("label"): r for r in snap.get("routers") or [] if isinstance(r, dict)}
        t = Text(no_wrap=True, overflow="ellipsis")
        for k, link in enumerate(self.feed.routers):
            if k:
                t.append("\n")
            r = summary.get(link.label) or {}
            chosen = k == self.feed.selected
            t.append(f"{'▶' if chosen else ' '} {link.label} ", style="bold reverse" if chosen else "bold")
            t.append(f" {link.feed.url}  ")
            if not link.connected:
                t.append(f"✖ unreachable: {link.error or 'connecting'}", style=f"bold {self._color('error')}")
                continue
            t.append(f"{r.get('policy') or '?'}", style="bold")
            t.append(f"  {float(r.get('request_rate') or 0):.1f} req/s  in flight {r.get('in_flight') or 0}")
            up, n = r.get("healthy_instances"), r.get("instances") or 0
            t.append(f"  {up if is_number(up) else '?'}/{n} up",
                     style="" if up == n else f"bold {self._color('error')}")
            if r.get("replicas"):  # router replicas: the shared view, or the own view when peers are lost
                t.append(f"  {r['replicas']}", style="" if r["replicas"].startswith("shared") and "lost" not in
                         r["replicas"] else f"bold {self._color('error')}")
            problem = getattr(link.feed, "control_problem", None)
            if self.readonly_flag or r.get("readonly"):
                t.append("  read-only", style="dim")
            elif not link.can_control:
                t.append("  read-only (no token)", style="dim")
            elif problem:
                t.append(f"  CONTROL UNAVAILABLE: {problem}", style="bold reverse")
            else:
                t.append("  control ok", style=self._color("success"))
        t.append("\n  R: next router (policy and knob changes act on ▶)", style="dim")
        self._update_static("#routers", t)

    @property
    def connecting(self) -> bool:
        """Not connected yet, and either nothing has failed or the start-up grace is not over."""
        c = self.collected
        return (not c.connected and not c.ever_connected
                and (c.error is None or time.monotonic() - self._started < self.connect_grace_s))

    def _draw_banner(self) -> None:
        c = self.collected
        banner = self.query_one("#banner", Static)
        if c.connected or self.connecting:
            if c.malformed_error:
                # The stream is up but the router sent something the API does not describe:
                # say so on one line and keep drawing what could be read.
                if not banner.display:
                    banner.display = True
                banner.set_class(True, "-malformed")
                msg = f"⚠ malformed data from the router ({c.malformed} so far, dropped or shown as –): {c.malformed_error}"
                self._update_static("#banner", Text(msg, style="bold", no_wrap=True, overflow="ellipsis"))
            elif banner.display:
                banner.display = False
            return
        if not banner.display:
            banner.display = True
        banner.set_class(False, "-malformed")
        self._update_static("#banner", Text(self.banner_text(), style="bold", no_wrap=True, overflow="ellipsis"))

    def banner_text(self) -> str:
        """Since when, why in words, when the next try is, and how old the figures below are."""
        c = self.collected
        now = time.time()
        since = ""
        if c.disconnected_at:
            since = (f" since {time.strftime('%H:%M:%S', time.localtime(c.disconnected_at))}"
                     f" ({fmt_duration(now - c.disconnected_at)})")
        retry = f"; next try in {max(0.0, c.retry_at - now):.0f} s" if c.retry_at else ""
        age = ""
        if c.snapshot:
            ts = c.snapshot.get("ts")
            when = time.strftime("%H:%M:%S", time.localtime(float(ts))) if is_number(ts) else "?"
            age = f"; every figure below is stale, from {when}"
        return f"✖ router unreachable{since}: {c.error or 'no connection yet'}{retry}{age}"

    # instances
    def _color(self, name: str) -> str:
        if not self._colors:
            v = self.get_css_variables()
            self._colors = {k: v.get(k, "") for k in ("warning", "error", "success", "text-muted")}
        return self._colors.get(name, "")

    def watch_theme(self, _theme: str) -> None:
        self._colors = {}
        self._theme_seq += 1  # the overview restyles every cell with the new theme's colours
        if self.is_mounted:
            self._applied_snapshot = -1
            self._static_cache.clear()
            self._remember_theme(_theme)

    def _remember_theme(self, theme: str) -> None:
        """Save a theme the user switched to in the config file; a write failure is one notice."""
        if (self.config_file is None or self._theme_saved is None or theme == self._theme_saved
                or self._config_write_failed):
            return
        from kvtop.tui.config import save_theme

        try:
            save_theme(self.config_file, theme)
        except (OSError, ValueError) as exc:
            self._config_write_failed = True  # notify once, then carry on without saving
            self.notify(f"cannot save the theme to {self.config_file}: {exc}", severity="warning", timeout=8)
            return
        self._theme_saved = theme

    def sort_label(self) -> str:
        """``prefill backlog ▼``: the sort as the operator reads it."""
        name = COLUMN_HELP.get(self.sort_key, (self.sort_key, ""))[0]
        return f"{name} {'▼' if self.sort_reverse else '▲'}"

    def _draw_policy(self) -> None:
        self.query_one(PolicyTab).draw()

    def _shadows(self) -> dict[str, Any]:
        sh = (self.collected.snapshot or {}).get("shadows")
        return sh if isinstance(sh, dict) else {}

    def shadow_rows(self) -> list[dict[str, Any]]:
        return [r for r in self._shadows().get("shadows") or [] if isinstance(r, dict) and isinstance(r.get("policy"), str)]

    def shadow_effect(self, row: dict[str, Any]) -> str:
        """A shadow in one line: its agreement so far and what its picks would have changed."""
        from kvtop.receipt import fmt_num

        picks = row.get("picks") if is_number(row.get("picks")) else 0
        agree = row.get("agreement")
        text = f"agrees {fmt_pct(agree)}% of {fmt_num(picks)} picks" if is_number(agree) else "no picks yet"
        saved = row.get("saved_prefill_tokens")
        if is_number(saved) and picks:
            text += f", est. prefill {'saved' if saved >= 0 else 'added'} {fmt_num(abs(saved))} tok"
        return text

    def _shadow_specs(self) -> list[dict[str, Any]]:
        """The shadow set as it is now, in PUT shadows' shape (each with its knobs, so kept ones keep counting)."""
        return [{"policy": r["policy"], "knobs": dict(r.get("knobs") or {})} for r in self.shadow_rows()]

    def action_shadows(self) -> None:
        """Shadow policies: add one, remove one, or promote one to active (a menu of each)."""
        if not self.control_enabled:
            return
        rows = self.shadow_rows()
        cur = self.current_policy().get("name")
        shadowed = {r["policy"] for r in rows}
        choices: list[dict[str, Any]] = []
        for r in rows:  # promotions first: S then Enter promotes, as S did before add and remove
            choices.append({"name": f"promote:{r['policy']}", "label": f"promote {r['policy']} to active",
                            "doc": self.shadow_effect(r)})
        for r in rows:
            choices.append({"name": f"remove:{r['policy']}", "label": f"remove shadow {r['policy']}",
                            "doc": "stop asking it; its counts end"})
        for p in self.policies_body.get("policies", []):
            if p["name"] != cur and p["name"] not in shadowed:
                choices.append({"name": f"add:{p['name']}", "label": f"add {p['name']} as a shadow",
                                "doc": doc_summary(p.get("doc"))})

        def picked(choice: str | None) -> None:
            if not choice:
                return
            verb, _, name = choice.partition(":")
            {"promote": self.promote_shadow, "remove": self.remove_shadow, "add": self.add_shadow}[verb](name)

        self.push_screen(PolicyPicker(choices, None, title="Shadow policies (asked on every request, never applied)"),
                         picked)

    def action_promote_shadow(self) -> None:
        """The shadow menu (kept as the S key's action name, so a remapped key keeps working)."""
        self.action_shadows()

    def add_shadow(self, name: str) -> None:
        before = self._shadow_specs()
        if any(s["policy"] == name for s in before):
            self.notify(f"{name} is already a shadow", severity="warning")
            return
        after = before + [{"policy": name, "knobs": {}}]
        self._confirm_shadows(f"Add shadow policy {name}{self.on_router()}", before, after)

    def remove_shadow(self, name: str) -> None:
        before = self._shadow_specs()
        after = [s for s in before if s["policy"] != name]
        self._confirm_shadows(f"Remove shadow policy {name}{self.on_router()}", before, after)

    def _confirm_shadows(self, title: str, before: list[dict[str, Any]], after: list[dict[str, Any]]) -> None:
        label = lambda specs: ", ".join(s["policy"] for s in specs) or "none"  # noqa: E731

        def confirmed(ok: bool | None) -> None:
            if ok:
                self._apply_shadows(after, None)

        self.push_screen(ConfirmScreen(title, [("shadows", label(before), label(after))]), confirmed)

    def promote_shadow(self, name: str) -> None:
        """Make a shadow the active policy (with its knobs); its shadowing ends with it, so no
        later agreement mixes the time before and after."""
        if not self.control_enabled:
            return
        if not any(r["policy"] == name for r in self.shadow_rows()):
            self.notify(f"{name} is not a shadow on this router", severity="warning")
            return

        def diff() -> list[tuple[str, Any, Any]]:
            # drawn again on every refresh while the dialog is open: the agreement keeps counting
            row = next((r for r in self.shadow_rows() if r["policy"] == name), {"policy": name})
            cur = self.current_policy()
            knobs = row.get("knobs") if isinstance(row.get("knobs"), dict) else {}
            out = [("policy", cur.get("policy", "?"), name), ("so far", "", self.shadow_effect(row)),
                   ("shadow " + name, "asked on every request", "ends (its count ends with it)")]
            out += [(f"knobs.{k}", (cur.get("knobs") or {}).get(k, "-"), v) for k, v in knobs.items()]
            return out

        def confirmed(ok: bool | None) -> None:
            if not ok:
                return
            row = next((r for r in self.shadow_rows() if r["policy"] == name), {})
            knobs = dict(row.get("knobs") or {}) if isinstance(row.get("knobs"), dict) else {}
            rest = [s for s in self._shadow_specs() if s["policy"] != name]
            self._apply_change("put_policy", name, knobs, then_shadows=rest)

        self.push_screen(ConfirmScreen(f"Promote shadow {name} to the active policy{self.on_router()}", diff),
                         confirmed)

    @work(exclusive=True, group="control")
    async def _apply_shadows(self, specs: list[dict[str, Any]], note: str | None) -> None:
        try:
            await self.feed.put_shadows(specs)
        except ControlError as exc:
            self.last_error = exc.message
            self.notify(exc.message, title=f"the router refused the shadow change{self.on_router()}",
                        severity="error", timeout=15)
            return
        self.last_error = None
        self.notify(note or ("shadows now: " + (", ".join(s["policy"] for s in specs) or "none")) + self.on_router(),
                    title="applied", timeout=4)

    def _schema(self, name: str | None) -> list[dict[str, Any]]:
        for p in self.policies_body.get("policies", []):
            if p["name"] == name:
                return list(p.get("knobs") or [])
        return []

    def _control_schema(self, name: str | None) -> list[dict[str, Any]]:
        """The policy's knobs, then the router-level ones (offload, admission) not shared with it."""
        own = self._schema(name)
        names = {k["name"] for k in own}
        router = [{**k, "router": True} for k in self.policies_body.get("features") or []
                  if k["name"] not in names]
        return own + router

    def _current_knobs(self) -> dict[str, Any]:
        cur = self.current_policy()
        return {**(cur.get("features") or {}), **(cur.get("knobs") or {})}

    def _refresh_controls(self) -> None:
        show = self.control_enabled
        for bid in ("#btn-policy", "#btn-knobs"):
            self.query_one(bid, Button).display = show
        self.refresh_bindings()

    # -- actions --------------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("switch_policy", "edit_knobs", "promote_shadow", "shadows"):
            return self.control_enabled
        if action == "next_router":
            return self.multi
        return True

    def action_next_router(self) -> None:
        """With several routers: the next one becomes the one control acts on."""
        if not self.multi:
            return
        self.feed.select(self.feed.selected + 1)
        self.policies_body = {"current": {}, "policies": []}
        self.last_error = None
        self._refresh_controls()
        self._load_policies()
        self.notify(f"policy and knob changes now act{self.on_router()}", timeout=3)
        self.apply(force=True)

    # -- fleet: cordon, drain, uncordon, remove the selected instance ------------------------------
    def _fleet_target(self) -> str | None:
        """The instance the fleet keys act on: the open instance detail's, else the overview's
        selected row; None elsewhere."""
        from kvtop.tui.screens import InstanceScreen

        if isinstance(self.screen, InstanceScreen):
            return self.screen.instance
        if len(self.screen_stack) > 1 or self.query_one(TabbedContent).active != "overview":
            return None
        table = self.query_one("#instances", DataTable)
        if not table.row_count or table.cursor_row < 0:
            return None
        try:
            return str(table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value)
        except Exception:  # no cell at the cursor
            return None

    def _instance(self, name: str) -> dict[str, Any] | None:
        return next((i for i in (self.collected.snapshot or {}).get("instances", []) if i.get("name") == name), None)

    def action_fleet(self, verb: str) -> None:
        """Cordon, drain, uncordon or remove the selected instance: a confirmation that says
        what changes (a drain's progress, kept live), then ``POST fleet/{instance}/{verb}``."""
        name = self._fleet_target()
        if name is None:
            self.notify(f"{verb}: select an instance first (a row of the overview, 1, or its detail, Enter)",
                        severity="warning", timeout=5)
            return
        if self.readonly:
            self.notify(f"read-only: fleet changes are off, {name} is not changed", severity="warning", timeout=8)
            return
        if not self.can_control:
            self.notify(f"cannot {verb} {name}: no control token for this router. Pass --token-file or set "
                        "$KVTOP_CONTROL_TOKEN (kvtop fleet needs it too)", title="read-only", severity="error",
                        timeout=10)
            return
        inst = self._instance(name)
        if inst is None:
            self.notify(f"{name} is not in the router's latest snapshot", severity="warning")
            return
        before, after = fleet_state(inst), FLEET_AFTER[verb]
        if before == after or before == "removed":
            self.notify(f"{name} is {before} already" if before == after
                        else f"{name} was removed: add it again with kvtop fleet add", severity="warning")
            return
        in_flight = inst.get("num_requests") if is_number(inst.get("num_requests")) else 0
        force = verb == "remove" and in_flight > 0  # the dialog says so: they are cut off

        def diff() -> list[tuple[str, Any, Any]]:
            # drawn again on every refresh while the dialog is open: a drain's progress keeps moving
            cur = self._instance(name) or inst
            out: list[tuple[str, Any, Any]] = [("fleet state", fleet_state(cur), after),
                                               ("what it means", "", FLEET_VERBS[verb])]
            homed = (((self.collected.snapshot or {}).get("affinity") or {}).get("per_instance") or {}).get(name)
            n = cur.get("num_requests") if is_number(cur.get("num_requests")) else 0
            if verb in ("drain", "remove"):
                out.append(("requests in flight", n, "cut off: each is retried elsewhere if nothing reached its "
                            "client yet (forced remove)" if force else "finish there"))
            if is_number(homed) and verb != "uncordon":
                out.append(("sessions homed there", homed, "each moves at its next turn"
                            if verb != "cordon" else "keep coming"))
            return out

        def confirmed(ok: bool | None) -> None:
            if ok:
                self._apply_fleet(name, verb, force)

        title = f"{'Force-remove' if force else verb.capitalize()} instance {name}{self.on_router()}"
        self.push_screen(ConfirmScreen(title, diff), confirmed)

    @work(exclusive=True, group="control")
    async def _apply_fleet(self, name: str, verb: str, force: bool) -> None:
        try:
            out = await self.feed.fleet_action(name, verb, force)
        except ControlError as exc:
            self.last_error = exc.message
            self.notify(exc.message, title=f"the router refused to {verb} {name}{self.on_router()}",
                        severity="error", timeout=15)
            return
        self.last_error = None
        self.notify(f"{name}: {out.get('before') or '?'} → {out.get('after') or '?'}{self.on_router()}",
                    title="applied", timeout=4)

    def action_columns(self) -> None:
        """Choose the instance table's columns; the choice is saved to the config file."""
        from kvtop.tui.screens import ColumnChooser

        tab = self.query_one(OverviewTab)
        choices = [(key, label, column_legend(key) or "") for key, label, _ in INSTANCE_COLUMNS + tab._optional
                   if key != "name"]

        def chosen(hidden: set[str] | None) -> None:
            if hidden is None or hidden == self.hidden_columns:
                return
            self.hidden_columns = set(hidden)
            tab.build_columns()
            self._applied_snapshot = -1
            self.apply(force=True)
            tab.sort_instances()
            self._save_config("hidden_columns", sorted(self.hidden_columns))

        self.push_screen(ColumnChooser(choices, self.hidden_columns), chosen)

    def _save_config(self, key: str, value: Any) -> None:
        if self.config_file is None or self._config_write_failed:
            return
        from kvtop.tui.config import save_setting

        try:
            save_setting(self.config_file, key, value)
        except (OSError, ValueError) as exc:
            self._config_write_failed = True  # notify once, then carry on without saving
            self.notify(f"cannot save {key} to {self.config_file}: {exc}", severity="warning", timeout=8)
            return
        self.notify(f"saved to {self.config_file}", timeout=3)

    def compact_active(self, instances: int) -> bool:
        """Whether the overview shows only the rows that fit (automatic from COMPACT_MIN)."""
        return instances >= COMPACT_MIN if self.compact is None else self.compact

    def action_compact(self) -> None:
        n = len((self.collected.snapshot or {}).get("instances", []))
        self.compact = not self.compact_active(n)
        self.notify("condensed: the rows that fit, the rest summed" if self.compact else "every instance a row",
                    timeout=2)
        self._applied_snapshot = -1
        self.apply(force=True)

    def action_pause(self) -> None:
        self.paused = not self.paused
        self.apply(force=True)

    def action_sort(self) -> None:
        i = SORT_KEYS.index(self.sort_key) if self.sort_key in SORT_KEYS else -1
        self.set_sort(SORT_KEYS[(i + 1) % len(SORT_KEYS)])
        self.notify(f"sort: {self.sort_label()}", timeout=2)

    @on(DataTable.HeaderSelected, "#instances")
    def _header_clicked(self, event: DataTable.HeaderSelected) -> None:
        """A click on a column header sorts by it; a second click on it reverses."""
        key = str(event.column_key.value)
        if key not in SORT_KEYS and key not in (MEASURED_TPS_COLUMN[0], "drift", "share"):
            key = "backlog_tokens"  # the trend column sorts by the backlog it draws
        if key == self.sort_key:
            self.action_reverse()
        else:
            self.set_sort(key)

    def set_sort(self, key: str, reverse: bool | None = None) -> None:
        self.sort_key = key
        if reverse is not None:
            self.sort_reverse = reverse
        elif key in ("name",):
            self.sort_reverse = False
        else:
            self.sort_reverse = True  # busiest first for load columns
        self.query_one(OverviewTab).sort_instances()
        self.query_one(OverviewTab).draw_totals()

    def action_reverse(self) -> None:
        self.sort_reverse = not self.sort_reverse
        self.query_one(OverviewTab).sort_instances()
        self.query_one(OverviewTab).draw_totals()

    def action_tab(self, tab: str) -> None:
        self.query_one(TabbedContent).active = tab
        self._focus_tab_table()
        self.apply(force=True)

    def _focus_tab_table(self) -> None:
        """Give the visible tab's table the keys, so Enter and the arrows act on it at once."""
        pane = self.query_one(TabbedContent).active_pane
        table = pane.query(DataTable).first() if pane is not None and pane.query(DataTable) else None
        if table is not None and not isinstance(self.focused, Input):
            table.focus()

    @on(TabbedContent.TabActivated)
    def _tab_changed(self, event: TabbedContent.TabActivated) -> None:
        self._focus_tab_table()
        if self.query_one(TabbedContent).active == "sessions":
            self._fetch_sessions()
        if self.query_one(TabbedContent).active == "policy":
            self._draw_policy()
        self.apply(force=True)

    def action_filter(self) -> None:
        active = self.query_one(TabbedContent).active
        if active not in self.filters:
            self.notify("filter works on the overview, sessions and decisions tabs", timeout=3)
            return
        inp = self.query_one("#filter", Input)
        inp.display = True
        inp.value = self.filters[active]
        inp.focus()

    @on(Input.Changed, "#filter")
    def _filter_typed(self, event: Input.Changed) -> None:
        self.set_filter(event.value)

    @on(Input.Submitted, "#filter")
    def _filter_done(self, event: Input.Submitted) -> None:
        event.input.display = bool(event.value)
        self.query_one(TabbedContent).active_pane.query(DataTable).first().focus()  # type: ignore[union-attr]

    def set_filter(self, query: str) -> None:
        active = self.query_one(TabbedContent).active
        if active not in self.filters or self.filters[active] == query:
            return
        self.filters[active] = query
        if active == "decisions":
            self.query_one(DecisionsTab).draw_decisions(rebuild=True)
        elif active == "sessions":
            self.query_one(SessionsTab).draw_sessions()
        else:
            self.query_one(OverviewTab).draw_instances()
            self.query_one(OverviewTab).draw_totals()

    def action_clear_filter(self) -> None:
        inp = self.query_one("#filter", Input)
        if inp.display or any(self.filters.values()):
            inp.value = ""
            self.set_filter("")
            inp.display = False

    def action_faster(self) -> None:
        self._set_hz(next((h for h in HZ_STEPS if h > self.hz), HZ_STEPS[-1]))

    def action_slower(self) -> None:
        self._set_hz(next((h for h in reversed(HZ_STEPS) if h < self.hz), HZ_STEPS[0]))

    def _set_hz(self, hz: float) -> None:
        self.hz = hz
        self.feed.set_hz(hz)
        if self.apply_timer:
            self._timer.stop()
            self._timer = self.set_interval(1 / hz, self._tick)
        self._draw_topbar()

    def action_window(self, step: int) -> None:
        i = WINDOWS_S.index(self.window_s) if self.window_s in WINDOWS_S else 2
        self.window_s = WINDOWS_S[max(0, min(len(WINDOWS_S) - 1, i + step))]
        self.notify(f"chart window {self.window_s} s", timeout=2)
        self._charts_at = 0.0
        self.apply(force=True)

    def key_names(self, binding_id: str, default: str) -> str:
        """The keys bound to ``binding_id`` now (a remap included), as a person writes them:
        ``?``, ``[``, ``+ / =``, ``^c``, not Textual's ``question_mark``."""
        keys = [k for k, ab in self.active_bindings.items() if ab.binding.id == binding_id] or default.split(",")
        return " / ".join(dict.fromkeys(self.get_key_display(Binding(k.strip(), "")) for k in keys))

    def help_text(self) -> Text:
        """Every key with its human name and its binding id, the header's fields, then the
        overview's column legend. Built as Text, never markup: a key such as ``[`` is a key."""
        t = Text()

        def key_line(keys: str, what: str, bid: str = "") -> None:
            t.append(f"  {keys:<10}", style="bold")
            t.append(f" {what}")
            if bid:
                t.append(f"  {bid}", style="dim")
            t.append("\n")

        t.append("kvtop attach: keys\n\n", style="bold")
        for b in self.BINDINGS:
            if isinstance(b, Binding) and b.id:
                if b.action in ("switch_policy", "edit_knobs", "shadows") and not self.control_enabled:
                    continue
                if b.action == "next_router" and not self.multi:
                    continue
                key_line(self.key_names(b.id, b.key), f"{b.description:<10}", b.id)
        key_line("enter", "on an instance: its detail (sessions, decisions, KV, GPU, errors); on a decision: "
                          "its receipt; on a session: its turns")
        key_line("c d u x", "cordon, drain, uncordon, remove the selected instance (an overview row or its "
                            "detail): each shows what changes and asks first; needs the control token")
        key_line("c", "in a receipt or a session: copy its id")
        if not self.multi:
            key_line("R", "next router (with several URLs: attach URL URL ...)")
        key_line("^p", "command palette: policies, knobs, shadows, columns, themes (kvtop-light, kvtop-cb)")
        t.append("  click a column header to sort by it; again to reverse\n")
        t.append("  filter: words, or reason:X instance:Y session:Z class:C" + (" router:R" if self.multi else "") + "\n")
        t.append("\nHeader\n\n", style="bold")
        t.append("  marks (paused, disconnected with its age, read-only, recording, instances down), the policy@version, "
                 "req/s, uptime, router URL, refresh rate, decision log path. On a narrow screen the last ones are "
                 "left out first; hover the header for all of it. The line under it is the fleet's health: instances "
                 "up, in flight, backlog, decode, est. hit, errors, routed. Grey with 'stale Ns': the router is "
                 "unreachable and the figures are from the last snapshot.\n")
        t.append("\nOverview columns\n\n", style="bold")
        for key, label, _ in INSTANCE_COLUMNS + OPTIONAL_COLUMNS:
            t.append(f"  {label:<13}", style="bold")
            t.append(f" {column_legend(key) or ''}"
                     + (" (when the router reports it)" if (key, label, _) in OPTIONAL_COLUMNS else "") + "\n")
        t.append("\n▲/▼ after a value: it rose/fell since the last frame. Bold: moderate load; reverse video: heavy. "
                 "– : the router did not report it.\n")
        t.append("\nThe dim names are binding ids, for remapping keys. Esc closes.", style="")
        return t

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.help_text()))

    @on(Button.Pressed, "#btn-policy")
    def action_switch_policy(self) -> None:
        if not self.control_enabled:
            return
        cur = self.current_policy().get("name")

        def picked(name: str | None) -> None:
            if name:
                self.switch_policy_to(name)

        self.push_screen(PolicyPicker(self.policies_body.get("policies", []), cur), picked)

    def switch_policy_to(self, name: str) -> None:
        if not self.control_enabled:
            self.notify("read-only: policy changes are off", severity="warning")
            return
        cur = self.current_policy()
        diff = [("policy", cur.get("policy", "?"), name)]
        new_schema = self._schema(name)
        for k in new_schema:
            diff.append((f"knobs.{k['name']}", (cur.get("knobs") or {}).get(k["name"], "-"), k.get("default")))

        def confirmed(ok: bool | None) -> None:
            if ok:
                self._apply_change("put_policy", name, {})

        self.push_screen(ConfirmScreen(f"Switch policy to {name}{self.on_router()} (knobs at their defaults)", diff),
                         confirmed)

    @on(Button.Pressed, "#btn-knobs")
    def action_edit_knobs(self) -> None:
        if not self.control_enabled:
            return
        cur = self.current_policy()
        schema = self._control_schema(cur.get("name"))
        knobs = self._current_knobs()

        def edited(changed: dict[str, Any] | None) -> None:
            if not changed:
                return
            diff = [(k, knobs.get(k, "-"), v) for k, v in changed.items()]

            def confirmed(ok: bool | None) -> None:
                if ok:
                    self._apply_change("patch_knobs", None, changed)

            self.push_screen(ConfirmScreen(f"Change knobs of {cur.get('policy', '?')}{self.on_router()}", diff),
                             confirmed)

        def live() -> tuple[str, dict[str, Any]]:
            return str(self.current_policy().get("name", "?")), self._current_knobs()

        self.push_screen(KnobForm(str(cur.get("name", "?")), schema, knobs, live=live), edited)

    @work(exclusive=True, group="control")
    async def _apply_change(self, call: str, name: str | None, knobs: dict[str, Any],
                            then_shadows: list[dict[str, Any]] | None = None) -> None:
        try:
            if call == "put_policy":
                result = await self.feed.put_policy(str(name), knobs)
            else:
                result = await self.feed.patch_knobs(knobs)
        except ControlError as exc:
            self.last_error = exc.message
            self.notify(exc.message, title=f"the router refused the change{self.on_router()}", severity="error",
                        timeout=15)
            self._draw_policy()
            return
        self.last_error = None
        note = f"now {result.get('policy')}{self.on_router()}"
        if then_shadows is not None:  # a promotion: the promoted policy stops shadowing itself
            try:
                await self.feed.put_shadows(then_shadows)
            except ControlError as exc:
                self.last_error = f"{note}, but its shadow was not removed: {exc.message}"
                self.notify(self.last_error, severity="error", timeout=15)
                self._load_policies()
                return
            note += f"; shadow {name} ended"
        self.notify(note, title="applied", timeout=4)
        self._load_policies()
