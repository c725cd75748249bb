"""Claude Code's mid-conversation ``system`` messages are rendered where the client put them
(as vLLM places them), so each turn's prompt extends the previous one, in the text
approximation and with a chat template alike."""

from __future__ import annotations

import pytest

from router.chat_template import ChatTemplate
from router.request import chat_text, count_prompt, read_body

BS = 16
#: Qwen's way with system turns (not only the first): each a <|im_start|>system turn.
QWEN_LIKE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
             "{% endif %}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}</tool_call>{% endfor %}"
             "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def claude_code_turn(turn: int) -> dict:
    """Turn ``turn`` of a Claude Code-shaped session: a system prompt, then per earlier turn a
    user message, a tool_use, its tool_result, a <system-reminder> system message and an answer."""
    msgs: list[dict] = []
    for k in range(1, turn + 1):
        msgs.append({"role": "user", "content": [{"type": "text", "text": f"task {k}: fix the bug in module {k}"}]})
        if k == turn:
            break
        msgs.append({"role": "assistant", "content": [{"type": "tool_use", "id": f"t{k}", "name": "Read",
                                                       "input": {"path": f"m{k}.py"}}]})
        msgs.append({"role": "system", "content": f"<system-reminder>todo list changed at step {k}</system-reminder>"})
        msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{k}",
                                                  "content": f"def f{k}(): return {k}\n" * 20}]})
        msgs.append({"role": "assistant", "content": [{"type": "text", "text": f"fixed module {k}"}]})
    msgs.append({"role": "system", "content": f"<system-reminder>turn {turn} context</system-reminder>"})
    return {"model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "You are Claude Code. " * 30}],
            "messages": msgs}


def _prompt(body):
    return read_body(body, "messages").prompt


def test_inline_system_messages_stay_in_order():
    msgs = _prompt(claude_code_turn(3)).messages
    roles = [m["role"] for m in msgs]
    # the system prompt alone leads; each reminder is its own system turn where it was sent,
    # except that one between a tool_use and its result waits until after the result
    assert roles[0] == "system" and msgs[0]["content"].startswith("You are Claude Code.")
    assert "todo list" not in msgs[0]["content"] and "context" not in msgs[0]["content"]
    i = roles.index("tool")
    assert roles[i - 1] == "assistant" and roles[i + 1] == "system" and "step 1" in msgs[i + 1]["content"]
    assert roles[-1] == "system" and "turn 3 context" in msgs[-1]["content"]


@pytest.mark.parametrize("render", ["approximation", "template"])
def test_each_turn_extends_the_previous_one(render):
    """The router's blocks for turn N are a prefix of turn N+1's: before, every new reminder
    was hoisted into the system prompt and changed the prompt's first block."""
    template = ChatTemplate({"default": QWEN_LIKE}, {})
    texts = []
    for turn in (2, 3, 4):
        p = _prompt(claude_code_turn(turn))
        # the turn's own trailing reminder is where the next turn adds to: compare without it
        msgs = p.messages[:-1]
        texts.append(chat_text(msgs, p.tools) if render == "approximation"
                     else template.render(msgs, p.tools, add_generation_prompt=False))
    for a, b in zip(texts, texts[1:]):
        assert b.startswith(a)
    p2, p3 = _prompt(claude_code_turn(2)), _prompt(claude_code_turn(3))
    b2, b3 = count_prompt(p2, BS).blocks, count_prompt(p3, BS).blocks
    shared = 0
    while shared < min(len(b2), len(b3)) and b2[shared] == b3[shared]:
        shared += 1
    assert shared >= len(b2) - 2  # all but the tail that the new turn changes


def test_leading_system_messages_join_the_system_prompt():
    body = {"model": "m", "max_tokens": 4, "system": "top",
            "messages": [{"role": "system", "content": "lead"}, {"role": "user", "content": "hi"}]}
    assert _prompt(body).messages == [{"role": "system", "content": "top\n\nlead"},
                                      {"role": "user", "content": "hi"}]


def test_without_a_system_prompt_they_fold_into_the_user_turn():
    body = {"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"}, {"role": "system", "content": "note 1"},
        {"role": "assistant", "content": "hello"}, {"role": "system", "content": "note 2"},
        {"role": "user", "content": "next"}]}
    assert _prompt(body).messages == [{"role": "user", "content": "hi\n\nnote 1"},
                                      {"role": "assistant", "content": "hello"},
                                      {"role": "user", "content": "note 2\n\nnext"}]


def test_billing_header_is_still_dropped_from_inline_system_messages():
    body = {"model": "m", "max_tokens": 4, "system": "top", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"}]}]}
    assert _prompt(body).messages == [{"role": "system", "content": "top"}, {"role": "user", "content": "hi"}]
