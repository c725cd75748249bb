"""A returning turn routed before its new text is tokenized (issue 15: no stalls, exact tokens).

The worker sends the router the turn's shared prefix, counted (its ids and block hashes are the
previous turn's), with the new text estimated at the session's characters per token; the router
routes and forwards on that, and amends the books when the count arrives a few ms later. What
must hold: the early answer's blocks are the counted request's prefix, the worker's protocol
carries one early answer per call, the counters end where an exact dispatch leaves them, and
every row says the counted size (with the estimate the policy saw beside it), written in order
even when the answer ended before the count came.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from router.cluster import Cluster
from router.core import RoutingCore
from router.features import Features
from router.pipeline import OK, Pipeline
from router.policies import build_policy
from router.request import RouteRequest
from router.worker import WorkerProcess, partial
from test_router_e2e import rows, start_router
from test_tokenize import _bench, tok, tok_dir  # noqa: F401 - fixtures


def _early_then(x, y):
    partial(x)
    partial("a second early answer is dropped")
    return y, os.getpid()


def _early_then_fail(x):
    partial(x)
    raise ValueError("counting failed")


def _no_early(y):
    return y


async def test_worker_sends_one_early_answer_before_the_result():
    w = await WorkerProcess.start()
    try:
        first, final = w.submit_partial(_early_then, "prefix", "whole")
        assert await asyncio.wait_for(asyncio.wrap_future(first), 30) == (True, "prefix")
        got, pid = await asyncio.wait_for(asyncio.wrap_future(final), 30)
        assert got == "whole" and pid == w.pid
        first, final = w.submit_partial(_no_early, "only")  # no early answer: both at the end
        assert await asyncio.wait_for(asyncio.wrap_future(first), 30) == (False, "only")
        assert final.result(0) == "only"
        first, final = w.submit_partial(_early_then_fail, "prefix")
        assert await asyncio.wait_for(asyncio.wrap_future(first), 30) == (True, "prefix")
        with pytest.raises(ValueError, match="counting failed"):
            await asyncio.wait_for(asyncio.wrap_future(final), 30)
        assert not w.broken and await asyncio.get_running_loop().run_in_executor(w, _no_early, 7) == 7
    finally:
        w.shutdown()


def test_partial_outside_a_worker_call_sends_nothing():
    assert partial("nobody listens") is False


def _session_raws(turns: int, chars: int = 120_000, api: str = "chat") -> list[bytes]:
    bench = _bench()
    s = bench.Session(5, bench.corpus(600_000), system_chars=chars)
    out = []
    for _ in range(turns):
        s.grow()
        out.append(json.dumps(s.body(api, "early-1")).encode())
    return out


def test_worker_preview_is_the_counted_prefix_and_an_estimate(tok, tok_dir, monkeypatch):  # noqa: F811
    from router import parsing

    monkeypatch.setattr(parsing, "_worker_turns", parsing.OrderedDict())
    sent: list[RouteRequest] = []
    monkeypatch.setattr(parsing, "worker_partial", sent.append)
    raws = _session_raws(3)
    first = parsing._parse_in_worker(raws[0], "chat", {}, "X-Session-ID", 16, str(tok_dir), None, True)
    assert sent == []  # a cold prompt: nothing to reuse, no early answer
    for raw in raws[1:]:
        sent.clear()
        final = parsing._parse_in_worker(raw, "chat", {}, "X-Session-ID", 16, str(tok_dir), None, True)
        assert len(sent) == 1
        early = sent[0]
        n = len(early.blocks)
        assert n >= len(first.blocks) - 2 and early.blocks.tolist() == final.blocks[:n].tolist()
        counted_prefix = early.input_tokens - early.tail_estimate
        assert counted_prefix >= n * 16 and 0 < early.tail_estimate
        true_tail = final.input_tokens - counted_prefix
        assert abs(early.tail_estimate - true_tail) <= 0.5 * true_tail  # the session's own ratio
        assert (early.session_id, early.token_source) == (final.session_id, "tokenizer")
        first = final
    # a router maximum the new text could exceed: no early answer, the count decides
    sent.clear()
    more = _session_raws(4)
    for raw in more[:3]:
        prev = parsing._parse_in_worker(raw, "chat", {}, "X-Session-ID", 16, str(tok_dir), None, True)
    sent.clear()
    final = parsing._parse_in_worker(more[3], "chat", {}, "X-Session-ID", 16, str(tok_dir),
                                     prev.input_tokens + 8_000, True)
    assert sent == [] and prev.input_tokens < final.input_tokens < prev.input_tokens + 8_000


class _Sink:
    def __init__(self):
        self.rows: list[tuple] = []

    def decision(self, d):
        self.rows.append(("decision", d.request.request_id, d.request.input_tokens,
                          d.extra.get("estimated_input_tokens"), d.new_prefill_tokens))

    def outcome(self, d, o):
        self.rows.append(("outcome", d.request.request_id, o.status))


def _pipe():
    now = [0.0]
    cluster = Cluster(["a", "b"], block_size=16, capacity_blocks=10_000, clock=lambda: now[0])
    core = RoutingCore(cluster, build_policy("leastwork", {}), clock=lambda: now[0])
    sink = _Sink()
    return Pipeline(core, lambda: Features.build({}), sink, clock=lambda: now[0]), sink, cluster, now


def _req(rid: str, tokens: int, blocks: list[int], estimate: int = 0) -> RouteRequest:
    r = RouteRequest(rid, "sess", "header", tokens, blocks, "tokenizer", "chat", True, 1)
    r.tail_estimate = estimate
    return r


@pytest.mark.parametrize("count_first", [True, False])
def test_amend_charges_the_count_and_writes_rows_in_order(count_first):
    pipe, sink, cluster, now = _pipe()
    prefix = list(range(100))
    flow = pipe.receive(_req("r1", 100 * 16 + 300, prefix, estimate=300))
    flow.request.counting = object()  # a count is on its way
    pipe.route(flow)
    inst = flow.decision.instance
    s = cluster.instances[inst]
    assert s.pending_prefill_tokens == 100 * 16 + 300
    counted = _req("other-id", 100 * 16 + 412, prefix + [1000 + k for k in range(25)])
    pipe.sent(flow)
    if count_first:
        pipe.amend(flow, counted)
        assert s.pending_prefill_tokens == 100 * 16 + 412 and flow.decision.ticket.new_prefill == 100 * 16 + 412
        assert cluster.index.match(counted.blocks)[inst] == 125
    assert sink.rows == ([("decision", "r1", 2_012, 1_900, 2_012)] if count_first else [])
    now[0] = 1.0
    pipe.first_token(flow)
    pipe.finish(flow, OK, output_tokens=2)
    if not count_first:
        assert sink.rows == []  # held until the count: the rows say the counted size
        pipe.amend(flow, counted)
        assert cluster.index.match(counted.blocks)[inst] == 125
    assert sink.rows == [("decision", "r1", 2_012, 1_900, 2_012), ("outcome", "r1", OK)]
    assert flow.request.request_id == "r1" and flow.request.input_tokens == 2_012  # the id that went upstream
    assert pipe.idle() and cluster.counters_zero()
    assert s.input_tokens_total == 2_012 and cluster.sessions["sess"].total_input_tokens == 2_012
    pipe.amend(flow, counted)  # once per request
    assert len(sink.rows) == 2 and s.input_tokens_total == 2_012


def test_a_count_that_fails_keeps_the_estimate_and_loses_no_row():
    pipe, sink, cluster, _ = _pipe()
    flow = pipe.receive(_req("r2", 1_000, list(range(50)), estimate=200))
    flow.request.counting = object()
    pipe.route(flow)
    pipe.sent(flow)
    pipe.finish(flow, OK, output_tokens=1)
    pipe.amend(flow, None)
    assert sink.rows == [("decision", "r2", 1_000, 1_000, 1_000), ("outcome", "r2", OK)]
    assert cluster.counters_zero()


@pytest.mark.parametrize("api,policy", [("chat", "leastwork"), ("messages", "leastwork"), ("messages", "unified"),
                                        ("responses", "unified")])
async def test_router_routes_returning_turns_early_and_records_the_count(router_client, fake_backends,
                                                                         tmp_path, tok, tok_dir,  # noqa: F811
                                                                         api, policy):
    from router import parsing
    from router.apis import APIS

    fakes = await fake_backends(2)
    client, state = await start_router(router_client, [u for _, u in fakes], tmp_path, policy=policy,
                                       tokenizer=str(tok_dir), block_size=16)
    raws = _session_raws(4, chars=150_000, api=api)
    assert all(len(r) > parsing.TOKENIZE_PROCESS_BYTES for r in raws)  # the worker's path
    insts = []
    for raw in raws:
        r = await client.post(APIS[api].path, data=raw, headers={"Content-Type": "application/json"})
        assert r.status == 200, await r.text()
        await r.read()
        insts.append(r.headers["X-Kvtop-Instance"])
    for _ in range(200):  # the last count may land after the last answer
        if state.pipeline.idle() and len(rows(state, "outcomes")) == 4:
            break
        await asyncio.sleep(0.02)
    decisions = rows(state, "decisions")
    want = [len(tok.encode(tok.render(parsing.read_body(json.loads(r), api).prompt))) for r in raws]
    assert [d["input_tokens"] for d in decisions] == want
    assert {d["token_source"] for d in decisions} == {"tokenizer"}
    assert decisions[0]["estimated_input_tokens"] is None  # cold: counted before it was routed
    for d, w in zip(decisions[1:], want[1:]):
        est = d["estimated_input_tokens"]
        assert est is not None and abs(est - w) < 0.05 * w
        assert d["new_prefill_tokens"] == max(0, w - d["est_hit_tokens"])
    assert len({d["session_id"] for d in decisions}) == 1  # one session, from the body
    assert len(set(insts[1:])) == 1 and state.cluster.counters_zero()
    s = state.cluster.instances
    assert sum(i.input_tokens_total for i in s) == sum(want)


def test_prefix_index_extend_is_the_two_inserts_in_one_walk():
    from router.prefix_index import PrefixIndex

    def fresh():
        idx = PrefixIndex(2, 100, 16)
        idx.insert(0, list(range(1000, 1070)), "old")
        idx.flush()
        return idx

    prefix = list(range(30))
    full = prefix + list(range(500, 520))
    a, b = fresh(), fresh()
    a.insert(0, prefix, "s")
    a.extend(0, full, "s")  # still pending: one walk
    assert a._pending == (0, full, "s")
    b.insert(0, prefix, "s")
    b.flush()
    b.insert(0, full, "s")
    for probe in (full, list(range(1000, 1070))):
        assert a.match(probe) == b.match(probe)
    assert a.cached_blocks(0) == b.cached_blocks(0) == 100 and a.evictions == b.evictions == [20, 0]
    c = fresh()
    c.insert(1, prefix, "s")
    c.extend(0, full, "s")  # the pending insert is another instance's: both apply
    assert c.match(full) == [50, 30]
