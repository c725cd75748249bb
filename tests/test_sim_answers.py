"""Where a simulated answer ends (kvtop/sim/answers.py, and the engine's ``stop_at``): lengths
drawn from the bundled trace, seeded by the prompt; ignore_eos; stop strings; tool calls in
each API's shape, bounded rounds; the engine's natural stop."""

from __future__ import annotations

import statistics
import subprocess
import sys

import pytest

from kvtop.sim.answers import MAX_TOOL_ROUNDS, OutputLengths, OutputLengthsError, _placeholder, plan
from kvtop.sim.engine import Engine, EngineRequest
from kvtop.sim.tokenizer import filler_text

TOOLS = [{"type": "function", "function": {"name": "Bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
    "required": ["command"]}}}]


def test_lengths_follow_the_bundled_trace_and_the_prompt_decides():
    lengths = OutputLengths("sample", seed=0)
    drawn = [lengths.draw(f"prompt {i}") for i in range(2000)]
    # the bundled sample's output lengths: 304 requests, median 250, from 3 to 5698 tokens
    assert 150 < statistics.median(drawn) < 350 and min(drawn) >= 3 and max(drawn) <= 5698
    assert set(drawn) <= set(lengths.lengths)
    assert [lengths.draw("same") for _ in range(5)] == [lengths.draw("same")] * 5  # temperature 0
    assert OutputLengths("sample", seed=1).draw("prompt 7") != lengths.draw("prompt 7") or \
        OutputLengths("sample", seed=1).draw("prompt 8") != lengths.draw("prompt 8")
    assert OutputLengths("42").draw("x") == 42


@pytest.mark.parametrize("spec", ["0", "nope.jsonl", "-3"])
def test_bad_output_len_is_refused(spec):
    with pytest.raises(OutputLengthsError):
        OutputLengths(spec)


def test_kvtop_sim_refuses_a_bad_output_len_in_one_line():
    r = subprocess.run([sys.executable, "-m", "kvtop", "sim", "--output-len", "nope.jsonl", "--duration", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--output-len nope.jsonl" in r.stderr and "Traceback" not in r.stderr


def test_natural_stop_max_tokens_and_ignore_eos():
    lengths = OutputLengths("100")
    tokens = list(range(50))
    assert plan(lengths, tokens, 500).stop_at == 100           # ends by itself
    assert plan(lengths, tokens, 60).stop_at is None           # the cap comes first: length
    assert plan(lengths, tokens, 500, ignore_eos=True).stop_at is None  # a replay's exact length
    assert plan(None, tokens, 500).stop_at is None             # no distribution: the old fixed answers


def test_stop_string_ends_the_answer_before_it():
    a = plan(OutputLengths("100"), [1, 2, 3], 500, stop=[" engine", " fake"])
    text = a.text(0, a.stop_at)
    assert a.stop_string == " fake" and text == filler_text(0, 4) and text + " fake" == filler_text(0, 5)
    assert a.stop_at == 5  # the token that completes the stop string is generated, not shown
    assert plan(OutputLengths("100"), [1], 500, stop=["never there"]).stop_at == 100


def test_tool_calls_bounded_rounds_and_tool_choice():
    lengths = OutputLengths("60")
    called = [plan(lengths, [i], 500, tools=TOOLS, messages=[{"role": "user", "content": "go"}]).tool_call
              for i in range(200)]
    share = sum(c is not None for c in called) / len(called)
    assert 0.35 < share < 0.65  # TOOL_CALL_P = 0.5
    call = next(c for c in called if c is not None)
    assert call.name == "Bash" and call.arguments == '{"command":"kvtop-sim"}'
    # after MAX_TOOL_ROUNDS calls since the user spoke, the model answers
    loop = [{"role": "user", "content": "go"}]
    for k in range(MAX_TOOL_ROUNDS):
        loop += [{"role": "assistant", "content": "", "tool_calls": [{"id": str(k), "type": "function",
                                                                       "function": {"name": "Bash", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": str(k), "content": "out"}]
    assert all(plan(lengths, [i], 500, tools=TOOLS, messages=loop).tool_call is None for i in range(50))
    # required / any / a named tool: always; none: never; the cap still ends the answer first
    for choice in ("required", "any", {"type": "any"}, {"type": "tool", "name": "Bash"},
                   {"type": "function", "function": {"name": "Bash"}}):
        assert plan(lengths, [1], 500, tools=TOOLS, tool_choice=choice, messages=loop).tool_call is not None
    assert all(plan(lengths, [i], 500, tools=TOOLS, tool_choice="none").tool_call is None for i in range(50))
    assert plan(lengths, [1], 30, tools=TOOLS, tool_choice="required").tool_call is None


@pytest.mark.parametrize("schema, value", [
    ({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a"]},
     {"a": "kvtop-sim"}),                                            # only required fields
    ({"type": "string", "enum": ["low", "high"]}, "low"),           # an enum's first value
    ({"type": "integer", "minimum": 5}, 5),
    ({"type": "array", "items": {"type": "string"}, "minItems": 1}, ["kvtop-sim"]),
    ({"type": ["null", "boolean"]}, False),
    ({"anyOf": [{"type": "number"}, {"type": "string"}]}, 1),
])
def test_placeholder_arguments_satisfy_the_schema(schema, value):
    assert _placeholder(schema, 0) == value


def test_engine_stop_at_is_a_natural_stop():
    e = Engine("h20")
    e.add_request(EngineRequest("a", 64, [], 100, 0.0, stop_at=7))
    e.add_request(EngineRequest("b", 64, [], 5, 0.0, stop_at=7))   # the cap first: length
    t, done = 0.0, {}
    while e.has_work():
        res = e.step(t)
        t = res.end_time if not res.idle else (e.next_event_time() or t)
        done.update({f.request_id: f for f in res.finished})
    assert (done["a"].finish_reason, done["a"].num_output_tokens) == ("stop", 7)
    assert (done["b"].finish_reason, done["b"].num_output_tokens) == ("length", 5)
    assert e.request_success["stop"] == 1 and e.request_success["length"] == 1


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_replay_asks_every_api_for_the_traces_exact_length(api):
    """kvtop replay sends ignore_eos on every API, so a trace's output length is met exactly on a
    simulator whose answers otherwise end early (vLLM's chat honours it; a server that does not
    know the field ignores it)."""
    from kvtop.replay import agent_body

    body = agent_body(api, list(range(3000)), "s1", 77)
    assert body["ignore_eos"] is True and 77 in (body.get("max_tokens"), body.get("max_output_tokens"))
