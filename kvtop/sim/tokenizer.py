"""Deterministic stand-in tokenizer and chat template for the simulated vLLM.

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
import re

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


def filler_text(start: int, count: int) -> str:
    """Output text for generated tokens ``start .. start+count-1`` (one piece per token)."""
    n = len(_FILLER)
    return "".join(_FILLER[(start + i) % n] for i in range(count))


def filler_ids(start: int, count: int) -> list[int]:
    n = len(_FILLER)
    return [_piece_id(_FILLER[(start + i) % n]) for i in range(count)]
