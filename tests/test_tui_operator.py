"""kvtop attach as an operator drives it (issue 20): the crashes and lost keys, each as a Pilot test."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvtop.tui import synthetic as syn
from test_tui import SIZE, make_app, settle


@pytest.fixture(autouse=True)
def utc(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    time.tzset()


async def test_theme_switch_keeps_drawing():
    """Switching theme cleared the cell cache but not the rows: the next frame re-added them (DuplicateKey)."""
    app, feed = make_app(steps=3, decisions=0)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        table = app.query_one("#instances")
        for theme in ("kvtop-light", "kvtop-cb", "textual-dark"):
            app.theme = theme
            await pilot.pause()
            feed.push("state", syn.snapshot(4, 50.0))
            await settle(pilot, app)
            assert table.row_count == 4
        assert app.is_running


async def test_enter_right_after_4_opens_a_receipt():
    """The decision table takes focus with its tab, so Enter needs no Tab first."""
    from kvtop.tui.screens import ReceiptScreen

    app, feed = make_app(decisions=20)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await pilot.press("4")
        await settle(pilot, app)
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, ReceiptScreen)
        assert app.screen.ev["request_id"] == syn.decision(19)["request_id"]  # the newest, where the cursor sits


async def test_knob_form_opens_with_its_first_field_focused():
    """Typing right after k edits the first knob; no key is lost."""
    from kvtop.tui.screens import KnobForm

    app, feed = make_app(steps=2, decisions=0)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await pilot.press("k")
        await pilot.pause()
        assert isinstance(app.screen, KnobForm)
        first = app.screen.query_one("#knob-overload_factor")
        assert app.screen.focused is first
        await pilot.press("ctrl+a", "ctrl+k", *"4", "ctrl+s")  # Input: ctrl+a home, ctrl+k delete to end
        await pilot.pause()
        await pilot.press("y")
        await pilot.pause()
        from test_tui import wait_group

        await wait_group(app, "control")
        assert feed.calls == [("patch_knobs", {"overload_factor": 4.0})]


async def test_ctrl_c_quits():
    """`kvtop demo --help` and docs/tui.md say q or ctrl+c quits; Textual 8 only hints at ctrl+q."""
    app, feed = make_app(steps=1, decisions=0)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        assert app.return_code is None
        await pilot.press("ctrl+c")
        assert app.return_code == 0  # App.exit() was called: the app is on its way out


def _idle_snapshot():
    snap = syn.snapshot(2, 0.0)
    for inst in snap["instances"]:
        inst["est_hit_rate"] = inst["est_hit_rate_recent"] = None
    snap["totals"]["est_hit_rate"] = None
    return snap


async def test_idle_router_shows_a_dash_for_the_hit_rate():
    """No input yet: there is no hit rate, and `n/a%` read like a broken unit."""
    from kvtop.tui.feed import FakeFeed

    feed = FakeFeed(policies=syn.POLICIES)
    feed.push("state", _idle_snapshot())
    app, _ = make_app(feed)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        health = str(app.query_one("#health").render())  # the fleet's totals: the line under the header
        assert "est hit –" in health and "n/a%" not in health


async def test_charts_tab_right_after_attach():
    """Two outcomes in the current TTFT bucket put its midpoint after now: plotext raised drawing it."""
    app, feed = make_app(steps=2, decisions=2)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await pilot.press("2")
        await settle(pilot, app)
        assert app.is_running and app.query_one("#chart-ttft").plt.build()


# -- a router that sends what the API does not describe ----------------------------------------

def test_sse_parser_bounds_memory_and_reports_once_per_problem():
    from kvtop.tui.feed import SseParser

    p = SseParser(max_event_bytes=1 << 20)
    events, errors = p.feed(b'event: state\ndata: {"a"')  # split anywhere, even mid-JSON
    assert (events, errors) == ([], [])
    events, errors = p.feed(b': 1}\n\n')
    assert events == [("state", {"a": 1})] and errors == []
    # 2 MiB on one line, in small chunks: dropped, the rest of the line skipped, memory bounded
    long_line = [b"event: state\ndata: " + b"x" * 65536] + [b"x" * 65536] * 31 + [b"\n\n"]
    errs = []
    for chunk in long_line:
        ev, er = p.feed(chunk)
        assert ev == [] and p.buffered_bytes <= (1 << 20) + 65536
        errs += er
    assert len(errs) == 1 and "line over 1 MiB" in errs[0]
    # 50 MiB of data lines that never end their event: dropped once, never held
    errs = []
    p.feed(b"event: decision\n")
    for _ in range(800):
        ev, er = p.feed(b"data: " + b"y" * 65530 + b"\n")
        assert ev == [] and p.buffered_bytes <= (1 << 20) + 65536
        errs += er
    assert len(errs) == 1 and "without the blank line" in errs[0]
    events, errors = p.feed(b"\nevent: state\ndata: not json\n\nevent: state\ndata: {}\n\n")
    assert events == [("state", {})] and len(errors) == 1 and "not JSON" in errors[0]


@pytest.mark.parametrize("kind, payload, why", [
    ("state", [], "an array where an object belongs"),
    ("state", {"instances": {"vllm-0": {}}}, "instances as an object"),
    ("state", {"instances": ["vllm-0", {"name": 7}, {"name": "ok", "num_requests": "12",
                                                      "engine": [], "gpu": {"util_pct": "full"}}],
               "totals": {"est_hit_rate": "high", "in_flight": None}, "router": None,
               "affinity": {"per_instance": {"ok": "3"}}, "decisions_by_reason": ["argmin"]}, "every field wrong"),
    ("decision", {"ts": "noon", "input_tokens": "many", "terms": "none", "session": 12}, "a decision of strings"),
    ("decision", "req-1", "a decision that is a string"),
    ("outcome", {"ttft_ms": "fast"}, "a TTFT that is not a number"),
    ("config", {"before": "unified@1", "after": 2}, "config sides that are not objects"),
])
async def test_wrongly_typed_events_give_a_banner_and_the_app_keeps_drawing(kind, payload, why):
    app, feed = make_app(steps=2, decisions=2)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        feed.push(kind, payload)
        await settle(pilot, app)
        for tab in "12345":  # every tab draws what it has
            await pilot.press(tab)
            app.apply(force=True)
            await pilot.pause()
        assert app.is_running, why
        banner = app.query_one("#banner")
        assert banner.display and "malformed data from the router" in str(banner.render()), why
        assert banner.size.height == 1, why
        feed.push("state", syn.snapshot(4, 60.0))  # a good snapshot after the bad one is drawn
        await pilot.press("1")
        await settle(pilot, app)
        assert app.query_one("#instances").row_count == 4


@pytest.fixture
async def broken_router(aiohttp_server):
    """A router-shaped server whose event stream is scripted by the test."""
    from aiohttp import web

    script: list[bytes] = []

    async def events(request):
        resp = web.StreamResponse()
        await resp.prepare(request)
        for chunk in script:
            await resp.write(chunk)
        await asyncio.sleep(30)
        return resp

    async def json_of(body):
        async def handler(request):
            return web.json_response(body)
        return handler

    app = web.Application()
    app.router.add_get("/kvtop/v1/events", events)
    app.router.add_get("/kvtop/v1/decisions", await json_of({"decisions": "none"}))
    app.router.add_get("/kvtop/v1/policies", await json_of([]))
    app.router.add_get("/kvtop/v1/state", await json_of({"instances": [{"name": "i0", "num_requests": "x"}]}))
    server = await aiohttp_server(app, host="127.0.0.1")
    return script, str(server.make_url("")).rstrip("/")


async def test_attach_survives_a_malformed_stream_over_loopback(broken_router):
    import json
    import tracemalloc

    from kvtop.tui.app import KvtopApp
    from kvtop.tui.feed import RouterFeed
    from test_tui import wait_for

    script, url = broken_router
    good = b"event: state\ndata: " + json.dumps(syn.snapshot(3, 1.0)).encode() + b"\n\n"
    script += [b"event: state\ndata: [1, 2]\n\n",                      # wrong JSON type
               b"event: state\ndata: " + b"z" * (9 * 2**20) + b"\n\n",  # a 9 MiB line
               # 18 MB of data lines that never meet the blank line that ends an event
               b"".join(b"event: decision\ndata: " + b"q" * 60000 + b"\n" for _ in range(300)),
               b"\n", good]
    app = KvtopApp(RouterFeed(url, None, hz=10), url=url, apply_timer=False, poll_sessions_s=0)
    tracemalloc.start()
    try:
        async with app.run_test(size=SIZE) as pilot:
            assert await wait_for(pilot, app, lambda: app.collected.snapshot is not None, timeout=20)
            _, peak = tracemalloc.get_traced_memory()
            assert app.is_running
            assert app.collected.malformed >= 3
            assert app.query_one("#instances").row_count == 3  # the good state after the bad ones
            assert app.query_one("#banner").size.height == 1
            assert app.policies_body["policies"] == []  # a list where an object belongs: ignored
    finally:
        tracemalloc.stop()
    assert peak < 60 * 2**20  # 27 MB of garbage went past; the 9 MiB line is skipped, not joined


async def test_once_on_a_wrongly_typed_state_is_one_line_exit_2(broken_router, capsys):
    from kvtop.cli import main

    script, url = broken_router
    rc = await asyncio.to_thread(main, ["attach", "--once", url, "--state-dir", "/nonexistent"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "malformed /kvtop/v1/state: i0.num_requests is str" in err


# -- sessions: order follows the values, ids stay whole where they fit ---------------------------

def _long_sessions(tokens):
    prefix = "mooncake-trace-conversation-agent-"  # 34 characters shared by every id
    return {"total": len(tokens), "sessions": [
        {"session": f"{prefix}{k:04d}", "instance": f"vllm-{k % 4}", "turns": 3, "tokens": t,
         "est_hit_rate": 0.5, "bound_for_s": 10.0, "idle_s": 1.0, "moves": 0} for k, t in enumerate(tokens)]}


async def test_sessions_resort_when_values_change_and_ids_are_whole_at_140_columns():
    from test_tui import wait_group

    app, feed = make_app(steps=2, decisions=3)
    feed.sessions_body = _long_sessions([30_000, 20_000, 10_000])
    async with app.run_test(size=(140, 42)) as pilot:
        await settle(pilot, app)
        await pilot.press("3")
        app._fetch_sessions()
        await wait_group(app, "sessions")
        await settle(pilot, app)
        table = app.query_one("#session-table")
        ids = lambda: [str(table.get_row_at(i)[0]) for i in range(table.row_count)]  # noqa: E731
        assert ids()[0] == "mooncake-trace-conversation-agent-0000"  # whole, not cut at 25
        # the router's order may lag the values: the table follows the tokens it shows
        feed.sessions_body = _long_sessions([19_826, 41_168, 10_000])
        feed.sessions_body["sessions"].reverse()
        app._fetch_sessions()
        await wait_group(app, "sessions")
        await settle(pilot, app)
        assert [s[-4:] for s in ids()] == ["0001", "0000", "0002"]
        assert [str(table.get_row_at(i)[3]) for i in range(3)] == ["41,168", "19,826", "10,000"]
        await pilot.press("4")
        await settle(pilot, app)
        dec = app.query_one("#decision-table")
        assert str(dec.get_row_at(0)[1]) == syn.decision(0)["session"]


@pytest.mark.parametrize("ident, width, shown", [
    ("sess-001", 18, "sess-001"),                                       # fits: untouched
    ("mooncake-trace-conversation-agent-0042", 18, "mooncake…gent-0042"),  # cut in the middle: the number stays
])
def test_fit_id_keeps_the_tail(ident, width, shown):
    from kvtop.tui.model import fit_id

    assert fit_id(ident, width) == shown and len(shown) <= width


# -- a router restart: the stream comes back, and so must control ---------------------------------

async def _start_router(aiohttp_server, backends, token, tmp_path, port=None):
    from router.app import Backend, RouterConfig, create_app

    cfg = RouterConfig(backends=[Backend(f"i{k}", url) for k, (_, url) in enumerate(backends)],
                       db=None, control_token=token, state_dir=str(tmp_path / "state"), scrape_interval_s=0.2)
    app = create_app(cfg)
    server = await aiohttp_server(app, host="127.0.0.1", **({"port": port} if port else {}))
    return server, app


async def test_control_keeps_working_after_a_router_restart(aiohttp_server, fake_backends, tmp_path):
    """A restarted router has a new token; the dashboard re-reads its token file on reconnect,
    and the header says so while control is unavailable."""
    from router.app import STATE
    from kvtop.tui.app import KvtopApp
    from kvtop.tui.feed import RouterFeed
    from test_tui import wait_for

    backends = await fake_backends(2)
    token_file = tmp_path / "router.token"
    token_file.write_text("token-one\n")
    server, rapp = await _start_router(aiohttp_server, backends, "token-one", tmp_path)
    url, port = str(server.make_url("")).rstrip("/"), server.port
    feed = RouterFeed(url, "token-one", hz=10, token_loader=lambda: token_file.read_text().strip())
    app = KvtopApp(feed, url=url, apply_timer=False, poll_sessions_s=0)
    async with app.run_test(size=SIZE) as pilot:
        assert await wait_for(pilot, app, lambda: app.collected.snapshot is not None)
        await server.close()
        assert await wait_for(pilot, app, lambda: not app.collected.connected)
        server, rapp = await _start_router(aiohttp_server, backends, "token-two", tmp_path, port=port)
        # the restarted router's token is not in the file yet: reconnect, and say control is off
        assert await wait_for(pilot, app, lambda: app.collected.connected, timeout=15)
        assert await wait_for(pilot, app, lambda: "CONTROL UNAVAILABLE" in str(app.query_one("#topbar").render()))
        token_file.write_text("token-two\n")  # what `kvtop route` writes when it starts
        app._apply_change("put_policy", "lmetric", {})
        from test_tui import wait_group

        await wait_group(app, "control")
        assert app.last_error is None
        assert rapp[STATE].slot.label == "lmetric@2"
        assert await wait_for(pilot, app, lambda: "CONTROL UNAVAILABLE" not in str(app.query_one("#topbar").render()))
    await server.close()


# -- the must-hold session (issue 20): an operator's whole visit, scripted -----------------------

async def _palette(pilot, text):
    await pilot.press("ctrl+p")
    await pilot.pause()
    await pilot.press(*text)
    await pilot.pause(0.3)
    await pilot.press("enter")
    await pilot.pause()


async def test_operator_session_end_to_end(aiohttp_server, fake_backends, tmp_path):
    import aiohttp

    from router.app import STATE
    from kvtop.tui.app import KvtopApp
    from kvtop.tui.feed import RouterFeed
    from kvtop.tui.screens import KnobForm, ReceiptScreen
    from test_tui import wait_for, wait_group

    backends = await fake_backends(2)
    token_file = tmp_path / "router.token"
    token_file.write_text("token-one\n")
    server, rapp = await _start_router(aiohttp_server, backends, "token-one", tmp_path)
    url, port = str(server.make_url("")).rstrip("/"), server.port

    async def traffic(n):
        async with aiohttp.ClientSession() as http:
            for k in range(n):
                async with http.post(f"{url}/v1/completions", headers={"X-Session-ID": f"agent-{k % 3}"},
                                     json={"prompt": [1] * 600 + [k], "max_tokens": 2}) as r:
                    assert r.status == 200

    feed = RouterFeed(url, "token-one", hz=10, token_loader=lambda: token_file.read_text().strip())
    app = KvtopApp(feed, url=url, hz=10, poll_sessions_s=0.5)  # real timers: the app as run
    async with app.run_test(size=(140, 42)) as pilot:
        assert await wait_for(pilot, app, lambda: app.collected.snapshot and app.policies_body.get("policies"))
        await traffic(6)
        for tab in "12345":  # every tab
            await pilot.press(tab)
            await pilot.pause(0.2)
        for theme in ("kvtop-light", "kvtop-cb", "textual-dark"):  # three themes, from the palette
            await _palette(pilot, "theme")
            await pilot.press(*theme)
            await pilot.pause(0.3)
            await pilot.press("enter")
            await pilot.pause(0.3)
            assert app.theme == theme
            await pilot.press("1")
            await pilot.pause(0.6)  # a frame of the overview in the new theme
        await _palette(pilot, "Switch policy to lmetric")  # policy, once from the palette...
        await pilot.press("y")
        await wait_group(app, "control")
        assert rapp[STATE].slot.label == "lmetric@2"
        assert await wait_for(pilot, app, lambda: (app.policies_body.get("current") or {}).get("name") == "lmetric")
        await pilot.press("P")  # ...and once with its key
        await pilot.pause()
        await pilot.press(*"unified")  # the picker is an OptionList: move to unified
        opts = app.screen.query_one("#picker-list")
        opts.highlighted = next(i for i in range(opts.option_count) if opts.get_option_at_index(i).id == "unified")
        await pilot.press("enter")
        await pilot.pause()
        await pilot.press("y")
        await wait_group(app, "control")
        assert rapp[STATE].slot.label.startswith("unified@3")
        assert await wait_for(pilot, app, lambda: (app.policies_body.get("current") or {}).get("name") == "unified")
        await pilot.press("k")  # a knob, typed into the focused first field
        await pilot.pause()
        assert isinstance(app.screen, KnobForm)
        first = app.screen.focused
        await pilot.press("ctrl+a", "ctrl+k", *("3" if "factor" in first.id else "0.25"), "ctrl+s")
        await pilot.pause()
        await pilot.press("y")
        await wait_group(app, "control")
        assert rapp[STATE].slot.version == 4 and app.last_error is None
        await pilot.press("4")  # Enter right after 4
        await pilot.pause(0.6)
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, ReceiptScreen)
        await pilot.press("escape")
        # the router restarts with a new token
        await server.close()
        assert await wait_for(pilot, app, lambda: not app.collected.connected, timeout=10)
        token_file.write_text("token-two\n")
        server, rapp = await _start_router(aiohttp_server, backends, "token-two", tmp_path, port=port)
        assert await wait_for(pilot, app, lambda: app.collected.connected, timeout=15)
        await _palette(pilot, "Switch policy to lmetric")
        await pilot.press("y")
        await wait_group(app, "control")
        assert app.last_error is None and rapp[STATE].slot.label == "lmetric@2"
        await pilot.press("ctrl+c")
        assert app.return_code == 0
    await server.close()
