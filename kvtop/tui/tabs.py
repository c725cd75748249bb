"""The five tabs of ``kvtop attach``, one widget each, over the app's one data model.

Each tab is a ``TabPane`` that composes its own widgets (the ids the CSS and the tests use) and
draws them from ``app.collected`` and the app's view state (filters, sort, chart window). The
app (kvtop/tui/app.py) decides when: it calls the visible tab's draw methods from ``apply``.
"""

from __future__ import annotations

import time
from typing import Any

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, DataTable, Static, TabPane
from textual_plotext import PlotextPlot

from kvtop.receipt import fmt_num
from kvtop.tui.axis import set_y_ticks
from kvtop.tui.model import (MISSING, DRIFT_COLUMN, FLEET_MIN, GPU_BUSY_PCT, INSTANCE_COLUMNS, LOW_HIT_RATE,
                             MEASURED_TPS_COLUMN, SHARE_COLUMN, THRESHOLDS, column_legend, config_change_text,
                             decision_matches,
                             doc_summary, drain_progress, drift_of, fit_id, fleet_note, fleet_state,
                             fleet_strips, fmt_drift, fmt_duration, fmt_int,
                             fmt_latency, fmt_pct, fmt_secs, gpu_cells, health_state, instance_values, is_number,
                             natural_key, sort_value, sparkline, terms_summary)
from kvtop.tui.screens import ReceiptScreen, SessionScreen
from kvtop.tui.widgets import LiveTable


#: One marker per series, so a legend entry is told apart by its glyph, not its colour alone.
MARKERS = ("braille", "•", "+", "x", "*", "o", "#", "=")


def chart_now(app: Any) -> float:
    """The charts' "now": the latest snapshot's time, else the app's clock."""
    now = app.clock()
    snap = app.collected.snapshot or {}
    if snap.get("ts"):
        now = float(snap["ts"])
    return now


def draw_backlog(app: Any, backlog: PlotextPlot) -> None:
    """The prefill backlog per instance over the chart window: the overview's plot and the charts tab's."""
    now = chart_now(app)
    c = app.collected
    w = app.window_s
    plt = backlog.plt
    plt.clear_data()
    plt.clear_figure()
    stale = app.stale_label()
    plt.title(f"prefill backlog tokens per instance (last {w}s; [ ] window)" + (f" · {stale}" if stale else ""))
    ranked = sorted(c.backlog.items(), key=lambda kv: -(kv[1][-1][1] if kv[1] else 0))
    plotted: list[float] = []
    for k, (name, ring) in enumerate(ranked[:8]):  # more lines is noise; the table has every instance
        pts = [(ts - now, v) for ts, v in ring if now - w <= ts <= now]  # plotext raises on a series
        if pts:                                                           # wholly outside xlim
            plt.plot([p[0] for p in pts], [p[1] for p in pts], label=name, marker=MARKERS[k % len(MARKERS)])
            plotted += [p[1] for p in pts]
    set_y_ticks(plt, plotted, "count", rows=backlog.size.height, integer=True)
    plt.xlim(-w, 0)
    plt.xlabel("seconds ago")
    backlog.refresh()


class BacklogPlot(PlotextPlot):
    """The overview's backlog plot: its y ticks are chosen for its height (``set_y_ticks``), so a
    change of height (the notes under the table grow or shrink) draws it again at once rather
    than at the next 1 Hz plot frame, with ticks for the old height until then."""

    def on_resize(self, event: Any) -> None:
        pane = next((a for a in self.ancestors if isinstance(a, OverviewTab)), None)
        if pane is not None and getattr(self.app, "collected", None) is not None:
            pane.draw_backlog()


class OverviewTab(TabPane):
    """Instances table, fleet strips, totals and the backlog plot."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._cells: dict[str, dict[str, tuple]] = {}
        self._sort_values: dict[str, dict[str, Any]] = {}
        self._gpu_na: str | None = None
        self._health_notes: dict[str, str] = {}  # instance -> why it is down or ejected
        #: columns added when the data has them, at the end, in the order they appeared: the
        #: measured prefill rate, KV-event drift, several routers' in-flight shares
        self._optional: list[tuple[str, str, int]] = []
        self._hidden: list[dict[str, Any]] = []  # condensed: the instances not on a row
        self._theme_seq = -1  # the app's theme change count the cells were drawn under

    def compose(self) -> ComposeResult:
        yield Static(id="fleet")
        yield LiveTable(id="instances", cursor_type="row", zebra_stripes=True, fixed_columns=1)
        yield Static(id="totals")
        yield BacklogPlot(id="overview-backlog")

    def on_mount(self) -> None:
        self.watch(self.query_one("#instances", DataTable), "hover_coordinate", self._header_tooltip, init=False)

    def _header_tooltip(self, coordinate: Any) -> None:
        """Over a column header, the tooltip says what the column means: the help's legend text."""
        table = self.query_one("#instances", DataTable)
        tip = None
        columns = table.ordered_columns
        if coordinate.row == -1 and 0 <= coordinate.column < len(columns):
            tip = column_legend(str(columns[coordinate.column].key.value))
        if table.tooltip != tip:
            table.tooltip = tip

    def draw(self) -> None:
        self.draw_instances()
        self.draw_fleet()
        self.draw_totals()

    def draw_backlog(self) -> None:
        draw_backlog(self.app, self.query_one("#overview-backlog", PlotextPlot))

    def _levelled(self, text: str, level: int, arrow: str = "") -> Text:
        app: Any = self.app
        if level == 2:
            return Text(f"{text}{arrow}", style=f"bold reverse {app._color('error')}")
        if level == 1:
            return Text(f"{text}{arrow}", style=f"bold {app._color('warning')}")
        return Text(f"{text}{arrow}")

    def _instance_values(self, inst: dict[str, Any], now: float) -> dict[str, Any]:
        """The row's raw values (what sorts and what the arrows compare), its health or fleet
        note and its optional columns' values: cheap, for every instance on every frame."""
        app: Any = self.app
        v = instance_values(inst, app.collected.instance_ttft(str(inst.get("name")), now))
        name = v["name"]
        state, reason = health_state(inst)
        fleet = fleet_state(inst)
        v["_health"] = (state, fleet, drain_progress(inst) if fleet == "draining" else None)
        if fleet == "removed":
            note = fleet_note(inst)
        elif reason:
            note = f"{name} {'ejected' if state == 'ejected' else 'down'}: {reason}"
        else:
            per = ((app.collected.snapshot or {}).get("affinity") or {}).get("per_instance") or {}
            note = fleet_note(inst, per.get(name))
        if note:
            self._health_notes[name] = note
        else:
            self._health_notes.pop(name, None)
        share, source = drift_of(inst)
        if share is not None or source is not None:
            v["drift"] = share
            v["_drift"] = (share, source)
        routers = inst.get("routers")
        if isinstance(routers, dict) and routers:
            v["share"] = tuple(int(n) if is_number(n) else 0 for n in routers.values())
        return v

    def _health_cell(self, v: dict[str, Any]) -> tuple:
        """The health column: a problem first (down, ejected), then the fleet state, with a glyph
        and a word (colour is never the only signal)."""
        app: Any = self.app
        state, fleet, drain = v["_health"]
        if fleet == "removed":
            return (v["_health"], Text("✕ removed", style="dim"))
        if state != "up":
            return (v["_health"], Text("⏏ ejected" if state == "ejected" else "✖ DOWN",
                                       style=f"bold reverse {app._color('error')}"))
        if fleet == "draining":
            return (v["_health"], Text("⇣ drained" if drain and drain[2] else "⇣ draining",
                                       style=f"bold {app._color('warning')}"))
        if fleet == "cordoned":
            return (v["_health"], Text("⊘ cordoned", style=f"bold {app._color('warning')}"))
        return (v["_health"], Text("● up", style=app._color("success")))

    def _instance_cells(self, inst: dict[str, Any], v: dict[str, Any], prev: dict[str, Any] | None
                        ) -> dict[str, tuple]:
        """Column key -> (comparable, renderable): only for the rows on the table."""
        app: Any = self.app

        def arrow(key: str) -> str:
            if prev is None or prev.get(key) is None or v[key] is None:
                return "  "
            return " ▲" if v[key] > prev[key] else " ▼" if v[key] < prev[key] else "  "

        util, mem, why = gpu_cells(inst.get("gpu"))
        cells: dict[str, tuple] = {}
        cells["name"] = (v["name"], v["name"])
        cells["health"] = self._health_cell(v)
        for key in ("ttft_p50", "ttft_p90"):
            cells[key] = (v[key], fmt_latency(v[key]))
        errors = v["errors"]
        cells["errors"] = (errors, Text(fmt_int(errors), style=f"bold {app._color('error')}") if errors
                           else Text("0" if errors == 0 else "–", style="dim"))
        if v["prefill_tps"] is not None:
            cells["prefill_tps"] = (v["prefill_tps"], fmt_int(v["prefill_tps"]))
        if "_drift" in v:
            share, source = v["_drift"]
            # an estimate that is off, or an index that is not exact, is worth a look
            bad = (share is not None and share >= 0.05) or source not in (None, "exact")
            cells["drift"] = ((share, source), self._levelled(fmt_drift(share, source), 1) if bad
                              else fmt_drift(share, source))
        if "share" in v:
            counts = v["share"]
            total = sum(counts)
            text = "/".join(map(str, counts)) + (
                "  " + "/".join(f"{100 * n / total:.0f}" for n in counts) + "%" if total else "")
            cells["share"] = (counts, text)
        lv = THRESHOLDS["requests"].level(v["requests"])
        a = arrow("requests")
        cells["requests"] = ((v["requests"], a, lv), self._levelled(str(v["requests"]), lv, a))
        lv = THRESHOLDS["backlog_s"].level(v["backlog_s"])
        a = arrow("backlog_tokens")
        cells["backlog_tokens"] = ((v["backlog_tokens"], a, lv), self._levelled(fmt_int(v["backlog_tokens"]), lv, a))
        cells["backlog_s"] = ((v["backlog_s"], lv), self._levelled(fmt_secs(v["backlog_s"]), lv))
        cells["decode_requests"] = (v["decode_requests"], str(v["decode_requests"]))
        cells["decode_tokens"] = (v["decode_tokens"], fmt_int(v["decode_tokens"]))
        for key in ("est_hit", "engine_hit"):
            low = is_number(v[key]) and v[key] < LOW_HIT_RATE
            cells[key] = (v[key], self._levelled(fmt_pct(v[key]) + ("↓" if low else ""), 1) if low
                          else fmt_pct(v[key]))
        lv = THRESHOLDS["kv"].level(v["kv"])
        cells["kv"] = ((v["kv"], lv), self._levelled(fmt_pct(v["kv"]), lv))
        if why:
            cells["gpu_util"] = (why, Text(MISSING, style="dim"))
            cells["gpu_mem"] = (why, Text(MISSING, style="dim"))
            self._gpu_na = why
        else:
            busy = is_number(v["gpu_util"]) and v["gpu_util"] >= GPU_BUSY_PCT
            cells["gpu_util"] = ((util, busy), Text(util, style=app._color("success")) if busy else Text(util))
            cells["gpu_mem"] = (mem, mem)
        ring = app.collected.backlog.get(v["name"])
        spark = sparkline([x for _, x in list(ring)[-12:]]) if ring else ""
        cells["trend"] = (spark, spark)
        stale = app.stale_s
        if stale is not None:
            # The router is unreachable: every figure is the last snapshot's. Grey, and the
            # health cell says how old, so no row reads as live "up".
            for key, (cmp, rend) in list(cells.items()):
                cells[key] = ((cmp, "stale"), Text(rend.plain if isinstance(rend, Text) else str(rend), style="dim"))
            label = f"stale {int(stale)}s" if stale < 1000 else "stale"
            cells["health"] = (("stale", label), Text(label, style="bold dim"))
        return cells

    def draw_instances(self) -> None:
        app: Any = self.app
        if self._theme_seq != app._theme_seq:  # a theme change: rewrite every row in its colours
            self._theme_seq = app._theme_seq
            self._cells.clear()
        table = self.query_one("#instances", DataTable)
        snap = app.collected.snapshot or {}
        insts = snap.get("instances", [])
        query = app.filters["overview"].lower()
        if query:
            insts = [i for i in insts if query in str(i.get("name", "")).lower()]
        names = {i["name"] for i in insts}
        prev_values = self._sort_values
        sort_changed = False
        # rows removed above the cursor would move it onto another instance: remember which
        selected = self._selected()
        for key in [k for k in table.rows if k.value not in names]:
            table.remove_row(key)
            self._cells.pop(str(key.value), None)
        for name in [n for n in self._health_notes if n not in names]:
            self._health_notes.pop(name)
        have = {c[0] for c in self._optional}
        for col, present in ((MEASURED_TPS_COLUMN, lambda i: i.get("prefill_tps_measured") is not None),
                             (DRIFT_COLUMN, lambda i: isinstance(i.get("kv_events"), dict)),
                             (SHARE_COLUMN, lambda i: isinstance(i.get("routers"), dict))):
            if col[0] not in have and any(present(i) for i in insts):
                # The data has it (a router that measures prefill rates, KV events, several
                # routers): one more column, at the end.
                key, label, width = col
                self._optional.append(col)
                if key not in app.hidden_columns:
                    table.add_column(label, key=key, width=max(width, len(label) + 1), default="–")
                self._cells.clear()  # every row gets the new cell
        columns = self.visible_columns()
        snap_ts = snap.get("ts")
        now = float(snap_ts) if is_number(snap_ts) else app.clock()
        # Values for every instance (the sort, the notes, the condensed summary need them);
        # cells, the costly part, only for the rows on the table.
        values = {inst["name"]: self._instance_values(inst, now) for inst in insts}
        self._sort_values = values
        self._hidden = []
        if app.compact_active(len(snap.get("instances", []))):
            # Condensed: the rows that fit, busiest first by the current sort; the rest are
            # summed on one line under the table (and drawn in the fleet strips above it).
            order = sorted(values, key=self._sort_key(), reverse=app.sort_reverse)
            rows = self.compact_rows()
            # instances out of rotation (cordoned, draining) or down keep their rows, up to half
            # of them, however idle: they are what the operator is watching (and acting on)
            watched = [n for n in order if values[n]["_health"][1] in ("cordoned", "draining")
                       or (values[n]["_health"][0] != "up" and values[n]["_health"][1] != "removed")][:rows // 2]
            if selected is not None and str(selected.value) in values:
                watched.append(str(selected.value))  # the selected row stays: the keys act on it
            shown = set(watched)
            shown.update([n for n in order if n not in shown][:rows - len(shown)])
            self._hidden = [i for i in insts if i["name"] not in shown]
            insts = [i for i in insts if i["name"] in shown]
            for key in [k for k in table.rows if k.value not in shown]:
                table.remove_row(key)
                self._cells.pop(str(key.value), None)
        for inst in insts:
            name = inst["name"]
            cells = self._instance_cells(inst, values[name], prev_values.get(name))
            for key, _, _ in self._optional:
                cells.setdefault(key, (None, "–"))
            old = self._cells.get(name)
            if name not in table.rows:
                table.add_row(*[cells[k][1] for k in columns], key=name)
                sort_changed = True
            else:
                # No cached cells (a theme change drops them to restyle): rewrite the whole row.
                changed = {key: cells[key][1] for key in columns if old is None or old[key][0] != cells[key][0]}
                table.set_cells(name, changed)
                if app.sort_key in changed or (app.sort_key == "backlog_s" and "backlog_tokens" in changed):
                    sort_changed = True
                if prev_values.get(name, {}).get(app.sort_key) != values[name].get(app.sort_key):
                    sort_changed = True
            self._cells[name] = cells
        if sort_changed:
            self.sort_instances(selected)
        elif selected is not None and selected in table.rows and self._selected() != selected:
            table.move_cursor(row=table.get_row_index(selected), animate=False)

    def visible_columns(self) -> list[str]:
        """The column keys on screen: every column but those the chooser hid (the name stays)."""
        app: Any = self.app
        return [k for k, _, _ in INSTANCE_COLUMNS + self._optional if k == "name" or k not in app.hidden_columns]

    def build_columns(self) -> None:
        """(Re)make the table's columns from the chooser's choice; every row is drawn again."""
        app: Any = self.app
        table = self.query_one("#instances", DataTable)
        table.clear(columns=True)
        self._cells.clear()
        for key, label, width in INSTANCE_COLUMNS + self._optional:
            if key == "name" or key not in app.hidden_columns:
                table.add_column(label, key=key, width=max(width, len(label) + 1), default="–")

    @on(DataTable.RowSelected, "#instances")
    def open_instance(self, event: DataTable.RowSelected) -> None:
        """Enter on an instance: its detail (load, health, KV, GPU, errors, sessions, decisions)."""
        from kvtop.tui.screens import InstanceScreen

        self.app.push_screen(InstanceScreen(str(event.row_key.value)))

    def compact_rows(self) -> int:
        """How many instance rows fit (the table takes at most 60% of the tab), header and the
        summary line aside."""
        height = self.size.height
        return max(4, int(height * 0.6) - 2) if height else 20

    def _sort_key(self) -> Any:
        """The overview's order as a key on instance names (or their name cells)."""
        app: Any = self.app
        key = app.sort_key
        values = self._sort_values
        names = sorted(values, key=natural_key)
        # Ties (idle instances all have backlog 0) by requests, then by name, a-z whichever
        # way the column runs: the order never flickers between equal rows.
        rank = {n: (-k if app.sort_reverse else k) for k, n in enumerate(names)}

        def by(name_cell: Any) -> Any:
            name = str(getattr(name_cell, "plain", name_cell))
            v = values.get(name, {})
            return (sort_value(v.get(key)), sort_value(v.get("requests")), rank.get(name, 0))

        return by

    def _selected(self) -> Any:
        """The row key under the cursor (None: an empty table)."""
        table = self.query_one("#instances", DataTable)
        if table.row_count and table.cursor_row >= 0:
            try:
                return table.coordinate_to_cell_key(table.cursor_coordinate).row_key
            except Exception:  # no cell at the cursor (an empty table)
                return None
        return None

    def sort_instances(self, selected: Any = None) -> None:
        app: Any = self.app
        key = app.sort_key
        by = self._sort_key()
        table = self.query_one("#instances", DataTable)
        # The selection stays on its instance while rows move under it.
        selected = selected if selected is not None else self._selected()
        table.sort("name", key=by, reverse=app.sort_reverse)
        if selected is not None and selected in table.rows:
            table.move_cursor(row=table.get_row_index(selected), animate=False)
        for ckey, label, _ in INSTANCE_COLUMNS + self._optional:
            mark = ("▼" if app.sort_reverse else "▲") if ckey == key else ""
            col = table.columns.get(ckey)  # type: ignore[call-overload]
            if col is not None:
                col.label = Text(label + mark, style="bold underline" if mark else "")
        table.refresh()

    def draw_fleet(self) -> None:
        """The fleet strips above the table, from FLEET_MIN instances: every instance at once."""
        app: Any = self.app
        insts = (app.collected.snapshot or {}).get("instances", [])
        fleet = self.query_one("#fleet", Static)
        if len(insts) < FLEET_MIN:
            if fleet.display:
                fleet.display = False
            return
        fleet.display = True
        label_w = 9
        styles = {0: "", 1: f"bold {app._color('warning')}", 2: f"bold reverse {app._color('error')}"}
        t = Text(no_wrap=True)
        down = sum(1 for i in insts if not i.get("healthy") and fleet_state(i) != "removed")
        lines = fleet_strips(insts, app.size.width - label_w - 3)
        for n, (label, cells) in enumerate(lines):
            if n:
                t.append("\n")
            t.append(f"{label:<{label_w}}", style="bold" if label else "")
            run, level = "", None
            for ch, lv in cells:  # one span per run of a level, not one per instance
                if lv != level and run:
                    t.append(run, style=styles[level or 0])
                    run = ""
                run += ch
                level = lv
            if run:
                t.append(run, style=styles[level or 0])
        t.append(f"\n{len(insts)} instances in name order, one character each: bar height = backlog "
                 f"(of the busiest) and est. hit rate; ✖ down ({down})", style="dim")
        app._update_static("#fleet", t)

    def draw_totals(self) -> None:
        """Under the table: the reasons, the condensed rows' sum, health notes and the sort. The
        fleet's totals are the health line under the header (``#health``), on every tab."""
        app: Any = self.app
        snap = app.collected.snapshot or {}
        line = Text(no_wrap=True, overflow="ellipsis")
        reasons = snap.get("decisions_by_reason") or {}
        if reasons:
            top = sorted(reasons.items(), key=lambda kv: -kv[1])[:5]
            line.append("reasons " + "  ".join(f"{k} {v}" for k, v in top), style="dim")
        if self._hidden:
            hidden = self._hidden
            down = sum(1 for i in hidden if not i.get("healthy") and fleet_state(i) != "removed")
            busy = sum(1 for i in hidden if i.get("num_requests"))
            line.append(f"{chr(10) if line.plain else ''}+{len(hidden)} more instances (condensed; z shows every row): "
                        f"{busy} busy, {sum(int(i.get('num_requests') or 0) for i in hidden)} requests, backlog "
                        f"{fmt_int(sum(float(i.get('pending_prefill_tokens') or 0) for i in hidden))} tok"
                        + (f", {down} down" if down else ""), style="bold" if not down else
                        f"bold {app._color('error')}")
        sort = f"\nsort: {app.sort_label()} (s next column or click a header, r reverse)"
        if app.filters["overview"]:
            sort += f"  filter: {app.filters['overview']}"
        if self._health_notes:
            notes = sorted(self._health_notes.values(), key=natural_key)
            line.append((chr(10) if line.plain else "") + "; ".join(notes[:4]) + (f"; {len(notes) - 4} more" if len(notes) > 4 else ""),
                        style=f"bold {app._color('error')}")
        if self._gpu_na:
            sort += f"  GPU –: {self._gpu_na}"
        if app.collected.dropped:
            sort += f"  events dropped by the router for this viewer: {app.collected.dropped}"
        line.append(sort if line.plain else sort.lstrip("\n"), style="dim")
        app._update_static("#totals", line)


class ChartsTab(TabPane):
    """Backlog, TTFT and prefix-hit plots over the chart window."""

    def compose(self) -> ComposeResult:
        with Vertical(id="chart-stack"):
            yield PlotextPlot(id="chart-backlog")
            with Horizontal(id="chart-row"):
                yield PlotextPlot(id="chart-ttft")
                yield PlotextPlot(id="chart-hit")

    def draw(self) -> None:
        app: Any = self.app
        now = chart_now(app)
        c = app.collected
        w = app.window_s
        draw_backlog(app, self.query_one("#chart-backlog", PlotextPlot))
        ttft = self.query_one("#chart-ttft", PlotextPlot)
        plt = ttft.plt
        plt.clear_data()
        plt.clear_figure()
        plt.title("TTFT p50 / p90")  # the tick labels carry the unit, ms or s
        xs, p50, p90 = c.ttft_series(w, now)
        if xs:
            plt.plot(xs, p50, label="p50", marker=MARKERS[0])
            plt.plot(xs, p90, label="p90", marker=MARKERS[2])
        set_y_ticks(plt, p50 + p90, "ms", rows=ttft.size.height)
        plt.xlim(-w, 0)
        ttft.refresh()
        hit = self.query_one("#chart-hit", PlotextPlot)
        plt = hit.plt
        plt.clear_data()
        plt.clear_figure()
        plt.title("prefix hit % (router est / engine)")
        for (label, ring), marker in zip((("est", c.hit_rate), ("engine", c.engine_hit_rate)), (MARKERS[0], MARKERS[3])):
            pts = [(ts - now, v) for ts, v in ring if now - w <= ts <= now]
            if pts:
                plt.plot([p[0] for p in pts], [p[1] for p in pts], label=label, marker=marker)
        plt.xlim(-w, 0)
        set_y_ticks(plt, [], "%", rows=hit.size.height, lo=0, hi=100)
        hit.refresh()


class SessionsTab(TabPane):
    """Affinity summary and the session table (from GET sessions)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._session_order: list[str] = []

    def compose(self) -> ComposeResult:
        yield Static(id="affinity")
        yield Static(id="session-summary")
        yield LiveTable(id="session-table", cursor_type="row", zebra_stripes=True)

    @staticmethod
    def fmt_secs(v: Any) -> str:
        """A session time: tenths of a second under 10 s (a short session reads 0.4s, not 0s)."""
        if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 10:
            return f"{v:.1f}s"
        return fmt_duration(v)

    def summary_text(self) -> Text:
        """Over every session the router holds (GET sessions's ``summary``, issue 39): how long
        a session took, first request to last answer, and how much of it was the fleet's."""
        app: Any = self.app
        summ = app.sessions_body.get("summary")
        if not isinstance(summ, dict):
            # several routers: their percentiles do not merge, and each holds its own sessions
            why = "per router only (attach one for its summary)" if app.multi else "not reported by this router"
            return Text(f"session times: {why}", style="dim")

        def stat(fig: str, name: str) -> str:
            d = summ.get(fig)
            return self.fmt_secs(d.get(name) if isinstance(d, dict) else None)

        return Text(f"sessions {fmt_int(summ.get('sessions', 0))}  completion mean {stat('completion_s', 'mean')} "
                    f"p90 {stat('completion_s', 'p90')} max {stat('completion_s', 'max')}  "
                    f"fleet mean {stat('fleet_s', 'mean')}  client mean {stat('client_s', 'mean')}")

    def draw_affinity(self) -> None:
        app: Any = self.app
        aff = (app.collected.snapshot or {}).get("affinity") or {}
        per = aff.get("per_instance") or {}
        total = max(1, sum(per.values()))
        t = Text()
        stale = app.stale_label()
        if stale:
            t.append(f"{stale}: ", style="bold")
        t.append(f"sessions {fmt_int(aff.get('sessions', 0))}  moved {aff.get('moved_sessions', 0)} "
                 f"({aff.get('moves', 0)} moves)\n", style="bold" if not stale else "bold dim")
        parts = [f"{k} {n} ({100 * n / total:.0f}%)" for k, n in per.items()]
        t.append("per instance: " + "  ".join(parts[:16]) + (" …" if len(parts) > 16 else ""))
        app._update_static("#affinity", t)

    def draw_sessions(self) -> None:
        app: Any = self.app
        app._update_static("#session-summary", self.summary_text())
        table = self.query_one("#session-table", DataTable)
        query = app.filters["sessions"].lower()
        rows = [s for s in app.sessions_body.get("sessions", [])
                if not query or query in f"{s.get('session')} {s.get('instance')}".lower()]
        keep = {str(s["session"]) for s in rows}
        for key in [k for k in table.rows if k.value not in keep]:
            table.remove_row(key)
        # Whole ids where the width allows (two sessions cut to one prefix read as one).
        id_width = max(24, app.size.width - 97)
        for s in rows:
            # Text, not str: a client's session id is data, never markup for DataTable to read.
            cells = {"session": Text(fit_id(str(s["session"]), id_width)), "instance": Text(str(s.get("instance"))),
                     "turns": str(s.get("turns", 0)), "tokens": fmt_int(s.get("tokens")),
                     "hit": fmt_pct(s.get("est_hit_rate")), "bound": fmt_duration(s.get("bound_for_s")),
                     "idle": fmt_duration(s.get("idle_s")), "moves": str(s.get("moves", 0)),
                     "completion": self.fmt_secs(s.get("completion_s")), "fleet": self.fmt_secs(s.get("fleet_s")),
                     "client": self.fmt_secs(s.get("client_s"))}
            key = str(s["session"])
            if key in table.rows:
                table.set_cells(key, {col: val for col, val in cells.items() if table.get_cell(key, col) != val})
            else:
                table.add_row(*cells.values(), key=key)
        # Heaviest first by the tokens shown, re-sorted whenever that order changes. The sort
        # key is the row's own cell object: cut ids are not unique, and keying by their text
        # put 41,168 tokens below 19,826.
        def tokens(s: dict[str, Any]) -> float:
            t = s.get("tokens")
            return float(t) if isinstance(t, (int, float)) else -1.0

        order = [str(s["session"]) for s in sorted(rows, key=lambda s: (-tokens(s), str(s["session"])))]
        if order != self._session_order:
            self._session_order = order
            rank = {k: n for n, k in enumerate(order)}
            by_cell = {id(table.get_cell(k, "session")): rank.get(str(k.value), 0) for k in table.rows}
            table.sort("session", key=lambda cell: by_cell.get(id(cell), 0))


    @on(DataTable.RowSelected, "#session-table")
    def open_session(self, event: DataTable.RowSelected) -> None:
        """Enter on a session: its detail (full id, hits, the turns seen) with copy-to-clipboard."""
        app: Any = self.app
        key = str(event.row_key.value)
        row = next((s for s in app.sessions_body.get("sessions", []) if str(s.get("session")) == key), None)
        if row is None:
            return
        turns = [ev for _, ev in app.collected.decisions if str(ev.get("session")) == key][-200:]
        app.push_screen(SessionScreen(row, turns))


class DecisionsTab(TabPane):
    """The decision log; Enter on a row opens its receipt."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._dec_events: dict[str, dict[str, Any]] = {}

    def compose(self) -> ComposeResult:
        yield LiveTable(id="decision-table", cursor_type="row", zebra_stripes=True)

    def _decision_row(self, ev: dict[str, Any]) -> list[Any]:
        app: Any = self.app
        ts = time.strftime("%H:%M:%S", time.localtime(float(ev.get("ts") or 0)))
        router = [Text(str(ev.get("router") or ""))] if app.multi else []  # attach URL URL ...
        inp = ev.get("input_tokens") or 0
        hit = ev.get("est_hit") or 0
        hit_s = f"{100 * hit / inp:.0f}% {fmt_int(hit)}" if inp else fmt_int(hit)
        reason = str(ev.get("reason", "?"))
        session = Text(fit_id(str(ev.get("session") or ""), max(18, app.size.width - 100)))
        return [ts, *router, session, str(ev.get("class", "")), Text(str(ev.get("instance", ""))),
                Text(reason, style="bold") if reason not in ("argmin", "affinity_stick") else reason,
                hit_s, terms_summary(ev.get("terms"), ev.get("instance"))]

    def draw_decisions(self, rebuild: bool = False) -> None:
        app: Any = self.app
        table = self.query_one("#decision-table", DataTable)
        c = app.collected
        query = app.filters["decisions"]
        at_end = table.cursor_row >= table.row_count - 1 or not table.has_focus
        if rebuild:
            table.clear()
            self._dec_events.clear()
            mark = 0
        else:
            mark = app._applied_decision
        new = [(seq, ev) for seq, ev in c.decisions if seq > mark and (not query or decision_matches(ev, query))]
        for seq, ev in new[-app.max_decisions:]:
            key = f"d{seq}"
            table.add_row(*self._decision_row(ev), key=key)
            self._dec_events[key] = ev
        # Cap: drop the oldest rows, never the whole table.
        while table.row_count > app.max_decisions:
            oldest = next(iter(table.rows))
            table.remove_row(oldest)
            self._dec_events.pop(str(oldest.value), None)
        app._applied_decision = c.decision_seq
        if at_end and table.row_count:
            table.move_cursor(row=table.row_count - 1, animate=False)
            table.scroll_end(animate=False, immediate=True)

    @on(DataTable.RowSelected, "#decision-table")
    def open_receipt(self, event: DataTable.RowSelected) -> None:
        app: Any = self.app
        ev = self._dec_events.get(str(event.row_key.value))
        if ev is not None:
            app.push_screen(ReceiptScreen(ev))


class PolicyTab(TabPane):
    """The current policy, its knobs, the shadow policies and the recent changes."""

    def compose(self) -> ComposeResult:
        # The buttons sit on the first line, beside the policy's name: a long docstring
        # or many knobs pushed them off an 80x24 screen when they came last.
        with Horizontal(id="policy-buttons"):
            yield Static(id="policy-name")
            yield Button("Switch policy (P)", id="btn-policy", compact=True)
            yield Button("Edit knobs (k)", id="btn-knobs", compact=True)
        yield Static(id="policy-head")
        yield DataTable(id="knob-table", cursor_type="row", zebra_stripes=True)
        yield Static(id="shadow-panel")
        yield Static(id="config-log")

    def draw(self) -> None:
        """Everything from the latest snapshot (policy, knobs, shadows) and the policies answer
        for the latest version (schemas, docs): called on every applied update while visible."""
        app: Any = self.app
        body = app.policies_body
        cur = app.current_policy()
        stale = app.stale_label()
        name = Text(f"policy {cur.get('policy', '?')}{app.on_router()}", style="bold" if not stale else "bold dim")
        if stale:
            name.append(f"  ({stale}: the router is unreachable)", style="bold")
        app._update_static("#policy-name", name)
        head = Text()
        schema = app._control_schema(cur.get("name"))
        doc = next((p.get("doc", "") for p in body.get("policies", []) if p["name"] == cur.get("name")), "")
        if doc_summary(doc):
            head.append(doc_summary(doc) + "\n", style="dim")
        if app.readonly:
            head.append("read-only: policy and knob changes are hidden\n", style="bold")
        elif not app.can_control:
            head.append("no control token found: read-only (use --token-file or $KVTOP_CONTROL_TOKEN)\n",
                        style="bold")
        if app.last_error:
            head.append(f"last error: {app.last_error}", style=f"bold {app._color('error')}")
        head.rstrip()
        app._update_static("#policy-head", head)
        table = self.query_one("#knob-table", DataTable)
        knobs = app._current_knobs()
        order = [k["name"] for k in schema]
        if [str(k.value) for k in table.rows] != order[:len(table.rows)] or len(table.rows) > len(order):
            # another policy: its own knobs first, then the router's, as the docs say (rows
            # appended after a switch landed below the router's ten)
            table.clear()
        for k in schema:
            doc = ("router: " if k.get("router") else "") + str(k.get("doc") or "")
            # Text, not str: DataTable reads a str cell as markup ("[0, 1]" in a range or doc).
            cells = [Text(str(v)) for v in (k["name"], knobs.get(k["name"], k.get("default")), k.get("default"),
                                            k.get("range") or "-", doc)]
            if stale:
                cells[1].stylize("dim")
            if k["name"] in table.rows:
                for col, val in zip(("knob", "value", "default", "range", "doc"), cells):
                    old = table.get_cell(k["name"], col)
                    if str(old) != val.plain or getattr(old, "style", None) != val.style or (
                            getattr(old, "spans", None) != val.spans):
                        table.update_cell(k["name"], col, val)
            else:
                table.add_row(*cells, key=k["name"])
        shadows = self.shadow_text()
        app._update_static("#shadow-panel", shadows)
        # The knob table gets what the rest leaves: at 80x24 the shadows and the change log stay
        # on screen (the table scrolls), at 140x42 no blank lines sit between them.
        from textual.widgets import TabbedContent

        height = max(10, app.query_one(TabbedContent).size.height - 2)  # the pane's share of the screen
        head_h = self.query_one("#policy-head").size.height
        log_n = max(2, min(6, (height - 1 - head_h - len(shadows.plain.splitlines()) - 1 - 6)))
        lines = [config_change_text(ev) for ev in list(app.collected.config_events)[-log_n:]]
        log = Text("recent changes\n", style="bold", no_wrap=True, overflow="ellipsis")
        log.append("\n".join(lines) or "no policy, knob or shadow changes since attach")
        app._update_static("#config-log", log)
        room = height - 1 - head_h - len(shadows.plain.splitlines()) - len(log.plain.splitlines())
        table.styles.max_height = max(4, room)

    def shadow_text(self) -> Text:
        """The shadow panel: per shadow policy, agreement with the active one, where they
        disagree, and what its picks would have saved by the router's estimate."""
        app: Any = self.app
        sh = app._shadows()
        rows = [r for r in sh.get("shadows") or [] if isinstance(r, dict) and isinstance(r.get("policy"), str)]
        out = Text("shadow policies", style="bold", no_wrap=True, overflow="ellipsis")
        stale = app.stale_label()
        if stale:
            out.append(f"  ({stale})", style="bold")
        if not rows and not sh.get("dropped"):
            out.append("  none" + ("  (S adds one)" if app.control_enabled else
                                   "  (kvtop route --shadow P1,P2, or PUT /kvtop/v1/shadows)"), style="dim")
            return out
        if app.control_enabled:
            out.append("  S: add, remove, promote", style="dim")
        out.append("\n")
        for r in rows:
            picks = r.get("picks") if is_number(r.get("picks")) else 0
            agree = r.get("agreement")
            out.append(f"  {r['policy']:<16}", style="bold")
            out.append(f"agrees {fmt_pct(agree) + '%' if is_number(agree) else '–'} of {fmt_num(picks)}",
                       style="dim" if stale else "")
            if isinstance(r.get("against"), str):  # counted against this active policy@version only
                out.append(f" against {r['against']}", style="dim")
            if is_number(r.get("since")):
                out.append(time.strftime(" since %H:%M:%S", time.localtime(float(r["since"]))), style="dim")
            by_class = r.get("disagree_by_class") if isinstance(r.get("disagree_by_class"), dict) else {}
            if by_class:
                top = sorted(by_class.items(), key=lambda kv: -kv[1] if is_number(kv[1]) else 0)[:4]
                out.append("  differs on " + ", ".join(f"{k} {fmt_num(v)}" for k, v in top))
            saved = r.get("saved_prefill_tokens")
            if is_number(saved) and picks:
                style = app._color("success") if saved > 0 else (app._color("warning") if saved < 0 else "")
                out.append("  est. prefill ")
                out.append(f"{'saved' if saved >= 0 else 'added'} {fmt_num(abs(saved))} tok", style=style)
            moved = r.get("disagree_shadow_instance") if isinstance(r.get("disagree_shadow_instance"), dict) else {}
            if moved:
                top = sorted(moved.items(), key=lambda kv: -kv[1] if is_number(kv[1]) else 0)[:3]
                out.append("  would send to " + ", ".join(f"{k} {fmt_num(v)}" for k, v in top), style="dim")
            out.append("\n")
        for d in (sh.get("dropped") or [])[-2:]:
            if isinstance(d, dict):
                out.append(f"  dropped {d.get('policy', '?')}: {d.get('why', '')}\n", style=app._color("error"))
        out.rstrip()
        return out
