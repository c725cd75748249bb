"""kvtop attach as an operator drives it (issue 20): the crashes and lost keys, each as a Pilot test."""

from __future__ import annotations

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
        totals = str(app.query_one("#totals").render())
        assert "est hit –" in totals and "n/a%" not in totals
