"""A relayed non-streaming answer (router/answer.py): the bytes aiohttp's web.Response would
write, in one send, for a fraction of its Python work; its fallbacks; and the router's use of it."""

from __future__ import annotations

import asyncio
import json
import sys
from unittest import mock

import pytest
from aiohttp import web
from aiohttp.http import HttpVersion
from aiohttp.http_writer import StreamWriter
from aiohttp.test_utils import make_mocked_request

from router import answer
from router.answer import Sent, send_whole

BODY = (b'{"id":"cmpl-1","object":"text_completion","model":"tiny","choices":[{"index":0,'
        b'"text":"ok ok ","finish_reason":"length"}],"usage":{"prompt_tokens":64,'
        b'"completion_tokens":2,"total_tokens":66}}')
HEADERS = {"X-Kvtop-Instance": "i0", "X-Kvtop-Request-Id": "0123abcd", "X-Kvtop-Policy": "lmetric@1",
           "Content-Type": "application/json"}


class _Transport:
    """Records what is written; never pauses."""

    def __init__(self):
        self.writes: list[bytes] = []

    def write(self, data) -> None:
        self.writes.append(bytes(data))

    def writelines(self, chunks) -> None:
        self.writes.append(b"".join(bytes(c) for c in chunks))

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0


def _request(*, version=(1, 1), headers=None, closing=False):
    loop = asyncio.get_running_loop()
    tr = _Transport()
    proto = mock.Mock(transport=tr, _paused=False)
    writer = StreamWriter(proto, loop)
    req = make_mocked_request("POST", "/v1/completions", headers=headers or {}, version=HttpVersion(*version),
                              closing=closing, writer=writer, transport=tr, protocol=proto)
    return req, tr


def _parse(wire: bytes) -> tuple[str, dict[str, str], bytes]:
    head, _, body = wire.partition(b"\r\n\r\n")
    lines = head.decode("utf-8").split("\r\n")
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(": ")
        assert k.lower() not in headers, f"{k} twice"
        headers[k.lower()] = v
    return lines[0], headers, body


async def _web_response(req, status, headers, body):
    resp = web.Response(body=body, status=status, headers=headers)
    await resp.prepare(req)
    await resp.write_eof()
    return resp


@pytest.mark.parametrize("status,instance", [(200, "i0"), (201, "i0"), (404, "i0"), (599, "i0"), (200, "gpu-ü-0")])
async def test_send_whole_writes_what_web_response_writes_in_one_send(status, instance):
    headers = {**HEADERS, "X-Kvtop-Instance": instance}
    req, tr = _request()
    resp = await send_whole(req, status, headers, BODY)
    assert isinstance(resp, Sent) and resp.prepared and resp.keep_alive and resp.status == status
    assert len(tr.writes) == 1  # head and body in one send
    ref_req, ref_tr = _request()
    await _web_response(ref_req, status, headers, BODY)
    got, ref = _parse(tr.writes[0]), _parse(b"".join(ref_tr.writes))
    assert got[0] == ref[0]  # the status line, reason included
    assert got[1].keys() == ref[1].keys() and got[2] == ref[2] == BODY
    for k in ref[1]:
        if k != "date":  # a second may pass between the two
            assert got[1][k] == ref[1][k], k
    assert got[1]["content-length"] == str(len(BODY))
    # aiohttp's handler finds it sent: nothing more is written
    assert await resp.prepare(req) is None
    await resp.write_eof()
    assert len(tr.writes) == 1 and req.writer.output_size == len(tr.writes[0]) == resp.body_length


async def test_a_large_answer_is_not_copied_behind_its_head():
    req, tr = _request()
    big = b"x" * (answer._JOIN_BYTES + 1)
    await send_whole(req, 200, HEADERS, big)
    assert len(tr.writes) == 2 and tr.writes[1] == big and tr.writes[0].endswith(b"\r\n\r\n")
    assert b"Content-Length: %d\r\n" % len(big) in tr.writes[0]


@pytest.mark.parametrize("case", ["http/1.0", "connection: close", "control character"])
async def test_what_the_fast_path_does_not_take_goes_through_web_response(case):
    kw = {"http/1.0": {"version": (1, 0)}, "connection: close": {"headers": {"Connection": "close"}, "closing": True}}.get(case, {})
    req, tr = _request(**kw)
    headers = {**HEADERS, "X-Kvtop-Request-Id": "a\x01b"} if case == "control character" else HEADERS
    if case == "control character":  # aiohttp refuses it, as it always did: never written as it is
        with pytest.raises(ValueError):
            await send_whole(req, 200, headers, BODY)
        assert tr.writes == []
        return
    resp = await send_whole(req, 200, headers, BODY)
    assert not isinstance(resp, Sent) and isinstance(resp, web.Response)
    status_line, got, body = _parse(b"".join(tr.writes))
    assert body == BODY
    if case == "connection: close":
        assert got["connection"] == "close" and not resp.keep_alive


def _python_calls(write) -> int:
    """Python function calls made by ``write(request)`` (the request is made before counting)."""
    calls = 0

    def prof(frame, event, arg):
        nonlocal calls
        if event == "call" and not frame.f_code.co_filename.endswith("test_answer.py"):
            calls += 1

    async def run():
        req, _ = _request()
        sys.setprofile(prof)
        try:
            await write(req)
        finally:
            sys.setprofile(None)

    asyncio.run(run())
    return calls


def test_send_whole_is_a_fraction_of_web_responses_python_work():
    """Deterministic, unlike a timing: the number of Python calls an answer costs. aiohttp's
    path (the router's before router/answer.py) makes twice as many, and its C parts (the
    header multidict, the head's serialization) are more again."""
    def fast(req):
        return send_whole(req, 200, HEADERS, BODY)

    def slow(req):
        return _web_response(req, 200, HEADERS, BODY)

    _python_calls(fast), _python_calls(slow)  # once first: the date and status line are made once
    ours, theirs = _python_calls(fast), _python_calls(slow)
    assert ours * 2 <= theirs, (ours, theirs)


async def test_the_router_relays_a_non_streaming_answer_whole(router_server, fake_backends, tmp_path):
    """Through the real router: the backend's bytes, the router's headers, one send, and the
    keep-alive connection serving the next request."""
    from router.app import Backend, RouterConfig, create_app

    fakes = await fake_backends(1)
    cfg = RouterConfig(backends=[Backend("i0", fakes[0][1])], db=None, state_dir=str(tmp_path / "state"))
    router = await router_server(create_app(cfg))
    sent = []
    real = answer.send_whole

    async def spy(request, status, headers, body):
        resp = await real(request, status, headers, body)
        sent.append((resp, body))
        return resp

    reader, writer = await asyncio.open_connection(router.host, router.port)
    with mock.patch("router.proxy.send_whole", spy):
        for k in range(2):  # the same connection twice
            body = json.dumps({"prompt": [1, 2, 3, k], "max_tokens": 2}).encode()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            async with asyncio.timeout(5):
                status_line = await reader.readline()
                headers = {}
                while (line := await reader.readline()) != b"\r\n":
                    name, _, value = line.decode("latin-1").partition(":")
                    headers[name.strip().lower()] = value.strip()
                data = await reader.readexactly(int(headers["content-length"]))
            assert status_line == b"HTTP/1.1 200 OK\r\n"
            assert headers["x-kvtop-instance"] == "i0" and headers["x-kvtop-policy"]
            assert headers["content-type"].startswith("application/json")
            assert "connection" not in headers  # kept alive
            resp, relayed = sent[-1]
            assert isinstance(resp, Sent) and relayed == data  # the backend's bytes, as they came
            assert headers["x-kvtop-request-id"] == resp.headers["X-Kvtop-Request-Id"]
            assert json.loads(data)["usage"]["completion_tokens"] == 2
    writer.close()
    state = router.state
    assert state.counts["requests"] == 2


async def test_the_data_plane_skips_the_apps_url_dispatcher(router_server, fake_backends, tmp_path):
    """router/app.py data_plane_first: a data-plane POST reaches its handler without the
    application's resolve and middleware chain; everything else still goes through them."""
    from router.app import Backend, RouterConfig, create_app

    fakes = await fake_backends(1)
    cfg = RouterConfig(backends=[Backend("i0", fakes[0][1])], db=None, state_dir=str(tmp_path / "state"))
    through_app = []
    real = web.Application._handle

    async def counted(self, request):
        through_app.append((request.method, request.path))
        return await real(self, request)

    with mock.patch.object(web.Application, "_handle", counted):
        router = await router_server(create_app(cfg))
    client = router.client()
    async with client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}) as r:
        assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 2
    async with client.post("/v1/chat/completions", json={"messages": "not a list"}) as r:
        assert r.status == 400 and (await r.json())["error"]["code"] == 400  # the handler's own refusal
    assert through_app == []
    async with client.get("/v1/completions") as r:  # not a POST: the app's 405, in JSON
        assert r.status == 405 and (await r.json())["error"]["code"] == 405
    async with client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2},
                           headers={"Expect": "100-continue"}) as r:  # the app answers 100-continue
        assert r.status == 200
    async with client.get("/health") as r:
        assert r.status == 200
    assert through_app == [("GET", "/v1/completions"), ("POST", "/v1/completions"), ("GET", "/health")]


@pytest.mark.parametrize("body,tokens", [
    (BODY, 2),
    (b'{"usage": {"completion_tokens": 3}, "logprob": NaN}', 3),  # orjson refuses it, json reads it
    (b'{"usage": {"completion_tokens": 3}, "seed": 123456789012345678901234567890}', 3),
    (b'{"response": {"usage": {"output_tokens": 5}}}', 5),  # a Responses answer
    (b"not json", None),
    (b"\xff\xfe{}", None),
    (b"[" * 100_000 + b"]" * 100_000, None),  # nested past json's recursion limit: no usage, no error
], ids=["openai", "nan", "big int", "responses", "not json", "not utf-8", "deep"])
def test_usage_of_a_non_streaming_answer(body, tokens):
    from router.forward import completion_tokens, usage_of

    assert completion_tokens(usage_of(body)) == tokens
