"""The chat template's sandbox: its shortcuts for ``message.role`` and ``loop.first`` give what
transformers' ImmutableSandboxedEnvironment gives, character for character, and what the
sandbox refuses it still refuses."""

from __future__ import annotations

import json

import pytest
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from router.chat_template import ChatTemplate, TemplateError, _for_template

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi", "items": "a key named like a dict method", "__globals__": "g"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{\"path\": \".\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
]

CASES = [
    # attribute lookups on dicts: present keys, missing keys, keys named like dict methods
    "{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}",
    "{% for m in messages %}{{ m.tool_calls is defined }}{{ m.missing is defined }}{% endfor %}",
    "{% for m in messages %}{{ m['items'] if 'items' in m }}/{{ m.items is callable }}/{{ m.get('role') }}{% endfor %}",
    "{% for m in messages %}{{ m.__globals__ is defined }}{{ m['__globals__'] is defined }}{% endfor %}",
    # loop variables, as templates use them for the first system turn and runs of tool results
    "{% for m in messages %}{{ loop.index0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}"
    "{{ loop.revindex }}{% if loop.previtem %}<{{ loop.previtem.role }}{% endif %}{% endfor %}",
    "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.name }}"
    "{{ c.function.arguments }}{% endfor %}{% endfor %}",
    "{{ tools | length }}{% for t in tools %}{{ t.function.name }}{% endfor %}",
]


def _stock(src: str) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False)
    return env.from_string(src).render(messages=[_for_template(m, False) for m in MESSAGES],
                                       tools=[{"type": "function", "function": {"name": "ls"}}],
                                       add_generation_prompt=True)


@pytest.mark.parametrize("src", CASES)
def test_shortcuts_render_what_the_stock_sandbox_renders(src):
    ours = ChatTemplate({"default": src}, {}).render(
        MESSAGES, [{"type": "function", "function": {"name": "ls"}}])
    assert ours == _stock(src)


@pytest.mark.parametrize("src", [
    "{{ messages.append(1) }}",  # the immutable sandbox: no mutating a list
    "{% for m in messages %}{{ m.update({'role': 'x'}) }}{% endfor %}",  # nor a dict
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # nor reaching Python's internals
    "{% for m in messages %}{{ loop.__class__.__init__.__globals__ }}{% endfor %}",
])
def test_the_sandbox_still_refuses(src):
    with pytest.raises(TemplateError):
        ChatTemplate({"default": src}, {}).render(MESSAGES)
