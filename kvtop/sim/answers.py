"""What the simulated model answers: how long, how it ends, and whether it calls a tool.

The engine (kvtop/sim/engine.py) only counts tokens; this module decides, before a request is
queued, where its answer ends, as a model's sampling would:

* **Length.** Drawn from a distribution of answer lengths (``OutputLengths``): by default the
  output lengths of the bundled sample trace (real Claude Code and Kimi chat requests,
  kvtop/data/ATTRIBUTION.md), or a trace file's, or a fixed number. The draw is seeded by the
  instance's seed and the prompt itself, so the same prompt gets the same answer (as a model at
  temperature 0 would) whatever else the server is doing. A drawn length under ``max_tokens``
  ends with the natural stop (``stop`` / ``end_turn``); over it, the cap (``length`` /
  ``max_tokens``).
* **``ignore_eos``** (vLLM's sampling parameter, which `kvtop replay` sends so a trace's output
  length is met exactly): no natural end; the answer runs to ``max_tokens``.
* **Stop strings** (``stop`` / ``stop_sequences``): the answer's text is the simulator's filler
  text; where a stop string occurs in it, the answer ends at the token that completes it and its
  text stops before it, as vLLM's detokenizer does.
* **Tool calls.** Where the request offers function tools (and ``tool_choice`` allows it), an
  answer is a tool call with probability ``TOOL_CALL_P``, at most ``MAX_TOOL_ROUNDS`` rounds in a
  row since the user last spoke, so an agent's loop runs a few steps and then ends its turn. The
  call names one of the offered tools (seeded) with placeholder arguments built from its JSON
  schema: each required string is ``"kvtop-sim"`` (an enum's first value), numbers their minimum
  or 1, booleans false, arrays empty. An agent executes them as it would a model's calls: run
  agents against the simulator with their usual permissions or sandbox.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvtop.sim.tokenizer import count_tokens, filler_text

#: Chance that an answer to a request offering tools is a tool call.
TOOL_CALL_P = 0.5
#: Tool-call rounds in a row (since the user's last message) after which the model answers.
MAX_TOOL_ROUNDS = 3
#: The string every required string argument of a simulated tool call gets.
PLACEHOLDER = "kvtop-sim"
#: Pieces of filler text in which any stop string that can ever match has matched (the filler
#: repeats every 17 pieces, each at most 8 characters).
_STOP_SCAN_PIECES = 64


class OutputLengthsError(ValueError):
    """A --output-len that cannot be used."""


class OutputLengths:
    """Answer lengths to draw from, seeded. ``spec``: ``sample`` (the bundled trace's output
    lengths), a positive integer (every answer that long), or the path of a kvtop trace."""

    def __init__(self, spec: str = "sample", seed: int = 0):
        self.spec = spec
        self.seed = seed
        self.lengths = _lengths_of(spec)

    def draw(self, key: str) -> int:
        """The answer length for a prompt identified by ``key``."""
        if len(self.lengths) == 1:
            return self.lengths[0]
        return random.Random(f"{self.seed}:len:{key}").choice(self.lengths)


@lru_cache(maxsize=8)
def _lengths_of(spec: str) -> tuple[int, ...]:
    if spec.isdigit():
        n = int(spec)
        if n < 1:
            raise OutputLengthsError("--output-len must be at least 1 token")
        return (n,)
    from kvtop.traces import load_trace, sample_trace_path

    path = sample_trace_path() if spec == "sample" else Path(spec)
    if not path.is_file():
        raise OutputLengthsError(f"--output-len {spec}: not 'sample', a number, or a trace file")
    try:
        lengths = tuple(int(r.output_tokens) for r in load_trace(path) if int(r.output_tokens) >= 1)
    except (OSError, ValueError, KeyError) as exc:
        raise OutputLengthsError(f"--output-len {spec}: cannot read it as a kvtop trace ({exc})") from None
    if not lengths:
        raise OutputLengthsError(f"--output-len {spec}: the trace has no request with output tokens")
    return lengths


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str   # JSON text
    call_id: str     # toolu_... / call_... (the API shapes it)


@dataclass(frozen=True, slots=True)
class Answer:
    """One planned answer. ``stop_at``: output tokens at its natural end (None: it runs to
    max_tokens); ``text_tokens``: tokens of text before the tool call (all tokens without one);
    ``stop_string``: the stop string that ended it; ``text_end``: characters of text kept."""

    stop_at: int | None
    text_tokens: int
    tool_call: ToolCall | None = None
    stop_string: str | None = None
    text_end: int | None = None

    def text(self, start: int, count: int) -> str:
        """The answer's text for output tokens start .. start+count-1 (none past the text)."""
        count = max(0, min(count, self.text_tokens - start))
        if count <= 0:
            return ""
        piece = filler_text(start, count)
        if self.text_end is not None:
            done = len(filler_text(0, start))
            piece = piece[:max(0, self.text_end - done)]
        return piece

    def finish(self, engine_reason: str | None) -> str:
        """``tool_calls`` | ``stop`` | ``length`` (``abort`` passes through)."""
        if engine_reason == "stop":
            return "tool_calls" if self.tool_call is not None else "stop"
        return engine_reason or "length"


#: What a simulated instance answers when nothing is configured: the engine runs to max_tokens.
RUN_TO_MAX = Answer(stop_at=None, text_tokens=1 << 62)


def _key(tokens: list[int]) -> str:
    return f"{len(tokens)}:{tokens[-64:]}"


def plan(lengths: OutputLengths | None, tokens: list[int], max_tokens: int, *,
         ignore_eos: bool = False, stop: list[str] = (), tools: list[dict] | None = None,
         tool_choice: Any = None, messages: list[dict] | None = None,
         call_prefix: str = "call_") -> Answer:
    """Plan the answer to a prompt (``tokens``) of a request with these parameters. ``tools``
    and ``messages`` in chat shape (router/prompts.py converts Messages and Responses bodies to
    it); ``tool_choice`` as the request gave it."""
    if lengths is None:  # a SimInstance built without a distribution: the old fixed behaviour
        natural = None
    else:
        natural = None if ignore_eos else lengths.draw(_key(tokens))
    limit = max_tokens if natural is None else min(natural, max_tokens)
    call = None
    if natural is not None and natural < max_tokens:
        call = _tool_call(lengths, tokens, tools, tool_choice, messages, call_prefix)
    stop_at = natural if natural is not None and natural < max_tokens or call is not None else None
    text_tokens = limit
    if call is not None:
        # the call's own tokens are part of the answer: the text before it is what is left
        text_tokens = max(0, natural - count_tokens(call.name + call.arguments) - 4)
        stop_at = max(natural, 1)
    stop_string = None
    if stop:
        scan = filler_text(0, min(text_tokens, _STOP_SCAN_PIECES))
        hits = [(scan.find(s), s) for s in stop if s and scan.find(s) >= 0]
        if hits:
            pos, stop_string = min(hits)
            end = pos + len(stop_string)
            done = 0
            for k in range(text_tokens):   # the token that completes the stop string
                done += len(filler_text(k, 1))
                if done >= end:
                    break
            return Answer(stop_at=k + 1 if k + 1 < max_tokens else None, text_tokens=k + 1,
                          stop_string=stop_string, text_end=pos)
    return Answer(stop_at=stop_at, text_tokens=text_tokens, tool_call=call)


def _tool_call(lengths: OutputLengths, tokens: list[int], tools: list[dict] | None, tool_choice: Any,
               messages: list[dict] | None, call_prefix: str) -> ToolCall | None:
    functions = [t.get("function") or {} for t in tools or () if isinstance(t, dict)]
    functions = [f for f in functions if isinstance(f.get("name"), str) and f["name"]]
    if not functions or tool_choice in ("none",) or (isinstance(tool_choice, dict)
                                                      and tool_choice.get("type") == "none"):
        return None
    forced = _forced(tool_choice)
    rng = random.Random(f"{lengths.seed}:tool:{_key(tokens)}")
    if forced is None and (_tool_rounds(messages or ()) >= MAX_TOOL_ROUNDS or rng.random() >= TOOL_CALL_P):
        return None
    if isinstance(forced, str):
        functions = [f for f in functions if f["name"] == forced] or functions
    fn = rng.choice(functions)
    args = _placeholder(fn.get("parameters") or fn.get("input_schema") or {}, 0)
    if not isinstance(args, dict):
        args = {}
    return ToolCall(fn["name"], json.dumps(args, separators=(",", ":")),
                    call_prefix + "%024x" % rng.getrandbits(96))


def _forced(choice: Any) -> str | bool | None:
    """True when any tool must be called, the tool's name when one is named, else None."""
    if choice in ("required", "any"):
        return True
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "any":
            return True
        name = choice.get("name") or (choice.get("function") or {}).get("name")
        if kind in ("tool", "function") and isinstance(name, str):
            return name
    return None


def _tool_rounds(messages) -> int:
    """Assistant tool calls since the user's last message (tool results are not the user)."""
    rounds = 0
    for m in reversed(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            break
        if role == "assistant" and m.get("tool_calls"):
            rounds += 1
    return rounds


def _placeholder(schema: Any, depth: int) -> Any:
    """A value that satisfies the common constraints of a JSON schema (required fields, type,
    enum, minimum), without meaning anything."""
    if not isinstance(schema, dict) or depth > 6:
        return None
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    for combo in ("anyOf", "oneOf", "allOf"):
        options = schema.get(combo)
        if isinstance(options, list) and options:
            return _placeholder(options[0], depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), kind[0] if kind else None)
    if kind == "object" or (kind is None and "properties" in schema):
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = [r for r in schema.get("required") or () if isinstance(r, str)]
        return {name: _placeholder(props.get(name, {}), depth + 1) for name in required}
    if kind == "array":
        n = schema.get("minItems") if type(schema.get("minItems")) is int else 0
        return [_placeholder(schema.get("items", {}), depth + 1) for _ in range(min(n, 4))]
    if kind == "integer":
        lo = schema.get("minimum")
        return int(lo) if isinstance(lo, (int, float)) else 1
    if kind == "number":
        lo = schema.get("minimum")
        return lo if isinstance(lo, (int, float)) else 1
    if kind == "boolean":
        return False
    if kind == "null":
        return None
    return PLACEHOLDER
