"""kvtop attach never shows a stale or misleading view as live (issue 35): a restarted router's
policy and knobs, the shadow panel, a lost connection, a broken event stream, the header, the
fleet's health line at 80x24, shadows managed from the dashboard."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest

from kvtop.tui import synthetic as syn
from kvtop.tui.feed import FakeFeed
from test_tui import live_router, make_app, settle, wait_for, wait_group  # noqa: F401 - a fixture


@pytest.fixture(autouse=True)
def utc(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    time.tzset()


async def _router(aiohttp_server, backends, tmp_path, *, token="tok", port=None, **cfg_kw):
    from router.app import Backend, RouterConfig, create_app

    cfg_kw.setdefault("db", None)
    cfg = RouterConfig(backends=[Backend(f"i{k}", url) for k, (_, url) in enumerate(backends)],
                       control_token=token, state_dir=str(tmp_path / "state"), scrape_interval_s=0.2, **cfg_kw)
    app = create_app(cfg)
    server = await aiohttp_server(app, host="127.0.0.1", **({"port": port} if port else {}))
    return server, app


def _text(app, selector):
    return str(app.query_one(selector).render())


def _knob_cell(app, name):
    return str(app.query_one("#knob-table").get_cell(name, "value"))


# -- a router restart: the Policy tab and the knob form show the new router's truth -------------

async def test_policy_tab_and_knob_form_show_the_restarted_router_within_one_refresh(
        aiohttp_server, fake_backends, tmp_path):
    """The issue's case: the old router ran unified@2 with offload on and a custom knob; it
    restarts on other knobs. Within one refresh of the reconnect, the Policy tab and an open
    knob form show the new values, not the old router's."""
    from router.app import STATE
    from kvtop.tui.app import KvtopApp
    from kvtop.tui.feed import RouterFeed
    from kvtop.tui.screens import KnobForm

    backends = await fake_backends(2)
    server, rapp = await _router(aiohttp_server, backends, tmp_path, policy="unified")
    url, port = str(server.make_url("")).rstrip("/"), server.port
    rapp[STATE].set_policy(None, {"overload_factor": 3.5, "offload_mode": "simple", "offload_threshold": 30000},
                           "test", merge=True)
    app = KvtopApp(RouterFeed(url, "tok", hz=10), url=url, apply_timer=False, poll_sessions_s=0)
    async with app.run_test(size=(140, 42)) as pilot:
        assert await wait_for(pilot, app, lambda: app.policies_body.get("policies") and app.collected.snapshot)
        await pilot.press("5")
        assert await wait_for(pilot, app, lambda: _knob_cell(app, "overload_factor") == "3.5")
        assert _knob_cell(app, "offload_mode") == "simple" and "unified@2" in _text(app, "#policy-name")
        await server.close()
        assert await wait_for(pilot, app, lambda: not app.collected.connected)
        # the restarted router: defaults, but another overload factor
        server, rapp = await _router(aiohttp_server, backends, tmp_path, port=port, policy="unified",
                                     knobs={"overload_factor": 1.5})
        assert await wait_for(pilot, app, lambda: app.collected.connected and app.collected.snapshot
                              and app.collected.snapshot["router"]["run_id"] == rapp[STATE].run_id, timeout=15)
        app.apply(force=True)  # one refresh
        await pilot.pause()
        assert "unified@1" in _text(app, "#policy-name")
        assert _knob_cell(app, "overload_factor") == "1.5"
        assert _knob_cell(app, "offload_mode") == "off"  # the old router's "simple" is gone
        assert _knob_cell(app, "offload_threshold") != "30000"
        await pilot.press("k")
        await pilot.pause()
        form = app.screen
        assert isinstance(form, KnobForm)
        assert str(form.query_one("#knob-overload_factor").value) == "1.5"
        assert str(form.query_one("#knob-offload_mode").value) == "off"
        # and a change made behind the open form shows in it at the next refresh
        rapp[STATE].set_policy(None, {"overload_factor": 4.0}, "someone else", merge=True)
        assert await wait_for(pilot, app, lambda: str(form.query_one("#knob-overload_factor").value) == "4.0")
        assert "now 4.0" in str(form.query_one("#knob-label-overload_factor").render())
        await pilot.press("escape")
    await server.close()


# -- every tab and modal redraws from the latest snapshot ---------------------------------------

def _with_shadows(t, rows):
    snap = syn.snapshot(4, t)
    snap["shadows"] = {"budget_ms": 5.0, "shadows": rows, "dropped": []}
    return snap


def _shadow(policy, picks, agree):
    return {"policy": policy, "knobs": {}, "picks": picks, "agree": agree, "agreement": agree / picks,
            "disagree_by_class": {}, "saved_prefill_tokens": 100, "since": 1_700_000_000.0}


async def test_shadow_panel_and_promote_dialog_follow_the_router_while_on_screen():
    feed = FakeFeed(policies=copy.deepcopy(syn.POLICIES))
    feed.push("state", _with_shadows(0.0, []))
    app, _ = make_app(feed)
    async with app.run_test(size=(140, 42)) as pilot:
        await settle(pilot, app)
        await pilot.press("5")
        await settle(pilot, app)
        assert "none" in _text(app, "#shadow-panel")
        feed.push("state", _with_shadows(1.0, [_shadow("lmetric", 180, 139)]))
        await settle(pilot, app)
        assert "lmetric" in _text(app, "#shadow-panel") and "77.2% of 180" in _text(app, "#shadow-panel")
        feed.push("state", _with_shadows(2.0, [_shadow("lmetric", 286, 227)]))
        await settle(pilot, app)
        assert "79.4% of 286" in _text(app, "#shadow-panel")
        app.promote_shadow("lmetric")
        await pilot.pause()
        diff = lambda: _text(app.screen, "#confirm-diff")  # noqa: E731
        assert "79.4% of 286" in diff()
        feed.push("state", _with_shadows(3.0, [_shadow("lmetric", 300, 240)]))
        await settle(pilot, app)
        assert "80.0% of 300" in diff()  # the dialog and the panel agree: one refresh rule
        await pilot.press("n")


# -- a lost connection is visible as stale ------------------------------------------------------

async def test_a_disconnected_view_is_grey_with_its_age_and_the_banner_says_why_in_words():
    feed = FakeFeed(policies=copy.deepcopy(syn.POLICIES))
    for t in range(3):
        feed.push("state", syn.snapshot(4, float(t)))
    app, _ = make_app(feed)
    async with app.run_test(size=(140, 42)) as pilot:
        await settle(pilot, app)
        health = lambda: str(app.query_one("#instances").get_cell("vllm-0", "health"))  # noqa: E731
        assert health() == "● up"
        top_live = _text(app, "#topbar")
        feed.push("_status", {"connected": False, "retry_in_s": 4.0,
                              "error": "connection refused: nothing listens at 127.0.0.1:8000 "
                                       "(the router is stopped or restarting)"})
        await settle(pilot, app)
        app.collected.disconnected_at -= 12  # twelve seconds later
        app.apply(force=True)
        await pilot.pause()
        assert health().startswith("stale 1")  # no row reads "up" any more
        assert all(str(app.query_one("#instances").get_cell(n, "health")).startswith("stale")
                   for n in ("vllm-1", "vllm-2", "vllm-3"))
        top = _text(app, "#topbar")
        assert "DISCONNECTED · stale 12s" in top
        rate = next(part for part in top_live.split("  ") if "req/s" in part)
        assert rate in top  # the rate is frozen at the last snapshot, not updated or zeroed
        banner = _text(app, "#banner")
        assert "since" in banner and "(12s)" in banner and "nothing listens at 127.0.0.1:8000" in banner
        assert "every figure below is stale" in banner
        assert _text(app, "#health").startswith("stale 12s:")
        assert app.query_one("#tabs").region.y == 2  # the banner sits above the footer: nothing moved
        # back: live again, nothing greyed
        feed.push("_status", {"connected": True, "error": None})
        feed.push("state", syn.snapshot(4, 4.0))
        await settle(pilot, app)
        assert health() == "● up" and "DISCONNECTED" not in _text(app, "#topbar")


async def test_the_words_for_a_refused_connection():
    import socket

    from kvtop.tui.feed import RouterFeed

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        unused_tcp_port = sock.getsockname()[1]

    feed = RouterFeed(f"http://127.0.0.1:{unused_tcp_port}", None)
    events = feed.events()
    kind, payload = await events.__anext__()
    await events.aclose()
    await feed.close()
    assert kind == "_status" and not payload["connected"]
    assert payload["error"] == (f"connection refused: nothing listens at 127.0.0.1:{unused_tcp_port} "
                                "(the router is stopped or restarting)")


# -- a stream of endless data lines (issue 36) ---------------------------------------------------

@pytest.fixture
async def endless_router(aiohttp_server):
    """A server whose event stream is data lines that never end an event (for 20 s a connection)."""
    from aiohttp import web

    async def events(request):
        resp = web.StreamResponse()
        await resp.prepare(request)
        line = b"data: " + b"x" * 100 + b"\n"
        t = time.monotonic()
        try:
            while time.monotonic() - t < 20.0:
                await resp.write(line * 100)
        except (ConnectionError, RuntimeError):
            pass
        return resp

    async def decisions(request):
        return web.json_response({"decisions": []})

    async def policies(request):
        return web.json_response({"current": {}, "policies": []})

    app = web.Application()
    app.router.add_get("/kvtop/v1/events", events)
    app.router.add_get("/kvtop/v1/decisions", decisions)
    app.router.add_get("/kvtop/v1/policies", policies)
    server = await aiohttp_server(app, host="127.0.0.1")
    return str(server.make_url("")).rstrip("/")


async def test_endless_data_lines_show_the_error_and_reconnect(endless_router):
    """It died with RuntimeError('Connection closed.') (exit 1): now the stream is dropped as
    broken, the banner says so, and the dashboard connects again."""
    from kvtop.tui.app import KvtopApp
    from kvtop.tui.feed import RouterFeed

    url = endless_router
    app = KvtopApp(RouterFeed(url, None, hz=4), url=url, poll_sessions_s=0)
    seen_errors = set()
    ingest = app.collected.ingest

    def spy(kind, payload):
        if kind == "_status" and payload.get("error"):
            seen_errors.add(payload["error"])
        ingest(kind, payload)

    app.collected.ingest = spy
    async with app.run_test(size=(120, 40)) as pilot:
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline and app.collected.connects < 2:
            await pilot.pause(0.1)
            assert app.is_running
        assert app.collected.connects >= 2  # dropped and connected again, well before the 20 s
        assert any("the event stream is broken" in e for e in seen_errors), seen_errors
        assert app.is_running
    assert app.return_code in (None, 0)


async def test_a_feed_that_raises_is_a_lost_connection_not_the_end():
    """Whatever a feed raises, the reader shows it and starts again."""

    class Flaky(FakeFeed):
        calls_n = 0

        async def events(self):
            Flaky.calls_n += 1
            if Flaky.calls_n == 1:
                yield "_status", {"connected": True, "error": None}
                yield "state", syn.snapshot(4, 0.0)
                raise RuntimeError("Connection closed.")
            async for item in super().events():
                yield item

    feed = Flaky(policies=copy.deepcopy(syn.POLICIES))
    app, _ = make_app(feed)
    errors = []
    ingest = app.collected.ingest

    def spy(kind, payload):
        if kind == "_status" and payload.get("error"):
            errors.append(payload["error"])
        ingest(kind, payload)

    app.collected.ingest = spy
    async with app.run_test(size=(120, 40)) as pilot:
        assert await wait_for(pilot, app, lambda: Flaky.calls_n >= 2 and app.collected.connected, timeout=6)
        assert errors == ["the event reader failed: RuntimeError: Connection closed."]
        assert app.is_running and app.collected.connects == 2
        feed.push("state", syn.snapshot(4, 1.0))
        assert await wait_for(pilot, app, lambda: app.collected.snapshot_seq >= 2)


# -- the header never wraps; the fleet's health line stays at 80x24 ------------------------------

@pytest.mark.parametrize("size", [(140, 42), (80, 24)])
async def test_header_is_one_line_at_any_width_and_numbers(size):
    feed = FakeFeed(policies=copy.deepcopy(syn.POLICIES))
    app, _ = make_app(feed)
    async with app.run_test(size=size) as pilot:
        for t, rate in ((0.0, 0.5), (1.0, 12345.6), (2.0, 3.0)):
            snap = syn.snapshot(4, t)
            snap["router"]["db"] = "/home/operator/.local/state/kvtop/demo/kvtop-demo-20261128-163000-12345.db"
            snap["router"]["draining"] = True
            snap["totals"]["request_rate"] = rate
            feed.push("state", snap)
            await settle(pilot, app)
            bar = app.query_one("#topbar")
            assert bar.size.height == 1
            assert len(_text(app, "#topbar").rstrip()) <= size[0]
            assert "unified@3" in _text(app, "#topbar") and "DRAINING" in _text(app, "#topbar")
            assert app.query_one("#tabs").region.y == 2  # header + health line: nothing below moves
        assert "kvtop-demo-20261128-163000-12345.db" in str(bar.tooltip)


@pytest.mark.parametrize("n", [4, 64])
async def test_80x24_keeps_the_fleet_health_line(n):
    app, feed = make_app(n=n, steps=4, decisions=20)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, app)
        for tab in "12345":
            await pilot.press(tab)
            await settle(pilot, app)
            health = app.query_one("#health")
            assert health.region.height == 1 and 0 <= health.region.y < 24
            assert f"/{n} up" in _text(app, "#health") and "in flight" in _text(app, "#health")


# -- shadows from the dashboard: add, promote, remove; audited -----------------------------------

async def test_shadows_add_promote_remove_from_the_dashboard(aiohttp_server, fake_backends, tmp_path):
    from router.app import STATE
    from kvtop.tui.app import KvtopApp
    from kvtop.tui.feed import RouterFeed
    from test_tui_operator import _palette

    backends = await fake_backends(2)
    server, rapp = await _router(aiohttp_server, backends, tmp_path, policy="unified")
    url = str(server.make_url("")).rstrip("/")
    st = rapp[STATE]
    app = KvtopApp(RouterFeed(url, "tok", hz=10), url=url, apply_timer=False, poll_sessions_s=0)
    async with app.run_test(size=(140, 42)) as pilot:
        assert await wait_for(pilot, app, lambda: app.policies_body.get("policies") and app.collected.snapshot)
        await pilot.press("5")
        await _palette(pilot, "Add shadow policy lmetric")
        await pilot.press("y")
        await wait_group(app, "control")
        assert st.shadows.names() == ["lmetric"]
        assert await wait_for(pilot, app, lambda: "lmetric" in _text(app, "#shadow-panel"))
        await pilot.press("S")  # the shadow menu: add leastwork
        await pilot.pause()
        opts = app.screen.query_one("#picker-list")
        opts.highlighted = next(i for i in range(opts.option_count) if opts.get_option_at_index(i).id == "add:leastwork")
        await pilot.press("enter")
        await pilot.pause()
        await pilot.press("y")
        await wait_group(app, "control")
        assert st.shadows.names() == ["lmetric", "leastwork"]
        # promote lmetric: it becomes the active policy and stops shadowing itself
        assert await wait_for(pilot, app, lambda: "leastwork" in _text(app, "#shadow-panel"))
        app.promote_shadow("lmetric")
        await pilot.pause()
        await pilot.press("y")
        await wait_group(app, "control")
        assert st.slot.policy.name == "lmetric" and st.shadows.names() == ["leastwork"]
        await _palette(pilot, "Remove shadow policy leastwork")
        await pilot.press("y")
        await wait_group(app, "control")
        assert st.shadows.names() == []
        # every change is in the change log, with what changed, and who made it
        assert await wait_for(pilot, app, lambda: "-leastwork" in _text(app, "#config-log"))
        log = _text(app, "#config-log")
        assert "kvtop-attach: shadows +lmetric (now: lmetric)" in log
        assert "shadows -lmetric (now: leastwork)" in log
        assert "policy unified@1 → lmetric@2" in log
        assert "{}" not in log
    await server.close()


# -- smaller items -------------------------------------------------------------------------------

async def test_help_has_no_markup_leak_and_names_every_key():
    app, _ = make_app()
    async with app.run_test(size=(140, 42)) as pilot:
        await settle(pilot, app)
        await pilot.press("question_mark")
        await pilot.pause()
        text = app.help_text().plain
        assert "[/b]" not in text and "[b]" not in text and "[dim]" not in text
        lines = text.splitlines()
        assert any(line.strip().startswith("[ ") or line.strip().startswith("[") and "window-" in line
                   for line in lines)
        for key in ("R ", "c ", "enter"):
            assert any(line.strip().startswith(key.strip()) for line in lines), key


async def test_policy_tab_lists_the_policys_own_knobs_first_after_a_switch(live_router):
    from kvtop.tui.app import KvtopApp
    from kvtop.tui.feed import RouterFeed
    from router.app import STATE
    from test_tui import TOKEN

    server, rapp, url = live_router
    rapp[STATE].set_policy("lmetric", {}, "test")
    app = KvtopApp(RouterFeed(url, TOKEN, hz=10), url=url, apply_timer=False, poll_sessions_s=0)
    async with app.run_test(size=(140, 42)) as pilot:
        assert await wait_for(pilot, app, lambda: app.policies_body.get("policies") and app.collected.snapshot)
        await pilot.press("5")
        assert await wait_for(pilot, app, lambda: "lmetric@" in _text(app, "#policy-name"))
        rapp[STATE].set_policy("unified", {}, "test")
        assert await wait_for(pilot, app, lambda: "unified@" in _text(app, "#policy-name"))
        table = app.query_one("#knob-table")
        assert await wait_for(pilot, app, lambda: str(table.get_row_at(0)[0]) == "overload_factor")
        first = [str(table.get_row_at(i)[0]) for i in range(3)]
        assert first == ["overload_factor", "cache_ratio_gate", "lmetric_decode_weight"]


# -- an instance's detail; the column chooser -----------------------------------------------------

async def test_enter_on_an_instance_opens_its_detail_and_it_follows_the_snapshot():
    from kvtop.tui.screens import InstanceScreen, ReceiptScreen

    app, feed = make_app(n=4, steps=3, decisions=40)
    async with app.run_test(size=(140, 42)) as pilot:
        await settle(pilot, app)
        table = app.query_one("#instances")
        table.focus()
        name = str(table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value)
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, InstanceScreen) and app.screen.instance == name
        head = lambda: _text(app.screen, "#instance-head")  # noqa: E731
        for word in ("health", "load", "engine", "KV index", "GPU", "errors", name):
            assert word in head(), word
        routed_here = sum(1 for _, ev in app.collected.decisions if ev.get("instance") == name)
        assert app.screen.query_one("#instance-decisions").row_count == min(15, routed_here) > 0
        snap = syn.snapshot(4, 10.0)
        inst = next(i for i in snap["instances"] if i["name"] == name)
        inst["pending_prefill_tokens"] = 987_654
        feed.push("state", snap)
        await settle(pilot, app)
        assert "988k" in head() or "987,654" in head()  # redrawn from the latest snapshot
        await pilot.press("enter")  # a decision's receipt from the detail
        await pilot.pause()
        assert isinstance(app.screen, ReceiptScreen)


async def test_column_chooser_hides_a_column_and_saves_it(tmp_path):
    from kvtop.tui.config import load_config

    path = tmp_path / "attach.toml"
    path.write_text('theme = "kvtop-dark"\n[keys]\nkvtop.sort = "o"\n')
    app, _ = make_app(config_file=path)
    async with app.run_test(size=(140, 42)) as pilot:
        await settle(pilot, app)
        await pilot.press("C")
        await pilot.pause()
        lst = app.screen.query_one("#column-list")
        lst.deselect("gpu_mem")
        lst.deselect("trend")
        await pilot.press("enter")
        await pilot.pause()
        await settle(pilot, app)
        keys = [str(c.key.value) for c in app.query_one("#instances").ordered_columns]
        assert "gpu_mem" not in keys and "trend" not in keys and "backlog_tokens" in keys
        assert app.query_one("#instances").row_count == 4
    saved = load_config(path)
    assert saved["hidden_columns"] == ["gpu_mem", "trend"] and saved["keys"] == {"kvtop.sort": "o"}
    app2, _ = make_app(hidden_columns=saved["hidden_columns"])  # the next attach starts with it
    async with app2.run_test(size=(140, 42)) as pilot:
        await settle(pilot, app2)
        assert "gpu_mem" not in [str(c.key.value) for c in app2.query_one("#instances").ordered_columns]


async def test_receipt_at_80x24_scrolls_keeps_the_chosen_row_first_and_explains_its_terms():
    from kvtop.tui.screens import ReceiptScreen

    app, feed = make_app(n=64, steps=2, decisions=0)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, app)
        ev = syn.decision(7, 64)
        app.push_screen(ReceiptScreen(ev))
        await pilot.pause()
        table = app.screen.query_one("#receipt-terms")
        first = table.get_row_at(0)
        assert str(first[0]) == "▶" and str(first[1]) == ev["instance"]  # 64 candidates: the chosen one first
        legend = str(app.screen.query_one("#receipt-legend").render())
        for term in ("P prefill backlog tokens", "BS requests in flight", "D decoding context tokens"):
            assert term in legend
        scroll = app.screen.query_one("#receipt")
        assert scroll.max_scroll_y > 0 and scroll.scroll_y == 0
        await pilot.press("pagedown")
        await pilot.pause()
        assert scroll.scroll_y > 0  # PageDown scrolls at 80x24


# -- kvtop log runs / log shadow ----------------------------------------------------------------

async def test_log_runs_lists_policy_changes_made_without_traffic(aiohttp_server, fake_backends, tmp_path, capsys):
    """A switch made while no request came is a policy of the run too (it was left out)."""
    from router.app import STATE
    from kvtop.cli import main

    backends = await fake_backends(2)
    db = tmp_path / "k.db"
    server, rapp = await _router(aiohttp_server, backends, tmp_path, policy="unified", db=str(db))
    st = rapp[STATE]
    st.set_policy("lmetric", {}, "test")       # no request in between: no decision row for either
    st.set_policy(None, {"offload_threshold": 30000}, "test", merge=True)
    await server.close()
    rc = await asyncio.to_thread(main, ["log", "--db", str(db), "runs"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "unified@1 (no traffic) -> lmetric@2 (no traffic) -> lmetric@3 (no traffic)" in out


def test_log_shadow_score_gaps_read_in_one_format():
    from kvtop.log_cli import _gap

    cells = [_gap(g) for g in (5571.0, 14280.4, 0.0123, None)]
    assert cells == ["5,571.0", "14,280.4", "0.0123", "-"]
    assert not any("e+" in c or "e-" in c for c in cells)


# -- the SVG plots of simulate --repeats and sweep -----------------------------------------------

def test_svg_plots_have_an_axis_mark_cut_intervals_and_no_text_over_text(tmp_path):
    import xml.etree.ElementTree as ET

    from kvtop.repeats import svg_ticks, write_svg

    assert svg_ticks(3.7) == [0.0, 1.0, 2.0, 3.0, 4.0] and svg_ticks(14280) == [0, 5000, 10000, 15000]
    from kvtop.repeats import METRICS

    metric = lambda m: {key: (10.0 if key == "tpot_p90_ms" else m) for key, _ in METRICS} | {"apc": 0.5}  # noqa: E731
    # a wide spread: leastwork's interval reaches below 0 and is cut at the axis
    runs = {"leastwork": [metric(v) for v in (100.0, 3000.0, 50.0)], "lmetric": [metric(v) for v in (900.0, 1000.0, 950.0)]}
    path = tmp_path / "r.svg"
    write_svg(str(path), runs, "simulate: a title long enough to reach the first chart if it were there")
    root = ET.parse(path).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    texts = [(float(t.get("x")), float(t.get("y")), t.text or "") for t in root.iter(ns + "text")]
    rows = sorted({y for _, y, _ in texts})
    # lines of text at the left margin are at least a line apart: no title drawn over another
    left = sorted(y for x, y, _ in texts if x < 20)
    assert all(b - a >= 12 for a, b in zip(left, left[1:])), left
    assert any(t == "s" for _, _, t in texts)  # the axis names its unit
    assert any(t.strip() in ("0", "0.0") for _, _, t in texts)  # and starts at 0
    titles = [r.find(ns + "title").text for r in root.iter(ns + "rect") if r.find(ns + "title") is not None]
    assert any("cut at the axis" in t for t in titles if t.startswith("leastwork"))
    assert not any("cut at the axis" in t for t in titles if t.startswith("lmetric"))
    assert rows


async def test_chart_legends_tell_series_apart_by_glyph():
    app, _ = make_app(n=4)
    async with app.run_test(size=(140, 42)) as pilot:
        await settle(pilot, app)
        await pilot.press("2")
        await settle(pilot, app)
        legend = [line for line in app.query_one("#chart-backlog").plt.build().splitlines() if "vllm-" in line]
        import re

        plain = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in legend]
        glyphs = set()
        for line in plain:
            for m in re.finditer(r"(\S+) vllm-\d", line):
                glyphs.add(m.group(1)[-2:])
        assert len(glyphs) >= 4, plain  # four instances, four glyphs


@pytest.mark.parametrize("screen", ["instance", "knobs", "promote"])
async def test_a_refresh_while_a_dialog_is_opening_does_not_crash(screen):
    """The refresh can run between a dialog's compose and its mount (it crashed the instance
    detail: "More values provided than there are columns")."""
    from kvtop.tui.screens import ConfirmScreen, InstanceScreen, KnobForm

    app, feed = make_app(n=4, steps=2, decisions=10)
    async with app.run_test(size=(140, 42)) as pilot:
        await settle(pilot, app)
        dialog = {"instance": lambda: InstanceScreen("vllm-0"),
                  "knobs": lambda: KnobForm("unified", app._control_schema("unified"), app._current_knobs(),
                                            live=lambda: ("unified", app._current_knobs())),
                  "promote": lambda: ConfirmScreen("x", lambda: [("a", 1, 2)])}[screen]()
        dialog.refresh_live()  # before it is mounted
        app.push_screen(dialog)
        dialog.refresh_live()  # while it mounts
        app.apply(force=True)
        await pilot.pause()
        app.apply(force=True)
        await pilot.pause()
        assert app.screen is dialog and app.is_running


@pytest.mark.parametrize("degraded, shown", [
    (None, None),                                                      # absent: none
    ([{"task": "kv-events", "error": "boom"}, "scraper"], "⚠ 2 tasks down: kv-events, scraper"),
])
async def test_header_carries_the_routers_dead_background_tasks(degraded, shown):
    feed = FakeFeed(policies=copy.deepcopy(syn.POLICIES))
    snap = syn.snapshot(4, 0.0)
    if degraded is not None:
        snap["degraded"] = degraded
    feed.push("state", snap)
    app, _ = make_app(feed)
    async with app.run_test(size=(140, 42)) as pilot:
        await settle(pilot, app)
        top = _text(app, "#topbar")
        assert (shown in top) if shown else ("tasks down" not in top and "task down" not in top)


async def test_enum_knobs_are_a_choice_not_free_text():
    from textual.widgets import Select

    from kvtop.tui.screens import KnobForm

    policies = copy.deepcopy(syn.POLICIES)
    policies["features"] = [{"name": "offload_mode", "type": "str", "default": "off", "choices": ["off", "simple", "cost"],
                             "range": "one of off, simple, cost", "doc": "offload HEAVY prefills"}]
    feed = FakeFeed(policies=policies)
    feed.push("state", syn.snapshot(4, 0.0))
    app, _ = make_app(feed)
    async with app.run_test(size=(140, 42)) as pilot:
        await settle(pilot, app)
        await pilot.press("k")
        await pilot.pause()
        form = app.screen
        assert isinstance(form, KnobForm)
        field = form.query_one("#knob-offload_mode")
        assert isinstance(field, Select) and field.value == "off"
        field.value = "cost"
        assert form.changed() == ({"offload_mode": "cost"}, [])


async def test_sessions_and_charts_grey_out_when_stale():
    app, feed = make_app(n=4, steps=3, decisions=10)
    async with app.run_test(size=(140, 42)) as pilot:
        await settle(pilot, app)
        await pilot.press("3")
        app._fetch_sessions()
        await wait_group(app, "sessions")
        await settle(pilot, app)
        table = app.query_one("#session-table")

        def text_colour():
            seg = next(seg for seg in table.render_line(3) if seg.text.strip())  # a data row's first text
            return seg.style.color

        live_colour = text_colour()
        feed.push("_status", {"connected": False, "error": "connection refused", "retry_in_s": 1.0})
        await settle(pilot, app)
        await pilot.pause()
        assert app.screen.has_class("-stale")
        assert _text(app, "#affinity").startswith("stale ")
        assert text_colour() != live_colour  # greyed
        await pilot.press("2")
        await settle(pilot, app)
        assert "stale" in app.query_one("#chart-backlog").plt.build()
        feed.push("_status", {"connected": True, "error": None})
        feed.push("state", syn.snapshot(4, 9.0))
        await settle(pilot, app)
        assert not app.screen.has_class("-stale")
