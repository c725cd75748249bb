"""Trace tools: converters on the real public traces, session derivation against the WEKA
truth, build/cap/stats, token synthesis, the loader's error reporting, the bundled sample."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kvtop.cli import CliError, main
from kvtop.traces import sample_trace_path
from kvtop.traces.build import build_stream, cap_turns
from kvtop.traces.convert import (WEKA_NAMESPACE, CapReport, cap_input, convert_azure,
                                  convert_mooncake, convert_weka)
from kvtop.traces.loader import TraceRequest, load_trace, read_header, write_trace
from kvtop.traces.sessions import derive_sessions, score_derivation
from kvtop.traces.stats import percentile, prefix_ceiling, trace_stats
from kvtop.traces.synth import tokens_for_request

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
WEKA = TRACES / "weka_claude_code"
MOONCAKE = TRACES / "mooncake_fast25" / "conversation_trace.jsonl"
AZURE = TRACES / "azure_llm_2023"

needs_traces = pytest.mark.skipif(not TRACES.is_dir(), reason=f"real traces not found at {TRACES}")


def req(session: str, turn: int, arrival: float, n_in: int, ids: list[int], *, n_out: int = 10,
        bs: int = 64, parent: str | None = None) -> TraceRequest:
    return TraceRequest(arrival, session, turn, n_in, n_out, ids, bs, None, parent, "test")


# ------------------------------------------------------------------ converters, real files

@pytest.fixture(scope="module")
def mooncake() -> list[TraceRequest]:
    if not MOONCAKE.exists():
        pytest.skip(f"{MOONCAKE} not found")
    return convert_mooncake([MOONCAKE])


@needs_traces
def test_weka_session_with_subagents():
    # trace_0003 has sub-agents: each becomes its own session under the parent, offset by spawn t.
    path = WEKA / "trace_0003.json.gz"
    doc = json.load(gzip.open(path))
    reqs = convert_weka([path])
    subagents = [e for e in doc["requests"] if e.get("type") == "subagent"]
    n_parent = len(doc["requests"]) - len(subagents)
    assert len(reqs) == n_parent + sum(len(s["requests"]) for s in subagents)
    parent = [r for r in reqs if r.parent is None]
    assert {r.session for r in parent} == {"weka-0003"} and len(parent) == n_parent
    first = subagents[0]
    child = [r for r in reqs if r.session == f"weka-0003/{first['agent_id']}"]
    assert all(r.parent == "weka-0003" for r in child)
    assert child[0].arrival == pytest.approx(first["t"] + first["requests"][0]["t"])
    assert [r.turn for r in child] == list(range(1, len(child) + 1))
    assert [r.turn for r in parent] == list(range(1, n_parent + 1))
    assert all(h // WEKA_NAMESPACE == 3 for r in reqs for h in r.hash_ids)  # file 0003's space
    assert all(len(r.hash_ids) == r.input_tokens // 64 for r in reqs)  # full blocks only
    assert [r.arrival for r in reqs] == sorted(r.arrival for r in reqs)
    plain = [e for e in doc["requests"] if e.get("type") != "subagent"]
    assert [r.think_time for r in parent] == [e.get("think_time") for e in plain]


@needs_traces
def test_weka_namespaces_keep_files_apart():
    # Local ids restart at 1 in every file; namespaced, two files share no id.
    a, b = convert_weka([WEKA / "trace_0001.json.gz"]), convert_weka([WEKA / "trace_0002.json.gz"])
    assert not {h for r in a for h in r.hash_ids} & {h for r in b for h in r.hash_ids}
    assert prefix_ceiling(a + b)[0] == pytest.approx(
        (prefix_ceiling(a)[0] * sum(len(r.hash_ids) for r in a)
         + prefix_ceiling(b)[0] * sum(len(r.hash_ids) for r in b))
        / sum(len(r.hash_ids) for r in a + b))


def test_mooncake_matches_readme_figures(mooncake):
    # README: 12,031 requests, 7,862 derived chains, ceiling 0.366 blocks / 0.374 tokens.
    assert len(mooncake) == 12031
    assert len({r.session for r in mooncake}) == 7862
    blocks, tokens = prefix_ceiling(mooncake)
    assert blocks == pytest.approx(0.366, abs=0.001)
    assert tokens == pytest.approx(0.374, abs=0.001)
    s = trace_stats(mooncake)
    assert s["rate_rps"] == pytest.approx(3.40, abs=0.01)
    assert s["input_tokens"]["p50"] == 6909
    assert all(r.block_size == 512 and r.think_time is None for r in mooncake)


@needs_traces
@pytest.mark.parametrize("name,count,rate", [
    ("AzureLLMInferenceTrace_code.csv", 8819, 2.57),   # README table
    ("AzureLLMInferenceTrace_conv.csv", 19366, 5.53),
])
def test_azure_one_request_per_session(name, count, rate):
    reqs = convert_azure([AZURE / name])
    assert len(reqs) == count
    assert len({r.session for r in reqs}) == count
    assert all(r.hash_ids == [] and r.turn == 1 for r in reqs)
    assert reqs[0].arrival == 0.0
    assert trace_stats(reqs)["rate_rps"] == pytest.approx(rate, abs=0.01)


@pytest.mark.parametrize("drop,expect_len,capped,dropped", [
    (False, 3, 1, 0),  # over the cap: truncated to it, hash_ids cut to whole blocks
    (True, 2, 0, 1),   # over the cap: dropped
])
def test_cap_input(drop, expect_len, capped, dropped):
    reqs = [req("a", 1, 0, 100, [1]), req("a", 2, 1, 1000, list(range(15))),
            req("b", 1, 2, 640, list(range(10)))]
    report = CapReport()
    out = cap_input(reqs, 640, drop=drop, report=report)
    assert (len(out), report.capped, report.dropped) == (expect_len, capped, dropped)
    if not drop:
        assert out[1].input_tokens == 640 and out[1].hash_ids == list(range(10))


@needs_traces
def test_cli_convert_reports_cut_requests(tmp_path, capsys):
    out = tmp_path / "w.jsonl"
    assert main(["trace", "convert", str(WEKA / "trace_0004.json.gz"), "--format", "weka",
                 "--max-input", "150000", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    reqs = load_trace(out)
    header = read_header(out)
    assert max(r.input_tokens for r in reqs) == 150000
    assert header["capped"] > 0 and f"{header['capped']} of {len(reqs)} requests truncated" in err
    assert main(["trace", "stats", str(out), "--format", "json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["requests"] == len(reqs)


@pytest.mark.parametrize("content", [
    "",                          # empty file
    "not json\n",               # nothing parses: the usual sign of a wrong --format
])
def test_cli_convert_with_no_requests_is_an_error(tmp_path, capsys, content):
    src, out = tmp_path / "m.jsonl", tmp_path / "o.jsonl"
    src.write_text(content)
    assert main(["trace", "convert", str(src), "--format", "mooncake", "--out", str(out)]) == 2
    assert "no mooncake requests" in capsys.readouterr().err
    assert not out.exists()


# ------------------------------------------------------------------ session derivation

@needs_traces
def test_derived_sessions_match_weka_truth():
    # README method: namespace per file, interleave every session by t, derive, score.
    files = sorted(WEKA.glob("trace_*.json.gz"))[:20]
    reqs = convert_weka(files)
    links = derive_sessions([r.hash_ids for r in reqs], 64)
    score = score_derivation([r.session for r in reqs], [ln.session for ln in links])
    assert score.purity >= 0.95
    assert score.split_rate <= 0.15
    # The strict-only rule splits far more streams (compaction breaks the chain).
    strict = derive_sessions([r.hash_ids for r in reqs], 64, min_ratio=1.0, hub_min_tokens=10**12)
    assert score_derivation([r.session for r in reqs],
                            [ln.session for ln in strict]).split_rate > 2 * score.split_rate


@pytest.mark.parametrize("chains,expect_sessions,why", [
    ([[1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4, 5]], [0, 0, 0], "each turn extends the last"),
    ([[1, 2, 3], [1, 9, 10]], [0, 1], "only the shared system block: new session"),
    ([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7]], [0, 0], "extends >= half of the parent (an edit)"),
    ([[1, 2], [1, 2, 3], [1, 2, 4]], [0, 0, 0], "branching follow-ups join"),
    ([[5] + list(range(100, 500)), [5] + list(range(100, 230)) + [999]], [0, 0],
     "131 blocks (8,384 tokens) of a 401-block context: a compaction, still joined"),
    ([[5] + list(range(100, 500)), [5] + list(range(100, 220)) + [999]], [0, 1],
     "121 blocks (7,744 tokens), under half the parent and under 8k: new session"),
])
def test_derive_sessions_rules(chains, expect_sessions, why):
    links = derive_sessions(chains, 64)
    assert [ln.session for ln in links] == expect_sessions, why


@pytest.mark.parametrize("hub_max_sessions,joins", [
    (2, True),   # a 10k-token prefix only one session has used: private, the request joins
    (0, False),  # the same node counted as a hub: refused, a new session starts
])
def test_long_prefix_rule_refuses_hubs(hub_max_sessions, joins):
    prefix = list(range(160))  # 160 x 64 = 10,240 tokens, under half of the parent's 561 blocks
    chains = [prefix + list(range(1000, 1401)), prefix + [9999]]
    links = derive_sessions(chains, 64, hub_max_sessions=hub_max_sessions)
    assert (links[1].parent == 0) is joins


def test_score_derivation_arithmetic():
    s = score_derivation(["a", "a", "a", "b", "b"], [1, 1, 2, 2, 2])
    assert s.purity == pytest.approx(4 / 5)   # derived 2 holds a,b,b: majority 2; derived 1: 2
    assert s.split_rate == pytest.approx(1 / 2)  # "a" is spread over 1 and 2; "b" is not


# ------------------------------------------------------------------ token synthesis

def test_synth_shared_ids_share_tokens():
    a = req("s", 1, 0, 64 * 3 + 10, [11, 12, 13])
    b = req("s", 2, 1, 64 * 4 + 5, [11, 12, 13, 14])
    c = req("t", 1, 1, 64 * 3, [21, 12, 13])  # same later ids after a different first id
    ta, tb = tokens_for_request(a, request_salt="a"), tokens_for_request(b, request_salt="b")
    tc = tokens_for_request(c, request_salt="c")
    assert (len(ta), len(tb), len(tc)) == (a.input_tokens, b.input_tokens, c.input_tokens)
    assert ta[:192] == tb[:192]           # same ids -> same tokens
    assert ta[192:] != tb[192:202]        # a's tail differs from b's block 14
    assert tc[:64] != ta[:64]             # different id -> different block
    assert tokens_for_request(a, request_salt="a") == ta  # deterministic


def test_synth_tails_differ_by_salt_and_fit_vocab():
    r = req("s", 1, 0, 64 + 50, [7])
    x, y = tokens_for_request(r, request_salt=1), tokens_for_request(r, request_salt=2)
    assert x[:64] == y[:64] and x[64:] != y[64:]
    small = tokens_for_request(r, vocab_size=1000, request_salt=1)
    assert all(0 <= t < 1000 for t in small) and len(small) == 114
    assert all(0 <= t < 32000 for t in x)


def test_synth_partial_last_block_is_cut():
    # Mooncake lists ceil(input/512) ids: the last block is partial and cut to fit.
    r = req("m", 1, 0, 600, [1, 2], bs=512)
    toks = tokens_for_request(r, request_salt=0)
    full = tokens_for_request(req("m", 1, 0, 1024, [1, 2], bs=512), request_salt=0)
    assert len(toks) == 600 and toks == full[:600]


def test_synth_200k_tokens_is_fast():
    import time

    r = req("s", 1, 0, 200_000, list(range(7 * 10**9, 7 * 10**9 + 3125)))
    tokens_for_request(r, request_salt=0)           # first time draws every block
    t0 = time.perf_counter()
    out = tokens_for_request(r, request_salt=1)     # next turn: blocks cached
    assert len(out) == 200_000
    assert time.perf_counter() - t0 < 0.05


# ------------------------------------------------------------------ cap and build

def test_cap_turns_keeps_first_turns_and_spawned_subagents():
    reqs = [req("p", k, float(k), 100, []) for k in range(1, 6)]
    reqs += [req("p/a", 1, 1.5, 50, [], parent="p"), req("p/a", 2, 1.7, 50, [], parent="p"),
             req("p/b", 1, 4.5, 50, [], parent="p")]  # spawned after turn 4: dropped at 2 turns
    out = cap_turns(reqs, 2)
    assert [(r.session, r.turn) for r in out] == [("p", 1), ("p/a", 1), ("p/a", 2), ("p", 2)]


def _two_inputs() -> list[list[TraceRequest]]:
    # Both inputs use ids 1..3 locally: they must not collide after building.
    a = [req(f"a{k}", t, 10.0 * t, 200, [1, 2, 3][: t + 1]) for k in range(5) for t in (1, 2)]
    b = [req(f"b{k}", t, 5.0 * t, 200, [1, 2, 3][: t + 1]) for k in range(5) for t in (1, 2)]
    return [sorted(a, key=lambda r: r.arrival), sorted(b, key=lambda r: r.arrival)]


def test_build_seeded_and_namespaced():
    one = build_stream(_two_inputs(), sessions=6, window=100, seed=3).requests
    same = build_stream(_two_inputs(), sessions=6, window=100, seed=3).requests
    other = build_stream(_two_inputs(), sessions=6, window=100, seed=4).requests
    assert one == same and one != other
    assert len({r.session for r in one}) == 6
    assert [r.arrival for r in one] == sorted(r.arrival for r in one)
    ids = {r.session[0]: set() for r in one}
    for r in one:
        ids[r.session[0]].update(r.hash_ids)
    assert not ids.get("a", set()) & ids.get("b", set())
    for name in {r.session for r in one}:  # internal gaps kept, turns renumbered
        turns = [r for r in one if r.session == name]
        assert [r.turn for r in turns] == [1, 2]
        gap = turns[1].arrival - turns[0].arrival
        assert gap == pytest.approx(10.0 if name.startswith("a") else 5.0)


def test_build_stagger_rate_and_shared_prefix():
    staggered = build_stream(_two_inputs(), sessions=4, stagger=30.0).requests
    firsts = sorted({r.session: r.arrival for r in reversed(staggered)}.values())
    assert firsts == [0.0, 30.0, 60.0, 90.0]
    dense = build_stream(_two_inputs(), rate=0.1, window=60.0, seed=1)
    in_window = [r for r in dense.requests if r.arrival < 60.0]
    assert len(in_window) / 60.0 >= 0.1
    shared = build_stream(_two_inputs(), sessions=10, window=10, shared_prefix_tokens=128).requests
    assert len({tuple(r.hash_ids[:2]) for r in shared}) == 1  # first 2 blocks shared by all
    assert "assumption" in build_stream(_two_inputs(), shared_prefix_tokens=64).header
    copies = build_stream(_two_inputs(), sessions=15, window=10).requests  # 10 sessions: cycles
    assert len({r.session for r in copies}) == 15
    assert len({h for r in copies for h in r.hash_ids}) > len({h for r in shared for h in r.hash_ids})


@pytest.mark.parametrize("think, max_gap, expected", [
    (1200.0, 20.0, 20.0),  # a 20-minute think: closed-loop replay would wait all of it
    (5.0, 20.0, 5.0),      # below the cap: kept
    (None, 20.0, None),    # no think time in the source: stays unknown, not 0
    (1200.0, None, 1200.0),  # no --max-gap: untouched
])
def test_build_max_gap_clamps_think_time_like_the_arrival_gap(think, max_gap, expected):
    first = req("s", 1, 0.0, 100, [1])
    second = TraceRequest(1200.0, "s", 2, 100, 10, [1, 2], 64, think, None, "test")
    built = build_stream([[first, second]], sessions=1, stagger=0.0, max_gap=max_gap).requests
    assert built[1].think_time == expected
    assert built[1].arrival - built[0].arrival == (1200.0 if max_gap is None else max_gap)


# ------------------------------------------------------------------ stats arithmetic

def test_stats_on_hand_made_trace():
    reqs = [
        req("s", 1, 0.0, 1000, [1, 2]),          # WARM; 2 new blocks
        req("s", 2, 5.0, 6000, [1, 2, 3]),       # MEDIUM; 2 hits
        req("t", 1, 10.0, 30000, [9, 2, 3]),     # HEAVY; 0 hits (different first block)
        req("t", 2, 20.0, 250000, [9, 2, 3, 4]),  # HEAVY+; 3 hits
    ]
    s = trace_stats(reqs)
    assert (s["requests"], s["sessions"]) == (4, 2)
    assert s["class_counts"] == {"WARM": 1, "MEDIUM": 1, "HEAVY": 1, "HEAVY+": 1}
    assert s["share_input_at_least"] == {"20000": 0.5, "50000": 0.25, "100000": 0.25,
                                         "200000": 0.25}
    assert s["rate_rps"] == pytest.approx(4 / 20)
    assert s["prefix_ceiling_blocks"] == pytest.approx(5 / 12)
    assert s["prefix_ceiling_tokens"] == pytest.approx((128 + 192) / 287000)
    assert s["input_tokens"]["p50"] == pytest.approx(18000)  # between 6000 and 30000
    assert s["turns_per_session"] == {"p50": 2, "p90": 2, "max": 2}


@pytest.mark.parametrize("values,q,expect", [
    ([1, 2, 3, 4], 50, 2.5), ([1, 2, 3, 4], 90, 3.7), ([5], 99, 5), ([3, 1, 2], 0, 1),
])
def test_percentile_linear(values, q, expect):
    assert percentile(values, q) == pytest.approx(expect)


# ------------------------------------------------------------------ loader errors

def _write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_malformed_line_skip_and_fail(tmp_path, capsys):
    good = req("s", 1, 0.0, 100, [1]).to_json()
    path = _write_lines(tmp_path / "t.jsonl", ['{"kvtop_trace": 1}', good, "{not json",
                                               '{"arrival": 1}', good])
    assert len(load_trace(path)) == 2
    err = capsys.readouterr().err
    assert "t.jsonl:3:" in err and "t.jsonl:4:" in err and "missing field" in err
    with pytest.raises(CliError, match=r"t\.jsonl:3: malformed"):
        load_trace(path, on_error="fail")
    assert main(["trace", "stats", str(path), "--on-error", "fail"]) == 2
    assert capsys.readouterr().err.count("\n") == 1  # one line


def test_lines_are_read_one_by_one_and_a_bad_one_is_named(tmp_path, capsys):
    # a line that is not UTF-8 is one malformed line with its number, not an unreadable file;
    # an id past 64 bits (orjson reads it as a float) is refused as not an integer
    good = req("s", 1, 0.0, 100, [1]).to_json()
    big = req("s", 2, 1.0, 100, [2 ** 70]).to_json()
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\n".join([good.encode(), big.encode(), b'{"session": "\xff"}', good.encode()])
                     + b"\n")
    assert [r.hash_ids for r in load_trace(path)] == [[1], [1]]
    err = capsys.readouterr().err
    assert "t.jsonl:2: malformed trace line: hash_ids must be a list of integers" in err
    assert "t.jsonl:3: malformed trace line" in err


def test_missing_file(tmp_path, capsys):
    with pytest.raises(CliError, match="trace file not found"):
        load_trace(tmp_path / "nope.jsonl")
    assert main(["trace", "stats", str(tmp_path / "nope.jsonl")]) == 2
    assert "trace file not found" in capsys.readouterr().err


def test_write_and_load_roundtrip_gz(tmp_path):
    reqs = [req("s", 1, 0.0, 100, [1]), req("s", 2, 1.5, 200, [1, 2])]
    path = tmp_path / "t.jsonl.gz"
    assert write_trace(path, reqs, header={"note": "x"}) == 2
    assert load_trace(path) == reqs and read_header(path)["note"] == "x"


# ------------------------------------------------------------------ bundled sample

def test_sample_trace_is_small_and_valid():
    path = sample_trace_path()
    assert path.exists() and path.stat().st_size < 1_000_000
    reqs = load_trace(path, on_error="fail")
    assert 150 <= len(reqs) <= 400
    assert {r.source for r in reqs} == {"weka", "mooncake"}
    assert max(r.input_tokens for r in reqs) <= 60_000
    assert [r.arrival for r in reqs] == sorted(r.arrival for r in reqs)
    assert (Path(str(path)).parent / "ATTRIBUTION.md").exists()


def test_cap_of_an_empty_trace_is_a_one_line_error(tmp_path, capsys):
    from kvtop.cli import main

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["trace", "cap", str(empty), "--max-turns", "8", "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "no requests" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()
