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
import threading
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from router.blocks import ROOT_HASH, estimate_text_tokens, hash_text_blocks, valid_token_ids
from router.classes import route_class


class BadRequest(ValueError):
    """The client's request cannot be routed; becomes a 400 in the client API's error shape."""

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
class Prompt:
    """What the model will read, before tokenization: token ids, text, or chat messages."""

    param: str  # the body field named in errors about it
    tokens: list[int] | None = None
    text: str | None = None
    messages: list[dict] | None = None  # OpenAI chat messages (chat, and messages/responses converted)
    tools: list[dict] | None = None  # OpenAI chat tools
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)


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


# --- bodies -> prompts ------------------------------------------------------------------------

_ANTHROPIC_ROLES = {"user": "user", "assistant": "assistant", "system": "system",
                    "ctx": "user", "msg": "user"}  # Claude Code >= 2.1.154 sends ctx/msg (vLLM maps them)
_BILLING_HEADER = "x-anthropic-billing-header"  # per-request hash in Claude Code's system; vLLM drops it


#: How deep an object the router serializes may nest (tool schemas, tool inputs and outputs,
#: tool calls): the prompt's rendering writes them as JSON, which recursion bounds at about
#: 1,000 levels (orjson reads 1,024), and no real schema comes near 100.
MAX_NESTING = 100


def _check_nesting(value: Any, where: str, param: str) -> None:
    """BadRequest when ``value`` nests lists and objects more than MAX_NESTING deep. Iterative,
    and only over containers: a tool's schema costs microseconds."""
    if type(value) not in (dict, list):
        return
    stack = [(value, 1)]
    while stack:
        obj, depth = stack.pop()
        if depth > MAX_NESTING:
            raise BadRequest(f"{where} is nested more than {MAX_NESTING} levels deep", param)
        for v in (obj.values() if type(obj) is dict else obj):
            if type(v) is dict or type(v) is list:
                stack.append((v, depth + 1))


def _chat_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{k}] must be an object", "messages")
        if not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{k}].role must be a string", "messages")
        if m.get("tool_calls") is not None:
            _check_nesting(m["tool_calls"], f"messages[{k}].tool_calls", "messages")
        content = m.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise BadRequest(f"messages[{k}].content must be a string or a list of parts", "messages")
        for part in content:
            if not isinstance(part, dict) or ("type" not in part and not isinstance(part.get("text"), str)):
                raise BadRequest(f"messages[{k}].content has an invalid part", "messages")
    return messages


def _chat_tools(tools: Any, param: str = "tools") -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRequest(f"'{param}' must be a list of objects", param)
    for k, t in enumerate(tools):
        _check_nesting(t, f"{param}[{k}]", param)
    return tools or None


def _text_of_blocks(blocks: list, where: str) -> list[str]:
    out = []
    for b in blocks:
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise BadRequest(f"{where} has a block without a 'type'", "messages")
        if b["type"] == "text" and isinstance(b.get("text"), str) and b["text"]:
            if not b["text"].startswith(_BILLING_HEADER):
                out.append(b["text"])
    return out


def _anthropic_prompt(body: dict) -> Prompt:
    """Anthropic Messages -> chat messages and tools, as vLLM's AnthropicServingMessages does."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    system = body.get("system")
    system_parts: list[str] = []
    if isinstance(system, str):
        if system:
            system_parts.append(system)
    elif isinstance(system, list):
        system_parts += _text_of_blocks(system, "system")
    elif system is not None:
        raise BadRequest("'system' must be a string or a list of text blocks", "system")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in _ANTHROPIC_ROLES:
            raise BadRequest(f"messages[{k}] must be an object with role user or assistant", "messages")
    leading, messages = _place_inline_system(messages, bool(system_parts))
    system_text = "\n\n".join(t for t in ("".join(system_parts), leading) if t)
    out: list[dict] = []
    if system_text:
        out.append({"role": "system", "content": system_text})
    for k, m in enumerate(messages):
        role = _ANTHROPIC_ROLES[m["role"]]
        content = m.get("content")
        if role == "system":  # an inline system turn, kept where the client put it
            out.append({"role": "system", "content": content})
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise BadRequest(f"messages[{k}].content must be a string or a list of blocks", "messages")
        msg: dict[str, Any] = {"role": role}
        parts: list[dict] = []
        calls: list[dict] = []
        reasoning: list[str] = []
        for j, b in enumerate(content):
            if not isinstance(b, dict) or not isinstance(b.get("type"), str):
                raise BadRequest(f"messages[{k}].content has a block without a 'type'", "messages")
            t = b["type"]
            if t == "text" and isinstance(b.get("text"), str) and b["text"]:
                parts.append({"type": "text", "text": b["text"]})
            elif t == "image":
                parts.append({"type": "image_url", "image_url": {"url": ""}})  # no text to hash
            elif t == "thinking" and isinstance(b.get("thinking"), str):
                reasoning.append(b["thinking"])
            elif t == "tool_use":
                _check_nesting(b.get("input"), f"messages[{k}].content[{j}].input", "messages")
                calls.append({"id": b.get("id") or "", "type": "function",
                              "function": {"name": b.get("name") or "",
                                           "arguments": json.dumps(b.get("input") or {})}})
            elif t == "tool_result":
                text = _tool_result_text(b.get("content"), f"messages[{k}].content[{j}].content")
                if role == "user":
                    out.append({"role": "tool", "tool_call_id": b.get("tool_use_id") or "", "content": text})
                else:
                    parts.append({"type": "text", "text": f"Tool result: {text}"})
        if reasoning:
            msg["reasoning"] = "".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        if parts:
            msg["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
        if role == "user" and "content" not in msg:
            continue  # a user turn of tool results only: its tool messages stand for it
        out.append(msg)
    tools = body.get("tools")
    chat_tools = None
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequest("'tools' must be a list", "tools")
        chat_tools = []
        for k, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str):
                raise BadRequest(f"tools[{k}] must be an object with a name", "tools")
            if "input_schema" not in t:
                continue  # a server tool (web_search, ...): the model does not see a schema
            _check_nesting(t["input_schema"], f"tools[{k}].input_schema", "tools")
            chat_tools.append({"type": "function", "function": {
                "name": t["name"], "description": t.get("description"), "parameters": t.get("input_schema")}})
    return Prompt("messages", messages=out, tools=chat_tools or None,
                  template_kwargs=_template_kwargs(body))


def _system_message_text(m: dict, k: int) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return "" if c.startswith(_BILLING_HEADER) else c
    return "".join(_text_of_blocks(c if isinstance(c, list) else [], f"messages[{k}]"))


def _place_inline_system(messages: list, has_system: bool) -> tuple[str, list[dict]]:
    """Claude Code's ``system`` messages inside ``messages``, placed as vLLM places them
    (vllm/entrypoints/anthropic/inline_system.py, "preserve", what it probes for templates that
    mark system turns, ChatML and Qwen's among them): those leading the list join the system
    prompt; the others stay system turns where the client put them, except that one between an
    assistant's tool_use and the user turn answering it waits until after that turn. Without a
    system prompt they are folded into the neighbouring user turn instead. Either way only the
    end of the conversation changes from turn to turn, so each request renders as an extension
    of the previous one and the router's blocks are the engine's blocks. (Hoisting them all
    into the system prompt, as before, changed the prompt's head on every turn.)

    Returns the text to add to the system prompt and the messages, inline system messages
    as ``{"role": "system", "content": text}``."""
    if all(_ANTHROPIC_ROLES[m["role"]] != "system" for m in messages):
        return "", messages
    lead = 0
    while lead < len(messages) and _ANTHROPIC_ROLES[messages[lead]["role"]] == "system":
        lead += 1
    leading = "\n\n".join(t for t in (_system_message_text(m, k) for k, m in enumerate(messages[:lead])) if t)
    rest: list[tuple[int, dict]] = []
    held: list[tuple[int, dict]] = []
    awaiting = False
    for k in range(lead, len(messages)):
        m = messages[k]
        role = _ANTHROPIC_ROLES[m["role"]]
        if role == "system":
            (held if awaiting else rest).append((k, m))
            continue
        if role == "assistant":
            rest += held
            held.clear()
        rest.append((k, m))
        if role == "user":
            rest += held
            held.clear()
        c = m.get("content")
        awaiting = role == "assistant" and isinstance(c, list) and any(
            isinstance(b, dict) and b.get("type") == "tool_use" for b in c)
    rest += held
    if has_system or leading:  # preserve
        return leading, [{"role": "system", "content": t} if _ANTHROPIC_ROLES[m["role"]] == "system" else m
                         for k, m in rest
                         if _ANTHROPIC_ROLES[m["role"]] != "system" or (t := _system_message_text(m, k))]
    out: list[dict] = []  # fold
    pending: list[str] = []
    for k, m in rest:
        if _ANTHROPIC_ROLES[m["role"]] == "system":
            text = _system_message_text(m, k)
            if not text:
                continue
            if out and _ANTHROPIC_ROLES[out[-1]["role"]] == "user" and not pending:
                out[-1] = _fold_into_user(out[-1], text, at_end=True)
            else:
                pending.append(text)
            continue
        if pending:
            text = "\n\n".join(pending)
            pending.clear()
            if _ANTHROPIC_ROLES[m["role"]] == "user":
                m = _fold_into_user(m, text, at_end=False)
            else:
                out.append({"role": "user", "content": text})
        out.append(m)
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return leading, out


def _fold_into_user(m: dict, text: str, *, at_end: bool) -> dict:
    """``text`` joined onto one end of a user turn's own text (after its tool results when it
    has nothing else, into the last one's text), without adding a turn."""
    def join(a: str, b: str) -> str:
        return "\n\n".join(t for t in (a, b) if t)

    def add(content: Any) -> Any:
        if content is None or isinstance(content, str):
            return join(content or "", text) if at_end else join(text, content or "")
        items = list(content)
        end = -1 if at_end else 0
        if items and isinstance(items[end], dict) and items[end].get("type") == "text":
            old = items[end].get("text") or ""
            items[end] = {**items[end], "text": join(old, text) if at_end else join(text, old)}
        else:
            items.insert(len(items) if at_end else 0, {"type": "text", "text": text})
        return items

    c = m.get("content")
    if isinstance(c, list) and c and at_end and all(isinstance(b, dict) and b.get("type") == "tool_result" for b in c):
        return {**m, "content": [*c[:-1], {**c[-1], "content": add(c[-1].get("content"))}]}
    if isinstance(c, list):
        results = [b for b in c if isinstance(b, dict) and b.get("type") == "tool_result"]
        own = [b for b in c if not (isinstance(b, dict) and b.get("type") == "tool_result")]
        return {**m, "content": results + add(own)}
    return {**m, "content": add(c)}


def _tool_result_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of blocks", "messages")
    texts = []
    for i, item in enumerate(content):
        if isinstance(item, dict) and item.get("type") == "text":
            text = item.get("text", "")
            if not isinstance(text, str):
                raise BadRequest(f"{where}[{i}].text must be a string", "messages")
            texts.append(text)
    return "\n".join(texts)


def _responses_prompt(body: dict) -> Prompt:
    """Responses ``instructions`` + ``input`` + ``tools`` -> chat messages and tools."""
    out: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("'instructions' must be a string", "instructions")
        out.append({"role": "system", "content": instructions})
    inp = body.get("input")
    if isinstance(inp, str):
        out.append({"role": "user", "content": inp})
    elif isinstance(inp, list):
        for k, item in enumerate(inp):
            if not isinstance(item, dict):
                raise BadRequest(f"input[{k}] must be an object", "input")
            t = item.get("type", "message")
            if t == "message":
                role, content = item.get("role"), item.get("content")
                if not isinstance(role, str):
                    raise BadRequest(f"input[{k}].role must be a string", "input")
                if isinstance(content, list):
                    texts = [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
                    content = [{"type": "text", "text": x} for x in texts]
                elif not isinstance(content, str):
                    raise BadRequest(f"input[{k}].content must be a string or a list of parts", "input")
                out.append({"role": "system" if role == "developer" else role, "content": content})
            elif t == "function_call":
                _check_nesting(item.get("arguments"), f"input[{k}].arguments", "input")
                call = {"id": item.get("call_id") or "", "type": "function",
                        "function": {"name": item.get("name") or "", "arguments": item.get("arguments") or ""}}
                if out and out[-1].get("role") == "assistant" and "tool_calls" in out[-1]:
                    out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif t == "function_call_output":
                output = item.get("output")
                _check_nesting(output, f"input[{k}].output", "input")
                out.append({"role": "tool", "tool_call_id": item.get("call_id") or "",
                            "content": output if isinstance(output, str) else json.dumps(output)})
            # reasoning and other items carry nothing the prompt is rendered from
    elif inp is not None or body.get("previous_response_id") is None:
        raise BadRequest("'input' must be a string or a list of items", "input")
    if not out:
        raise BadRequest("'input' is empty", "input")
    tools = body.get("tools")
    chat_tools = None
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequest("'tools' must be a list", "tools")
        chat_tools = []
        for k, t in enumerate(tools):
            if isinstance(t, dict) and t.get("type") == "function":
                _check_nesting(t.get("parameters"), f"tools[{k}].parameters", "tools")
                chat_tools.append({"type": "function", "function": {
                    "name": t.get("name"), "description": t.get("description"),
                    "parameters": t.get("parameters")}})
    return Prompt("input", messages=out, tools=chat_tools or None, template_kwargs=_template_kwargs(body))


def _template_kwargs(body: dict) -> dict[str, Any]:
    kw = body.get("chat_template_kwargs")
    return dict(kw) if isinstance(kw, dict) else {}


def _completion_prompt(body: dict) -> Prompt:
    prompt = body.get("prompt")
    add_special = body.get("add_special_tokens", True) is not False  # vLLM's completions default
    if prompt is None:
        raise BadRequest("'prompt' is required", "prompt")
    if isinstance(prompt, str):
        return Prompt("prompt", text=prompt, add_special_tokens=add_special)
    if isinstance(prompt, list):
        if not prompt:
            raise BadRequest("'prompt' must not be empty", "prompt")
        if all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise BadRequest("batched prompts are not supported; send one prompt per request", "prompt")
            return Prompt("prompt", text=prompt[0], add_special_tokens=add_special)
        if isinstance(prompt[0], list):
            if len(prompt) != 1:
                raise BadRequest("batched prompts are not supported; send one prompt per request", "prompt")
            prompt = prompt[0]
        if not valid_token_ids(prompt):
            raise BadRequest("'prompt' token ids must be non-negative integers", "prompt")
        return Prompt("prompt", tokens=prompt)
    raise BadRequest("'prompt' must be a string or a list of token ids", "prompt")


def _chat_prompt(body: dict) -> Prompt:
    return Prompt("messages", messages=_chat_messages(body.get("messages")),
                  tools=_chat_tools(body.get("tools")),
                  add_special_tokens=body.get("add_special_tokens") is True,
                  add_generation_prompt=body.get("add_generation_prompt", True) is not False,
                  continue_final_message=body.get("continue_final_message") is True,
                  template_kwargs=_template_kwargs(body))


_PROMPTS = {"completions": _completion_prompt, "chat": _chat_prompt,
            "messages": _anthropic_prompt, "responses": _responses_prompt}

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


def count_prompt(prompt: Prompt, block_size: int, tokenizer: Tokenizer | None = None,
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
                  block_size: int = 512, tokenizer: Tokenizer | None = None,
                  max_input_tokens: int | None = None, request_id: str | None = None) -> RouteRequest:
    """Validate a body and extract the routing facts, all in the calling thread.

    Raises BadRequest with the offending parameter for anything a backend would reject
    or that the router cannot route.
    """
    parsed = read_body(body, endpoint, headers=headers, session_header=session_header)
    return route_request(parsed, count_prompt(parsed.prompt, block_size, tokenizer),
                         max_input_tokens=max_input_tokens, request_id=request_id)


# --- the tokenizer --------------------------------------------------------------------------------

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
