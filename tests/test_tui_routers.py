"""kvtop attach URL URL ...: several routers in front of the same instances (issue 16), and the
instance table's KV-event drift column."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest

from kvtop.tui import synthetic as syn
from kvtop.tui.feed import FakeFeed, MultiFeed
from kvtop.tui.model import clean_snapshot, merge_router_snapshots
from test_tui import SIZE, make_app, settle, wait_for, wait_group


@pytest.fixture(autouse=True)
def utc(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    time.tzset()


def _snap(n, t, url="http://127.0.0.1:8000"):
    snap = clean_snapshot(syn.snapshot(n, t))[0]
    snap["router"] = {**snap["router"], "url": url}
    return snap


def test_merge_matches_instances_by_url_and_sums_the_load():
    a, b = _snap(3, 1.0, "http://r1"), _snap(3, 2.0, "http://r2")
    for k, inst in enumerate(b["instances"]):
        inst["name"] = f"other{k}"  # the second router names them differently: the URL matches them
    b["instances"][1]["healthy"] = False
    m = merge_router_snapshots([("r1", a), ("r2", b)], selected=1)
    assert [i["name"] for i in m["instances"]] == [i["name"] for i in a["instances"]]  # one row per instance
    first = m["instances"][0]
    assert first["routers"] == {"r1": a["instances"][0]["num_requests"], "r2": b["instances"][0]["num_requests"]}
    assert first["num_requests"] == a["instances"][0]["num_requests"] + b["instances"][0]["num_requests"]
    assert not m["instances"][1]["healthy"]  # down for one router is down
    assert m["totals"]["in_flight"] == a["totals"]["in_flight"] + b["totals"]["in_flight"]
    assert m["router"]["url"] == "http://r2"  # the selected router's section: its policy, its control
    assert [r["label"] for r in m["routers"]] == ["r1", "r2"] and m["routers"][1]["selected"]


def test_merge_keeps_the_worst_drift_and_index_source():
    a, b = _snap(2, 1.0), _snap(2, 1.0)
    a["instances"][0]["kv_events"] = {"state": "exact", "drift": {"share": 0.01, "tokens": 10, "samples": 3}}
    a["instances"][0]["index_source"] = "exact"
    b["instances"][0]["kv_events"] = {"state": "resync", "drift": {"share": 0.2, "tokens": 90, "samples": 3}}
    b["instances"][0]["index_source"] = "estimate"
    m = merge_router_snapshots([("r1", a), ("r2", b)])
    assert m["instances"][0]["kv_events"] == {"state": "resync", "drift": {"share": 0.2}}
    assert "kv_events" not in m["instances"][1]  # no events there: no drift to show


async def test_drift_column_shows_share_and_index_source():
    """``instances[].kv_events.drift.share`` and where the index comes from, per instance."""
    feed = FakeFeed(policies=copy.deepcopy(syn.POLICIES))
    snap = syn.snapshot(3, 5.0)
    snap["instances"][0]["kv_events"] = {"state": "exact", "drift": {"share": 0.012, "tokens": 40, "samples": 9}}
    snap["instances"][0]["index_source"] = "exact"
    snap["instances"][1]["kv_events"] = {"state": "resync", "reason": "gap", "drift": {"share": None}}
    snap["instances"][1]["index_source"] = "estimate"
    feed.push("state", snap)
    app, _ = make_app(feed)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        table = app.query_one("#instances")
        names = [i["name"] for i in snap["instances"]]
        assert str(table.get_cell(names[0], "drift")) == "1.2% exact"
        assert str(table.get_cell(names[1], "drift")) == "– resync"
        assert str(table.get_cell(names[2], "drift")) == "–"  # no KV events from it
        assert "drift" in app.help_text()  # the legend explains it


def _two_fake_routers(selected=0):
    feeds = []
    for k in range(2):
        f = FakeFeed(policies=copy.deepcopy(syn.POLICIES), sessions=syn.sessions(6, 3))
        f.url = f"http://127.0.0.1:900{k + 1}"
        f.push("state", _snap(3, float(k), f.url))
        f.push("decision", {**syn.decision(k, 3), "request_id": f"req-{k}"})
        feeds.append(f)
    multi = MultiFeed(feeds)
    multi.select(selected)
    return multi, feeds


async def test_several_routers_share_one_table_and_label_decisions():
    multi, feeds = _two_fake_routers()
    app, _ = make_app(multi)
    async with app.run_test(size=(140, 42)) as pilot:
        await pilot.pause()
        assert await wait_for(pilot, app, lambda: app.collected.decision_seq >= 2 and app.collected.snapshot
                              and len(app.collected.snapshot.get("routers", [])) == 2
                              and all(r["seen"] for r in app.collected.snapshot["routers"]))
        table = app.query_one("#instances")
        assert table.row_count == 3  # one row per instance, not one per router and instance
        name = app.collected.snapshot["instances"][0]["name"]
        share = str(table.get_cell(name, "share"))
        assert len(share.split()[0].split("/")) == 2  # r1/r2
        lines = str(app.query_one("#routers").render())
        assert "r1" in lines and "r2" in lines and "http://127.0.0.1:9002" in lines and "control ok" in lines
        await pilot.press("4")
        await wait_for(pilot, app, lambda: app.query_one("#decision-table").row_count == 2)
        d = app.query_one("#decision-table")
        assert sorted(str(d.get_row_at(i)[1]) for i in range(2)) == ["r1", "r2"]


async def test_policy_change_acts_on_the_selected_router_and_says_which():
    from kvtop.tui.screens import ConfirmScreen

    multi, feeds = _two_fake_routers()
    app, _ = make_app(multi)
    async with app.run_test(size=(140, 42)) as pilot:
        assert await wait_for(pilot, app, lambda: app.collected.snapshot and app.policies_body.get("policies"))
        await pilot.press("R")  # the second router
        await pilot.pause()
        assert multi.selected == 1
        await wait_group(app, "policies")
        app.switch_policy_to("lmetric")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmScreen) and "on r2 (http://127.0.0.1:9002)" in app.screen.title_text
        await pilot.press("y")
        await wait_group(app, "control")
        assert feeds[1].calls == [("put_policy", {"name": "lmetric", "knobs": {}})]
        assert feeds[0].calls == []  # the other router is untouched
        await wait_for(pilot, app, lambda: "▶ r2" in str(app.query_one("#routers").render()))


# -- two real routers on loopback, in front of the same two instances ---------------------------

TOKEN = "routers-test-token"


async def _router(aiohttp_server, backends, tmp_path, k):
    from router.app import Backend, RouterConfig, create_app

    cfg = RouterConfig(backends=[Backend(f"i{n}", url) for n, (_, url) in enumerate(backends)],
                       db=None, control_token=TOKEN, state_dir=str(tmp_path / f"state{k}"), scrape_interval_s=0.2,
                       policy="unified")
    app = create_app(cfg)
    server = await aiohttp_server(app, host="127.0.0.1")
    return app, str(server.make_url("")).rstrip("/")


async def test_two_real_routers_one_instance_table_shares_and_control(aiohttp_server, fake_backends, tmp_path):
    import aiohttp

    from router.app import STATE
    from kvtop.tui.app import KvtopApp
    from kvtop.tui.feed import RouterFeed

    backends = await fake_backends(2, first_delay=3.0)  # requests stay in flight while we look
    (app1, url1), (app2, url2) = [await _router(aiohttp_server, backends, tmp_path, k) for k in (1, 2)]
    http = aiohttp.ClientSession()

    async def send(url, n, session):
        async with http.post(f"{url}/v1/completions", headers={"X-Session-ID": session},
                             json={"prompt": [1] * 600 + [n], "max_tokens": 2}) as r:
            await r.read()

    multi = MultiFeed([RouterFeed(url1, TOKEN, hz=10), RouterFeed(url2, TOKEN, hz=10)])
    app = KvtopApp(multi, url=url1, apply_timer=False, poll_sessions_s=0)
    sending = []
    try:
        async with app.run_test(size=(160, 42)) as pilot:
            assert await wait_for(pilot, app, lambda: app.collected.connected and app.collected.snapshot
                                  and all(r["seen"] for r in app.collected.snapshot.get("routers", [])))
            sending = [asyncio.create_task(send(url1, n, "a")) for n in range(3)]
            sending.append(asyncio.create_task(send(url2, 9, "b")))
            table = app.query_one("#instances")

            def shares():
                insts = (app.collected.snapshot or {}).get("instances", [])
                return {i["name"]: i.get("routers") for i in insts}

            assert await wait_for(pilot, app, lambda: sum(sum(s.values()) for s in shares().values()) == 4)
            assert table.row_count == 2  # two routers x two instances: still one row per instance
            total = {lb: sum(s[lb] for s in shares().values()) for lb in ("r1", "r2")}
            assert total == {"r1": 3, "r2": 1}
            cells = [str(table.get_cell(n, "share")) for n in shares()]
            assert cells == [f"{s['r1']}/{s['r2']}" + (f"  {100 * s['r1'] / (s['r1'] + s['r2']):.0f}/"
                                                       f"{100 * s['r2'] / (s['r1'] + s['r2']):.0f}%"
                                                       if s["r1"] + s["r2"] else "") for s in shares().values()]
            lines = str(app.query_one("#routers").render())
            assert url1 in lines and url2 in lines and lines.count("unified@1") == 2 and "control ok" in lines
            # decisions from both, labelled
            await pilot.press("4")
            assert await wait_for(pilot, app, lambda: app.query_one("#decision-table").row_count >= 4)
            d = app.query_one("#decision-table")
            assert {str(d.get_row_at(i)[1]) for i in range(d.row_count)} == {"r1", "r2"}
            # control acts on the selected router only
            await pilot.press("R")
            await wait_group(app, "policies")
            app.switch_policy_to("lmetric")
            await pilot.pause()
            assert f"on r2 ({url2})" in app.screen.title_text
            await pilot.press("y")
            await wait_group(app, "control")
            assert app2[STATE].slot.label == "lmetric@2" and app1[STATE].slot.label == "unified@1"
            assert await wait_for(pilot, app, lambda: "lmetric@2" in str(app.query_one("#routers").render()))
            await pilot.press("ctrl+c")
    finally:
        for t in sending:
            t.cancel()
        await asyncio.gather(*sending, return_exceptions=True)
        await http.close()


async def test_once_with_two_routers_prints_each_and_the_merged_table(aiohttp_server, fake_backends, tmp_path,
                                                                        capsys):
    from kvtop.cli import main

    backends = await fake_backends(2)
    (_, url1), (_, url2) = [await _router(aiohttp_server, backends, tmp_path, k) for k in (1, 2)]
    rc = await asyncio.to_thread(main, ["attach", "--once", url1, url2])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.startswith(f"r1 {url1}  policy unified@1") and f"r2 {url2}  policy unified@1" in out
    table = [line for line in out.splitlines() if line.startswith(("i0 ", "i1 "))]
    assert len(table) == 2  # one row per instance
    assert "in flight by router  i0: r1=0 r2=0  i1: r1=0 r2=0" in out
    rc = await asyncio.to_thread(main, ["attach", "--once", url1, "http://127.0.0.1:9"])
    assert rc == 2 and "r2: cannot reach the router at http://127.0.0.1:9" in capsys.readouterr().err


# -- the instance table's header tooltips (issue 20) ------------------------------------------------

async def test_column_headers_explain_themselves_with_the_help_legend():
    from kvtop.tui.model import COLUMN_HELP

    app, feed = make_app(steps=2, decisions=0)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        table = app.query_one("#instances")
        x = 1
        seen = {}
        for col in table.ordered_columns[:8]:  # the columns on screen at 120 wide
            width = col.get_render_width(table)
            await pilot.hover("#instances", offset=(x + 1, 0))  # the header row
            await pilot.pause()
            seen[str(col.key.value)] = table.tooltip
            x += width
        assert seen["est_hit"] == f"{COLUMN_HELP['est_hit'][0]}: {COLUMN_HELP['est_hit'][1]}"
        assert seen["backlog_s"].startswith("backlog seconds: that backlog in seconds")
        assert all(seen[k] and COLUMN_HELP[k][1] in seen[k] and COLUMN_HELP[k][1] in app.help_text()
                   for k in seen)  # one source: the help's legend says the same
        await pilot.hover("#instances", offset=(3, 2))  # a data row: no column tooltip
        await pilot.pause()
        assert table.tooltip is None


# -- sessions detail and copy to clipboard (issue 20) ------------------------------------------------

async def test_enter_on_a_session_shows_its_turns_and_c_copies_its_whole_id():
    from kvtop.tui.screens import ReceiptScreen, SessionScreen

    long_id = "agent-claude-code-7f3a9c2e-4b1d-4e8a-9f0c-" + "x" * 40 + "-0042"
    feed = FakeFeed(policies=copy.deepcopy(syn.POLICIES),
                    sessions={"total": 1, "sessions": [{**syn.sessions(1, 4)["sessions"][0], "session": long_id,
                                                        "instance": "vllm-2", "turns": 3}]})
    feed.push("state", syn.snapshot(4, 1.0))
    for k in range(3):
        feed.push("decision", {**syn.decision(k, 4), "session": long_id, "turn": k + 1})
    feed.push("decision", syn.decision(9, 4))  # another session's: not among its turns
    app, _ = make_app(feed)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await pilot.press("3")
        app._fetch_sessions()
        await wait_group(app, "sessions")
        await settle(pilot, app)
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, SessionScreen)
        assert long_id in str(app.screen.query_one("#session-head").render())  # whole, not cut
        turns = app.screen.query_one("#session-turns")
        assert turns.row_count == 3
        await pilot.press("c")
        await pilot.pause()
        assert app.clipboard == long_id
        await pilot.press("enter")  # the newest turn's receipt
        await pilot.pause()
        assert isinstance(app.screen, ReceiptScreen) and app.screen.ev["turn"] == 3
        await pilot.press("c")
        assert app.clipboard == app.screen.ev["request_id"]


# -- condensed rows for big fleets (issue 20) ------------------------------------------------------

async def test_a_big_fleet_condenses_to_the_busiest_rows_that_fit_and_z_shows_all():
    from kvtop.tui.tabs import OverviewTab

    app, feed = make_app(n=80, steps=3, decisions=0)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot, app)
        table = app.query_one("#instances")
        fit = app.query_one(OverviewTab).compact_rows()
        assert table.row_count == fit < 80
        insts = app.collected.snapshot["instances"]
        busiest = sorted(insts, key=lambda i: (i["pending_prefill_tokens"], i["num_requests"]), reverse=True)
        assert {str(k.value) for k in table.rows} == {i["name"] for i in busiest[:fit]}
        rest = busiest[fit:]
        totals = str(app.query_one("#totals").render())
        assert f"+{len(rest)} more instances" in totals
        assert f"{sum(i['num_requests'] for i in rest)} requests" in totals
        assert table.region.bottom <= 40  # the rows shown fit on the screen
        await pilot.press("z")
        await settle(pilot, app)
        assert table.row_count == 80 and "more instances" not in str(app.query_one("#totals").render())
        await pilot.press("z")
        await settle(pilot, app)
        assert table.row_count == fit


async def test_a_small_fleet_keeps_every_row():
    app, feed = make_app(n=20, steps=2, decisions=0)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot, app)
        assert app.query_one("#instances").row_count == 20
        assert "more instances" not in str(app.query_one("#totals").render())
