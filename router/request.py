"""Turn a client's OpenAI request into what routing needs: session, length, block hashes.

Session id, in order: the configured header (default ``X-Session-ID``), the body's
``session_id``, the body's ``user``, else ``blk-<hash of the first block>`` so that turns of
one conversation (which share their first block) still group together.

Prompt tokens: token ids in ``prompt`` are used as they are; text is tokenized with the
configured tokenizer (a ``tokenizer.json`` loaded with the ``tokenizers`` library) when
there is one, else hashed in fixed character chunks (see router/blocks.py). The decision
records which (``token_source``: tokens | tokenizer | text_approx).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from router.blocks import estimate_text_tokens, hash_text_blocks, hash_token_blocks, valid_token_ids
from router.classes import route_class


class BadRequest(ValueError):
    """The client's request cannot be routed; becomes an OpenAI-shaped 400."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status

    def __reduce__(self):  # keeps param and status across a process boundary (router/parsing.py)
        return BadRequest, (self.message, self.param, self.status)


@dataclass(slots=True)
class RouteRequest:
    request_id: str
    session_id: str
    session_source: str  # header | body_session_id | user | first_block
    input_tokens: int
    blocks: list[int]
    token_source: str  # tokens | tokenizer | text_approx
    endpoint: str  # completions | chat
    stream: bool
    max_tokens: int | None

    @property
    def route_class(self) -> str:
        return route_class(self.input_tokens)


class Tokenizer:
    """A ``tokenizers`` tokenizer.json, loaded once."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_file(path)
        except Exception as exc:  # the library raises a bare Exception on a bad file
            raise ValueError(f"cannot load tokenizer {path!r}: {exc}") from None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids


def _chat_text(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    parts: list[str] = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{k}] must be an object", "messages")
        role = m.get("role")
        if not isinstance(role, str):
            raise BadRequest(f"messages[{k}].role must be a string", "messages")
        content = m.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            bits = []
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    bits.append(part["text"])
                elif isinstance(part, dict) and "type" in part:
                    continue  # images and the like carry no prompt text we can hash
                else:
                    raise BadRequest(f"messages[{k}].content has an invalid part", "messages")
            text = "".join(bits)
        else:
            raise BadRequest(f"messages[{k}].content must be a string or a list of parts", "messages")
        parts.append(f"<|{role}|>\n{text}\n")
    return "".join(parts)


def _prompt(body: dict) -> tuple[list[int] | None, str | None]:
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest("'prompt' is required", "prompt")
    if isinstance(prompt, str):
        return None, prompt
    if isinstance(prompt, list):
        if not prompt:
            raise BadRequest("'prompt' must not be empty", "prompt")
        if all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise BadRequest("batched prompts are not supported; send one prompt per request", "prompt")
            return None, prompt[0]
        if isinstance(prompt[0], list):
            if len(prompt) != 1:
                raise BadRequest("batched prompts are not supported; send one prompt per request", "prompt")
            prompt = prompt[0]
        if not valid_token_ids(prompt):
            raise BadRequest("'prompt' token ids must be non-negative integers", "prompt")
        return prompt, None
    raise BadRequest("'prompt' must be a string or a list of token ids", "prompt")


def parse_request(body: Any, endpoint: str, *, headers: Any = None, session_header: str = "X-Session-ID",
                  block_size: int = 512, tokenizer: Tokenizer | None = None,
                  max_input_tokens: int | None = None, request_id: str | None = None) -> RouteRequest:
    """Validate an OpenAI completions/chat body and extract the routing facts.

    Raises BadRequest with the offending parameter for anything a backend would reject
    or that the router cannot route.
    """
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for name, typ in (("stream", bool), ("max_tokens", int), ("model", str), ("user", str)):
        v = body.get(name)
        if v is not None and (not isinstance(v, typ) or (typ is int and isinstance(v, bool))):
            raise BadRequest(f"'{name}' must be of type {typ.__name__}", name)
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and max_tokens < 0:
        raise BadRequest("'max_tokens' must be >= 0", "max_tokens")
    if endpoint == "chat":
        tokens, text = None, _chat_text(body.get("messages"))
    else:
        tokens, text = _prompt(body)

    if tokens is not None:
        token_source = "tokens"
    elif tokenizer is not None:
        tokens = tokenizer.encode(text)
        token_source = "tokenizer"
    else:
        token_source = "text_approx"
    if tokens is not None:
        input_tokens = len(tokens)
        blocks = hash_token_blocks(tokens, block_size)
    else:
        input_tokens = estimate_text_tokens(text)
        blocks = hash_text_blocks(text, block_size)
    if input_tokens == 0:
        raise BadRequest("the prompt is empty", "messages" if endpoint == "chat" else "prompt")
    if max_input_tokens is not None and input_tokens > max_input_tokens:
        raise BadRequest(f"the prompt has {input_tokens} tokens, over this router's maximum of "
                         f"{max_input_tokens}", "messages" if endpoint == "chat" else "prompt")

    session_id, source = None, ""
    if headers is not None and session_header:
        hv = headers.get(session_header)
        if hv:
            session_id, source = hv, "header"
    if session_id is None:
        sid = body.get("session_id")
        if sid is not None:
            if not isinstance(sid, (str, int)) or isinstance(sid, bool):
                raise BadRequest("'session_id' must be a string", "session_id")
            session_id, source = str(sid), "body_session_id"
    if session_id is None and body.get("user"):
        session_id, source = body["user"], "user"
    if session_id is None:
        if blocks:
            session_id = f"blk-{blocks[0] & 0xFFFFFFFFFFFF:012x}"
        else:  # shorter than one block: nothing to share, so nothing to group by
            session_id = "blk-short"
        source = "first_block"
    return RouteRequest(
        request_id=request_id or os.urandom(8).hex(),
        session_id=session_id[:256],
        session_source=source,
        input_tokens=input_tokens,
        blocks=blocks,
        token_source=token_source,
        endpoint=endpoint,
        stream=bool(body.get("stream", False)),
        max_tokens=max_tokens,
    )
