"""kvtop attach: the pure core, Pilot behaviour on a fake feed and on a real router, snapshots."""

from __future__ import annotations

import asyncio
import copy
import os
import time

import pytest

from kvtop.tui import synthetic as syn
from kvtop.tui.feed import ControlError, FakeFeed, resolve_target
from kvtop.tui.model import Collected, decision_matches, doc_summary, render_once, sparkline

SIZE = (120, 40)
NOW = syn.snapshot(4, 39.0)["ts"]


@pytest.fixture(autouse=True)
def utc(monkeypatch):
    """Decision times print in local time: pin it so snapshots match on every machine."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    time.tzset()


def make_app(feed=None, *, n=4, steps=40, decisions=60, **kw):
    from kvtop.tui.app import KvtopApp

    if feed is None:
        feed = FakeFeed(policies=copy.deepcopy(syn.POLICIES), sessions=syn.sessions(60, n))
        for t in range(steps):
            feed.push("state", syn.snapshot(n, float(t)))
        for k in range(decisions):
            feed.push("decision", syn.decision(k, n))
            feed.push("outcome", syn.outcome(k, n))
    kw.setdefault("apply_timer", False)  # tests apply explicitly instead of waiting on timers
    kw.setdefault("poll_sessions_s", 0)
    return KvtopApp(feed, url="http://127.0.0.1:8000", clock=lambda: NOW, **kw), feed


async def wait_group(app, group):
    """Wait for one worker group; the stream worker never ends, so not ``wait_for_complete``."""
    for w in [w for w in app.workers if w.group == group]:
        await w.wait()


async def settle(pilot, app):
    """Let the worker drain the fake feed, then draw."""
    for _ in range(50):
        await pilot.pause()
        if app.collected.snapshot is not None and not app.feed.queue.qsize():
            break
    app.apply(force=True)
    await pilot.pause()


# -- pure core ------------------------------------------------------------------------------

@pytest.mark.parametrize("values, expected", [
    ([], ""),
    ([0, 0, 0], "▁▁▁"),            # all idle: flat floor, not a division by zero
    ([0, 50, 100], "▁▄█"),          # scaled to the window's maximum
])
def test_sparkline(values, expected):
    assert sparkline(values) == expected


@pytest.mark.parametrize("lo, hi, max_ticks, integer, ticks", [
    (0, 139925, 7, True, [0, 25e3, 50e3, 75e3, 100e3, 125e3, 150e3]),  # round steps, past the top
    (505.8, 2518.4, 7, False, [500, 1000, 1500, 2000, 2500, 3000]),  # first tick at or below lo
    (0, 100, 7, False, [0, 20, 40, 60, 80, 100]),
    (0, 139925, 3, True, [0, 100e3, 200e3]),  # a short chart gets fewer ticks, not crowded ones
    (0.1, 0.35, 5, False, [0.1, 0.2, 0.3, 0.4]),  # no float noise such as 0.30000000000000004
    (0, 1, 7, True, [0, 1]),  # tokens: never a half-token step
    (0, 0, 7, True, [0, 1]),  # all idle: an axis from 0, not plotext's -1 to 1
])
def test_nice_ticks(lo, hi, max_ticks, integer, ticks):
    from kvtop.tui.axis import nice_ticks

    assert nice_ticks(lo, hi, max_ticks, integer=integer) == ticks


@pytest.mark.parametrize("ticks, unit, labels", [
    ([0, 25e3, 50e3, 75e3], "count", ["0", "25k", "50k", "75k"]),  # 62630.0 was the complaint
    ([62000, 62200, 62400, 62600], "count", ["62k", "62.2k", "62.4k", "62.6k"]),  # enough digits
    ([0, 0.4e6, 0.8e6, 1.2e6], "count", ["0", "0.4M", "0.8M", "1.2M"]),
    ([0, 3e9], "count", ["0", "3G"]),
    ([0, 2000, 4000, 6000, 8000], "count", ["0", "2000", "4000", "6000", "8000"]),  # short as is
    ([0, 0.5, 1, 1.5], "count", ["0", "0.5", "1", "1.5"]),  # integers without .0
    ([500, 1000, 1500, 2000], "ms", ["0.5s", "1s", "1.5s", "2s"]),  # a second or more: seconds
    ([0, 250, 500, 750], "ms", ["0", "250ms", "500ms", "750ms"]),
    ([0.1, 0.2, 0.3], "ms", ["0.1ms", "0.2ms", "0.3ms"]),
    ([0, 50, 100], "%", ["0", "50%", "100%"]),
    ([-5, 0, 5], "count", ["-5", "0", "5"]),
])
def test_tick_labels(ticks, unit, labels):
    from kvtop.tui.axis import tick_labels

    assert tick_labels(ticks, unit) == labels


@pytest.mark.parametrize("doc, summary", [
    (None, ""),
    ("One line.", "One line."),
    ("unified: stick while hit / input > gate and\n    BS_a <= mean(BS) x factor.\n\nKnobs: ...",
     "unified: stick while hit / input > gate and BS_a <= mean(BS) x factor."),  # the whole sentence
])
def test_doc_summary_is_the_first_paragraph(doc, summary):
    assert doc_summary(doc) == summary


def test_ttft_series_buckets_and_percentiles():
    c = Collected()
    for ts, ttft in [(95.0, 4.0), (91.0, 1.0), (93.0, 3.0), (92.0, 2.0),  # one bucket, out of order
                     (85.0, 10.0),                                         # the bucket before
                     (10.0, 999.0)]:                                       # outside the window
        c.ingest("outcome", {"ts": ts, "ttft_ms": ttft})
    xs, p50, p90 = c.ttft_series(window_s=30, now=100.0, bucket_s=10)
    assert xs == [-15.0, -5.0]  # bucket midpoints, seconds before now
    assert p50 == [10.0, 2.5] and p90 == [10.0, pytest.approx(3.7)]  # numpy's linear percentile


@pytest.mark.parametrize("query, hit", [
    ("reason:argmin", True),
    ("reason:affinity", False),     # field match is a substring of that field only
    ("instance:vllm-1 sess-005", True),
    ("nothing-like-this", False),
])
def test_decision_filter(query, hit):
    ev = {"reason": "argmin", "instance": "vllm-1", "session": "sess-005", "class": "HEAVY"}
    assert decision_matches(ev, query) is hit


def test_collected_keeps_bounded_decisions_and_interval_hit_rate():
    c = Collected(max_decisions=100)
    for k in range(250):
        c.ingest("decision", {"k": k})
    assert len(c.decisions) == 100 and c.decision_seq == 250
    c.ingest("state", syn.snapshot(2, 0.0))
    c.ingest("state", syn.snapshot(2, 1.0))
    assert len(c.hit_rate) == 2 and 0 <= c.hit_rate[-1][1] <= 100


def test_render_once_has_every_instance_and_gpu_reason():
    text = render_once(syn.snapshot(3, 5.0))
    assert "policy unified@3" in text
    for i in range(3):
        assert f"vllm-{i}" in text
    assert "gpu – (no NVIDIA driver)" in text  # one mark for a missing value, the reason beside it
    assert "totals" in text and "in_flight=" in text
    assert "kv_drift" not in text  # no instance reports KV events: no column


def test_render_once_shows_kv_drift_where_events_flow():
    snap = syn.snapshot(3, 5.0)
    snap["instances"][0]["kv_events"] = {"state": "exact", "drift": {"share": 0.0412, "tokens": 5, "samples": 2}}
    snap["instances"][0]["index_source"] = "exact"
    snap["instances"][1]["kv_events"] = {"state": "resync", "drift": {"share": None}}
    lines = render_once(snap).splitlines()
    header = next(line for line in lines if line.startswith("instance"))
    assert header.rstrip().endswith("kv_drift")
    rows = {line.split()[0]: line for line in lines if line.startswith("vllm-")}
    assert rows["vllm-0"].rstrip().endswith("4.1% exact")
    assert rows["vllm-1"].rstrip().endswith("– resync")
    assert rows["vllm-2"].rstrip().endswith("–")


def test_resolve_target_reads_locator_and_token(tmp_path, monkeypatch):
    monkeypatch.delenv("KVTOP_CONTROL_TOKEN", raising=False)
    (tmp_path / "router-9.token").write_text("tok\n")
    (tmp_path / "router-9.json").write_text(
        '{"url": "http://127.0.0.1:9", "pid": %d, "token_file": "%s", "started_at": 1}'
        % (os.getpid(), tmp_path / "router-9.token"))
    t = resolve_target(None, state_dir=tmp_path)
    assert (t.url, t.token, t.token_source) == ("http://127.0.0.1:9", "tok", "locator")
    monkeypatch.setenv("KVTOP_CONTROL_TOKEN", "from-env")
    assert resolve_target(None, state_dir=tmp_path).token == "from-env"  # env beats the locator
    t = resolve_target(None, state_dir=tmp_path / "none")
    assert t.url == "http://127.0.0.1:8000"
    with pytest.raises(ControlError, match="cannot read token file"):
        resolve_target(None, token_file=str(tmp_path / "missing"), state_dir=tmp_path)


# -- Pilot on a fake feed -----------------------------------------------------------------------

async def test_pause_freezes_view_while_data_keeps_arriving():
    app, feed = make_app(steps=1, decisions=0)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        table = app.query_one("#instances")
        before = str(table.get_cell("vllm-0", "backlog_tokens"))
        await pilot.press("p")
        assert app.paused
        feed.push("state", syn.snapshot(4, 17.0))
        for k in range(5):
            feed.push("decision", syn.decision(k))
        await pilot.pause()
        await pilot.pause()
        app.apply()
        await pilot.pause()
        assert app.collected.snapshot["ts"] == syn.snapshot(4, 17.0)["ts"]  # collected...
        assert app.collected.decision_seq == 5
        assert str(table.get_cell("vllm-0", "backlog_tokens")) == before  # ...but not drawn
        assert "PAUSED" in str(app.query_one("#topbar").render())
        await pilot.press("4")  # switching tabs while paused draws nothing new either
        await pilot.pause()
        assert app.query_one("#decision-table").row_count == 0
        await pilot.press("p")
        await pilot.pause()
        assert app.query_one("#decision-table").row_count == 5
        await pilot.press("1")
        await pilot.pause()
        assert str(table.get_cell("vllm-0", "backlog_tokens")) != before


async def test_sort_by_key_and_reverse():
    app, feed = make_app(steps=5, decisions=0)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        table = app.query_one("#instances")
        names = lambda: [str(table.get_row_at(i)[0]) for i in range(table.row_count)]  # noqa: E731
        backlog = {i["name"]: i["pending_prefill_tokens"] for i in app.collected.snapshot["instances"]}
        assert names() == sorted(backlog, key=lambda n: -backlog[n])  # by load, busiest first, from the start
        app.set_sort("name")
        await pilot.pause()
        assert names() == ["vllm-0", "vllm-1", "vllm-2", "vllm-3"]
        app.set_sort("backlog_tokens")
        await pilot.pause()
        assert names() == sorted(backlog, key=lambda n: -backlog[n])
        await pilot.press("r")
        assert names() == sorted(backlog, key=lambda n: backlog[n])
        await pilot.press("s")  # the s key moves to the next column
        assert app.sort_key == "backlog_s"


async def test_sort_reads_as_words_keeps_its_arrow_and_follows_clicks():
    """Issue 20: `s` said `sort: backlog_tokens` and the header's arrow was cut off
    (the column was 8 wide, "backlog ▼" is 9); sorting by any column takes a header click."""
    app, feed = make_app(steps=5, decisions=0)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        table = app.query_one("#instances")
        totals = lambda: str(app.query_one("#totals").render())  # noqa: E731
        assert "sort: prefill backlog ▼" in totals() and "backlog_tokens" not in totals()
        from kvtop.tui.model import INSTANCE_COLUMNS
        for key, label, _ in INSTANCE_COLUMNS:  # every label fits with its arrow
            assert table.columns[key].width >= len(label) + 1, key
        header = str(table.columns[table.ordered_columns[3].key].label)
        assert header == "backlog▼"
        # The selection stays on its instance when the rows move.
        table.move_cursor(row=[str(table.get_row_at(i)[0]) for i in range(4)].index("vllm-1"))
        # A click on the "req" header sorts by requests, a second click reverses.
        x = sum(c.get_render_width(table) for c in table.ordered_columns[:2]) + 2
        await pilot.click("#instances", offset=(x, 0))
        await pilot.pause()
        assert app.sort_key == "requests" and app.sort_reverse
        reqs = {i["name"]: i["num_requests"] for i in app.collected.snapshot["instances"]}
        assert [reqs[str(table.get_row_at(i)[0])] for i in range(4)] == sorted(reqs.values(), reverse=True)
        assert "sort: requests ▼" in totals()
        assert str(table.get_row_at(table.cursor_row)[0]) == "vllm-1"
        await pilot.click("#instances", offset=(x, 0))
        await pilot.pause()
        assert app.sort_key == "requests" and not app.sort_reverse
        assert str(table.get_row_at(table.cursor_row)[0]) == "vllm-1"


async def test_busy_gpu_is_not_drawn_as_trouble_and_low_hit_rates_stand_out():
    """Issue 20: GPU 100% was reverse video in the error colour, which operators read as bad."""
    feed = FakeFeed(policies=copy.deepcopy(syn.POLICIES), sessions=syn.sessions(4, 4))
    snap = syn.snapshot(4, 0.0, gpu=True)
    snap["instances"][0]["gpu"]["util_pct"] = 100.0
    snap["instances"][1]["gpu"]["util_pct"] = 20.0
    snap["instances"][2]["est_hit_rate_recent"] = 0.08
    snap["instances"][3]["engine"]["prefix_hit_rate_recent"] = 0.12
    feed.push("state", snap)
    app, _ = make_app(feed)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        table = app.query_one("#instances")
        busy = table.get_cell("vllm-0", "gpu_util")
        assert busy.plain == "100" and "reverse" not in str(busy.style) and "bold" not in str(busy.style)
        assert app._color("error") not in str(busy.style) and app._color("success") in str(busy.style)
        assert str(table.get_cell("vllm-1", "gpu_util")) == "20"
        low = table.get_cell("vllm-2", "est_hit")
        assert low.plain == "8.0↓" and "bold" in str(low.style)  # an arrow and bold, not colour alone
        assert table.get_cell("vllm-3", "engine_hit").plain == "12.0↓"
        assert str(table.get_cell("vllm-0", "est_hit")).endswith("↓") is False


async def test_policy_change_log_names_each_knob_with_old_and_new_values():
    """Issue 20: the log said `knobs lmetric@2 -> lmetric@3` without which knob or values."""
    app, feed = make_app(steps=2, decisions=0)
    knobs = dict(syn.POLICIES["current"]["knobs"])
    features = {"offload_mode": "off", "admission": "off"}
    feed.push("config", {"ts": NOW, "kind": "knobs", "who": "alice",
                         "before": {"policy": "unified", "version": 3, "knobs": knobs, "features": features},
                         "after": {"policy": "unified", "version": 4, "knobs": {**knobs, "overload_factor": 1.5},
                                   "features": {**features, "admission": "pack"}}})
    feed.push("config", {"ts": NOW + 1, "kind": "policy", "who": "api",
                         "before": {"policy": "unified", "version": 4, "knobs": knobs, "features": features},
                         "after": {"policy": "lmetric", "version": 5, "knobs": {}, "features": features}})
    feed.push("config", {"ts": NOW + 2, "kind": "health", "who": "outliers",
                         "before": {"instance": "vllm-2", "healthy": True},
                         "after": {"instance": "vllm-2", "healthy": False, "reason": "5 errors in a row"}})
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await pilot.press("5")
        await pilot.pause()
        app._draw_policy()
        log = str(app.query_one("#config-log").render())
        assert ("22:13:59 alice: knobs unified@3 → unified@4: overload_factor 2.0 → 1.5, "
                "router: admission off → pack") in log
        assert "22:14:00 api: policy unified@4 → lmetric@5 (knobs at their defaults): no value changed" in log
        assert "22:14:01 outliers: vllm-2 unhealthy: 5 errors in a row" in log


async def test_policy_buttons_stay_on_an_80x24_screen_with_many_knobs():
    """Issue 20: at 80x24 a real router's 11 knobs and a long docstring pushed the buttons off-screen."""
    policies = copy.deepcopy(syn.POLICIES)
    unified = next(p for p in policies["policies"] if p["name"] == "unified")
    unified["doc"] = " ".join(["a long docstring that wraps over many lines at eighty columns."] * 8)
    policies["features"] = [{"name": f"router_knob_{k}", "type": "int", "default": k, "min": 0, "max": 99,
                             "choices": None, "range": "int in [0, 99]", "doc": "router-level [x] knob"}
                            for k in range(12)]
    feed = FakeFeed(policies=policies, sessions=syn.sessions(4, 4))
    feed.push("state", syn.snapshot(4, 0.0))
    app, _ = make_app(feed)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, app)
        await pilot.press("5")
        await wait_group(app, "policies")
        await pilot.pause()
        for bid in ("#btn-policy", "#btn-knobs"):
            region = app.query_one(bid).region
            assert region.height and region.bottom <= 23 and region.right <= 80, (bid, region)
        table = app.query_one("#knob-table")
        assert table.row_count == 15
        assert str(table.get_cell("router_knob_0", "range")) == "int in [0, 99]"  # not eaten as markup
        assert str(table.get_cell("router_knob_0", "doc")) == "router: router-level [x] knob"
        await pilot.click("#btn-knobs")
        await pilot.pause()
        from kvtop.tui.screens import KnobForm
        assert isinstance(app.screen, KnobForm)


async def test_client_ids_are_shown_as_sent_not_read_as_markup():
    feed = FakeFeed(policies=copy.deepcopy(syn.POLICIES),
                    sessions={"total": 1, "sort": "tokens", "sessions": [{**syn.sessions(1, 4)["sessions"][0],
                                                                         "session": "[b]agent[/b]-7"}]})
    feed.push("state", syn.snapshot(4, 0.0))
    feed.push("decision", {**syn.decision(0, 4), "session": "[b]agent[/b]-7"})
    app, _ = make_app(feed)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await pilot.press("4")
        await settle(pilot, app)
        table = app.query_one("#decision-table")
        cell = table.get_row_at(0)[1]
        rendered = "".join(seg.text for seg in table._render_cell(0, 1, table.rich_style, 40)[0])
        assert "[b]agent[/b]-7" in rendered, (cell, rendered)
        await pilot.press("3")
        app._fetch_sessions()
        await wait_group(app, "sessions")
        await settle(pilot, app)
        sessions = app.query_one("#session-table")
        rendered = "".join(seg.text for seg in sessions._render_cell(0, 0, sessions.rich_style, 40)[0])
        assert "[b]agent[/b]-7" in rendered


async def test_instances_show_errors_recent_ttft_health_reasons_and_writer_health():
    """Issue 20: per-instance errors, TTFT p50/p90 over a recent window, why an instance is
    out; the header says when the decision log's writer is degraded and how many are ejected."""
    feed = FakeFeed(policies=copy.deepcopy(syn.POLICIES), sessions=syn.sessions(4, 4))
    snap = syn.snapshot(4, 0.0)
    snap["router"]["db"] = "/var/tmp/kvtop-demo-x1/kvtop.db"
    snap["router"]["decision_log"] = {"rows_written": 900, "rows_dropped": 12, "rows_failed": 0,
                                      "lag_s": 3.0, "degraded": True, "last_error": None}
    i0, i1, i2, i3 = snap["instances"]
    i0["errors"]["requests_total"] = 7
    i2.update(healthy=False, health={"ejected": True, "ejected_for_s": 25.0,
                                     "last_error": "5 failed requests in a row; ejected for 30 s"})
    i3.update(healthy=False, health={"ejected": False, "last_error": "ClientConnectorError: refused"})
    for k, ttft in enumerate([100, 200, 300, 400, 5000]):
        feed.push("outcome", {"ts": snap["ts"] - 5, "instance": "vllm-1", "ttft_ms": ttft, "status": "ok"})
    feed.push("outcome", {"ts": snap["ts"] - 300, "instance": "vllm-0", "ttft_ms": 9999, "status": "ok"})  # too old
    feed.push("state", snap)
    app, _ = make_app(feed)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        table = app.query_one("#instances")
        cell = lambda name, col: str(table.get_cell(name, col))  # noqa: E731
        assert cell("vllm-1", "ttft_p50") == "300ms" and cell("vllm-1", "ttft_p90") == "3.2s"  # 400 + 0.6 x 4,600
        assert cell("vllm-0", "ttft_p50") == "–"  # nothing in the last minute
        assert cell("vllm-0", "errors") == "7" and cell("vllm-1", "errors") == "0"
        assert cell("vllm-2", "health") == "⏏ ejected" and cell("vllm-3", "health") == "✖ DOWN"
        totals = str(app.query_one("#totals").render())
        assert "vllm-2 ejected: 5 failed requests in a row; ejected for 30 s (back in 25 s)" in totals
        assert "vllm-3 down: ClientConnectorError: refused" in totals
        top = str(app.query_one("#topbar").render())
        assert "⚠ rec DEGRADED: 12 dropped, 3 s behind" in top and "⏏ 1 ejected" in top and "✖ 1 down" in top
        # the header is one line: the log path, its least important field, is left out at 120
        # columns; the whole header (the path included) is its tooltip
        assert app.query_one("#topbar").size.height == 1
        assert "log /var/tmp/kvtop-demo-x1/kvtop.db" in str(app.query_one("#topbar").tooltip)
        assert "prefill_tps" not in [str(c.value) for c in table.columns]
        # A router that measures prefill rates gets the column, sortable by a click.
        snap2 = copy.deepcopy(snap)
        for n, inst in enumerate(snap2["instances"]):
            inst["prefill_tps_measured"] = 4000.0 + 1000 * n
        snap2["router"]["decision_log"]["degraded"] = False
        feed.push("state", snap2)
        await settle(pilot, app)
        assert cell("vllm-3", "prefill_tps") == "7,000"
        assert "● rec" in str(app.query_one("#topbar").render())
        app.set_sort("prefill_tps")
        await pilot.pause()
        assert [str(table.get_row_at(i)[0]) for i in range(4)] == ["vllm-3", "vllm-2", "vllm-1", "vllm-0"]


async def test_fleet_strips_show_every_instance_from_16_up():
    """Issue 20: a fleet of 64-256 instances read at a glance, not 20 rows at a time."""
    from kvtop.tui.model import fleet_strips

    feed = FakeFeed(policies=copy.deepcopy(syn.POLICIES), sessions=syn.sessions(4, 40))
    snap = syn.snapshot(40, 0.0)
    snap["instances"][7]["healthy"] = False
    feed.push("state", snap)
    app, _ = make_app(feed)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, app)
        fleet = app.query_one("#fleet")
        assert fleet.display
        lines = str(fleet.render()).splitlines()
        # 40 one-character cells per strip, wrapped to the width; the down instance is ✖ in both
        cells = [line[9:] for line in lines[:-1]]
        assert sum(len(c) for c in cells) == 80 and all(len(c) <= 80 - 9 - 3 for c in cells)
        assert lines[0].startswith("backlog") and any(l.startswith("est hit") for l in lines)
        assert "".join(cells).count("✖") == 2 and "✖ down (1)" in lines[-1]
    strips = fleet_strips(snap["instances"], 100)
    busiest = max(snap["instances"], key=lambda i: i["pending_prefill_tokens"] if i["healthy"] else -1)
    names = sorted((i["name"] for i in snap["instances"]), key=lambda n: int(n.split("-")[1]))
    assert strips[0][1][names.index(busiest["name"])][0] == "█"  # the busiest is the full bar
    small, _ = make_app(n=4, steps=2, decisions=0)
    async with small.run_test(size=SIZE) as pilot:
        await settle(pilot, small)
        assert not small.query_one("#fleet").display  # 4 instances: the table says it all


async def test_help_names_keys_as_typed_and_explains_every_column():
    """Issue 20: help listed Textual's key ids (question_mark, left_square_bracket) and no legend."""
    from kvtop.tui.screens import HelpScreen

    app, feed = make_app(steps=2, decisions=0)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        text = str(app.screen.query_one("Static").render())
        assert "question_mark" not in text and "square_bracket" not in text and "equals_sign" not in text
        rows = {line.split()[0]: line for line in text.splitlines() if line.startswith("  ") and line.split()}
        assert "kvtop.help" in rows["?"] and "kvtop.window_shorter" in rows["["]
        assert "kvtop.faster" in rows["+"] and "kvtop.quit_ctrl_c" in rows["^c"]
        for label in ("est%", "eng%", "bl", "dreq", "dtok", "KV%", "GPU%"):
            assert label in rows, label
        # A remapped key shows as remapped.
        await pilot.press("escape")
        app.set_keymap({"kvtop.pause": "space"})
        await pilot.pause()
        assert app.key_names("kvtop.pause", "p") == "space"


async def test_decision_filter_and_receipt():
    from kvtop.tui.screens import ReceiptScreen

    app, feed = make_app(decisions=60)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await pilot.press("4")
        await settle(pilot, app)
        table = app.query_one("#decision-table")
        assert table.row_count == 60
        await pilot.press("slash")
        await pilot.press(*"reason:argmin")
        await pilot.press("enter")
        await pilot.pause()
        reasons = {str(table.get_row_at(i)[4]) for i in range(table.row_count)}
        assert reasons == {"argmin"} and table.row_count == 10
        table.focus()
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, ReceiptScreen)
        terms = app.screen.query_one("#receipt-terms")
        assert terms.row_count == 4  # every candidate, not only the chosen one
        await pilot.press("escape")
        await pilot.press("escape")  # clears the filter: all rows back
        await pilot.pause()
        assert table.row_count == 60


async def test_receipt_times_and_numbers_read_as_a_person_would():
    """Issue 20: the receipt showed t_proxy_recv as raw epoch seconds and mixed 1536, 11,776
    and 1.66e+04; now local time plus ms from the receipt, and one number format."""
    from kvtop.tui.screens import ReceiptScreen

    feed = FakeFeed(policies=copy.deepcopy(syn.POLICIES), sessions=syn.sessions(4, 4))
    feed.push("state", syn.snapshot(4, 0.0))
    ev = syn.decision(0, 4)
    ev.update(reason="affinity_stick", t_proxy_recv=ev["ts"] - 0.0042, admission_wait_ms=3.25)
    ev["terms"][0].update(P=1536, new=11776, score=16612.7)
    feed.push("decision", ev)
    app, _ = make_app(feed)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await pilot.press("4", "enter")
        await pilot.pause()
        assert isinstance(app.screen, ReceiptScreen)
        head = str(app.screen.query_one("#receipt-head").render())
        assert "received 22:13:19.995 · decided +4.2 ms" in head
        assert "admission_wait_ms 3.2 ms" in head and "1699999999" not in head
        terms = app.screen.query_one("#receipt-terms")
        rows = [[str(c) for c in terms.get_row_at(r)] for r in range(terms.row_count)]
        assert rows[0][:2] == ["▶", ev["instance"]]  # the chosen candidate first
        row = next(r for r in rows if r[1] == "vllm-0")
        assert row[1:] == ["vllm-0", row[2], "11,776", "1,536", row[5], row[6], "16,613"]
        assert "e+" not in " ".join(str(c) for r in range(terms.row_count) for c in terms.get_row_at(r))
        assert "fallback would have scored" in str(app.screen.query_one("#receipt-note").render())


async def test_decision_rows_capped():
    app, feed = make_app(decisions=150, max_decisions=100)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await pilot.press("4")
        await pilot.pause()
        table = app.query_one("#decision-table")
        assert table.row_count == 100
        assert str(table.get_row_at(table.row_count - 1)[1]) == syn.decision(149)["session"]


async def test_disconnect_banner():
    app, feed = make_app(steps=2, decisions=0)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        assert not app.query_one("#banner").display
        feed.push("_status", {"connected": False, "error": "Connection refused", "retry_in_s": 2.0})
        await settle(pilot, app)
        banner = app.query_one("#banner")
        assert banner.display and "Connection refused" in str(banner.render())
        assert "DISCONNECTED" in str(app.query_one("#topbar").render())


async def test_first_frames_say_connecting_not_disconnected():
    """Issue 20: every demo opened on a red DISCONNECTED frame for about a second."""
    feed = FakeFeed(policies=copy.deepcopy(syn.POLICIES), sessions=syn.sessions(4, 4))
    feed.events = feed_that_waits(feed)  # no _status yet: the stream has not answered
    app, _ = make_app(feed, connect_grace_s=60)
    async with app.run_test(size=SIZE) as pilot:
        app.apply(force=True)
        await pilot.pause()
        top = str(app.query_one("#topbar").render())
        assert "connecting" in top and "DISCONNECTED" not in top
        assert not app.query_one("#banner").display
        # The router refusing during its start-up is still "connecting" within the grace...
        app.collected.ingest("_status", {"connected": False, "error": "Connection refused", "retry_in_s": 0.5})
        app.apply(force=True)
        await pilot.pause()
        assert "connecting" in str(app.query_one("#topbar").render())
        assert not app.query_one("#banner").display
        # ...and red once the grace is over.
        app.connect_grace_s = 0
        app.apply(force=True)
        await pilot.pause()
        assert "DISCONNECTED" in str(app.query_one("#topbar").render())
        assert app.query_one("#banner").display


def feed_that_waits(feed):
    async def events():
        import asyncio
        await asyncio.Event().wait()
        yield "_status", {}
    return events


async def test_chart_y_labels_are_round_and_compact():
    """The charts' y axes read 150k, 1.5s and 80%, not plotext's 139925.0, 2518.4 and 83.3."""
    import re

    label = re.compile(r"^(0|-?\d+(\.\d+)?(k|M|G|ms|s|%)?)$")
    app, _ = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await pilot.press("2")
        await settle(pilot, app)
        seen = {}
        for chart, unit_label in [("#chart-backlog", "150k"), ("#chart-ttft", "1.5s"), ("#chart-hit", "80%")]:
            text = re.sub(r"\x1b\[[0-9;]*m", "", app.query_one(chart).plt.build())
            labels = [line.split("┤")[0].strip() for line in text.splitlines() if "┤" in line]
            assert len(labels) >= 3, (chart, text)
            assert all(label.match(y) and not y.endswith(".0") for y in labels), (chart, labels)
            assert unit_label in labels, (chart, labels)
            seen[chart] = labels
        assert seen["#chart-hit"][0] == "100%" and seen["#chart-hit"][-1] == "0"  # pinned 0 to 100


async def test_readonly_hides_control():
    from kvtop.tui.app import PolicyCommands

    app, feed = make_app(steps=2, decisions=0, readonly=True)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        assert app.check_action("switch_policy", ()) is False
        assert app.check_action("edit_knobs", ()) is False
        assert not app.query_one("#btn-policy").display
        names = [name for name, _, _ in PolicyCommands(app.screen)._commands()]
        assert not any(n.startswith("Switch policy") or n.startswith("Edit knobs") for n in names)
        await pilot.press("P")
        assert feed.calls == []


async def test_knob_form_validates_before_sending():
    from kvtop.tui.screens import KnobForm

    app, feed = make_app(steps=2, decisions=0)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await pilot.press("k")
        await pilot.pause()
        assert isinstance(app.screen, KnobForm)
        inp = app.screen.query_one("#knob-overload_factor")
        inp.value = "99"  # above the schema's max of 10
        app.screen.action_submit()
        await pilot.pause()
        assert isinstance(app.screen, KnobForm)
        assert "overload_factor" in str(app.screen.query_one("#knob-error").render())
        inp.value = "3.5"
        app.screen.action_submit()
        await pilot.pause()
        await pilot.press("y")  # the confirm-with-diff screen
        await wait_group(app, "control")
        assert feed.calls == [("patch_knobs", {"overload_factor": 3.5})]


# -- Pilot on a real router over loopback ------------------------------------------------------

TOKEN = "tui-test-token"


@pytest.fixture
async def live_router(aiohttp_server, fake_backends, tmp_path):
    from router.app import Backend, RouterConfig, create_app

    backends = await fake_backends(2)
    # unified, not the default: a policy with knobs, which these tests show and edit
    cfg = RouterConfig(backends=[Backend(f"i{k}", url) for k, (_, url) in enumerate(backends)],
                       db=None, control_token=TOKEN, state_dir=str(tmp_path / "state"), scrape_interval_s=0.2,
                       policy="unified")
    app = create_app(cfg)
    server = await aiohttp_server(app, host="127.0.0.1")
    return server, app, str(server.make_url("")).rstrip("/")


async def wait_for(pilot, app, cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        app.apply(force=True)
        await pilot.pause(0.05)
        if cond():
            app.apply(force=True)
            await pilot.pause()
            return True
    return False


async def test_policy_switch_through_palette_reaches_router(live_router):
    from router.app import STATE
    from kvtop.tui.app import KvtopApp
    from kvtop.tui.feed import RouterFeed

    server, rapp, url = live_router
    app = KvtopApp(RouterFeed(url, TOKEN, hz=10), url=url, apply_timer=False, poll_sessions_s=0)
    async with app.run_test(size=SIZE) as pilot:
        assert await wait_for(pilot, app, lambda: app.collected.snapshot is not None
                              and app.policies_body.get("policies"))
        assert "unified@1" in str(app.query_one("#topbar").render())
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"Switch policy to lmetric")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await pilot.pause()
        await pilot.press("y")
        await wait_group(app, "control")
        assert rapp[STATE].slot.label == "lmetric@2"
        assert await wait_for(pilot, app, lambda: "lmetric@2" in str(app.query_one("#topbar").render()))
        assert any(ev.get("kind") == "policy" for ev in app.collected.config_events)


async def test_invalid_knob_shows_router_message(live_router):
    from router.app import STATE
    from kvtop.tui.app import KvtopApp
    from kvtop.tui.feed import RouterFeed

    server, rapp, url = live_router
    app = KvtopApp(RouterFeed(url, TOKEN, hz=10), url=url, apply_timer=False, poll_sessions_s=0)
    async with app.run_test(size=SIZE) as pilot:
        assert await wait_for(pilot, app, lambda: app.collected.snapshot is not None)
        # Past the form's own checks (as with a schema the client does not know): the router decides.
        app._apply_change("patch_knobs", None, {"overload_factor": -5})
        await wait_group(app, "control")
        await pilot.pause()
        assert app.last_error and "overload_factor" in app.last_error
        assert any("overload_factor" in str(n.message) for n in app._notifications)
        assert rapp[STATE].slot.version == 1  # nothing changed


async def test_router_level_knobs_show_and_apply_through_the_form(live_router):
    """Offload/admission knobs are the router's, not the policy's: listed and editable too."""
    from router.app import STATE
    from kvtop.tui.app import KvtopApp
    from kvtop.tui.feed import RouterFeed

    server, rapp, url = live_router
    app = KvtopApp(RouterFeed(url, TOKEN, hz=10), url=url, apply_timer=False, poll_sessions_s=0)
    async with app.run_test(size=SIZE) as pilot:
        assert await wait_for(pilot, app, lambda: app.policies_body.get("features"))
        app.action_tab("policy")
        await pilot.pause()
        table = app.query_one("#knob-table")
        assert "admission" in [k.value for k in table.rows] and "offload_mode" in [k.value for k in table.rows]
        app.action_edit_knobs()
        await pilot.pause()
        inp = app.screen.query_one("#knob-admission")
        inp.value = "pack"
        await pilot.press("ctrl+s")
        await pilot.pause()
        await pilot.press("y")
        await wait_group(app, "control")
        assert rapp[STATE].features.knobs["admission"] == "pack"
        assert rapp[STATE].slot.version == 2


async def test_policy_docs_are_not_read_as_markup(live_router):
    """round_robin's doc has [rr_counter mod n]: Rich markup must not swallow it."""
    from kvtop.tui.app import KvtopApp
    from kvtop.tui.feed import RouterFeed
    from kvtop.tui.screens import PolicyPicker

    server, rapp, url = live_router
    app = KvtopApp(RouterFeed(url, TOKEN, hz=10), url=url, apply_timer=False, poll_sessions_s=0)
    async with app.run_test(size=SIZE) as pilot:
        assert await wait_for(pilot, app, lambda: app.policies_body.get("policies"))
        app.push_screen(PolicyPicker(app.policies_body["policies"], "unified"))
        await pilot.pause()
        options = app.screen.query_one("#picker-list")
        from textual.content import Content

        # what is drawn: the prompt parsed as markup, the way the option list renders it
        from rich.text import Text

        prompts = [options.get_option_at_index(i).prompt for i in range(options.option_count)]
        texts = [p.plain if isinstance(p, Text) else Content.from_markup(str(p)).plain for p in prompts]
        assert any("[rr_counter mod n]" in t for t in texts), texts


async def test_attach_without_a_terminal_points_to_once(live_router, capsys):
    from kvtop.cli import main

    server, rapp, url = live_router
    rc = await asyncio.to_thread(main, ["attach", url])  # pytest captures stdout: no TTY
    err = capsys.readouterr().err
    assert rc == 2 and "--once" in err and "Traceback" not in err


async def test_once_on_real_router(live_router, capsys):
    from kvtop.cli import main

    server, rapp, url = live_router
    rc = await asyncio.to_thread(main, ["attach", "--once", url])
    out = capsys.readouterr().out
    assert rc == 0
    assert "policy unified@1" in out and "i0" in out and "i1" in out and "totals" in out


async def test_wrong_token_is_one_line_error(live_router, tmp_path, capsys):
    from kvtop.cli import main

    server, rapp, url = live_router
    bad = tmp_path / "bad.token"
    bad.write_text("not-the-token")
    rc = await asyncio.to_thread(main, ["attach", url, "--token-file", str(bad)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "refused" in err and "Traceback" not in err


def test_wrong_url_is_one_line_error(capsys):
    from kvtop.cli import main

    rc = main(["attach", "http://127.0.0.1:9", "--state-dir", "/nonexistent"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("kvtop attach: cannot reach the router at http://127.0.0.1:9")


@pytest.mark.parametrize("flags, message", [
    (["--theme", "nope"], "unknown theme 'nope'; one of: kvtop-dark"),  # was a Textual traceback
    (["--max-decisions", "0"], "--max-decisions must be at least 1"),  # -1 crashed the row cap
    (["--hz", "0"], "--hz must be between 0.5 and 10"),
])
def test_bad_attach_flags_are_one_line_errors_before_connecting(capsys, flags, message):
    from kvtop.cli import main

    # port 9 has no router: a flag error must come first, without a network call
    rc = main(["attach", "http://127.0.0.1:9", "--state-dir", "/nonexistent", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith(f"kvtop attach: {message}")


# -- snapshots (plain def: snap_compare runs its own loop) -------------------------------------

def _snap_app(tab="overview", n=4, **kw):
    app, _ = make_app(n=n, **kw)

    async def run_before(pilot):
        await settle(pilot, app)
        if tab != "overview":
            await pilot.press(str(["overview", "charts", "sessions", "decisions", "policy"].index(tab) + 1))
            if tab == "sessions":
                app._fetch_sessions()
                await wait_group(app, "sessions")
            await settle(pilot, app)

    return app, run_before


@pytest.mark.parametrize("tab", ["overview", "charts", "sessions", "decisions", "policy"])
def test_snapshot_tabs(snap_compare, tab):
    app, run_before = _snap_app(tab)
    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_snapshot_overview_80x24(snap_compare):
    app, run_before = _snap_app("overview")
    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


def _view_app(view, n):
    """The overview, a receipt or the Policy tab (issue 35: each at 80x24 and 140x42); the
    overview with a cordoned and a draining instance (issue 34)."""
    from kvtop.tui.screens import ReceiptScreen

    feed = None
    if view == "fleet":
        feed = FakeFeed(policies=copy.deepcopy(syn.POLICIES), sessions=syn.sessions(60, n))
        for t in range(40):
            feed.push("state", syn.snapshot(n, float(t), fleet={1: "cordoned", 2: "draining"}))
        for k in range(60):
            feed.push("decision", syn.decision(k, n))
            feed.push("outcome", syn.outcome(k, n))
    app, run_tab = _snap_app("policy" if view == "policy" else "overview", n=n, feed=feed)

    async def run_before(pilot):
        await run_tab(pilot)
        if view == "receipt":
            app.push_screen(ReceiptScreen(syn.decision(7, n, seconds=True)))  # expected_cost's terms
            await pilot.pause()

    return app, run_before


@pytest.mark.parametrize("size", [(80, 24), (140, 42)])
@pytest.mark.parametrize("view, n", [("overview", 4), ("overview", 64), ("receipt", 4), ("policy", 4),
                                     ("fleet", 4)])
def test_snapshot_views_at_both_sizes(snap_compare, view, n, size):
    app, run_before = _view_app(view, n)
    assert snap_compare(app, terminal_size=size, run_before=run_before)


def test_snapshot_colour_blind_theme(snap_compare):
    app, run_before = _snap_app("overview", theme="kvtop-cb")
    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


async def test_save_docs_screenshots():
    """KVTOP_SAVE_SCREENSHOTS=1 pytest -k docs_screenshots rewrites docs/screenshots/*.svg."""
    if not os.environ.get("KVTOP_SAVE_SCREENSHOTS"):
        pytest.skip("set KVTOP_SAVE_SCREENSHOTS=1 to regenerate docs/screenshots")
    from pathlib import Path

    out = str(Path(__file__).resolve().parents[1] / "docs" / "screenshots")
    shots = [("overview", (120, 40), None, "overview"), ("charts", (120, 40), None, "charts"),
             ("sessions", (120, 40), None, "sessions"), ("decisions", (120, 40), None, "decisions"),
             ("policy", (120, 40), None, "policy"), ("overview", (80, 24), None, "overview-80x24"),
             ("overview", (120, 40), "kvtop-light", "overview-light"),
             ("overview", (120, 40), "kvtop-cb", "overview-colour-blind"),
             ("overview", (120, 40), None, "fleet-64")]
    for tab, size, theme, name in shots:
        app, run_before = _snap_app(tab, n=64 if name == "fleet-64" else 4, **({"theme": theme} if theme else {}))
        async with app.run_test(size=size) as pilot:
            await run_before(pilot)
            if name == "decisions":
                app.query_one("#decision-table").focus()
                await pilot.press("enter")
                await pilot.pause()
                app.save_screenshot("receipt.svg", out)
                await pilot.press("escape")
                await pilot.pause()
            app.save_screenshot(f"{name}.svg", out)


# -- LiveTable draws exactly what DataTable draws -----------------------------------------------

def _same_line(table, y):
    """LiveTable's line y against DataTable's own (its render_line, the base class's)."""
    from rich.segment import Segment
    from textual.widgets import DataTable

    # zero-width segments draw nothing (DataTable leaves an empty fill where the table is wider
    # than the screen); the rest must be the same text in the same styles, mouse meta included
    ours = [seg for seg in Segment.simplify(list(table.render_line(y))) if seg.text]
    theirs = [seg for seg in Segment.simplify(list(DataTable.render_line(table, y))) if seg.text]
    return ours == theirs, ours, theirs


@pytest.mark.parametrize("tab, table_id", [("1", "#instances"), ("3", "#session-table"), ("4", "#decision-table")])
@pytest.mark.parametrize("theme", ["kvtop-cb", "kvtop-light"])
async def test_live_table_lines_match_datatable(tab, table_id, theme):
    """The content-keyed cell cache draws every line exactly as DataTable does: zebra rows,
    the pinned column scrolled sideways, the cursor, the mouse hover, focus or not, moved rows
    (their mouse meta), after a theme change."""
    app, feed = make_app(n=8, steps=12, decisions=40, theme=theme)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await pilot.press(tab)
        if tab == "3":
            app._fetch_sessions()
            await wait_group(app, "sessions")
        await settle(pilot, app)
        table = app.query_one(table_id)
        app.set_sort("backlog_tokens")  # moved rows must not keep their old mouse meta
        await pilot.pause()
        checked = 0

        async def check_all(label):
            nonlocal checked
            await pilot.pause()
            for y in range(min(table.size.height, table.row_count + 1)):
                same, ours, theirs = _same_line(table, y)
                assert same, (label, y, ours, theirs)
                checked += 1

        await check_all("first")
        table.move_cursor(row=2)
        await check_all("cursor")
        await pilot.hover(table_id, offset=(4, 3))  # the mouse over a row
        await check_all("hover")
        table.scroll_x = 30  # sideways, the pinned column stays
        await check_all("scrolled")
        table.scroll_x = 0
        app.set_focus(None)
        await check_all("blurred")
        app.theme = "textual-dark" if theme != "textual-dark" else "kvtop-dark"
        await settle(pilot, app)
        await check_all("theme")
        feed.push("state", syn.snapshot(8, 99.0))
        await settle(pilot, app)
        await check_all("new values")
        assert checked > 60
