"""The estimate's drift from the KV events, where an operator reads it: the router's /metrics
(per-instance KV-event families that agree with /kvtop/v1/state) and the decision log's
``estimate_hit_tokens`` (what the router's own estimate gave the chosen instance while its hit
came from the events)."""

from __future__ import annotations

import asyncio
import random
import sqlite3

import sqlite_utils

from kvfake import FakeEngineCache
from router.app import STATE, Backend, RouterConfig, create_app
from router.blocks import hash_token_blocks
from router.cluster import Cluster
from router.core import RoutingCore
from router.exact_index import ExactIndex
from router.kv_batches import decode_batch, encode_batch
from router.policies import build_policy
from router.request import RouteRequest
from router.engine_metrics import parse_prometheus
from store.schema import TABLES, ensure_schema
from store.writer import Writer
from kvtop.procs import free_port_run

BS = 16


def _request(tokens, rid, source="tokens"):
    return RouteRequest(request_id=str(rid), session_id=f"s{rid}", session_source="header",
                        input_tokens=len(tokens), blocks=hash_token_blocks(tokens, BS),
                        token_source=source, endpoint="completions", stream=False, max_tokens=1)


def _feed(index, instance, events):
    index.apply(instance, decode_batch(encode_batch(0.0, events))[1])  # through the wire format


# -- the decision record -----------------------------------------------------------------------
def test_decision_keeps_the_estimate_beside_the_exact_hit():
    c = Cluster(["a", "b"], block_size=BS, capacity_blocks=1000)
    c.exact = ExactIndex(2, BS, speculative_ttl_s=0)
    toks = list(range(160))
    c.index.insert(0, hash_token_blocks(toks, BS))  # the estimate believes a holds all 10 blocks
    _feed(c.exact, 0, FakeEngineCache(BS).run(toks[:64]))  # a really holds 4
    c.exact.set_live(0, True)
    core = RoutingCore(c, build_policy("leastwork", {}))
    d = core.decide(_request(toks, 1))
    # b has nothing (estimate 0, new 160); a: exact 64 (new 96), where the estimate said 144
    assert (d.instance, d.index_source, d.est_hit_tokens, d.estimate_hit_tokens) == (0, "exact", 64, 144)
    row = d.row("r")
    assert row["estimate_hit_tokens"] == 144 and row["est_hit_tokens"] == 64
    assert d.event()["estimate_hit"] == 144
    # a text-hashed prompt routes on the estimate: nothing to compare, NULL
    d2 = core.decide(_request(toks, 2, source="text_approx"))
    assert (d2.index_source, d2.estimate_hit_tokens) == ("estimate", None)
    # an instance chosen while its events are not live: NULL as well
    c.exact.set_live(0, False)
    d3 = core.decide(_request(toks, 3))
    assert (d3.index_source, d3.estimate_hit_tokens) == ("estimate", None)


def test_old_decision_log_gains_the_column_and_stays_readable(tmp_path):
    """A file written before estimate_hit_tokens existed: opening it adds the column (NULL in
    the old rows) and new rows fill it."""
    path = str(tmp_path / "old.db")
    db = sqlite_utils.Database(path)
    old_cols = {k: v for k, v in TABLES["decisions"].items() if k != "estimate_hit_tokens"}
    db["decisions"].create(old_cols, pk="id")
    db["decisions"].insert({"run_id": "r0", "request_id": "old", "est_hit_tokens": 5, "index_source": "exact"})
    db.conn.close()
    w = Writer(path).start()
    try:
        w.put("decisions", {"run_id": "r1", "request_id": "new", "est_hit_tokens": 64,
                            "index_source": "exact", "estimate_hit_tokens": 144})
        assert w.flush()
    finally:
        w.close()
    rows = sqlite3.connect(path).execute(
        "SELECT request_id, est_hit_tokens, estimate_hit_tokens FROM decisions ORDER BY id").fetchall()
    assert rows == [("old", 5, None), ("new", 64, 144)]
    ensure_schema(sqlite_utils.Database(path))  # idempotent on the migrated file


# -- /metrics against /kvtop/v1/state, with kvtop sim publishing --------------------------------
from test_kv_events_router import _sim_fleet  # noqa: E402  (kvtop sim instances publishing, in this loop)


def _by_instance(metrics, name, **labels):
    return {lab["instance"]: v for lab, v in metrics.get(name, [])
            if all(lab.get(k) == want for k, want in labels.items())}


async def test_metrics_show_each_instance_kv_events_and_drift(router_client, tmp_path):
    """Two kvtop sim instances with events (and a third backend without): 60 requests of 8
    growing sessions on caches that hold about two; then /metrics and /kvtop/v1/state say the
    same per instance, and the decision log holds the estimate beside every exact hit."""
    insts, task = await _sim_fleet(2, blocks=400)
    try:
        backends = [Backend(f"i{k}", f"http://127.0.0.1:{inst.port}", kv_events=inst.kv_publisher.endpoint,
                            kv_replay=inst.kv_publisher.replay_endpoint) for k, inst in enumerate(insts)]
        # a third backend without events: i1's engine again, reached on the estimate alone
        backends.append(Backend("plain", f"http://127.0.0.1:{insts[1].port}"))
        cfg = RouterConfig(backends=backends, policy="leastwork", block_size=BS, capacity_tokens=400 * BS,
                           db=str(tmp_path / "k.db"), state_dir=str(tmp_path / "state"), kv_speculative_ttl_s=0)
        client = await router_client(create_app(cfg))
        state = client.server.app[STATE]
        await asyncio.sleep(0.3)  # the SUB connections are up before the first batch leaves
        rng = random.Random(3)
        sessions: dict[str, list[int]] = {}
        for rid in range(60):
            sid = f"s{rng.randrange(8)}"
            prompt = sessions.get(sid, []) + [rng.randrange(30_000) for _ in range(rng.randrange(100, 600))]
            sessions[sid] = prompt
            r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2},
                                  headers={"X-Session-ID": sid})
            assert r.status == 200, await r.text()
            await r.read()
            await asyncio.sleep(0.02)
        for _ in range(100):  # every batch the engines published has arrived
            subs = state.kv_subscribers[:2]
            if all(s.expected == inst.kv_publisher.seq for s, inst in zip(subs, insts)):
                break
            await asyncio.sleep(0.02)
        text = await (await client.get("/metrics")).text()
        snap = (await (await client.get("/kvtop/v1/state")).json())["instances"]
    finally:
        task.cancel()
        try:
            await task
        except BaseException:
            pass
    m = parse_prometheus(text)
    assert _by_instance(m, "kvtop_instance_kv_index_exact") == {"i0": 1, "i1": 1, "plain": 0}
    assert _by_instance(m, "kvtop_instance_kv_events_state", state="exact") == {"i0": 1, "i1": 1}
    assert sum(_by_instance(m, "kvtop_instance_kv_events_state", state="resync").values()) == 0
    for name, key in (("kvtop_instance_kv_events_total", "events"),
                      ("kvtop_instance_kv_event_batches_total", "batches"),
                      ("kvtop_instance_kv_event_gaps_total", "gaps"),
                      ("kvtop_instance_kv_resyncs_total", "resyncs"),
                      ("kvtop_instance_kv_restarts_total", "restarts"),
                      ("kvtop_instance_kv_cached_blocks", "router_blocks")):
        got = _by_instance(m, name)
        assert got == {i["name"]: i["kv_events"][key] for i in snap[:2]}, name  # "plain": no sample
    drift = _by_instance(m, "kvtop_instance_kv_drift_tokens_total")
    drift_in = _by_instance(m, "kvtop_instance_kv_drift_input_tokens_total")
    share = _by_instance(m, "kvtop_instance_kv_drift_share")
    for i in snap[:2]:
        d = i["kv_events"]["drift"]
        assert drift[i["name"]] == d["tokens"] and _by_instance(
            m, "kvtop_instance_kv_drift_decisions_total")[i["name"]] == d["samples"]
        assert abs(share[i["name"]] - d["share"]) < 1e-12 and drift_in[i["name"]] > 0
    assert all(i["kv_events"]["events"] > 0 and i["kv_events"]["blocks_removed"] > 0 for i in snap[:2])
    assert sum(drift.values()) > 0  # under capacity pressure the LRU model is off somewhere
    state.writer.flush()
    rows = list(sqlite_utils.Database(cfg.db)["decisions"].rows)
    assert len(rows) == 60
    for r in rows:  # exact where the chosen instance's events flow, and only there the estimate
        want = ("estimate", False) if r["instance"] == "plain" else ("exact", True)
        assert (r["index_source"], r["estimate_hit_tokens"] is not None) == want, r
    chosen_drift = sum(abs(r["est_hit_tokens"] - r["estimate_hit_tokens"]) for r in rows
                       if r["estimate_hit_tokens"] is not None)
    # drift counts every exact instance on every decision, the log only the chosen one
    assert 0 < chosen_drift <= sum(drift.values())


# -- kvtop sim publishes by default; its startup lines say where ---------------------------------


async def test_kvtop_sim_publishes_by_default_where_its_route_line_says(router_client, tmp_path):
    """`kvtop sim` with no KV flag: the ports after the HTTP ones publish events, and the
    `route with:` line it prints gives a router exact hits (--no-kv-events: none)."""
    import shlex
    import subprocess
    import sys

    from router.cli import parse_backend

    base = free_port_run(6)  # 2 HTTP ports, then 2 x (events, replay)
    proc = subprocess.Popen([sys.executable, "-m", "kvtop", "sim", "--instances", "2", "--port-base", str(base),
                             "--speed", "100", "--duration", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        lines = [proc.stdout.readline() for _ in range(3)]
        assert lines[0].startswith("instance 0:") and f"KV events tcp://127.0.0.1:{base + 2} replay " \
            f"tcp://127.0.0.1:{base + 3}" in lines[0], lines
        assert lines[2].startswith("route with: kvtop route --backend"), lines
        argv = shlex.split(lines[2].split(":", 1)[1])[2:]
        specs = [v for flag, v in zip(argv, argv[1:]) if flag == "--backend"]
        assert argv[-4:] == ["--tokenizer", "kvtop-sim", "--block-size", "16"]  # the engine's tokens and blocks
        backends = [parse_backend(spec, k) for k, spec in enumerate(specs)]
        assert [b.kv_events for b in backends] == [f"tcp://127.0.0.1:{base + 2}", f"tcp://127.0.0.1:{base + 4}"]
        cfg = RouterConfig(backends=backends, policy="leastwork", block_size=BS, db=str(tmp_path / "k.db"),
                           state_dir=str(tmp_path / "state"), kv_speculative_ttl_s=0)  # only the events
        client = await router_client(create_app(cfg))
        state = client.server.app[STATE]
        for _ in range(200):  # the startup replay from 0 makes an engine that never published exact
            if all(s.state == "exact" for s in state.kv_subscribers):
                break
            await asyncio.sleep(0.02)
        prompt = list(range(100, 100 + BS * 20))
        for _ in range(2):
            r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
            assert r.status == 200, await r.text()
            await r.read()
            await asyncio.sleep(0.3)  # the engine's BlockStored reaches the router
        state.writer.flush()
        rows = list(sqlite_utils.Database(cfg.db)["decisions"].rows)
        assert [r["index_source"] for r in rows] == ["exact", "exact"]
        assert rows[1]["est_hit_tokens"] == BS * 19  # the repeat: every block but the last token's
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    off = subprocess.run([sys.executable, "-m", "kvtop", "sim", "--port-base", str(base), "--no-kv-events",
                          "--duration", "0.2"], capture_output=True, text=True, timeout=30)
    assert off.returncode == 0, off.stderr
    assert "KV events" not in off.stdout and f"--backend http://127.0.0.1:{base} --tokenizer kvtop-sim\n" in off.stdout


def test_kvtop_sim_says_which_kv_port_is_taken_and_how_to_move():
    import socket
    import subprocess
    import sys

    base = free_port_run(4)
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", base + 2))  # one instance: HTTP on base, events base + 1, replay base + 2
        blocker.listen()
        # ports asked for and taken: a clear error
        r = subprocess.run([sys.executable, "-m", "kvtop", "sim", "--port-base", str(base),
                            "--kv-events-port-base", str(base + 1), "--duration", "5"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"cannot publish KV events on 127.0.0.1 ports {base + 1}..{base + 2}" in r.stderr
        assert "--kv-events-port-base PORT, or --no-kv-events" in r.stderr
        # the default layout taken: free ports instead, and the startup lines say which
        ok = subprocess.run([sys.executable, "-m", "kvtop", "sim", "--port-base", str(base), "--duration", "1"],
                            capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    line = next(ln for ln in ok.stdout.splitlines() if ln.startswith("route with: "))
    replay = int(line.rsplit("@kv-replay=tcp://127.0.0.1:", 1)[1].split()[0])
    assert replay != base + 2 and f"@kv=tcp://127.0.0.1:{base + 1}@" in line
    assert f"replay tcp://127.0.0.1:{replay}" in ok.stdout  # the instance's own line agrees
    both = subprocess.run([sys.executable, "-m", "kvtop", "sim", "--port-base", str(base), "--no-kv-events",
                           "--kv-events-port-base", str(base + 10), "--duration", "1"],
                          capture_output=True, text=True, timeout=60)
    assert both.returncode == 2 and "contradict" in both.stderr, both.stderr
    overlap = subprocess.run([sys.executable, "-m", "kvtop", "sim", "--instances", "2", "--port-base", str(base),
                              "--kv-events-port-base", str(base + 1), "--duration", "1"],
                             capture_output=True, text=True, timeout=60)
    assert overlap.returncode == 2 and "Traceback" not in overlap.stderr, overlap.stderr
    assert f"over the HTTP ports {base}..{base + 1}" in overlap.stderr, overlap.stderr
