"""Issue 35's leftovers: the "connecting" first frame comes before the heavy imports, shadow
agreement counts start again at a policy switch, receipts print figures in one precision."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from test_control import router  # noqa: F401  (the router fixture)


# -- the first frame -------------------------------------------------------------------------------

def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.getcwd()})
    return set(out.stdout.split())


def test_running_a_verb_imports_that_verbs_module_only():
    """kvtop demo's first frame waited for every verb's module (the router's server, aiohttp:
    0.45 s of CPU, seconds on a loaded host) before demo ran at all."""
    mods = _modules_after("from kvtop.cli import main\nassert main(['demo', '--instances', '0']) == 2")
    assert "kvtop.demo" in mods
    assert not {"router.app", "router.cli", "aiohttp", "textual", "kvtop.simulate"} & mods


def test_kvtop_help_still_lists_every_verb(capsys):
    from kvtop.cli import VERBS, main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(verb in out for verb, _, _ in VERBS)


def test_the_connecting_frame_is_written_before_textual_is_imported():
    import pty

    code = ("import os, sys\nfrom kvtop.tui import splash\nfd = int(sys.argv[1])\n"
            "f = os.fdopen(fd, 'w', encoding='utf-8')\n"
            "assert splash.connecting_frame('http://127.0.0.1:9', 'starting 4 instances', out=f)\n"
            "assert 'textual' not in sys.modules and 'rich' not in sys.modules\n")
    leader, follower = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(follower)], pass_fds=(follower,), timeout=60,
                              env={**os.environ, "PYTHONPATH": os.getcwd()}, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        written = os.read(leader, 4096).decode()
    finally:
        os.close(leader)
        os.close(follower)
    assert written.startswith("\x1b[?1049h")  # the alternate screen Textual then draws over
    assert "⋯ connecting   http://127.0.0.1:9   starting 4 instances" in written


def test_no_frame_when_the_output_is_not_a_terminal(tmp_path):
    from kvtop.tui import splash

    with open(tmp_path / "out", "w") as f:
        assert not splash.connecting_frame("http://x", out=f)
    assert (tmp_path / "out").read_text() == ""


# -- shadow agreement: counted against one active policy ------------------------------------------

async def test_a_policy_switch_starts_every_shadows_count_again_against_the_new_policy(router):
    """Agreement is with the active policy: counts carried across a switch mixed two policies
    (issue 35). Each shadow starts again, labelled with the policy@version it compares with;
    a knob change of the active policy is a new policy too; a feature knob is not."""
    from router.app import STATE
    from test_control import AUTH, complete
    from test_shadow import _drain

    c = await router(3, shadows=["leastwork", "round_robin"])
    for k in range(4):
        assert (await complete(c, f"s{k % 2}"))["status"] == 200
    await _drain(c)
    before = {s["policy"]: s for s in (await (await c.get("/kvtop/v1/shadows")).json())["shadows"]}
    assert before["leastwork"]["picks"] == 4 and before["leastwork"]["against"] == "unified@1"
    r = await c.put("/kvtop/v1/policy", json={"name": "lmetric", "knobs": {}}, headers=AUTH)
    assert r.status == 200
    after = {s["policy"]: s for s in (await (await c.get("/kvtop/v1/shadows")).json())["shadows"]}
    assert all(s["picks"] == 0 and s["agreement"] is None and s["against"] == "lmetric@2" for s in after.values())
    assert after["leastwork"]["since"] > before["leastwork"]["since"]
    assert (await complete(c, "s9"))["status"] == 200
    await _drain(c)
    counted = (await (await c.get("/kvtop/v1/shadows")).json())["shadows"]
    assert [s["picks"] for s in counted] == [1, 1]
    r = await c.patch("/kvtop/v1/knobs", json={"offload_mode": "simple"}, headers=AUTH)  # a router feature
    assert r.status == 200
    assert [s["picks"] for s in (await (await c.get("/kvtop/v1/shadows")).json())["shadows"]] == [1, 1]
    st = c.server.app[STATE]
    st.set_policy("unified", {"overload_factor": 3.0}, "test")
    assert [s.picks for s in st.shadows.shadows.values()] == [0, 0]


async def test_the_shadow_panel_says_what_the_counts_compare_with():
    import copy

    from kvtop.tui import synthetic as syn
    from kvtop.tui.feed import FakeFeed
    from test_tui import make_app, settle

    snap = syn.snapshot(4, 0.0)
    snap["shadows"] = {"shadows": [{"policy": "leastwork", "knobs": {}, "picks": 12, "agree": 9, "agreement": 0.75,
                                    "since": 1_700_000_000.0, "against": "lmetric@2"}], "dropped": []}
    feed = FakeFeed(policies=copy.deepcopy(syn.POLICIES))
    feed.push("state", snap)
    app, _ = make_app(feed)
    async with app.run_test(size=(140, 42)) as pilot:
        await settle(pilot, app)
        await pilot.press("5")
        await settle(pilot, app)
        panel = str(app.query_one("#shadow-panel").render())
        assert "agrees 75.0% of 12 against lmetric@2 since" in panel, panel


# -- receipts: one precision a column --------------------------------------------------------------

@pytest.mark.parametrize("values, expected", [
    ([0, 16_600, 3], ["0", "16,600", "3"]),                      # whole numbers: integers, as before
    ([5000.0, 4000.0], ["5,000", "4,000"]),                      # integral floats too
    ([0.3412, 1.3648, 12.5, 0.0], ["0.341", "1.365", "12.500", "0.000"]),  # was 0.3412, 1.36, 12.50, 0
    ([49_800, 1_600, 0.0523], ["49,800.0000", "1,600.0000", "0.0523"]),    # the smallest sets the decimals
    ([None, 2.5, "n/a"], ["–", "2.50", "n/a"]),                 # missing and text pass through
])
def test_a_receipt_column_has_one_precision(values, expected):
    from kvtop.receipt import candidates

    terms = [{"instance": f"i{k}", "x": v} for k, v in enumerate(values)]
    _, rows = candidates(terms, "i0")
    assert [cells[1] for _, cells in rows] == expected


def test_the_receipt_head_says_the_policy_time_in_the_timelines_precision():
    from kvtop.receipt import head_lines
    from kvtop.tui import synthetic as syn

    assert any(line.endswith("policy ran 41.5 µs") for line in head_lines(syn.decision(7, 4)))
