"""Modal screens: the decision receipt, help, policy picker, knob form and the confirm-with-diff."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.validation import Function, Integer, Number
from textual.widgets import Button, DataTable, Input, Label, OptionList, Select, Static
from textual.widgets.option_list import Option

from kvtop import receipt


#: What a receipt's term columns mean (the policies' score terms; docs/policies.md has the formulas).
TERM_HELP = {
    "hit": "est. cached prefix tokens there", "new": "tokens it would prefill there", "P": "prefill backlog tokens",
    "BS": "requests in flight", "D": "decoding context tokens", "tps": "its prefill rate, tok/s",
    "wait_s": "queue wait before its prefill", "own_s": "its own prefill time", "interf_s": "slowdown of the decodes there",
    "queue_s": "returning turns it holds up", "evict_s": "cache of returning sessions it evicts",
    "score": "the policy's score (lowest wins)", "cost": "expected seconds added (lowest wins)",
}


class ReceiptScreen(ModalScreen[None]):
    """Why one request went where it did: every candidate's terms, the chosen one first and marked.

    The text is ``kvtop.receipt``'s, the same as ``kvtop log why`` prints: one number
    format, times as local clock plus milliseconds from the router's receipt of the request.
    It scrolls (PageDown, the arrows) where the terminal is small.
    """

    BINDINGS = [Binding("escape,q,enter", "dismiss", "close", id="kvtop.receipt.close"),
                Binding("c", "copy_id", "copy request id", id="kvtop.receipt.copy"),
                Binding("pagedown", "page(1)", "page down", show=False, id="kvtop.receipt.page_down"),
                Binding("pageup", "page(-1)", "page up", show=False, id="kvtop.receipt.page_up")]

    def __init__(self, ev: dict[str, Any]):
        super().__init__()
        self.ev = ev

    def compose(self) -> ComposeResult:
        head = Text()
        for n, line in enumerate(receipt.head_lines(self.ev)):
            head.append(("\n" if n else "") + line, style="bold" if line.startswith("→") else "")
        note = "▶ the chosen instance (first row) · c copies the request id · PgDn/PgUp scroll · Esc closes"
        if self.ev.get("reason") == "affinity_stick":
            note = "the session's instance passed the affinity gate; score is what the fallback would have scored · " + note
        cols, _ = receipt.candidates(self.ev.get("terms"), self.ev.get("instance"))
        legend = Text()
        for c in cols:
            if c in TERM_HELP:
                legend.append(f"{c}", style="bold")
                legend.append(f" {TERM_HELP[c]}  ")
        with VerticalScroll(id="receipt", classes="dialog"):
            yield Static(Text(note, style="dim"), id="receipt-note")
            yield Static(head, id="receipt-head")
            yield DataTable(id="receipt-terms", cursor_type="row", zebra_stripes=True)
            yield Static(legend, id="receipt-legend")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        cols, rows = receipt.candidates(self.ev.get("terms"), self.ev.get("instance"))
        table.add_column("", key="_mark")
        for c in cols:
            table.add_column(c, key=c)
        # the chosen row first: with 64 candidates the marker no longer scrolls out of sight
        order = [r for r in rows if r[0]] + [r for r in rows if not r[0]]
        for n, (chosen, cells) in enumerate(order):
            style = "bold" if chosen else ""
            row: list[Any] = [Text("▶", style="bold") if chosen else ""]
            row += [Text(v, style=style, justify="left" if i == 0 else "right") for i, v in enumerate(cells)]
            table.add_row(*row, key=f"c{n}")
        # the dialog, not the table, takes the keys: it opens at its head and PageDown scrolls it
        self.query_one("#receipt", VerticalScroll).focus()

    def action_page(self, step: int) -> None:
        scroll = self.query_one("#receipt", VerticalScroll)
        if step > 0:
            scroll.scroll_page_down(animate=False)
        else:
            scroll.scroll_page_up(animate=False)

    def action_copy_id(self) -> None:
        rid = str(self.ev.get("request_id") or "")
        self.app.copy_to_clipboard(rid)
        self.notify(f"copied {rid}", timeout=3)


class SessionScreen(ModalScreen[None]):
    """One session: its full id, instance, turns, tokens and hits, and the turns the dashboard
    saw it route (newest last; Enter opens a turn's receipt). ``c`` copies the session id."""

    BINDINGS = [Binding("escape,q", "dismiss", "close", id="kvtop.session.close"),
                Binding("c", "copy_id", "copy id", id="kvtop.session.copy")]

    def __init__(self, session: dict[str, Any], turns: list[dict[str, Any]]):
        super().__init__()
        self.session = session
        self.turns = turns

    @property
    def session_id(self) -> str:
        return str(self.session.get("session", ""))

    def compose(self) -> ComposeResult:
        from kvtop.tui.model import fmt_duration, fmt_int, fmt_pct

        s = self.session
        head = Text()
        head.append("session ", style="bold")
        head.append(self.session_id + "\n")  # whole, never cut: this is where it is read or copied
        head.append(f"instance {s.get('instance', '?')}  turns {s.get('turns', 0)}  tokens {fmt_int(s.get('tokens'))}"
                    f"  last hit {fmt_pct(s.get('est_hit_rate'))}% ({fmt_int(s.get('last_est_hit_tokens'))} of "
                    f"{fmt_int(s.get('last_input_tokens'))} tok)\n")
        head.append(f"stayed {fmt_duration(s.get('bound_for_s'))} on its instance  idle {fmt_duration(s.get('idle_s'))}"
                    f"  moves {s.get('moves', 0)}")
        note = (f"{len(self.turns)} turns seen by this dashboard · Enter: a turn's receipt · "
                "c copies the session id · Esc closes")
        with Vertical(id="session-detail", classes="dialog"):
            yield Static(head, id="session-head")
            yield DataTable(id="session-turns", cursor_type="row", zebra_stripes=True)
            yield Static(Text(note, style="dim"), id="session-note")

    def on_mount(self) -> None:
        import time

        from kvtop.tui.model import fmt_int

        table = self.query_one(DataTable)
        for key in ("time", "turn", "instance", "reason", "input", "est. hit"):
            table.add_column(key, key=key)
        for n, ev in enumerate(self.turns):
            inp, hit = ev.get("input_tokens") or 0, ev.get("est_hit") or 0
            table.add_row(time.strftime("%H:%M:%S", time.localtime(float(ev.get("ts") or 0))),
                          Text(str(ev.get("turn", ""))),
                          Text(str(ev.get("instance", "")) + (f" ({ev['router']})" if ev.get("router") else "")),
                          Text(str(ev.get("reason", ""))), fmt_int(inp),
                          f"{100 * hit / inp:.0f}% {fmt_int(hit)}" if inp else fmt_int(hit), key=f"t{n}")
        if table.row_count:
            table.move_cursor(row=table.row_count - 1, animate=False)
        table.focus()

    @on(DataTable.RowSelected, "#session-turns")
    def _open_turn(self, event: DataTable.RowSelected) -> None:
        self.app.push_screen(ReceiptScreen(self.turns[int(str(event.row_key.value)[1:])]))

    def action_copy_id(self) -> None:
        self.app.copy_to_clipboard(self.session_id)
        self.notify(f"copied {self.session_id}", timeout=3)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "close", id="kvtop.help.close")]

    def __init__(self, text: Text | str):
        super().__init__()
        self.text = text

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help", classes="dialog"):
            yield Static(self.text)


class ConfirmScreen(ModalScreen[bool]):
    """Shows what will change; Enter/y applies, Esc/n cancels.

    ``diff`` is a list of (name, before, after), or a function returning one: then the dialog is
    redrawn from the latest snapshot on every refresh while it is open (``refresh_live``).
    """

    BINDINGS = [Binding("y", "yes", "apply", id="kvtop.confirm.yes"),
                Binding("escape,n", "no", "cancel", id="kvtop.confirm.no")]

    def __init__(self, title: str, diff: list[tuple[str, Any, Any]] | Callable[[], list[tuple[str, Any, Any]]]):
        super().__init__()
        self.title_text = title
        self._diff = diff

    @property
    def diff(self) -> list[tuple[str, Any, Any]]:
        return self._diff() if callable(self._diff) else self._diff

    def diff_text(self) -> Text:
        text = Text()
        text.append(self.title_text, style="bold")
        text.append("\n")
        for name, before, after in self.diff:
            text.append(f"\n  {name}: ")
            text.append(str(before), style="bold")
            text.append(" → ")
            text.append(f" {after} ", style="bold reverse")
        return text

    def refresh_live(self) -> None:
        if callable(self._diff) and self.is_mounted:
            for widget in self.query("#confirm-diff"):
                widget.update(self.diff_text())

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm", classes="dialog"):
            yield Static(self.diff_text(), id="confirm-diff")
            with Horizontal(classes="buttons"):
                yield Button("Apply (y)", variant="warning", id="yes")
                yield Button("Cancel (n)", id="no")

    def on_mount(self) -> None:
        self.query_one("#yes", Button).focus()

    def action_yes(self) -> None:
        self.dismiss(True)

    def action_no(self) -> None:
        self.dismiss(False)

    @on(Button.Pressed)
    def pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class PolicyPicker(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "dismiss(None)", "cancel", id="kvtop.picker.cancel")]

    def __init__(self, policies: list[dict[str, Any]], current: str | None, title: str = "Switch policy"):
        super().__init__()
        self.policies = policies
        self.current = current
        self.title_text = title

    def compose(self) -> ComposeResult:
        from kvtop.tui.model import doc_summary

        opts = []
        for p in self.policies:
            mark = " (current)" if p["name"] == self.current else ""
            prompt = Text(f"{p.get('label') or p['name']}{mark}", style="bold")
            summary = doc_summary(p.get("doc"))  # the whole first paragraph, wrapped: never cut mid-formula
            if summary:
                prompt.append("\n  " + summary, style="dim")
            opts.append(Option(prompt, id=p["name"]))
        with Vertical(id="picker", classes="dialog"):
            yield Static(Text.assemble((self.title_text, "bold"), "  (Enter picks, Esc cancels)"))
            yield OptionList(*opts, id="picker-list")

    def on_mount(self) -> None:
        self.query_one(OptionList).focus()

    @on(OptionList.OptionSelected)
    def picked(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)


def parse_knob(schema: dict[str, Any], text: str) -> Any:
    t = schema.get("type")
    text = text.strip()
    if t == "int":
        return int(text)
    if t == "float":
        return float(text)
    if t == "bool":
        low = text.lower()
        if low in ("true", "yes", "on", "1"):
            return True
        if low in ("false", "no", "off", "0"):
            return False
        raise ValueError(text)
    return text


class KnobForm(ModalScreen[dict[str, Any] | None]):
    """Edit the current policy's knobs: value, default and range shown; validated as typed.

    Returns the changed knobs only; the caller confirms and applies them. The router still
    validates: its message lands in ``#knob-error``.
    """

    BINDINGS = [Binding("escape", "dismiss(None)", "cancel", id="kvtop.knobs.cancel"),
                Binding("ctrl+s", "submit", "apply", id="kvtop.knobs.apply")]

    def __init__(self, policy: str, schema: list[dict[str, Any]], current: dict[str, Any],
                 live: Callable[[], tuple[str, dict[str, Any]]] | None = None):
        super().__init__()
        self.policy = policy
        self.schema = schema
        self.current = dict(current)
        #: (the router's policy name, its knobs) now: the form follows it while open
        self._live = live
        self._shown: dict[str, str] = {}  # what each field was filled with (edited fields are kept)

    def _now_label(self, k: dict[str, Any]) -> Text:
        name = k["name"]
        text = Text()
        text.append(name, style="bold")
        if k.get("router"):
            text.append("  (router-level)")
        text.append("  now ")
        text.append(str(self.current.get(name, k.get("default"))), style="bold")
        text.append(f"  default {k.get('default')}  range {k.get('range') or '-'}")
        return text

    def refresh_live(self) -> None:
        """Redraw "now" from the latest snapshot; a field the user has not edited follows it."""
        if self._live is None or not self.is_mounted or not self.query("#knob-fields"):
            return
        policy, current = self._live()
        for k in self.schema:
            name = k["name"]
            new = current.get(name, k.get("default"))
            if new == self.current.get(name, k.get("default")):
                continue
            self.current[name] = new
            self.query_one(f"#knob-label-{name}", Label).update(self._now_label(k))
            field = self.query_one(f"#knob-{name}")
            if isinstance(field, Select):
                if field.value == self._shown.get(name):
                    field.value = str(new)
                    self._shown[name] = str(new)
            elif isinstance(field, Input) and field.value == self._shown.get(name):
                field.value = str(new)
                self._shown[name] = str(new)
        if policy != self.policy:
            self.show_error(f"the router now runs {policy}: these are {self.policy}'s knobs "
                            "(Esc, then k for the new policy's)")

    def compose(self) -> ComposeResult:
        with Vertical(id="knobs", classes="dialog"):
            yield Static(Text.assemble((f"Knobs of {self.policy}", "bold"), "  (Tab moves, ctrl+s or Apply, Esc cancels)"))
            with VerticalScroll(id="knob-fields"):
                if not self.schema:
                    yield Static("this policy has no knobs")
                for k in self.schema:
                    name = k["name"]
                    value = str(self.current.get(name, k.get("default")))
                    self._shown[name] = value
                    yield Label(self._now_label(k), id=f"knob-label-{name}", classes="knob-label")
                    if k.get("choices"):
                        # a closed set: pick one, nothing to mistype
                        choices = [str(c) for c in k["choices"]]
                        yield Select([(c, c) for c in choices], value=value if value in choices else Select.BLANK,
                                     allow_blank=value not in choices, id=f"knob-{name}", classes="knob-input")
                    else:
                        yield Input(value, id=f"knob-{name}", validators=self._validators(k), classes="knob-input")
                    if k.get("doc"):
                        yield Static(Text(str(k["doc"]), style="dim"), classes="knob-doc")
            yield Static("", id="knob-error")
            with Horizontal(classes="buttons"):
                yield Button("Apply", variant="warning", id="apply")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        # The first keys typed after `k` edit the first knob instead of going nowhere.
        first = self.query(".knob-input").first() if self.query(".knob-input") else None
        (first or self.query_one("#apply", Button)).focus()

    @staticmethod
    def _validators(k: dict[str, Any]) -> list:
        lo, hi = k.get("min"), k.get("max")
        if k.get("type") == "int":
            return [Integer(minimum=lo, maximum=hi)]
        if k.get("type") == "float":
            return [Number(minimum=lo, maximum=hi)]
        if k.get("type") == "bool":
            return [Function(lambda s: s.strip().lower() in ("true", "false", "yes", "no", "on", "off", "1", "0"),
                             "true or false")]
        if k.get("choices"):
            return [Function(lambda s, c=tuple(k["choices"]): s.strip() in c, "one of " + ", ".join(k["choices"]))]
        return []

    def changed(self) -> tuple[dict[str, Any], list[str]]:
        out: dict[str, Any] = {}
        errors: list[str] = []
        for k in self.schema:
            name = k["name"]
            field = self.query_one(f"#knob-{name}")
            if isinstance(field, Select):
                if field.value is Select.BLANK:
                    continue
                value = parse_knob(k, str(field.value))
                if value != self.current.get(name, k.get("default")):
                    out[name] = value
                continue
            inp = field if isinstance(field, Input) else self.query_one(f"#knob-{name}", Input)
            result = inp.validate(inp.value)
            if result is not None and not result.is_valid:
                errors.append(f"{name}: " + "; ".join(result.failure_descriptions))
                continue
            try:
                value = parse_knob(k, inp.value)
            except ValueError:
                errors.append(f"{name}: cannot read {inp.value!r} as {k.get('type')}")
                continue
            if value != self.current.get(name, k.get("default")):
                out[name] = value
        return out, errors

    def show_error(self, message: str) -> None:
        self.query_one("#knob-error", Static).update(Text(message, style="bold"))
        self.query_one("#knob-error").add_class("shown")

    def action_submit(self) -> None:
        changed, errors = self.changed()
        if errors:
            self.show_error("not valid: " + " · ".join(errors))
            return
        if not changed:
            self.show_error("nothing changed")
            return
        self.dismiss(changed)

    @on(Button.Pressed, "#apply")
    def apply(self) -> None:
        self.action_submit()

    @on(Button.Pressed, "#cancel")
    def cancel(self) -> None:
        self.dismiss(None)

    @on(Input.Submitted)
    def submitted(self) -> None:
        self.action_submit()


class InstanceScreen(ModalScreen[None]):
    """One instance, as k9s describes a pod: its load, health and why, KV-cache and KV-event
    state, GPU, errors, the sessions bound to it and the last decisions routed to it. Drawn
    again from the latest snapshot on every refresh (``refresh_live``); Enter on a decision
    opens its receipt."""

    BINDINGS = [Binding("escape,q", "dismiss", "close", id="kvtop.instance.close"),
                # the app's fleet keys, on this instance (a modal screen does not pass keys on)
                Binding("c", "app.fleet('cordon')", "cordon", show=False, id="kvtop.instance.cordon"),
                Binding("d", "app.fleet('drain')", "drain", show=False, id="kvtop.instance.drain"),
                Binding("u", "app.fleet('uncordon')", "uncordon", show=False, id="kvtop.instance.uncordon"),
                Binding("x", "app.fleet('remove')", "remove", show=False, id="kvtop.instance.remove")]

    def __init__(self, name: str):
        super().__init__()
        self.instance = name
        self._sessions: list[dict[str, Any]] = []
        self._decisions: dict[str, dict[str, Any]] = {}
        self._drawn_seq = -1
        self._ready = False  # the app's refresh can come before on_mount made the table's columns

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="instance-detail", classes="dialog"):
            yield Static(id="instance-head")
            yield Static(Text("last decisions routed here (Enter: its receipt)", style="bold"))
            yield DataTable(id="instance-decisions", cursor_type="row", zebra_stripes=True)
            yield Static(id="instance-sessions")
            yield Static(Text("Esc closes", style="dim"))

    def on_mount(self) -> None:
        table = self.query_one("#instance-decisions", DataTable)
        for key in ("time", "session", "class", "reason", "input", "est. hit"):
            table.add_column(key, key=key)
        self._ready = True
        self.refresh_live()
        self._load_sessions()
        table.focus(scroll_visible=False)  # the detail opens at its head; Enter acts on the decisions

    @work(exclusive=True, group="instance-sessions")
    async def _load_sessions(self) -> None:
        from kvtop.tui.feed import ControlError

        app: Any = self.app
        try:
            body = await app.feed.sessions(500)
        except ControlError as exc:
            self.query_one("#instance-sessions", Static).update(Text(f"sessions: {exc.message}", style="dim"))
            return
        rows = body.get("sessions") if isinstance(body, dict) else None
        self._sessions = [s for s in rows or [] if isinstance(s, dict)
                          and str(s.get("instance", "")).split(" (")[0] == self.instance]
        self._draw_sessions()

    def _draw_sessions(self) -> None:
        from kvtop.tui.model import fit_id, fmt_duration, fmt_int, fmt_pct

        t = Text()
        t.append(f"sessions bound here ({len(self._sessions)} of the 500 largest)\n", style="bold")
        for s in sorted(self._sessions, key=lambda s: -(s.get("tokens") or 0))[:12]:
            t.append(f"  {fit_id(str(s.get('session')), 40):<40}  {s.get('turns', 0):>3} turns  "
                     f"{fmt_int(s.get('tokens')):>8} tok  last hit {fmt_pct(s.get('est_hit_rate'))}%  "
                     f"idle {fmt_duration(s.get('idle_s'))}\n")
        if not self._sessions:
            t.append("  none\n", style="dim")
        t.rstrip()
        self.query_one("#instance-sessions", Static).update(t)

    def head_text(self) -> Text:
        from kvtop.tui.model import (drift_of, fleet_note, fmt_drift, fmt_int, fmt_pct, fmt_secs, gpu_cells,
                                     health_state, is_number)

        app: Any = self.app
        snap = app.collected.snapshot or {}
        inst = next((i for i in snap.get("instances", []) if i.get("name") == self.instance), None)
        t = Text()
        t.append(f"instance {self.instance}", style="bold")
        stale = app.stale_label()
        if stale:
            t.append(f"  ({stale}: the router is unreachable)", style="bold")
        if inst is None:
            t.append("\n  not in the router's latest snapshot (removed, or renamed)", style="bold")
            return t
        t.append(f"  {inst.get('url') or ''}\n", style="dim")
        state, why = health_state(inst)
        t.append("health   ")
        t.append({"up": "● up", "down": "✖ DOWN", "ejected": "⏏ ejected"}[state],
                 style="bold" if state == "up" else f"bold reverse {app._color('error')}")
        if why:
            t.append(f"  {why}")
        h = inst.get("health") or {}
        if is_number(h.get("ejections")):
            t.append(f"  ejections {fmt_int(h['ejections'])}")
        per = (snap.get("affinity") or {}).get("per_instance") or {}
        note = fleet_note(inst, per.get(self.instance))
        t.append("\nfleet    ")
        t.append(note.removeprefix(f"{self.instance} ") if note else "active (c cordon, d drain, x remove)",
                 style="bold" if note else "")
        t.append("\nload     ")
        t.append(f"{fmt_int(inst.get('num_requests'))} in flight  backlog {fmt_int(inst.get('pending_prefill_tokens'))} "
                 f"tok / {fmt_secs(inst.get('backlog_s'))} s  decoding {fmt_int(inst.get('decode_requests'))} req "
                 f"{fmt_int(inst.get('decode_tokens'))} tok  routed {fmt_int(inst.get('routed_total'))}")
        if is_number(inst.get("prefill_tps_measured")):
            t.append(f"  measured prefill {fmt_int(inst['prefill_tps_measured'])} tok/s")
        eng = inst.get("engine") or {}
        t.append("\nengine   ")
        t.append(f"KV {fmt_pct(eng.get('kv_usage'))}%  running {fmt_int(eng.get('running'))}  waiting "
                 f"{fmt_int(eng.get('waiting'))}  prefix hit {fmt_pct(eng.get('prefix_hit_rate_recent'))}% recent, "
                 f"{fmt_pct(eng.get('prefix_hit_rate'))}% since start  router est. hit "
                 f"{fmt_pct(inst.get('est_hit_rate_recent'))}%")
        if eng.get("error"):
            t.append(f"  scrape error: {eng['error']}", style=f"bold {app._color('error')}")
        kv = inst.get("kv_events") if isinstance(inst.get("kv_events"), dict) else None
        t.append("\nKV index ")
        if kv is None:
            t.append(f"{inst.get('index_source') or 'estimate'} (no KV events: the router's own estimate)")
        else:
            share, source = drift_of(inst)
            t.append(f"{fmt_drift(share, source)}  blocks pinned {fmt_int(kv.get('pinned_blocks'))} queued "
                     f"{fmt_int(kv.get('queued_blocks'))} free {fmt_int(kv.get('free_blocks'))}  events "
                     f"{fmt_int(kv.get('events'))}  gaps {fmt_int(kv.get('gaps'))}  resyncs {fmt_int(kv.get('resyncs'))}")
            if kv.get("reason"):
                t.append(f"  ({kv['reason']})")
        util, mem, why_gpu = gpu_cells(inst.get("gpu"))
        gpu = inst.get("gpu") or {}
        t.append("\nGPU      ")
        t.append(f"– ({why_gpu})" if why_gpu else f"{util}% busy  memory {mem}"
                 + (f"  (GPU {gpu['index']})" if gpu.get("index") is not None else ""))
        errs = inst.get("errors") or {}
        t.append("\nerrors   ")
        t.append(f"{fmt_int(errs.get('requests_total'))} failed requests since the router started")
        if errs.get("scrape"):
            t.append(f"  metrics scrape: {errs['scrape']}")
        if errs.get("gpu"):
            t.append(f"  GPU: {errs['gpu']}")
        return t

    def refresh_live(self) -> None:
        from kvtop.tui.model import fit_id, fmt_int

        import time

        if not self._ready:
            return
        app: Any = self.app
        self.query_one("#instance-head", Static).update(self.head_text())
        seq = app.collected.decision_seq
        if seq == self._drawn_seq:
            return
        self._drawn_seq = seq
        table = self.query_one("#instance-decisions", DataTable)
        rows = [(s, ev) for s, ev in app.collected.decisions if ev.get("instance") == self.instance][-15:]
        keep = {f"d{s}" for s, _ in rows}
        for key in [k for k in table.rows if k.value not in keep]:
            table.remove_row(key)
            self._decisions.pop(str(key.value), None)
        for s, ev in rows:
            key = f"d{s}"
            if key in table.rows:
                continue
            inp, hit = ev.get("input_tokens") or 0, ev.get("est_hit") or 0
            table.add_row(time.strftime("%H:%M:%S", time.localtime(float(ev.get("ts") or 0))),
                          Text(fit_id(str(ev.get("session") or ""), 24)), Text(str(ev.get("class") or "")),
                          Text(str(ev.get("reason") or "")), fmt_int(inp),
                          f"{100 * hit / inp:.0f}% {fmt_int(hit)}" if inp else fmt_int(hit), key=key)
            self._decisions[key] = ev

    @on(DataTable.RowSelected, "#instance-decisions")
    def _open_receipt(self, event: DataTable.RowSelected) -> None:
        ev = self._decisions.get(str(event.row_key.value))
        if ev is not None:
            self.app.push_screen(ReceiptScreen(ev))


class ColumnChooser(ModalScreen[set | None]):
    """Which instance-table columns to show (space toggles, Enter keeps, Esc cancels). Returns
    the set of hidden column keys; the app saves it to the config file."""

    BINDINGS = [Binding("escape", "dismiss(None)", "cancel", id="kvtop.columns.cancel"),
                Binding("enter", "done", "keep", id="kvtop.columns.keep", priority=True)]

    def __init__(self, columns: list[tuple[str, str, str]], hidden: set[str]):
        super().__init__()
        self.columns = columns
        self.hidden = set(hidden)

    def compose(self) -> ComposeResult:
        from textual.widgets import SelectionList

        with Vertical(id="columns", classes="dialog"):
            yield Static(Text.assemble(("Instance table columns", "bold"),
                                       "  (space shows or hides, Enter keeps, Esc cancels; saved to the config file)"))
            yield SelectionList(*[(Text.assemble((label, "bold"), "  ", (legend, "dim")), key, key not in self.hidden)
                                  for key, label, legend in self.columns], id="column-list")

    def on_mount(self) -> None:
        from textual.widgets import SelectionList

        self.query_one(SelectionList).focus()

    def action_done(self) -> None:
        from textual.widgets import SelectionList

        shown = set(self.query_one(SelectionList).selected)
        self.dismiss({key for key, _, _ in self.columns if key not in shown})
