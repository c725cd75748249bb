

def test_outcome_row_repeats_the_decision_row_and_fits_the_schema():
    """Outcome.row copies OUTCOME_DECISION_COLUMNS from its decision, with the decision row's
    values, and every key it writes is an ``outcomes`` column."""
    from router.blocks import hash_token_blocks
    from router.cluster import Cluster
    from router.core import RoutingCore
    from router.policies import build_policy
    from router.request import RouteRequest
    from router.pipeline import Outcome
    from store.schema import OUTCOME_DECISION_COLUMNS, TABLES

    core = RoutingCore(Cluster(["a", "b"], block_size=16, capacity_blocks=100), build_policy("unified", {}))
    toks = list(range(100))
    req = RouteRequest("r1", "s1", "header", len(toks), hash_token_blocks(toks, 16), "tokens",
                       "completions", False, 10)
    d = core.route(req)
    d.extra["route_class"] = "HEAVY_COLO"
    row = d.row("run")
    out = Outcome(status="ok", stream=0, t_recv=1.0, t_done=2.0, ttft_ms=500.0, e2e_ms=1000.0).row(d, "run")
    assert {c: out[c] for c in OUTCOME_DECISION_COLUMNS} == {c: row[c] for c in OUTCOME_DECISION_COLUMNS}
    assert set(out) <= set(TABLES["outcomes"]), set(out) - set(TABLES["outcomes"])


def test_stream_scan_holds_bounded_bytes_and_finds_the_final_usage():
    """Thousands of token events: the scan holds a few bytes and usage/[DONE] are still found."""
    from router.forward import _TAIL_BYTES, _USAGE_MAX_BYTES, StreamScan

    scan = StreamScan()
    ev = b'data: {"choices":[{"index":0,"text":"tok"}]}\n\n'
    assert scan.feed(ev)  # the first token
    for _ in range(5000):
        assert not scan.feed(ev)
    scan.feed(b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":5001}}\n\n')
    scan.feed(b"data: [DONE]\n\n")
    assert scan.held_bytes <= 2 * _TAIL_BYTES
    assert scan.usage() == {"prompt_tokens": 9, "completion_tokens": 5001}
    assert scan.saw_done and scan.data_events == 5002
    big = StreamScan()
    big.feed(b"data: " + b"x" * 100_000 + b"\n\n")
    big.feed(b"data: [DONE]\n\n")
    assert big.held_bytes <= 2 * _TAIL_BYTES + _USAGE_MAX_BYTES and big.saw_done
