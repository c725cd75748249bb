"""The fleet in the dashboard (issue 34): each instance's state (cordoned, draining, removed) in
the overview, a drain's progress, and keys that cordon / drain / uncordon / remove the selected
instance through the control API, with a confirmation, audited by the router."""

from __future__ import annotations

import copy

from kvtop.tui import synthetic as syn
from kvtop.tui.feed import FakeFeed
from test_tui import make_app, settle, wait_for, wait_group  # noqa: F401


async def _router(aiohttp_server, backends, tmp_path, token="tok"):
    from router.app import Backend, RouterConfig, create_app

    cfg = RouterConfig(backends=[Backend(f"i{k}", url) for k, (_, url) in enumerate(backends)], db=None,
                       control_token=token, state_dir=str(tmp_path / "state"), scrape_interval_s=0.2)
    app = create_app(cfg)
    server = await aiohttp_server(app, host="127.0.0.1")
    return server, app, str(server.make_url("")).rstrip("/")


def _cell(app, row, col="health"):
    return str(app.query_one("#instances").get_cell(row, col))


def _select(app, name):
    table = app.query_one("#instances")
    table.move_cursor(row=table.get_row_index(name), animate=False)


def _notes(app):
    return [str(n.message) for n in app._notifications]


async def test_keys_cordon_drain_remove_the_selected_instance_on_a_live_router(aiohttp_server, fake_backends,
                                                                               tmp_path):
    """Key -> the confirmation says what changes -> y sends it -> the router changes the state
    (audited) -> the row, the note under the table, the health line and the change log say so."""
    from router.app import STATE
    from kvtop.tui.app import KvtopApp
    from kvtop.tui.feed import RouterFeed
    from kvtop.tui.screens import ConfirmScreen

    backends = await fake_backends(3)
    server, rapp, url = await _router(aiohttp_server, backends, tmp_path)
    st = rapp[STATE]
    app = KvtopApp(RouterFeed(url, "tok", hz=10), url=url, apply_timer=False, poll_sessions_s=0)
    async with app.run_test(size=(140, 42)) as pilot:
        assert await wait_for(pilot, app, lambda: app.query_one("#instances").row_count == 3)
        assert _cell(app, "i1") == "● up"
        _select(app, "i1")
        await pilot.press("c")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmScreen)
        dialog = str(app.screen.query_one("#confirm-diff").render())
        assert "Cordon instance i1" in dialog and "active →  cordoned" in dialog and "no new sessions" in dialog
        await pilot.press("y")
        await wait_group(app, "control")
        assert st.router.fleet.states == ["active", "cordoned", "active"]
        assert await wait_for(pilot, app, lambda: _cell(app, "i1") == "⊘ cordoned")
        assert "i1 cordoned: no new sessions" in str(app.query_one("#totals").render())
        assert "⊘ 1 cordoned" in str(app.query_one("#health").render())

        _select(app, "i1")
        await pilot.press("d")
        await pilot.pause()
        dialog = str(app.screen.query_one("#confirm-diff").render())
        assert "Drain instance i1" in dialog and "requests in flight: 0 →  finish there" in dialog
        await pilot.press("y")
        await wait_group(app, "control")
        assert st.router.fleet.states[1] == "draining"
        # nothing in flight there: drained at once, and the note says what is left and what next
        assert await wait_for(pilot, app, lambda: _cell(app, "i1") == "⇣ drained")
        assert "i1 drained: nothing in flight, 0 sessions still homed (each moves at its next turn); x removes it" \
            in str(app.query_one("#totals").render())

        _select(app, "i1")
        await pilot.press("x")
        await pilot.pause()
        assert "Remove instance i1" in str(app.screen.query_one("#confirm-diff").render())
        await pilot.press("n")  # cancelled: nothing is sent
        await pilot.pause()
        assert st.router.fleet.states[1] == "draining"
        await pilot.press("x")
        await pilot.pause()
        await pilot.press("y")
        await wait_group(app, "control")
        assert st.router.fleet.states[1] == "removed"
        assert await wait_for(pilot, app, lambda: _cell(app, "i1") == "✕ removed")
        health = str(app.query_one("#health").render())
        assert "2/2 up" in health and "✕ 1 removed" in health and "down" not in health
        # every change audited by the router, and in the change log with who made it
        await pilot.press("5")
        assert await wait_for(pilot, app, lambda: "draining → removed" in str(app.query_one("#config-log").render()))
        log = str(app.query_one("#config-log").render())
        assert "kvtop-attach: fleet: i1 active → cordoned" in log
        assert "fleet: i1 cordoned → draining" in log
    await server.close()


async def test_a_drain_in_progress_shows_sessions_homed_and_requests_in_flight():
    """The router's ``drain`` section (router/fleet.py ``progress``) in the cell, the note under
    the table and the instance detail, and the confirmation of a remove says it cuts them off."""
    from kvtop.tui.screens import ConfirmScreen, InstanceScreen

    snap = syn.snapshot(4, 0.0)
    inst = snap["instances"][1]
    inst.update(fleet_state="draining", drain={"sessions_homed": 5, "in_flight": 3, "drained": False},
                num_requests=3)
    feed = FakeFeed(policies=copy.deepcopy(syn.POLICIES))
    feed.push("state", snap)
    app, _ = make_app(feed)
    async with app.run_test(size=(140, 42)) as pilot:
        await settle(pilot, app)
        assert _cell(app, "vllm-1") == "⇣ draining"
        assert ("vllm-1 draining: 3 requests in flight, 5 sessions still homed (each moves at its next turn)"
                in str(app.query_one("#totals").render()))
        _select(app, "vllm-1")
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, InstanceScreen)
        assert "fleet    draining: 3 requests in flight" in str(app.screen.query_one("#instance-head").render())
        await pilot.press("x")  # from the detail: the same keys act on its instance
        await pilot.pause()
        assert isinstance(app.screen, ConfirmScreen)
        dialog = str(app.screen.query_one("#confirm-diff").render())
        assert "Force-remove instance vllm-1" in dialog and "requests in flight: 3 →  cut off" in dialog
        await pilot.press("y")
        await wait_group(app, "control")
        assert feed.calls == [("fleet_action", ("vllm-1", "remove", True))]


async def test_fleet_keys_refuse_without_a_token_with_a_clear_message():
    app, feed = make_app(can_control=False)
    async with app.run_test(size=(140, 42)) as pilot:
        await settle(pilot, app)
        _select(app, "vllm-2")
        await pilot.press("d")
        await pilot.pause()
        assert app.screen is app.screen_stack[0]  # no dialog: nothing to confirm
        assert any("cannot drain vllm-2: no control token" in n and "--token-file" in n for n in _notes(app))
        assert not [c for c in feed.calls if c[0] == "fleet_action"]


async def test_a_token_the_router_refuses_is_said_in_its_words(aiohttp_server, fake_backends, tmp_path):
    from router.app import STATE
    from kvtop.tui.app import KvtopApp
    from kvtop.tui.feed import RouterFeed

    backends = await fake_backends(2)
    server, rapp, url = await _router(aiohttp_server, backends, tmp_path)
    app = KvtopApp(RouterFeed(url, "not-the-token", hz=10), url=url, apply_timer=False, poll_sessions_s=0)
    async with app.run_test(size=(140, 42)) as pilot:
        assert await wait_for(pilot, app, lambda: app.query_one("#instances").row_count == 2)
        _select(app, "i0")
        await pilot.press("c")
        await pilot.pause()
        await pilot.press("y")
        await wait_group(app, "control")
        assert rapp[STATE].router.fleet.states == ["active", "active"]
        refused = [n for n in app._notifications if "refused to cordon i0" in str(n.title)]
        assert refused and "token" in str(refused[0].message).lower()
    await server.close()


async def test_condensed_overview_keeps_the_rows_of_instances_out_of_rotation():
    """At 64 instances the overview shows the busiest rows; a drained (idle) or cordoned
    instance keeps its row, so the operator sees it and can act on it (u, x)."""
    feed = FakeFeed(policies=copy.deepcopy(syn.POLICIES))
    snap = syn.snapshot(64, 0.0, fleet={40: "draining", 41: "cordoned"})
    for k in (40, 41):
        snap["instances"][k].update(num_requests=0, pending_prefill_tokens=0)
        snap["instances"][k]["drain"] = {"sessions_homed": 2, "in_flight": 0, "drained": True} if k == 40 else None
    feed.push("state", snap)
    app, _ = make_app(feed)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, app)
        table = app.query_one("#instances")
        assert table.row_count < 64  # condensed
        assert _cell(app, "vllm-40") == "⇣ drained" and _cell(app, "vllm-41") == "⊘ cordoned"


async def test_the_selected_instance_stays_selected_while_condensed_rows_come_and_go():
    """The fleet keys act on the selected row: it keeps its row in the condensed table however
    idle it gets, and rows leaving above the cursor do not move the selection onto another
    instance."""
    feed = FakeFeed(policies=copy.deepcopy(syn.POLICIES))
    feed.push("state", syn.snapshot(64, 0.0))
    app, _ = make_app(feed)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, app)
        table = app.query_one("#instances")
        table.move_cursor(row=table.row_count - 1, animate=False)
        chosen = app._fleet_target()
        for t in range(1, 12):  # the busiest rows change every snapshot
            feed.push("state", syn.snapshot(64, t * 7.0))
            await settle(pilot, app)
            assert app._fleet_target() == chosen, t
