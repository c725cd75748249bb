"""Client bodies -> prompts: what the model will read, built per API as vLLM builds it.

OpenAI completions and chat, Anthropic Messages and OpenAI Responses bodies are validated
here (every bad field a BadRequest naming it) and turned into one Prompt: token ids, text, or
OpenAI chat messages and tools, converted the way vLLM converts them
(vllm/entrypoints/anthropic/serving.py, .../openai/responses). router/request.py counts and
hashes the Prompt; router/chat_template.py renders it with a model's template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from router.blocks import valid_token_ids


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


PROMPTS = {"completions": _completion_prompt, "chat": _chat_prompt,
            "messages": _anthropic_prompt, "responses": _responses_prompt}
