"""The simulated vLLM's tokenizer and chat rendering: ``kvtop sim`` serves with it, and the
router counts with it under ``--tokenizer kvtop-sim`` (the route line ``kvtop sim`` prints), so
a text prompt's token ids in the router are the ids the simulated engine hashes into its KV
events and routing on them is exact. It lives here, below both, so that there is one copy.

Text is cut into pieces by one regex: ChatML special tokens, then an optional single space
followed by up to 6 letters, up to 3 digits, or one other non-space character, then runs of
other whitespace. Each piece maps to ``blake2b(piece) mod VOCAB_SIZE``. English prose comes
out at about 4 characters per token, equal texts always give equal ids (across processes and
runs), and a shared text prefix gives a shared id prefix, which is all the prefix cache needs.
Detokenisation is not needed: output text is deterministic filler whose every token is one
piece, so re-tokenising an answer gives back exactly as many tokens as were generated.
"""

from __future__ import annotations

import hashlib
import json
import re
from array import array
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router.request import _common_prefix

#: Qwen3's vocabulary size, so ids look plausible.
VOCAB_SIZE = 151_936

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

_PIECE = re.compile(r"<\|im_start\|>|<\|im_end\|>| ?[^\W\d_]{1,6}| ?\d{1,3}| ?[^\w\s]| ?_|\s+")

_FILLER = (" the", " model", " is", " a", " fake", " engine", " and", " this", " text",
           " fills", " its", " output", " with", " tokens", " on", " demand", ".")


def _hash_piece(piece: str) -> int:
    digest = hashlib.blake2b(piece.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % VOCAB_SIZE


class _PieceIds(dict):
    """piece -> id, filled on a miss (``__missing__`` is called from C, so a hit costs one
    dict lookup). Emptied past ``LIMIT`` pieces: a flood of distinct pieces costs time, not
    unbounded memory."""

    LIMIT = 1 << 18  # ~35 MB of short pieces; a replay's vocabulary is 150k words

    def __missing__(self, piece: str) -> int:
        if len(self) >= self.LIMIT:
            self.clear()
        v = self[piece] = _hash_piece(piece)
        return v


_IDS = _PieceIds()
_piece_id = _IDS.__getitem__


def tokenize(text: str) -> list[int]:
    """Token ids of ``text`` (deterministic; about 4 characters per token on English)."""
    return list(map(_piece_id, _PIECE.findall(text)))


def count_tokens(text: str) -> int:
    return len(_PIECE.findall(text))


def token_strs(text: str) -> list[str]:
    return _PIECE.findall(text)


def render_chat(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """ChatML, as Qwen uses it: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message,
    then ``<|im_start|>assistant\\n``. List contents keep their ``text`` parts, joined by newlines.
    Raises ValueError on a malformed message."""
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError("each message must be an object with a string 'role'")
        content = m.get("content", "")
        if content is None:
            content = ""
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    parts.append(part["text"])
                elif isinstance(part, str):
                    parts.append(part)
                else:
                    raise ValueError("message content parts must be text")
            content = "\n".join(parts)
        elif not isinstance(content, str):
            raise ValueError("message content must be a string or a list of text parts")
        out.append(f"{IM_START}{m['role']}\n{content}{IM_END}\n")
    if add_generation_prompt:
        out.append(f"{IM_START}assistant\n")
    return "".join(out)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def chatml_messages(messages: list, tools: list | None = None) -> list[dict]:
    """Chat messages and tools -> messages with plain-string content for ``render_chat``: text
    parts joined by newlines (other typed parts, images, have no text and are left out), tool
    calls appended as ``<tool_call>`` JSON and the tools as JSON lines in the system turn (as
    Qwen's template places them). Raises ValueError on a malformed message."""
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError("each message must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                if isinstance(p, dict) and isinstance(p.get("text"), str):
                    parts.append(p["text"])
                elif isinstance(p, str):
                    parts.append(p)
                elif not (isinstance(p, dict) and isinstance(p.get("type"), str)):
                    raise ValueError("message content parts must be text")
            content = "\n".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ValueError("message content must be a string or a list of text parts")
        calls = m.get("tool_calls") or []
        if not isinstance(calls, list):
            raise ValueError("'tool_calls' must be a list")
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            fn = fn if isinstance(fn, dict) else {}
            call_json = _dumps({"name": fn.get("name"), "arguments": fn.get("arguments")})
            content += f"\n<tool_call>\n{call_json}\n</tool_call>"
        out.append({"role": m["role"], "content": content})
    if tools:
        if not isinstance(tools, list):
            raise ValueError("'tools' must be a list")
        listing = "\n".join(_dumps(t) for t in tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + f"\n\n# Tools\n<tools>\n{listing}\n</tools>"}
        else:
            out.insert(0, {"role": "system", "content": f"# Tools\n<tools>\n{listing}\n</tools>"})
    return out


def render_messages(messages: list, tools: list | None = None, add_generation_prompt: bool = True) -> str:
    """The prompt text of chat messages and tools: what ``kvtop sim`` tokenizes for chat,
    Anthropic Messages and Responses (converted to chat as router/prompts.py converts them) and
    what the router's ``--tokenizer kvtop-sim`` renders. Raises ValueError."""
    return render_chat(chatml_messages(messages, tools), add_generation_prompt)


def filler_text(start: int, count: int) -> str:
    """Output text for generated tokens ``start .. start+count-1`` (one piece per token)."""
    n = len(_FILLER)
    return "".join(_FILLER[(start + i) % n] for i in range(count))


def filler_ids(start: int, count: int) -> list[int]:
    n = len(_FILLER)
    return [_piece_id(_FILLER[(start + i) % n]) for i in range(count)]


# --- the router's --tokenizer kvtop-sim ---------------------------------------------------------------

#: ``kvtop route --tokenizer NAME`` for this tokenizer.
NAME = "kvtop-sim"
#: A piece's match depends on at most this many characters from its start (``<|im_start|>``,
#: 12, the longest alternative tried) or on one character past its end (a greedy run's stop):
#: text whose first ``n`` characters equal another's is cut the same way up to ``n - _LOOK``.
_LOOK = 13
#: Every this many tokens, where the piece starts is kept, for the next turn's prefix reuse.
_MARK_EVERY = 64


@dataclass(slots=True)
class Marks:
    """A tokenized text and, every ``_MARK_EVERY`` tokens, where a piece starts (characters) and
    its token index: the next turn of its session takes the tokens of the prefix they share."""

    text: str
    chars: array  # array('Q')
    tokens: array  # array('Q')


class SimTokenizer:
    """The router's side of this module, with router/tokenizer.Tokenizer's interface: ``render``
    (``render_messages``), ``ids``, and ``ids_after``, which reuses the previous turn's tokens
    up to a piece start inside the text both turns share (the regex cuts text left to right,
    every character in some piece, each piece decided by at most ``_LOOK`` characters, so the
    pieces before such a start are the same in both texts). Stateless but for the shared piece
    memo; safe to call from several threads."""

    name = NAME

    def render(self, prompt: Any) -> str:
        return render_messages(prompt.messages, prompt.tools, prompt.add_generation_prompt)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return tokenize(text)

    def ids(self, text: str, add_special_tokens: bool = False) -> array:
        return array("I", tokenize(text))  # no BOS: the sim adds none

    def ids_after(self, text: str, prev_ids: Any = None, prev: Marks | None = None,
                  on_cut: Callable[[int, str], None] | None = None) -> tuple[array, Marks, int | None]:
        cut_char = cut_tok = k = 0
        if prev is not None and prev_ids is not None and isinstance(prev, Marks):
            n = _common_prefix(text, prev.text, 16384)
            k = bisect_right(prev.chars, n - _LOOK) - 1
            if k > 0:
                cut_char, cut_tok = prev.chars[k], prev.tokens[k]
        if k <= 0:
            ids, chars, toks = self._marked(text, 0)
            return ids, Marks(text, chars, toks), None
        if on_cut is not None:
            on_cut(cut_tok, text[cut_char:])
        tail, chars, toks = self._marked(text, cut_char)
        ids = array("I", prev_ids[:cut_tok])
        ids += tail
        chars = prev.chars[:k] + chars
        toks = prev.tokens[:k] + array("Q", [t + cut_tok for t in toks])
        return ids, Marks(text, chars, toks), cut_tok

    @staticmethod
    def _marked(text: str, start: int) -> tuple[array, array, array]:
        """(ids of ``text[start:]``'s pieces, every ``_MARK_EVERY``-th piece's start in ``text``,
        its index among these ids). The pieces cover the text without gaps (each character is a
        letter, a digit, ``_``, white space or other), so their starts are running sums."""
        pieces = _PIECE.findall(text, start)
        ids = array("I", map(_piece_id, pieces))
        starts = array("Q")
        at = start
        for k in range(0, len(pieces), _MARK_EVERY):
            starts.append(at)
            at += sum(map(len, pieces[k:k + _MARK_EVERY]))
        if not starts:
            starts.append(start)
        return ids, starts, array("Q", range(0, len(starts) * _MARK_EVERY, _MARK_EVERY))
