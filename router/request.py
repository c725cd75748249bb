"""Turn a client's request into what routing needs: session, length, block hashes.

Four APIs (router/apis.py): OpenAI completions and chat, Anthropic Messages, OpenAI Responses.
Messages and Responses bodies are first converted to chat messages and tools the way vLLM
converts them (vllm/entrypoints/anthropic/serving.py, .../openai/responses), so that one
renderer serves chat, messages and responses alike.

Session id, in order (the first present wins; ``session_source`` records which):

1. the configured header (default ``X-Session-ID``)                          ``header``
2. Anthropic ``metadata.user_id``, its session part (Claude Code sends
   ``user_<hash>_account_<uuid>_session_<uuid>``, or a JSON object with
   ``session_id``); the whole value when it has none                        ``metadata_user_id``
3. the Responses API's ``prompt_cache_key``                                 ``prompt_cache_key``
4. the body's ``session_id``, then ``user``                                 ``body_session_id``, ``user``
5. else ``blk-<hash of the first block>``, so that turns of one
   conversation (which share their first block) still group together       ``first_block``

A Responses ``previous_response_id`` is carried on the request: the proxy sends it to the
instance that stored that response (router/apis.ResponseStore) and takes that response's session.

Prompt tokens (``token_source``): token ids in ``prompt`` are used as they are (``tokens``).
With a tokenizer (``--tokenizer``), text is tokenized and chat-like prompts are first rendered
with the model's own chat template (router/chat_template.py), tools included, so the count is
vLLM's prompt_tokens (``tokenizer``); ``--tokenizer kvtop-sim`` counts as ``kvtop sim`` does
(router/sim_tokenizer.py). Without one, text is hashed in fixed character chunks and
chat-like prompts in a ``<|role|>`` rendering with the tools' JSON first (``text_approx``,
router/blocks.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router.blocks import ROOT_HASH, estimate_text_tokens, hash_text_blocks
from router.classes import route_class
from router.prompts import MAX_NESTING, BadRequest, Prompt  # noqa: F401 (importers know them from here)
from router.prompts import PROMPTS as _PROMPTS




@dataclass(slots=True)
class RouteRequest:
    request_id: str
    session_id: str
    session_source: str  # header | metadata_user_id | prompt_cache_key | body_session_id | user | first_block | previous_response
    input_tokens: int
    blocks: list[int]
    token_source: str  # tokens | tokenizer | text_approx
    endpoint: str  # completions | chat | messages | responses
    stream: bool
    max_tokens: int | None
    previous_response_id: str | None = None
    #: Of ``input_tokens``, how many are an estimate: a returning turn routed before its new
    #: text was tokenized (router/parsing.py) counts that text at its session's characters per
    #: token until ``counting`` (a future of the counted request) is done; 0 once counted.
    tail_estimate: int = 0
    counting: Any = None

    @property
    def route_class(self) -> str:
        return route_class(self.input_tokens)




@dataclass(slots=True)
class Parsed:
    """A validated body: its prompt, and the session facts that need no tokens."""

    endpoint: str
    prompt: Prompt
    session_id: str | None
    session_source: str
    stream: bool
    max_tokens: int | None
    previous_response_id: str | None = None



#: Claude Code's metadata.user_id: user_<hash>_account_<uuid>_session_<uuid>
_CLAUDE_SESSION = re.compile(r"_session_([0-9A-Za-z-]{8,})$")


def _metadata_session(body: dict) -> str | None:
    meta = body.get("metadata")
    uid = meta.get("user_id") if isinstance(meta, dict) else None
    if not isinstance(uid, str) or not uid:
        return None
    if len(uid) > 4096:  # no client's id is this long: not searched or parsed, only bounded
        return uid
    m = _CLAUDE_SESSION.search(uid)
    if m:
        return m.group(1)
    if uid.startswith("{"):  # newer Claude Code: a JSON object as a string
        try:
            obj = json.loads(uid)
        except ValueError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("session_id"), str) and obj["session_id"]:
            return obj["session_id"]
    return uid


#: A session id longer than this (in characters) is kept as its first SESSION_ID_KEEP characters
#: and a digest of the whole: distinct ids stay distinct, and a client sending a 1 MB
#: ``metadata.user_id`` cannot make the router key its per-session state by megabytes.
MAX_SESSION_ID = 256
SESSION_ID_KEEP = 200


def bounded_session_id(sid: str) -> str:
    if len(sid) <= MAX_SESSION_ID:
        return sid
    digest = hashlib.blake2b(sid.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    return f"{sid[:SESSION_ID_KEEP]}~{digest}"


def read_body(body: Any, endpoint: str, *, headers: Any = None,
              session_header: str = "X-Session-ID") -> Parsed:
    """Validate a body of ``endpoint`` and extract everything but the tokens. Cheap: no
    tokenizing, no rendering. Raises BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    max_name = "max_output_tokens" if endpoint == "responses" else "max_tokens"
    for name, typ in (("stream", bool), (max_name, int), ("model", str), ("user", str)):
        v = body.get(name)
        if v is not None and (not isinstance(v, typ) or (typ is int and isinstance(v, bool))):
            raise BadRequest(f"'{name}' must be of type {typ.__name__}", name)
    max_tokens = body.get(max_name)
    if max_tokens is not None and max_tokens < 0:
        raise BadRequest(f"'{max_name}' must be >= 0", max_name)
    prompt = _PROMPTS[endpoint](body)

    session_id, source = None, ""
    if headers is not None and session_header:
        hv = headers.get(session_header)
        if hv:
            session_id, source = hv, "header"
    if session_id is None and endpoint == "messages":
        sid = _metadata_session(body)
        if sid:
            session_id, source = sid, "metadata_user_id"
    prev = None
    if endpoint == "responses":
        prev = body.get("previous_response_id")
        if prev is not None and (not isinstance(prev, str) or not prev):
            raise BadRequest("'previous_response_id' must be a string", "previous_response_id")
        key = body.get("prompt_cache_key")
        if session_id is None and isinstance(key, str) and key:
            session_id, source = key, "prompt_cache_key"
    if session_id is None:
        sid = body.get("session_id")
        if sid is not None:
            if not isinstance(sid, (str, int)) or isinstance(sid, bool):
                raise BadRequest("'session_id' must be a string", "session_id")
            session_id, source = str(sid), "body_session_id"
    if session_id is None and body.get("user"):
        session_id, source = body["user"], "user"
    if session_id is not None:
        session_id = bounded_session_id(session_id)
    return Parsed(endpoint, prompt, session_id, source, bool(body.get("stream", False)), max_tokens, prev)


# --- prompts -> tokens and blocks ---------------------------------------------------------------

def chat_text(messages: list[dict], tools: list[dict] | None = None) -> str:
    """The text fallback's rendering: the tools' JSON first (they come first in models' own
    templates and are the same every turn), then ``<|role|>\\ncontent\\n`` per message."""
    parts: list[str] = []
    if tools:
        parts.append("<|tools|>\n" + json.dumps(tools, separators=(",", ":")) + "\n")
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        elif not isinstance(content, str):
            content = ""
        calls = m.get("tool_calls")
        if calls:
            content += json.dumps(calls, separators=(",", ":"))
        parts.append(f"<|{m['role']}|>\n{content}\n")
    return "".join(parts)


def hash_blocks(tokens: Any, block_size: int, *, prev_tokens: Any = None,
                prev_blocks: Any = None, common: int | None = None) -> array:
    """router/blocks.py's chained block hashes of ``tokens`` (a list or an array), as an
    ``array('q')`` (it crosses from the parser's worker as one buffer: pickling 13,000 ints
    took 0.7 ms there), reusing ``prev_blocks`` for the blocks of the prefix ``tokens`` shares
    with ``prev_tokens`` (``common``: that prefix's length in tokens when the caller knows it,
    else compared here)."""
    n_full = len(tokens) // block_size
    out = array("q")
    parent = ROOT_HASH
    if prev_blocks and prev_tokens is not None:
        if common is None:
            common = _common_prefix(tokens, prev_tokens)
        same = min(n_full, len(prev_blocks), common // block_size)
        out = array("q", prev_blocks[:same])
        if same:
            parent = out[-1]
    for start in range(len(out) * block_size, n_full * block_size, block_size):
        parent = hash((parent, tuple(tokens[start:start + block_size])))
        out.append(parent)
    return out


def _common_prefix(a: Any, b: Any, step: int = 8192) -> int:
    """Length of the common prefix of two sequences (token lists or strings): slices compared
    in C, then a bisection inside the first slice that differs."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i:i + step] == b[i:i + step]:
        i += step
    if i >= n:
        return n
    lo, hi = i, min(n, i + step)  # a[:lo] == b[:lo]; they differ before hi, or only past n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo if a[lo] != b[lo] else hi


@dataclass(slots=True)
class Pieces:
    """A tokenized text and where its pieces (cut at special tokens) start, in characters and in
    tokens: the next turn of its session takes the tokens of the prefix they share from here."""

    text: str
    chars: array  # array('Q'): each piece's first character
    tokens: array  # array('Q'): each piece's first token


@dataclass(slots=True)
class Counted:
    input_tokens: int
    blocks: list[int]
    token_source: str
    tokens: Any = None  # the token ids (tokenizer path), for the next turn's block reuse
    pieces: Pieces | None = None  # the text they came from, for the next turn's prefix reuse


def count_prompt(prompt: Prompt, block_size: int, tokenizer: Any = None,
                 prev: Counted | None = None,
                 on_cut: Callable[[int, str], None] | None = None) -> Counted:
    """Tokens and block hashes of ``prompt``. With a tokenizer this is the slow part (rendering,
    tokenizing): the router calls it off the event loop. ``prev`` is the session's previous
    turn, whose block hashes are reused for the shared prefix; ``on_cut`` (see
    ``Tokenizer.ids_after``) hears how much of it is reused before the rest is tokenized."""
    if prompt.tokens is not None:
        return Counted(len(prompt.tokens), hash_blocks(prompt.tokens, block_size), "tokens")
    if tokenizer is not None:
        if prompt.messages is not None:
            text = tokenizer.render(prompt)
        else:
            text = prompt.text
        if prompt.add_special_tokens:
            ids, pieces, common = tokenizer.ids(text, add_special_tokens=True), None, None
        else:
            ids, pieces, common = tokenizer.ids_after(text, prev.tokens if prev else None,
                                                      prev.pieces if prev else None, on_cut)
        blocks = hash_blocks(ids, block_size, prev_tokens=prev.tokens if prev else None,
                             prev_blocks=prev.blocks if prev else None, common=common)
        return Counted(len(ids), blocks, "tokenizer", ids, pieces)
    text = chat_text(prompt.messages, prompt.tools) if prompt.messages is not None else prompt.text
    return Counted(estimate_text_tokens(text), hash_text_blocks(text, block_size), "text_approx")


def route_request(parsed: Parsed, counted: Counted, *, max_input_tokens: int | None = None,
                  request_id: str | None = None, blocks_as_list: bool = True) -> RouteRequest:
    """The RouteRequest, once the tokens are counted. Raises BadRequest (empty, too long).
    ``blocks_as_list`` off: the block hashes stay an ``array('q')`` (the parser's worker sends
    them so; router/parsing.BodyParser makes them a list on arrival)."""
    param = parsed.prompt.param
    if counted.input_tokens == 0:
        raise BadRequest("the prompt is empty", param)
    if max_input_tokens is not None and counted.input_tokens > max_input_tokens:
        raise BadRequest(f"the prompt has {counted.input_tokens} tokens, over this router's maximum of "
                         f"{max_input_tokens}", param)
    session_id, source = parsed.session_id, parsed.session_source
    if session_id is None:
        blocks = counted.blocks
        if blocks:
            session_id = f"blk-{blocks[0] & 0xFFFFFFFFFFFF:012x}"
        else:  # shorter than one block: nothing to share, so nothing to group by
            session_id = "blk-short"
        source = "first_block"
    return RouteRequest(
        request_id=request_id or os.urandom(8).hex(),
        session_id=session_id[:256],
        session_source=source,
        input_tokens=counted.input_tokens,
        blocks=counted.blocks.tolist() if blocks_as_list and isinstance(counted.blocks, array) else counted.blocks,
        token_source=counted.token_source,
        endpoint=parsed.endpoint,
        stream=parsed.stream,
        max_tokens=parsed.max_tokens,
        previous_response_id=parsed.previous_response_id,
    )


def parse_request(body: Any, endpoint: str, *, headers: Any = None, session_header: str = "X-Session-ID",
                  block_size: int = 512, tokenizer: Any = None,
                  max_input_tokens: int | None = None, request_id: str | None = None) -> RouteRequest:
    """Validate a body and extract the routing facts, all in the calling thread.

    Raises BadRequest with the offending parameter for anything a backend would reject
    or that the router cannot route.
    """
    parsed = read_body(body, endpoint, headers=headers, session_header=session_header)
    return route_request(parsed, count_prompt(parsed.prompt, block_size, tokenizer),
                         max_input_tokens=max_input_tokens, request_id=request_id)


# --- the tokenizer --------------------------------------------------------------------------------
