"""Shadow policies (router/shadow.py) and compact block chains (store/chains.py).

On a real router on 127.0.0.1: decision rows carry every shadow's pick, the summary counts
agreement, the control API swaps shadows with the token and an audit row, and a shadow that
raises or is slow is dropped with an event while routing goes on untouched."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest
import sqlite_utils

from router.app import STATE, create_app
from router.cluster import Cluster
from router.core import RoutingCore
from router.features import Features
from router.pipeline import OK, Pipeline
from router.policies import POLICIES, Policy, build_policy
from router.policies.base import ARGMIN, Pick
from router.request import RouteRequest
from router.shadow import ShadowError, Shadows, parse_specs
from store.chains import ChainDecoder, ChainEncoder
from test_control import AUTH, TOKEN, complete, router  # noqa: F401  (the router fixture)


class Boom(Policy):
    """Raises on every pick (a broken shadow)."""

    name = "boom"

    def pick(self, req, view):
        raise RuntimeError("kaput")


class Slow(Policy):
    """Takes 50 ms a pick (a slow shadow)."""

    name = "slow"

    def pick(self, req, view):
        time.sleep(0.05)
        return Pick(view.candidates[-1].index, ARGMIN)


class Looks(Policy):
    """Asks for the lookahead view and remembers whether it got one."""

    name = "looks"
    needs_lookahead = True
    seen: list = []

    def pick(self, req, view):
        la = view.lookahead  # present, and frozen before the dispatch (every candidate's walk done)
        Looks.seen.append(la is not None and set(la._victims) == {c.index for c in view.candidates})
        return Pick(view.candidates[0].index, ARGMIN)


def test_a_shadow_that_needs_the_lookahead_gets_it(monkeypatch):
    monkeypatch.setitem(POLICIES, "looks", Looks)
    Looks.seen = []
    pipe, _ = _pipeline("unified", Shadows(parse_specs("looks")))
    _run(pipe, 0, "s", [1, 2])
    assert Looks.seen == [True]


@pytest.fixture
def broken_policies(monkeypatch):
    monkeypatch.setitem(POLICIES, "boom", Boom)
    monkeypatch.setitem(POLICIES, "slow", Slow)


class _Sink:
    def __init__(self):
        self.decisions, self.outcomes = [], []

    def decision(self, d):
        self.decisions.append(d)

    def outcome(self, d, o):
        self.outcomes.append(o)


def _pipeline(policy: str, shadows: Shadows, n: int = 3):
    cluster = Cluster([f"i{k}" for k in range(n)], block_size=4, capacity_blocks=100)
    sink = _Sink()
    pipe = Pipeline(RoutingCore(cluster, build_policy(policy)), lambda: Features.build({}), sink)
    pipe.shadows = shadows
    return pipe, sink


def _run(pipe, k: int, session: str, blocks: list[int]):
    req = RouteRequest(f"r{k}", session, "header", len(blocks) * 4 + 1, blocks, "tokens", "completions",
                       True, 4)
    flow = pipe.receive(req)
    pipe.route(flow)
    assert pipe.admit(flow)
    pipe.sent(flow)
    pipe.first_token(flow)
    pipe.finish(flow, OK, output_tokens=4)
    return flow.decision


def test_parse_specs_names_and_objects():
    assert parse_specs("leastwork, unified") == [("leastwork", {}), ("unified", {})]
    assert parse_specs([{"policy": "unified", "knobs": {"cache_ratio_gate": 0.5}}])[0] == ("unified", {"cache_ratio_gate": 0.5})
    for bad, msg in (("nope", "unknown policy"), ("unified,unified", "twice"), (3, "expected a list"),
                     ([{"policy": "unified", "extra": 1}], "unknown field"),
                     ([{"policy": "unified", "knobs": {"nope": 1}}], "knobs.nope")):
        with pytest.raises(ShadowError, match=msg):
            parse_specs(bad)


def test_shadows_pick_on_the_decisions_own_view_and_never_change_counters():
    shadows = Shadows(parse_specs("round_robin,leastwork"))
    pipe, sink = _pipeline("unified", shadows)
    ref, _ = _pipeline("unified", Shadows([]))
    d = _run(pipe, 0, "s", [1, 2, 3])
    _run(ref, 0, "s", [1, 2, 3])
    assert [s["policy"] for s in d.shadow] == ["round_robin", "leastwork"]
    assert pipe.cluster.rr_counter == ref.cluster.rr_counter  # only the real pick may advance it
    assert d.view is None  # released once the shadows have seen it
    # turn 2 of the same session: unified sticks where the prefix is; round_robin goes by the counter
    d2 = _run(pipe, 1, "s", [1, 2, 3, 4])
    assert all(s["saved"] <= 0 for s in d2.shadow)  # unified took the instance with the prefix
    summ = {s["policy"]: s for s in shadows.summary()["shadows"]}
    assert summ["leastwork"]["picks"] == 2 and summ["round_robin"]["picks"] == 2
    for s in summ.values():
        assert s["agree"] + s["disagree"] == 2
        assert sum(s["disagree_by_class"].values()) == s["disagree"]
    assert pipe.idle()


def test_live_shadows_wait_for_the_answer_and_write_the_decision_once():
    """Live, the picks wait until the attempt ends (or the driver's timer): the decision is
    still written once, with the picks, and before its outcome."""
    shadows = Shadows(parse_specs("leastwork"))
    pipe, sink = _pipeline("unified", shadows)
    order = []
    sink.decision = lambda d: order.append(("decision", d))
    sink.outcome = lambda d, o: order.append(("outcome", d))
    later = []
    pipe.defer = later.append
    d = _run(pipe, 0, "s", [1, 2])  # finish came before the timer
    assert [k for k, _ in order] == ["decision", "outcome"] and d.shadow
    for fn in later:  # the timer fires afterwards: nothing more is written
        fn()
    assert len(order) == 2
    # a long request: the timer writes the decision while it is still running
    req = RouteRequest("r9", "t", "header", 9, [5, 6], "tokens", "completions", True, 4)
    flow = pipe.receive(req)
    pipe.route(flow)
    pipe.admit(flow)
    pipe.sent(flow)
    assert len(order) == 2
    later[-1]()
    assert order[-1][0] == "decision" and order[-1][1].shadow
    pipe.finish(flow, OK, output_tokens=4)
    assert [k for k, _ in order[2:]] == ["decision", "outcome"]


def test_saved_tokens_is_the_hit_difference():
    # i0 holds the session's prefix; a round-robin shadow picking elsewhere loses exactly that hit
    shadows = Shadows(parse_specs("round_robin"))
    pipe, _ = _pipeline("sticky", shadows, n=2)
    _run(pipe, 0, "s", [7, 8, 9])
    d = _run(pipe, 1, "s", [7, 8, 9, 10])
    sh = d.shadow[0]
    if sh["instance"] != d.instance_name:
        assert sh["saved"] == -d.est_hit_tokens
    else:
        assert sh["saved"] == 0


def test_broken_and_slow_shadows_are_dropped_with_an_event(broken_policies):
    dropped = []
    shadows = Shadows(parse_specs("boom,slow,leastwork"), budget_ms=5.0,
                      on_drop=lambda name, why: dropped.append((name, why)))
    pipe, sink = _pipeline("unified", shadows)
    picks = [_run(pipe, k, f"s{k}", [k, k + 1]).instance for k in range(4)]
    # routing is the active policy's alone: the same as with no shadows at all
    ref, _ = _pipeline("unified", Shadows([]))
    assert picks == [_run(ref, k, f"s{k}", [k, k + 1]).instance for k in range(4)]
    assert [n for n, _ in dropped] == ["boom", "slow"]
    assert "raised RuntimeError: kaput" in dropped[0][1] and "slow" in dropped[1][1]
    assert shadows.names() == ["leastwork"]
    assert [s["policy"] for s in sink.decisions[-1].shadow] == ["leastwork"]
    assert {d["policy"] for d in shadows.summary()["dropped"]} == {"boom", "slow"}


def test_chain_encoding_round_trips_and_is_compact():
    rng = random.Random(5)
    enc, dec = ChainEncoder(max_sessions=2), ChainDecoder()
    chains: dict[str, list[int]] = {}
    rows = []
    for k in range(60):
        s = f"s{k % 3}"
        prev = chains.get(s, [])
        keep = rng.randint(0, len(prev))
        chain = prev[:keep] + [rng.getrandbits(64) - 2**63 for _ in range(rng.randint(0, 5))]
        chains[s] = chain
        parent, text = enc.encode(s, f"r{k}", chain)
        rows.append((f"r{k}", parent, text, chain))
    for rid, parent, text, chain in rows:
        assert dec.decode(rid, parent, text) == chain
    # a turn that repeats 390 blocks and adds 2 stores 2 hashes, not 392
    enc = ChainEncoder()
    base = list(range(390))
    enc.encode("a", "t1", base)
    parent, text = enc.encode("a", "t2", base + [1000, 1001])
    assert parent == "t1" and text.startswith("390:") and len(text) < 30
    # a missing parent or a malformed value: None, never an exception
    assert ChainDecoder().decode("t2", "t1", text) is None
    for bad in (None, "", "x:abc", "3", "0:!!!", "0:AAAA"):
        assert ChainDecoder().decode("r", None, bad) is None
    # hashes beyond 64 bits (trace ids) keep their equality
    p, t = ChainEncoder().encode("z", "r", [2**70, 2**70 + 1])
    assert len(ChainDecoder().decode("r", p, t)) == 2


# -- on a real router ---------------------------------------------------------------------------

async def _drain(c):
    """Let the deferred shadow picks and the writer catch up."""
    await asyncio.sleep(0.05)
    st = c.server.app[STATE]
    if st.writer is not None:
        st.writer.flush()


async def test_router_records_both_shadows_per_decision(router):
    c = await router(3, db=True, shadows=["leastwork", "round_robin"])
    for k in range(6):
        assert (await complete(c, f"s{k % 2}", prompt="word " * (100 + 40 * k)))["status"] == 200
    await _drain(c)
    summ = await (await c.get("/kvtop/v1/shadows")).json()
    assert [s["policy"] for s in summ["shadows"]] == ["leastwork", "round_robin"]
    assert all(s["picks"] == 6 for s in summ["shadows"])
    state = await (await c.get("/kvtop/v1/state")).json()
    assert [s["policy"] for s in state["shadows"]["shadows"]] == ["leastwork", "round_robin"]
    ring = await (await c.get("/kvtop/v1/decisions?limit=1")).json()
    assert [s["policy"] for s in ring["decisions"][0]["shadow"]] == ["leastwork", "round_robin"]
    db = sqlite_utils.Database(c.server.app[STATE].config.db)
    rows = list(db["decisions"].rows)
    assert len(rows) == 6
    for row in rows:
        picks = json.loads(row["shadows"])
        assert [p["policy"] for p in picks] == ["leastwork", "round_robin"]
        assert all(p["instance"] in ("i0", "i1", "i2") for p in picks)
        assert row["blocks"] is not None
    dec = ChainDecoder()
    for row in sorted(rows, key=lambda r: r["id"]):
        assert dec.decode(row["request_id"], row["blocks_parent"], row["blocks"]) is not None


async def test_control_api_sets_shadows_with_token_and_audit(router):
    c = await router(2, db=True)
    r = await c.put("/kvtop/v1/shadows", json={"policies": ["leastwork"]})
    assert r.status == 401
    r = await c.put("/kvtop/v1/shadows", json={"policies": ["nope"]}, headers=AUTH)
    assert r.status == 400 and "unknown policy" in (await r.json())["error"]["message"]
    r = await c.put("/kvtop/v1/shadows", json={"shadows": []}, headers=AUTH)
    assert r.status == 400
    r = await c.put("/kvtop/v1/shadows", json={"policies": [{"policy": "lmetric", "knobs": {}}, "leastwork"]},
                    headers=AUTH)
    assert r.status == 200
    assert [s["policy"] for s in (await r.json())["shadows"]] == ["lmetric", "leastwork"]
    await complete(c, "a")
    r = await c.put("/kvtop/v1/shadows", json={"policies": []}, headers=AUTH)
    assert (await r.json())["shadows"] == []
    await complete(c, "b")
    await _drain(c)
    db = sqlite_utils.Database(c.server.app[STATE].config.db)
    audits = [r for r in db["config_events"].rows if r["kind"] == "shadow"]
    assert len(audits) == 2 and json.loads(audits[0]["after"])[0]["policy"] == "lmetric"
    shadows = [r["shadows"] for r in db["decisions"].rows_where(order_by="id")]
    assert shadows[0] is not None and shadows[1] is None


async def test_a_broken_shadow_never_touches_routing(router, broken_policies):
    c = await router(2, db=True, shadows=["boom", "slow", "leastwork"])
    events = []
    c.server.app[STATE].listeners.append(lambda kind, p: events.append((kind, p)))
    for k in range(4):
        assert (await complete(c, f"s{k}"))["status"] == 200
    await _drain(c)
    summ = await (await c.get("/kvtop/v1/shadows")).json()
    assert [s["policy"] for s in summ["shadows"]] == ["leastwork"]
    assert {d["policy"] for d in summ["dropped"]} == {"boom", "slow"}
    drops = [p for kind, p in events if kind == "config" and p["kind"] == "shadow"]
    assert {d["after"]["dropped"] for d in drops} == {"boom", "slow"}
    st = await (await c.get("/kvtop/v1/state")).json()
    assert st["outcomes_by_status"] == {"ok": 4}


async def test_log_shadow_summarises_per_segment(router, capsys):
    from kvtop.cli import main

    c = await router(2, db=True, shadows=["leastwork", "round_robin"])
    for k in range(4):
        await complete(c, f"s{k}")
    r = await c.put("/kvtop/v1/policy", json={"name": "lmetric"}, headers=AUTH)
    assert r.status == 200
    for k in range(3):
        await complete(c, f"s{k}")
    await _drain(c)
    db = c.server.app[STATE].config.db
    assert main(["log", "--db", db, "shadow", "--format", "jsonl"]) == 0
    rows = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    got = {(r["segment"], r["shadow"]): r for r in rows}
    assert set(got) == {("unified@1", "leastwork"), ("unified@1", "round_robin"),
                        ("lmetric@2", "leastwork"), ("lmetric@2", "round_robin")}
    assert got[("unified@1", "leastwork")]["picks"] == 4 and got[("lmetric@2", "round_robin")]["picks"] == 3
    for r in rows:
        assert r["agree"] + sum(r["disagree_by_class"].values()) == r["picks"]
    assert main(["log", "--db", db, "shadow"]) == 0
    out = capsys.readouterr().out
    assert "unified@1" in out and "agreement" in out and "est. prefill saved" in out


async def test_dashboard_shows_shadows_promotes_one_and_receipts_name_their_picks(router_client, fake_backends,
                                                                                 tmp_path):
    """Pilot: the Policy tab's shadow panel, S to promote (confirmation, audit row), and the
    shadow picks in a decision's receipt, on a real router."""
    from router.app import Backend, RouterConfig
    from kvtop.tui.app import KvtopApp
    from kvtop.tui.feed import RouterFeed
    from test_tui import SIZE, wait_for, wait_group

    backends = await fake_backends(2)
    cfg = RouterConfig(backends=[Backend(f"i{k}", url) for k, (_, url) in enumerate(backends)],
                       db=str(tmp_path / "k.db"), control_token=TOKEN, state_dir=str(tmp_path / "state"),
                       scrape_interval_s=0.2, shadows=["leastwork", "round_robin"])
    c = await router_client(create_app(cfg))
    for k in range(4):
        await complete(c, f"s{k}")
    rapp = c.server.app
    app = KvtopApp(RouterFeed(c.router.url, TOKEN, hz=10), url=c.router.url, apply_timer=False,
                   poll_sessions_s=0)
    async with app.run_test(size=SIZE) as pilot:
        assert await wait_for(pilot, app, lambda: app.collected.snapshot is not None
                              and app.policies_body.get("policies"))
        await pilot.press("5")
        assert await wait_for(pilot, app, lambda: "leastwork" in str(app.query_one("#shadow-panel").render()))
        panel = str(app.query_one("#shadow-panel").render())
        assert "round_robin" in panel and "agrees" in panel and "of 4" in panel
        # the receipt of a decision names each shadow's pick
        await complete(c, "s9")
        assert await wait_for(pilot, app, lambda: any(d.get("shadow") for _, d in app.collected.decisions))
        ev = next(d for _, d in reversed(app.collected.decisions) if d.get("shadow"))
        from kvtop.receipt import head_lines

        assert any(line.startswith("shadows: leastwork → ") for line in head_lines(ev))
        # S: pick a shadow, confirm, and the router runs it, with an audit row
        await pilot.press("S")
        await pilot.pause()
        await pilot.press("down", "enter")  # the picker lists the two shadows; take the second
        await pilot.pause()
        await pilot.press("y")
        await wait_group(app, "control")
        assert rapp[STATE].slot.policy.name in ("leastwork", "round_robin")
        assert rapp[STATE].slot.version == 2
        assert await wait_for(pilot, app, lambda: any(ev.get("kind") == "policy"
                                                      for ev in app.collected.config_events))


def test_a_deferred_shadow_reads_the_lookahead_as_it_was_at_the_decision():
    """A shadow runs after the request was dispatched (deferred): its eviction lookahead must be
    the one before the dispatch inserted the request's blocks, as the live policy's was."""
    from router.cluster import Cluster

    def fresh() -> Cluster:
        c = Cluster(["i0", "i1"], block_size=4, capacity_blocks=6)
        for sid, blocks in (("a", [1, 2, 3]), ("b", [4, 5, 6])):  # both on i0, which is then full
            c.dispatch(0, len(blocks) * 4, 0, blocks, session_id=sid)
            c.bind_session(sid, 0, len(blocks) * 4, 0, new_turn=True)
        return c

    new = [7, 8, 9, 10]

    def victims_after_dispatch(freeze: bool) -> list[tuple[str, int]]:
        c = fresh()
        view = c.view(new, 17, "c", lookahead=True)
        if freeze:
            view.lookahead.freeze([cand.index for cand in view.candidates])
        c.dispatch(0, 17, 0, new, session_id="c")
        c.bind_session("c", 0, 17, 0, new_turn=True)
        return sorted((s.session_id, n) for s, n in view.lookahead.victims(0))

    c = fresh()
    before = sorted((s.session_id, n) for s, n in c.view(new, 17, "c", lookahead=True).lookahead.victims(0))
    assert before == [("a", 12), ("b", 4)]  # 4 new blocks on a full 6-block cache: a's 3, one of b's
    assert victims_after_dispatch(freeze=True) == before
    assert victims_after_dispatch(freeze=False) != before  # what the shadow read before the fix
