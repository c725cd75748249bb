"""Request understanding: sessions, token sources, and the 400s."""

from __future__ import annotations

import pytest

from router.request import BadRequest, parse_request


@pytest.mark.parametrize("body,headers,session,source", [
    ({"prompt": [1] * 600, "session_id": "b", "user": "u"}, {"X-Session-ID": "h"}, "h", "header"),
    ({"prompt": [1] * 600, "session_id": "b", "user": "u"}, {}, "b", "body_session_id"),
    ({"prompt": [1] * 600, "user": "u"}, {}, "u", "user"),
    ({"prompt": [1] * 600}, {}, None, "first_block"),
])
def test_session_order(body, headers, session, source):
    r = parse_request(body, "completions", headers=headers)
    assert r.session_source == source
    if session:
        assert r.session_id == session
    else:
        assert r.session_id.startswith("blk-")


def test_first_block_session_groups_turns():
    t1 = parse_request({"prompt": list(range(1000))}, "completions")
    t2 = parse_request({"prompt": list(range(1500))}, "completions")
    assert t1.session_id == t2.session_id


@pytest.mark.parametrize("body,endpoint,source,tokens", [
    ({"prompt": list(range(1024))}, "completions", "tokens", 1024),
    ({"prompt": [list(range(10))]}, "completions", "tokens", 10),
    ({"prompt": "abcd" * 100}, "completions", "text_approx", 100),
    ({"prompt": ["abcd" * 3]}, "completions", "text_approx", 3),
    ({"messages": [{"role": "user", "content": "hello"}]}, "chat", "text_approx", 4),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, "chat", "text_approx", 3),
])
def test_token_sources(body, endpoint, source, tokens):
    r = parse_request(body, endpoint)
    assert (r.token_source, r.input_tokens) == (source, tokens)


@pytest.mark.parametrize("body,endpoint,param", [
    ([], "completions", None),
    ({}, "completions", "prompt"),
    ({"prompt": ""}, "completions", "prompt"),
    ({"prompt": []}, "completions", "prompt"),
    ({"prompt": 5}, "completions", "prompt"),
    ({"prompt": [1, -2]}, "completions", "prompt"),
    ({"prompt": [1, 2.5]}, "completions", "prompt"),
    ({"prompt": ["a", "b"]}, "completions", "prompt"),
    ({"prompt": "x", "stream": "yes"}, "completions", "stream"),
    ({"prompt": "x", "max_tokens": "9"}, "completions", "max_tokens"),
    ({"prompt": "x", "max_tokens": -1}, "completions", "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, "completions", "max_tokens"),
    ({"prompt": "x", "session_id": {"a": 1}}, "completions", "session_id"),
    ({"messages": []}, "chat", "messages"),
    ({"messages": "hi"}, "chat", "messages"),
    ({"messages": [{"content": "hi"}]}, "chat", "messages"),
    ({"messages": [{"role": "user", "content": 3}]}, "chat", "messages"),
])
def test_bad_requests(body, endpoint, param):
    with pytest.raises(BadRequest) as exc:
        parse_request(body, endpoint)
    assert exc.value.status == 400
    if param:
        assert exc.value.param == param


def test_prompt_over_maximum():
    with pytest.raises(BadRequest, match="over this router's maximum"):
        parse_request({"prompt": [1] * 101}, "completions", max_input_tokens=100)
