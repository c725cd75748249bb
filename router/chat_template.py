"""A model's own chat template, rendered as vLLM renders it (through transformers' Jinja setup).

The template comes from the tokenizer directory: ``chat_template.jinja`` if present, else
``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates: the
``tool_use`` one when the request has tools and there is one, else ``default``). It is rendered
in Jinja2's immutable sandbox (the sandbox stays, since a template is code from a model's files;
its two most frequent checks take a shorter path with the same result, see ``_sandbox``) with ``trim_blocks`` and ``lstrip_blocks``, the loop-controls
extension, transformers' ``tojson`` (ensure_ascii off), ``raise_exception`` and
``strftime_now``, and the special-token strings (``bos_token`` ...) as variables, with
``messages``, ``tools``, ``add_generation_prompt`` and the request's ``chat_template_kwargs``.

Content parts: like vLLM, a template that iterates over a message's ``content`` gets the
parts as they are ("openai" content format); any other gets the text parts joined with
newlines ("string" format), images dropped. Assistant ``tool_calls`` arguments are given to the
template as parsed JSON objects, as vLLM does.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime
from typing import Any

#: A template that loops over a message's content takes the parts list as it is.
_LOOPS_OVER_CONTENT = re.compile(r"\{%-?\s*for\s+\w+\s+in\s+[\w.]+(?:\[['\"]content['\"]\]|\.content)\b")


#: What a plain dict has as attributes (items, get, ...): a template's ``x.items`` means the method.
_DICT_ATTRIBUTES = frozenset(dir(dict))
#: A for loop's ``loop.*`` values: plain data the sandbox always lets through.
_LOOP_ATTRIBUTES = frozenset(("index", "index0", "revindex", "revindex0", "first", "last", "length",
                              "depth", "depth0", "previtem", "nextitem"))


class TemplateError(ValueError):
    """The template failed on this request (raise_exception, a type error, ...)."""


def _token_str(v: Any) -> str:
    if isinstance(v, dict):
        return str(v.get("content", ""))
    return "" if v is None else str(v)


def _sandbox():
    """transformers' (and so vLLM's) ImmutableSandboxedEnvironment, with a shorter path for the
    two lookups a chat template makes most, each returning what the sandbox's own path
    returns: ``message.role`` on a dict (the sandbox first tries the attribute, which a dict
    never has for a key outside ``dir(dict)``, and takes the key after the AttributeError) and
    ``loop.first`` (a value the sandbox checks and always allows). About half of a 200-message
    render's time went to those checks. Everything else (calls, other attributes, the
    immutability of lists and dicts) goes through the sandbox unchanged."""
    from jinja2.runtime import LoopContext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Sandbox(ImmutableSandboxedEnvironment):
        def getattr(self, obj: Any, attribute: str) -> Any:
            kind = type(obj)
            if kind is dict:
                if attribute in obj and attribute not in _DICT_ATTRIBUTES:
                    return obj[attribute]
            elif kind is LoopContext and attribute in _LOOP_ATTRIBUTES:
                return getattr(obj, attribute)
            return super().getattr(obj, attribute)

    return Sandbox


class ChatTemplate:
    def __init__(self, templates: dict[str, str], special: dict[str, str]):
        import jinja2
        from jinja2.ext import loopcontrols

        def raise_exception(message: str):
            raise TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = _sandbox()(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._compiled = {name: env.from_string(src) for name, src in templates.items()}
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template does not compile: {exc}") from None
        self._openai_format = {name: bool(_LOOPS_OVER_CONTENT.search(src)) for name, src in templates.items()}
        self.special = special

    @classmethod
    def load(cls, directory: str) -> ChatTemplate | None:
        """The template in ``directory``, or None when it has none."""
        templates: dict[str, str] = {}
        config: dict[str, Any] = {}
        path = os.path.join(directory, "tokenizer_config.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
            ct = config.get("chat_template")
            if isinstance(ct, str):
                templates["default"] = ct
            elif isinstance(ct, list):
                for item in ct:
                    if isinstance(item, dict) and isinstance(item.get("template"), str):
                        templates[str(item.get("name", "default"))] = item["template"]
        jinja_path = os.path.join(directory, "chat_template.jinja")
        if os.path.exists(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                templates["default"] = f.read()
        if not templates:
            return None
        if "default" not in templates:
            templates["default"] = next(iter(templates.values()))
        special = {k: _token_str(config.get(k)) for k in
                   ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
                   if config.get(k) is not None}
        return cls(templates, special)

    def render(self, messages: list[dict], tools: list[dict] | None = None, *,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text vLLM would build for these messages. Raises TemplateError."""
        name = "tool_use" if tools and "tool_use" in self._compiled else "default"
        openai_format = self._openai_format[name]
        msgs = [_for_template(m, openai_format) for m in messages]
        if continue_final_message and add_generation_prompt:
            raise TemplateError("continue_final_message and add_generation_prompt cannot both be true")
        ctx: dict[str, Any] = dict(kwargs or {})
        ctx.update(self.special)
        ctx.update(messages=msgs, tools=tools or None, add_generation_prompt=add_generation_prompt)
        try:
            text = self._compiled[name].render(**ctx)
        except TemplateError:
            raise
        except Exception as exc:  # the template's own errors: a type mismatch, an undefined call
            raise TemplateError(f"the chat template failed on this request: {exc}") from None
        if continue_final_message and msgs:
            # as transformers: cut after the final message's own text, so the model continues it
            last = msgs[-1].get("content")
            if isinstance(last, str) and last.strip() and last.strip() in text:
                cut = text.rindex(last.strip()) + len(last.strip())
                text = text[:cut]
        return text


def _for_template(m: dict, openai_format: bool) -> dict:
    """A message as vLLM hands it to the template."""
    out = dict(m)
    content = m.get("content")
    if isinstance(content, list) and not openai_format:
        out["content"] = "\n".join(p["text"] for p in content
                                   if isinstance(p, dict) and isinstance(p.get("text"), str))
    calls = m.get("tool_calls")
    if isinstance(calls, list):
        fixed = []
        for c in calls:
            fn = c.get("function") if isinstance(c, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    args = json.loads(fn["arguments"])
                except ValueError:
                    args = fn["arguments"]
                c = {**c, "function": {**fn, "arguments": args}}
            fixed.append(c)
        out["tool_calls"] = fixed
    return out
