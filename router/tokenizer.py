"""A model's tokenizer for the router: ``--tokenizer DIR`` (tokenizer.json and the chat
template of tokenizer_config.json) or ``--tokenizer kvtop-sim`` (router/sim_tokenizer.py).

Text is cut at special tokens and each piece tokenized once and kept, so a session's next
turn costs only its new text; the count equals vLLM's prompt_tokens.
"""

from __future__ import annotations

import os
import re
import threading
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from router.prompts import BadRequest, Prompt
from router.request import Pieces, _common_prefix, chat_text


def load_tokenizer(spec: str, *, parallel: bool = True):
    """``--tokenizer``'s value -> a tokenizer: ``kvtop-sim``, the simulated vLLM's own
    (router/sim_tokenizer.py: the same code ``kvtop sim`` counts with), else a model's
    tokenizer directory or tokenizer.json (``Tokenizer``). Raises ValueError."""
    from router.sim_tokenizer import NAME, SimTokenizer

    if spec == NAME:
        return SimTokenizer()
    return Tokenizer(spec, parallel=parallel)


#: New text (characters) from which a prompt's pieces are tokenized in parallel (a cold prompt's,
#: ~16k tokens or more).
PARALLEL_CHARS = 64 * 1024


class Tokenizer:
    """A model's tokenizer (``tokenizer.json``) and chat template (``tokenizer_config.json``).

    ``path`` is the model's tokenizer directory, or its tokenizer.json (the template is then
    looked for beside it). Text is cut at the tokenizer's special tokens (``<|im_start|>`` and
    the like, which it never merges with their neighbours) and each piece is tokenized once
    and kept (least recently used out first, at most ``cache_tokens`` tokens): a session's next
    turn re-tokenizes only its new messages, and a system prompt shared by many sessions is
    tokenized once. At load the pieced tokenization is checked against whole-text tokenization
    on a sample conversation; a tokenizer for which they differ is used whole. A cold prompt's
    pieces are tokenized in parallel (the Rust tokenizer's threads) unless ``parallel`` is off;
    a returning turn's few new ones in the calling thread.

    Safe to call from several threads: the Rust tokenizer releases the GIL while it works.
    """

    def __init__(self, path: str, *, cache_tokens: int = 8_000_000, parallel: bool = True):
        from tokenizers import Tokenizer as HFTokenizer

        from router.chat_template import ChatTemplate

        directory = path if os.path.isdir(path) else os.path.dirname(path) or "."
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        try:
            self._tok = HFTokenizer.from_file(file)
        except Exception as exc:  # the library raises a bare Exception on a bad file
            raise ValueError(f"cannot load tokenizer {file!r}: {exc}") from None
        try:
            self.template = ChatTemplate.load(directory)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load the chat template in {directory!r}: {exc}") from None
        specials = sorted((t.content for t in self._tok.get_added_tokens_decoder().values()
                           if t.special and t.content), key=len, reverse=True)
        self._specials = specials
        self._split = re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else None
        self._longest_special = len(specials[0]) if specials else 0
        self._wrap = self._tok.encode("", add_special_tokens=True).ids  # a BOS the post-processor adds
        self._lock = threading.Lock()
        self._pieces: OrderedDict[str, array] = OrderedDict()
        self._cached = 0
        self.cache_tokens = cache_tokens
        self.parallel = parallel
        self.hits = self.misses = 0
        if self._split is not None and not self._pieces_agree():
            self._split = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Whole-text tokenization (no pieces, no cache)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def render(self, prompt: Prompt) -> str:
        """The prompt text of chat messages: the model's template, else the text fallback's."""
        if self.template is None:
            return chat_text(prompt.messages, prompt.tools)
        from router.chat_template import TemplateError

        try:
            return self.template.render(prompt.messages, prompt.tools,
                                        add_generation_prompt=prompt.add_generation_prompt,
                                        continue_final_message=prompt.continue_final_message,
                                        kwargs=prompt.template_kwargs)
        except TemplateError as exc:
            raise BadRequest(str(exc), prompt.param) from None

    def ids(self, text: str, add_special_tokens: bool = False) -> array:
        """Token ids of ``text`` (an ``array('I')``), reusing the pieces seen before."""
        if self._split is None:
            out = array("I", self._tok.encode(text, add_special_tokens=False).ids)
        else:
            out = self._pieced(text)[0]
        if add_special_tokens and self._wrap:
            out = array("I", self._wrap) + out
        return out

    def ids_after(self, text: str, prev_ids: Any = None, prev: Pieces | None = None,
                  on_cut: Callable[[int, str], None] | None = None
                  ) -> tuple[array, Pieces | None, int | None]:
        """Token ids of ``text`` (no special tokens added), reusing a previous turn's: (ids, the
        pieces for the turn after, how many leading ids are the previous turn's, or None).

        A returning turn's rendered text repeats the previous turn's up to where the new
        messages begin. Up to the last piece start (a special token's start or end) that lies a
        whole special token's length inside that common prefix, the regex cuts both texts the
        same way (it reads no further than that at any position before it), so those pieces,
        and hence those tokens, are the previous turn's: only the rest is cut, looked up and
        tokenized, instead of the whole 800 KB text (~2 ms of CPU for a 215k-token turn).
        ``on_cut(tokens, rest)``, if given, is called once the previous turn's first ``tokens``
        ids are known to be reused and before ``rest`` (the text after them) is tokenized."""
        if self._split is None:
            return array("I", self._tok.encode(text, add_special_tokens=False).ids), None, None
        k = -1
        if prev is not None and prev_ids is not None:
            n = _common_prefix(text, prev.text, 16384)
            k = bisect_right(prev.chars, n - self._longest_special) - 1
        if k <= 0:  # nothing reused
            ids, chars, toks = self._pieced(text, marks=True)
            return ids, Pieces(text, chars, toks), None
        cut_char, cut_tok = prev.chars[k], prev.tokens[k]
        rest = text[cut_char:]
        if on_cut is not None:
            on_cut(cut_tok, rest)
        tail, chars, toks = self._pieced(rest, marks=True)
        ids = prev_ids[:cut_tok]
        ids += tail
        chars = prev.chars[:k] + array("Q", [c + cut_char for c in chars])
        toks = prev.tokens[:k] + array("Q", [t + cut_tok for t in toks])
        return ids, Pieces(text, chars, toks), cut_tok

    def _pieced(self, text: str, marks: bool = False) -> tuple[array, array | None, array | None]:
        """(token ids of ``text`` cut at special tokens, each piece tokenized once and kept;
        with ``marks``, each piece's first character and first token)."""
        pieces = [p for p in self._split.split(text) if p]
        found: list[array | None] = []
        with self._lock:
            for p in pieces:
                a = self._pieces.get(p)
                if a is not None:
                    self._pieces.move_to_end(p)
                found.append(a)
        missing = [p for p, a in zip(pieces, found) if a is None]
        self.hits += len(pieces) - len(missing)
        self.misses += len(missing)
        if missing:
            # a cold prompt's pieces in parallel (the tokenizer's own threads), a returning
            # turn's few new ones in this thread: on a busy host, waking the thread pool for
            # two 8k-character pieces took 14 ms, against 8 ms for tokenizing them here (the
            # same CPU time)
            parallel = self.parallel and sum(map(len, missing)) > PARALLEL_CHARS
            encoded = self._encode(missing, parallel=parallel)
            new = {p: array("I", e.ids) for p, e in zip(missing, encoded)}
            with self._lock:
                for p, a in new.items():
                    if p not in self._pieces:
                        self._pieces[p] = a
                        self._cached += len(a)
                while self._cached > self.cache_tokens and self._pieces:
                    _, old = self._pieces.popitem(last=False)
                    self._cached -= len(old)
            found = [a if a is not None else new[p] for p, a in zip(pieces, found)]
        out = array("I")
        if not marks:
            for a in found:
                out += a
            return out, None, None
        chars, toks = array("Q"), array("Q")
        at = 0
        for p, a in zip(pieces, found):
            chars.append(at)
            toks.append(len(out))
            at += len(p)
            out += a
        return out, chars, toks

    def _encode(self, pieces: list[str], *, parallel: bool) -> list:
        # encode_batch_fast: the same ids without the character offsets, which the router never
        # reads (a 2,400-token piece: ~15-30% less time)
        if parallel and len(pieces) > 1:
            return self._tok.encode_batch_fast(pieces, add_special_tokens=False)
        fast = self._tok.encode_batch_fast
        return [fast([p], add_special_tokens=False)[0] for p in pieces]

    def _pieces_agree(self) -> bool:
        """Does tokenizing between special tokens give the whole text's tokens on this tokenizer?"""
        sample_parts = ["You are a helpful assistant.\n  Use the tools.", " Hello there,  world!\n\n",
                        "def f(x):\n    return x  # done\n", "   leading spaces", "\u00e9t\u00e9 \u4e2d\u6587 ok"]
        specials = self._specials[:4]
        text = ""
        for k, part in enumerate(sample_parts):
            text += specials[k % len(specials)] + part
        text = text + sample_parts[0]
        pieces = [p for p in self._split.split(text) if p]
        joined: list[int] = []
        for p in pieces:  # one at a time: the tokenizer's thread pool starts later, from a worker
            joined += self._tok.encode(p, add_special_tokens=False).ids
        return joined == self._tok.encode(text, add_special_tokens=False).ids
