"""The truth audit, small (benchmarks/truth_audit.py at 2 turns): kvtop's figures held against
the simulated engines' own account of every request, Claude Code and Codex shapes included."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "truth_audit.py"


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    import asyncio

    spec = importlib.util.spec_from_file_location("_truth_audit", BENCH)
    ta = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = ta  # its dataclasses look their module up
    spec.loader.exec_module(ta)
    a = asyncio.run(ta.audit(2, tmp=str(tmp_path_factory.mktemp("truth"))))
    return ta, a


def _pairs(a):
    return [(s, a["truth"][s.request_id], a["outcomes"][s.request_id], a["decisions"][s.request_id])
            for s in a["sent"] if s.status == 200]


def test_every_request_has_a_decision_an_outcome_and_an_engine_record(audited):
    _, a = audited
    shapes = {s.shape for s in a["sent"]}
    assert shapes >= {"claude_code", "claude_code_resume", "codex_60_tools", "chat", "completions_text",
                      "completions_ids"}
    assert all(s.status == 200 for s in a["sent"])
    assert all(s.request_id in a["truth"] and s.request_id in a["outcomes"] and s.request_id in a["decisions"]
               for s in a["sent"])


def test_outcome_usage_equals_the_engines_for_every_request_codex_with_60_tools_included(audited):
    _, a = audited
    pairs = _pairs(a)
    assert [(o["output_tokens"], o["delivered_hit_tokens"]) for _, _, o, _ in pairs] == [
        (t["output_tokens"], t["cached_tokens"]) for _, t, _, _ in pairs]
    codex = [t for s, t, _, _ in pairs if s.shape == "codex_60_tools"]
    assert codex and any(t["cached_tokens"] > 0 for t in codex)  # a later turn hit, and it was recorded


def test_counts_agree_across_state_metrics_rows_and_log_summary(audited):
    ta, a = audited
    rows = {r[0]: r for r in ta.compare(a)}
    for figure, row in rows.items():
        if figure.startswith(("requests routed:", "ok outcomes:", "errors:", "in flight after the run:")):
            assert row[3] == "equal", row
    delivered = sum(t["cached_tokens"] for _, t, _, _ in _pairs(a))
    assert a["state"]["hit_tokens"]["delivered"] == delivered
    # the report's APC is the engines' counted share of prompt tokens (token-weighted, and
    # including the prefills after the segment's last decision): it was the time mean, +60%
    apc = rows["kvtop report --db: APC (cached share of prompt tokens)"]
    assert abs(float(apc[1]) - float(apc[2])) <= 0.01, apc


def test_token_id_prompts_are_exact_and_estimated_hits_match_the_engine(audited):
    _, a = audited
    ids = [(d, t) for s, t, _, d in _pairs(a) if s.shape == "completions_ids"]
    assert ids and all(d["index_source"] == "exact" for d, _ in ids)
    assert all(d["est_hit_tokens"] == t["cached_tokens"] and d["input_tokens"] == t["prompt_tokens"]
               for d, t in ids)


def test_logged_ttft_never_precedes_what_the_client_saw(audited):
    """The router's clock starts when it has the request and stops at the first token it
    passes on: it cannot be later than the client's (an offset or unit bug would be)."""
    _, a = audited
    for s, _, o, _ in _pairs(a):
        if o["stream"] and o["ttft_ms"] is not None:
            assert o["ttft_ms"] <= s.ttft_s * 1000 + 1.0, (s.shape, o["ttft_ms"], s.ttft_s)


def test_the_table_prints_and_text_shapes_are_exact_with_the_simulators_tokenizer(audited):
    """--tokenizer kvtop-sim: Claude Code, Codex, chat and text completions are counted as the
    engine counts them, every decision is exact, and the estimated hits are the engine's cached
    tokens within 1% of prompt tokens over the run."""
    ta, a = audited
    table = ta.format_table(ta.compare(a))
    assert "| figure" in table and "Codex with 60 tools" in table
    pairs = _pairs(a)
    assert all(d["index_source"] == "exact" and d["token_source"] != "text_approx" for _, _, _, d in pairs)
    assert all(d["input_tokens"] == t["prompt_tokens"] for _, t, _, d in pairs)
    text = [(t, d) for s, t, _, d in pairs if s.shape != "completions_ids"]
    off = sum(abs(d["est_hit_tokens"] - t["cached_tokens"]) for t, d in text)
    assert off <= 0.01 * sum(t["prompt_tokens"] for t, _ in text)
    assert not a["state"]["router"]["token_warning"]
